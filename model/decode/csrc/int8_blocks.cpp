// int8 weights against activations quantized per run of 32 values (as GGUF's Q8_0 quantizes
// them): Projection::int8_block_rows. The row-wise path (int8.cpp) gives a whole row one 7-bit
// grid, so a few large channels (a norm's output has some) leave the rest of the row a handful of
// levels; here every 32 values get their own 8-bit scale. fbgemm takes one activation scale per
// call, so the product is ours: per (row, output, run) an exact integer dot product, then
//   y_j = ws_j * sum_u float(dot_u) * s_u   (one fused multiply-add per run, runs in order),
// with ws_j the output's int8 weight scale (symmetric: no zero point) and s_u the run's
// activation scale. A portable loop and an AVX2 one give the same bits: the integer dots are
// exact whatever their order, and the float arithmetic is the same operations in the same order.
// A row's result never depends on the rows beside it.
#include "projection.h"

namespace tserve_native {
namespace {

constexpr int64_t RUN = 32;  // activations per scale
constexpr int64_t CHUNK = 64;  // outputs per piece shared between threads (a multiple of 8)

// One row's activations: r in [-127, 127] per run of 32, scale = max|x| / 127 (round half to
// even, as model.quant.q4.quantize_activations and q4.cpp's Q8Rows do).
void quantize_runs(const float* x, int64_t K, int8_t* r, float* scale) {
  for (int64_t u = 0; u < K / RUN; ++u) {
    const float* xs = x + u * RUN;
    float top = 0.0f;
    for (int64_t k = 0; k < RUN; ++k) top = std::max(top, std::fabs(xs[k]));
    const float inv = top > 0.0f ? 127.0f / top : 0.0f;
    scale[u] = top / 127.0f;
    for (int64_t k = 0; k < RUN; ++k) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xs[k] * inv));
      r[u * RUN + k] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
    }
  }
}

// Outputs [j0, j1) of rows [0, B): the portable loop.
void block_outputs_plain(const int8_t* w, const float* ws, const int8_t* r, const float* s, int64_t B, int64_t K,
                         int64_t N, int64_t j0, int64_t j1, float* y) {
  const int64_t runs = K / RUN;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t b = 0; b < B; ++b) {
      float acc = 0.0f;
      for (int64_t u = 0; u < runs; ++u) {
        const int8_t* wr = w + j * K + u * RUN;
        const int8_t* rr = r + b * K + u * RUN;
        int32_t dot = 0;
        for (int64_t k = 0; k < RUN; ++k) dot += static_cast<int32_t>(wr[k]) * rr[k];
        acc = std::fma(static_cast<float>(dot), s[b * runs + u], acc);
      }
      y[b * N + j] = acc * ws[j];
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define TSERVE_TARGET_AVX2 __attribute__((target("avx2,fma")))

// The 8 int32 lanes of each of 8 vectors summed: lane i of the result is the sum of vector i.
TSERVE_TARGET_AVX2 inline __m256i sum8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The same with AVX2, 8 outputs at a time: w . r as |w| (unsigned) times r carrying w's sign
// (maddubs: 128 * 127 * 2 fits its int16 pairs), widened to int32, the 8 outputs' sums gathered
// into one vector. Up to 4 rows share each run's weights.
TSERVE_TARGET_AVX2 void block_outputs_avx2(const int8_t* w, const float* ws, const int8_t* r, const float* s,
                                           int64_t B, int64_t K, int64_t N, int64_t j0, int64_t j1, float* y) {
  constexpr int64_t MB = 4;
  const int64_t runs = K / RUN;
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8)
    for (int64_t b0 = 0; b0 < B; b0 += MB) {
      const int64_t rows = std::min(MB, B - b0);
      __m256 acc[MB];
      for (int64_t i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t u = 0; u < runs; ++u) {
        __m256i wv[8], aw[8];
        for (int o = 0; o < 8; ++o) {
          wv[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j + o) * K + u * RUN));
          aw[o] = _mm256_sign_epi8(wv[o], wv[o]);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t b = b0 + i;
          const __m256i rv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + b * K + u * RUN));
          __m256i d[8];
          for (int o = 0; o < 8; ++o)
            d[o] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[o], _mm256_sign_epi8(rv, wv[o])), ones);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8(d)), _mm256_set1_ps(s[b * runs + u]), acc[i]);
        }
      }
      const __m256 scale = _mm256_loadu_ps(ws + j);
      for (int64_t i = 0; i < rows; ++i) {
        const __m256 out = _mm256_mul_ps(acc[i], scale);
        float lanes[8];
        _mm256_storeu_ps(lanes, out);
        for (int o = 0; o < 8; ++o) y[(b0 + i) * N + j + o] = lanes[o];
      }
    }
  if (j < j1) block_outputs_plain(w, ws, r, s, B, K, N, j, j1, y);
}
#endif

bool has_avx2() {
#if defined(__GNUC__) && defined(__x86_64__)
  // TSERVE_NATIVE_ISA=scalar: the plain loops, as every other kernel (common.h's cpu())
  static const bool yes = [] {
    const char* isa = std::getenv("TSERVE_NATIVE_ISA");
    if (isa != nullptr && std::strcmp(isa, "scalar") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

void block_outputs(const int8_t* w, const float* ws, const int8_t* r, const float* s, int64_t B, int64_t K, int64_t N,
                   int64_t j0, int64_t j1, float* y, bool portable) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (!portable && has_avx2()) return block_outputs_avx2(w, ws, r, s, B, K, N, j0, j1, y);
#endif
  block_outputs_plain(w, ws, r, s, B, K, N, j0, j1, y);
}

}  // namespace

bool Projection::attach_int8_blocks() {
  if (!packed) return false;
  auto unpacked = packed->unpack();
  const Tensor& qw = std::get<0>(unpacked);
  const int64_t n = qw.size(0), k = qw.size(1);
  if (k % RUN != 0 || qw.qscheme() != at::kPerChannelAffine || qw.q_per_channel_zero_points().ne(0).any().item<bool>())
    return false;
  Tensor ints = qw.int_repr().contiguous();
  i8.assign(ints.data_ptr<int8_t>(), ints.data_ptr<int8_t>() + n * k);
  i8_scale = to_vector(qw.q_per_channel_scales().to(at::kFloat), n, "scales");
  i8_k = k;
  return true;
}

Tensor Projection::int8_block_rows(const Tensor& x, bool portable) const {
  const int64_t B = x.size(0), K = i8_k, N = static_cast<int64_t>(i8_scale.size());
  TORCH_CHECK(x.size(1) == K, "an int8 projection of ", K, " inputs got ", x.size(1));
  std::vector<int8_t> r(B * K);
  std::vector<float> s(B * (K / RUN));
  const float* xp = x.data_ptr<float>();
  over_rows(portable ? nullptr : partner, B, K,
            [&](int64_t b0, int64_t b1) {
              for (int64_t b = b0; b < b1; ++b) quantize_runs(xp + b * K, K, r.data() + b * K, s.data() + b * (K / RUN));
            });
  Tensor y = at::empty({B, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t chunks = (N + CHUNK - 1) / CHUNK;
  auto piece = [&](int64_t c0, int64_t c1) {
    block_outputs(i8.data(), i8_scale.data(), r.data(), s.data(), B, K, N, c0 * CHUNK, std::min(N, c1 * CHUNK), yp,
                  portable);
  };
  if (portable) {
    piece(0, chunks);
  } else if (partner != nullptr && at::get_num_threads() == 1) {
    partner->run(chunks, [&](int64_t c) { piece(c, c + 1); });
  } else {
    at::parallel_for(0, chunks, 1, piece);
  }
  if (!int8_bias.empty())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < N; ++j) yp[b * N + j] += int8_bias[j];
  return y;
}

Tensor int8_block_linear(Tensor x, Tensor ints, Tensor scales, c10::optional<Tensor> bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be (B, k) float32");
  TORCH_CHECK(ints.dim() == 2 && ints.scalar_type() == at::kChar && ints.size(1) % RUN == 0,
              "ints must be (n, k) int8 with k a multiple of ", RUN);
  Projection p;
  const int64_t n = ints.size(0);
  Tensor c = ints.contiguous();
  p.i8.assign(c.data_ptr<int8_t>(), c.data_ptr<int8_t>() + c.numel());
  p.i8_scale = to_vector(scales, n, "scales");
  if (bias) p.int8_bias = to_vector(*bias, n, "bias");
  p.i8_k = ints.size(1);
  return p.int8_block_rows(x.contiguous(), portable);
}

}  // namespace tserve_native
