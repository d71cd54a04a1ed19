// The 4-bit kernels (q4.h has the format and its layout): activations quantized run by run, a
// portable loop and an AVX512-VNNI one that give the same bits, and Projection::q4_rows.
#include "q4.h"

namespace tserve_native {
namespace {

constexpr int64_t Q4_CHUNK = 4;  // tiles per chunk shared with the partner thread

// One row of activations, quantized run by run: r (K int8), and per run its scale s_a and
// s_a * sum(r) (for the offsets).
struct Q8Rows {
  std::vector<int8_t> r;
  std::vector<float> scale, scaled_sum;
  void quantize(const float* x, int64_t B, int64_t K) {
    const int64_t runs = K / Q4_RUN;
    r.resize(B * K);
    scale.resize(B * runs);
    scaled_sum.resize(B * runs);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t u = 0; u < runs; ++u) {
        const float* xs = x + b * K + u * Q4_RUN;
        float top = 0.0f;
        for (int64_t k = 0; k < Q4_RUN; ++k) top = std::max(top, std::fabs(xs[k]));
        const float s = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t sum = 0;
        int8_t* rs = r.data() + b * K + u * Q4_RUN;
        for (int64_t k = 0; k < Q4_RUN; ++k) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xs[k] * inv));
          rs[k] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
          sum += rs[k];
        }
        scale[b * runs + u] = s;
        scaled_sum[b * runs + u] = s * static_cast<float>(sum);
      }
  }
};

// Output tiles [t0, t1) of y (B, N) for B rows: the portable loop, in the vector loop's order
// (an exact integer dot per run, then y += float(dot) * (d * s_a), then y += m * (s_a sum r)),
// so both give the same bits.
void q4_tiles_scalar(const uint8_t* w, const Q8Rows& a, int64_t B, int64_t K, int64_t N, int64_t t0, int64_t t1,
                     float* y) {
  const int64_t runs = K / Q4_RUN;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < B; ++b) {
      float acc[Q4_TILE] = {0};
      for (int64_t u = 0; u < runs; ++u) {
        const uint8_t* run = w + (t * runs + u) * Q4_RUN_BYTES;
        const uint16_t* dm = reinterpret_cast<const uint16_t*>(run + 256);
        const int8_t* r = a.r.data() + b * K + u * Q4_RUN;
        const float s = a.scale[b * runs + u], ss = a.scaled_sum[b * runs + u];
        for (int64_t j = 0; j < Q4_TILE; ++j) {
          int32_t dot = 0;
          for (int c = 0; c < 4; ++c)
            for (int t4 = 0; t4 < 4; ++t4) {
              const uint8_t byte = run[c * 64 + 4 * j + t4];
              dot += static_cast<int32_t>(byte & 0x0f) * r[8 * c + t4] + static_cast<int32_t>(byte >> 4) * r[8 * c + 4 + t4];
            }
          acc[j] = std::fma(static_cast<float>(dot), half_to_float(dm[j]) * s, acc[j]);
          acc[j] = std::fma(half_to_float(dm[16 + j]), ss, acc[j]);
        }
      }
      std::copy_n(acc, Q4_TILE, y + b * N + t * Q4_TILE);
    }
}

#if defined(TSERVE_AVX512)
// The same with VNNI: per tile and run, the four chunks are widened into eight operands once and
// used for up to eight rows at a time.
TSERVE_TARGET_VNNI inline void q4_unpack(const uint8_t* run, __m512i* q, __m512& d, __m512& m) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i bytes = _mm512_loadu_si512(run + 64 * c);
    q[2 * c] = _mm512_and_si512(bytes, low);
    q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  }
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 256)));
  m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 288)));
}

// acc += float(q . r) * (d s) + m (s sum r) for one tile and one row's run.
TSERVE_TARGET_VNNI inline __m512 q4_run_row(const __m512i* q, __m512 d, __m512 m, const __m512i* r, __m512 s,
                                            __m512 ss, __m512 acc) {
  __m512i dot = _mm512_setzero_si512();
  for (int g = 0; g < 8; ++g) dot = _mm512_dpbusd_epi32(dot, q[g], r[g]);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, s), acc);
  return _mm512_fmadd_ps(m, ss, acc);
}

// The same with VNNI. A tile's run is widened into eight operands once and used for up to
// MB rows; tiles go two at a time, sharing each row's broadcast activations.
TSERVE_TARGET_VNNI void q4_tiles_vnni(const uint8_t* w, const Q8Rows& a, int64_t B, int64_t K, int64_t N, int64_t t0,
                                      int64_t t1, float* y) {
  constexpr int64_t MB = 4;
  const int64_t runs = K / Q4_RUN;
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2)
    for (int64_t b0 = 0; b0 < B; b0 += MB) {
      const int64_t rows = std::min(MB, B - b0);
      __m512 acc0[MB], acc1[MB];
      for (int64_t i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
      for (int64_t u = 0; u < runs; ++u) {
        __m512i q0[8], q1[8];
        __m512 d0, m0, d1, m1;
        q4_unpack(w + (t * runs + u) * Q4_RUN_BYTES, q0, d0, m0);
        q4_unpack(w + ((t + 1) * runs + u) * Q4_RUN_BYTES, q1, d1, m1);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t b = b0 + i;
          const int32_t* groups = reinterpret_cast<const int32_t*>(a.r.data() + b * K + u * Q4_RUN);
          __m512i r[8];
          for (int g = 0; g < 8; ++g) r[g] = _mm512_set1_epi32(groups[g]);
          const __m512 s = _mm512_set1_ps(a.scale[b * runs + u]), ss = _mm512_set1_ps(a.scaled_sum[b * runs + u]);
          acc0[i] = q4_run_row(q0, d0, m0, r, s, ss, acc0[i]);
          acc1[i] = q4_run_row(q1, d1, m1, r, s, ss, acc1[i]);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        _mm512_storeu_ps(y + (b0 + i) * N + t * Q4_TILE, acc0[i]);
        _mm512_storeu_ps(y + (b0 + i) * N + (t + 1) * Q4_TILE, acc1[i]);
      }
    }
  for (; t < t1; ++t)  // an odd tile at the end
    for (int64_t b = 0; b < B; ++b) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t u = 0; u < runs; ++u) {
        __m512i q[8];
        __m512 d, m;
        q4_unpack(w + (t * runs + u) * Q4_RUN_BYTES, q, d, m);
        const int32_t* groups = reinterpret_cast<const int32_t*>(a.r.data() + b * K + u * Q4_RUN);
        __m512i r[8];
        for (int g = 0; g < 8; ++g) r[g] = _mm512_set1_epi32(groups[g]);
        acc = q4_run_row(q, d, m, r, _mm512_set1_ps(a.scale[b * runs + u]), _mm512_set1_ps(a.scaled_sum[b * runs + u]), acc);
      }
      _mm512_storeu_ps(y + b * N + t * Q4_TILE, acc);
    }
}
#endif

void q4_tiles(const uint8_t* w, const Q8Rows& a, int64_t B, int64_t K, int64_t N, int64_t t0, int64_t t1, float* y) {
#if defined(TSERVE_AVX512)
  if (cpu().avx512_vnni) return q4_tiles_vnni(w, a, B, K, N, t0, t1, y);
#endif
  q4_tiles_scalar(w, a, B, K, N, t0, t1, y);
}

}  // namespace

// The output tiles shared between the threads: with a partner, chunks of tiles claimed by both.
Tensor Projection::q4_rows(const Tensor& x, bool portable) const {
  TORCH_CHECK(x.size(1) == q4_k, "a 4-bit projection of ", q4_k, " inputs got ", x.size(1));
  const int64_t B = x.size(0), tiles = q4_n / Q4_TILE;
  Q8Rows a;
  std::vector<float> plain;
  if (unsmooth.empty()) {
    a.quantize(x.data_ptr<float>(), B, q4_k);
  } else {
    plain.resize(B * q4_k);
    const float* xp = x.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < q4_k; ++k) plain[b * q4_k + k] = xp[b * q4_k + k] * unsmooth[k];
    a.quantize(plain.data(), B, q4_k);
  }
  Tensor y = at::empty({B, q4_n}, x.options());
  const uint8_t* w = q4.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (portable) {
    q4_tiles_scalar(w, a, B, q4_k, q4_n, 0, tiles, yp);
  } else if (q4_partner != nullptr && at::get_num_threads() == 1) {
    // chunks of Q4_CHUNK tiles (an even count: the vector loop takes tiles two at a time)
    const int64_t chunks = (tiles + Q4_CHUNK - 1) / Q4_CHUNK;
    q4_partner->run(chunks, [&](int64_t c) {
      q4_tiles(w, a, B, q4_k, q4_n, c * Q4_CHUNK, std::min(tiles, (c + 1) * Q4_CHUNK), yp);
    });
  } else {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { q4_tiles(w, a, B, q4_k, q4_n, t0, t1, yp); });
  }
  if (!q4_bias.empty())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < q4_n; ++j) yp[b * q4_n + j] += q4_bias[j];
  return y;
}

Projection q4_projection(const Tensor& runs, int64_t n, int64_t k, const c10::optional<Tensor>& bias) {
  TORCH_CHECK(n > 0 && k > 0 && n % Q4_TILE == 0 && k % Q4_RUN == 0, "a 4-bit projection needs outputs in "
              "multiples of 16 and inputs in multiples of 32, got ", n, " x ", k);
  TORCH_CHECK(runs.device().is_cpu() && runs.scalar_type() == at::kByte && runs.is_contiguous() &&
                  runs.numel() == (n / Q4_TILE) * (k / Q4_RUN) * Q4_RUN_BYTES,
              "runs must be a contiguous uint8 CPU tensor of (n / 16) * (k / 32) * 320 bytes");
  Projection p;
  p.q4 = runs;
  p.q4_n = n;
  p.q4_k = k;
  if (bias) p.q4_bias = to_vector(*bias, n, "bias");
  return p;
}

}  // namespace tserve_native
