// The GGUF block kernels for many rows (kquant.h has the maths). The row-at-a-time loops
// (kquant.cpp) unpack a weight block's values and scales again for every activation row; here a
// tile of 8 outputs is unpacked once into a buffer, one output per 32-bit lane: each 4 values of
// the 8 outputs make one vector, with the sub-block scales, the minima / offsets and the float
// scales beside them per block. Every row then runs against the buffer, 4 rows at a time, taking
// each group of 4 activation bytes broadcast to all lanes: a lane's sums are exactly the integers
// i0, i1 of kquant.h (integer sums do not depend on their order), and the float combination is
// the same operations per lane in the same block order (fma(d s_a, i0, acc), then the minima or
// offsets term), so every (row, output) keeps the bits of the scalar loops whatever B is.
#include "kquant_blocks.h"

namespace tserve_native {
namespace {

#if defined(TSERVE_KQ_X86)
#if defined(__AVX2__) && defined(__FMA__)
#define TSERVE_KT_TARGET
#else
#define TSERVE_KT_TARGET __attribute__((target("avx2,fma")))
#endif

constexpr int64_t KT = 8;  // outputs per tile, one per 32-bit lane
constexpr int KT_ROWS = 4;  // activation rows per pass over a tile's buffer

constexpr bool kt_k(int64_t t) { return t == KQ4_K || t == KQ5_K || t == KQ6_K; }
constexpr int64_t kt_values(int64_t t) { return kt_k(t) ? 256 : 32; }
// the correction sum_g c_g (sum r)_g is subtracted from i0 (offset types), or is i1 (minima, m)
constexpr bool kt_sub(int64_t t) { return t == KQ6_K || t == KQ4_0 || t == KQ5_0; }
constexpr bool kt_i1(int64_t t) { return t == KQ4_K || t == KQ5_K || t == KQ4_1 || t == KQ5_1; }
// vectors per block in the buffer: values / 4 of values, one of scales per 16 values, one of
// corrections per 32, then d and m
constexpr int64_t kt_stride(int64_t t) { return kt_values(t) / 4 + kt_values(t) / 16 + kt_values(t) / 32 + 2; }

// A tile's block unpacked, output j in row / lane j: values (unsigned; signed for Q8_0), the
// integer scale and the correction weight of every 16 values, and the float scales.
struct KtBlocks {
  alignas(32) uint8_t q[KT][256];
  alignas(32) int32_t sc[16][KT];
  alignas(32) int32_t corr[16][KT];
  alignas(32) float d[KT], m[KT];
};

TSERVE_KT_TARGET inline void kt_store(uint8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }

template <int64_t T>
TSERVE_KT_TARGET void kt_unpack(const uint8_t* w, KtBlocks& b, int64_t j) {
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
  if constexpr (T == KQ4_K || T == KQ5_K) {
    const uint8_t* qs = w + (T == KQ4_K ? 16 : 48);
    __m256i qh = T == KQ5_K ? loadu(w + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      const __m256i q = loadu(qs + 32 * c);
      __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      if (T == KQ5_K) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        qh = _mm256_srli_epi16(qh, 1);
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        qh = _mm256_srli_epi16(qh, 1);
      }
      kt_store(b.q[j] + 64 * c, lo);
      kt_store(b.q[j] + 64 * c + 32, hi);
    }
    int32_t sc[8], mn[8];
    scale_min_k4(w + 4, sc, mn);
    for (int g = 0; g < 16; ++g) {
      b.sc[g][j] = sc[g / 2];
      b.corr[g][j] = mn[g / 2];
    }
    b.d[j] = kq_half(w);
    b.m[j] = kq_half(w + 2);
  } else if constexpr (T == KQ6_K) {
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = loadu(w + 64 * h), ql1 = loadu(w + 64 * h + 32), qh = loadu(w + 128 + 32 * h);
      const __m256i nib[4] = {_mm256_and_si256(ql0, low), _mm256_and_si256(ql1, low),
                              _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low)};
      for (int c = 0; c < 4; ++c) {
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), three);
        kt_store(b.q[j] + 128 * h + 32 * c, _mm256_or_si256(nib[c], _mm256_slli_epi16(top, 4)));
      }
    }
    for (int g = 0; g < 16; ++g) {
      const int32_t s = static_cast<int8_t>(w[192 + g]);
      b.sc[g][j] = s;
      b.corr[g][j] = 32 * s;
    }
    b.d[j] = kq_half(w + 208);
  } else {
    if (T == KQ8_0) {
      kt_store(b.q[j], loadu(w + 2));
    } else {
      const bool five = T == KQ5_0 || T == KQ5_1, offset = T == KQ4_1 || T == KQ5_1;
      __m256i q = nibbles32(w + (offset ? 4 : 2) + (five ? 4 : 0));
      if (five) {
        uint32_t qh;
        std::memcpy(&qh, w + (offset ? 4 : 2), 4);
        q = _mm256_or_si256(q, fifth_bits(qh));
      }
      kt_store(b.q[j], q);
    }
    const int32_t c = T == KQ4_0 ? 8 : T == KQ5_0 ? 16 : (T == KQ4_1 || T == KQ5_1) ? 1 : 0;
    b.sc[0][j] = b.sc[1][j] = 1;
    b.corr[0][j] = b.corr[1][j] = c;
    b.d[j] = kq_half(w);
    b.m[j] = T == KQ4_1 || T == KQ5_1 ? kq_half(w + 2) : 0.0f;
  }
}

// r[j] holds dwords 0-7 of output j; out[t] holds dword t of outputs 0-7.
TSERVE_KT_TARGET inline void kt_transpose(const __m256i* r, __m256i* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    out[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// Lanes of int16 pairs (lo, hi) from two vectors of int32 lanes (each fits in 16 bits).
TSERVE_KT_TARGET inline __m256i kt_pairs(const int32_t* lo, const int32_t* hi) {
  const __m256i l = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
  const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
  return _mm256_or_si256(_mm256_and_si256(l, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(h, 16));
}

// The tile's buffer: outputs rows[0..8) (a row repeated where the tile has fewer outputs).
template <int64_t T>
TSERVE_KT_TARGET void kt_pack(const uint8_t* const* rows, int64_t blocks, __m256i* buf) {
  constexpr int64_t V = kt_values(T), G = V / 16, S = kt_stride(T);
  const int64_t bytes = kq_format(T).bytes;
  KtBlocks b;
  for (int64_t i = 0; i < blocks; ++i) {
    __m256i* out = buf + i * S;
    for (int64_t j = 0; j < KT; ++j) {
      for (int64_t line = 0; line < bytes; line += 64)  // two blocks ahead in each of the 8 rows
        _mm_prefetch(reinterpret_cast<const char*>(rows[j] + (i + 2) * bytes + line), _MM_HINT_T0);
      kt_unpack<T>(rows[j] + i * bytes, b, j);
    }
    for (int64_t c = 0; c < V / 32; ++c) {
      __m256i r[KT];
      for (int64_t j = 0; j < KT; ++j) r[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(b.q[j] + 32 * c));
      kt_transpose(r, out + 8 * c);
    }
    for (int64_t g = 0; g < G; ++g) out[V / 4 + g] = kt_pairs(b.sc[g], b.sc[g]);
    for (int64_t p = 0; p < G / 2; ++p) out[V / 4 + G + p] = kt_pairs(b.corr[2 * p], b.corr[2 * p + 1]);
    out[S - 2] = _mm256_castps_si256(_mm256_load_ps(b.d));
    out[S - 1] = _mm256_castps_si256(_mm256_load_ps(b.m));
  }
}

// A group of 16 values: acc gathers u . s per quad; finish applies the group's scale pair.
struct KtAvx2 {
  TSERVE_KT_TARGET static inline __m256i step(__m256i acc, __m256i u, __m256i s, __m256i sc) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc));
  }
  TSERVE_KT_TARGET static inline __m256i finish(__m256i acc, __m256i) { return acc; }
};
#if defined(TSERVE_KQ_VNNI)
struct KtVnni {
  static inline __m256i step(__m256i acc, __m256i u, __m256i s, __m256i) { return _mm256_dpbusd_epi32(acc, u, s); }
  static inline __m256i finish(__m256i acc, __m256i sc) { return _mm256_mullo_epi32(acc, _mm256_srai_epi32(sc, 16)); }
};
#endif

TSERVE_KT_TARGET inline __m256i kt_bcast(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [b0, b0 + R) against the tile: out[r][j] = row b0 + r times output j.
template <class Ops, int64_t T, int R>
TSERVE_KT_TARGET void kt_rows(const __m256i* buf, int64_t blocks, const KqActs& a, int64_t k, int64_t b0,
                              float (*out)[KT]) {
  constexpr int64_t V = kt_values(T), G = V / 16, S = kt_stride(T);
  const KqRowViews<R> rows(a, k, b0, blocks);
  __m256 acc[R];
  for (int x = 0; x < R; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const __m256i* blk = buf + i * S;
    __m256i i0[R], i1[R];
    for (int x = 0; x < R; ++x) i0[x] = i1[x] = _mm256_setzero_si256();
    for (int64_t g = 0; g < G; ++g) {
      const __m256i sc = blk[V / 4 + g];
      __m256i ga[R];
      for (int x = 0; x < R; ++x) ga[x] = _mm256_setzero_si256();
      for (int64_t t = 0; t < 4; ++t) {
        const __m256i q = blk[4 * g + t];
        const __m256i u = T == KQ8_0 ? _mm256_sign_epi8(q, q) : q;  // Q8_0: |q| against r with q's sign
        for (int x = 0; x < R; ++x) {
          __m256i s = kt_bcast(rows.r[x] + i * V + 16 * g + 4 * t);
          if (T == KQ8_0) s = _mm256_sign_epi8(s, q);
          ga[x] = Ops::step(ga[x], u, s, sc);
        }
      }
      for (int x = 0; x < R; ++x) i0[x] = _mm256_add_epi32(i0[x], Ops::finish(ga[x], sc));
    }
    if constexpr (kt_sub(T) || kt_i1(T)) {
      for (int64_t p = 0; p < G / 2; ++p) {
        const __m256i c = blk[V / 4 + G + p];
        for (int x = 0; x < R; ++x) i1[x] = _mm256_add_epi32(i1[x], _mm256_madd_epi16(c, kt_bcast(rows.sum16h[x] + i * G + 2 * p)));
      }
    }
    const __m256 d = _mm256_castsi256_ps(blk[S - 2]), m = _mm256_castsi256_ps(blk[S - 1]);
    for (int x = 0; x < R; ++x) {
      if (kt_sub(T)) i0[x] = _mm256_sub_epi32(i0[x], i1[x]);
      const __m256 sa = _mm256_set1_ps(rows.scale[x][i]);
      acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(d, sa), _mm256_cvtepi32_ps(i0[x]), acc[x]);
      if (T == KQ4_K || T == KQ5_K) acc[x] = _mm256_fnmadd_ps(_mm256_mul_ps(m, sa), _mm256_cvtepi32_ps(i1[x]), acc[x]);
      if (T == KQ4_1 || T == KQ5_1) acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(m, sa), _mm256_cvtepi32_ps(i1[x]), acc[x]);
    }
  }
  for (int x = 0; x < R; ++x) _mm256_storeu_ps(out[x], acc[x]);
}

template <class Ops, int64_t T>
void kt_run(const KqActs& a, int64_t B, int64_t k, const uint8_t* w, int64_t j0, int64_t j1, const float* bias,
            float* y, int64_t stride) {
  constexpr int64_t V = kt_values(T);
  const int64_t blocks = k / V, row = blocks * kq_format(T).bytes;
  thread_local std::vector<uint8_t> bytes;  // the tile's buffer, aligned to its vectors
  bytes.resize(static_cast<size_t>(blocks * kt_stride(T) + 1) * sizeof(__m256i));
  __m256i* buf = reinterpret_cast<__m256i*>((reinterpret_cast<uintptr_t>(bytes.data()) + 31) & ~uintptr_t{31});
  for (int64_t t0 = j0; t0 < j1; t0 += KT) {
    const int64_t count = std::min(KT, j1 - t0);
    const uint8_t* rows[KT];
    for (int64_t j = 0; j < KT; ++j) rows[j] = w + (t0 + std::min(j, count - 1)) * row;
    kt_pack<T>(rows, blocks, buf);
    float out[KT_ROWS][KT];
    auto emit = [&](int64_t b, int x) {
      for (int64_t j = 0; j < count; ++j) {
        const float v = out[x][j];
        y[b * stride + t0 + j] = bias == nullptr ? v : v + bias[t0 + j];
      }
    };
    int64_t b = 0;
    for (; b + KT_ROWS <= B; b += KT_ROWS) {
      kt_rows<Ops, T, KT_ROWS>(buf, blocks, a, k, b, out);
      for (int x = 0; x < KT_ROWS; ++x) emit(b + x, x);
    }
    for (; b < B; ++b) {
      kt_rows<Ops, T, 1>(buf, blocks, a, k, b, out);
      emit(b, 0);
    }
  }
}

template <class Ops>
void kt_dispatch(const KqActs& a, int64_t B, int64_t k, const uint8_t* w, int64_t qtype, int64_t j0, int64_t j1,
                 const float* bias, float* y, int64_t stride) {
  switch (qtype) {
    case KQ4_K: return kt_run<Ops, KQ4_K>(a, B, k, w, j0, j1, bias, y, stride);
    case KQ5_K: return kt_run<Ops, KQ5_K>(a, B, k, w, j0, j1, bias, y, stride);
    case KQ6_K: return kt_run<Ops, KQ6_K>(a, B, k, w, j0, j1, bias, y, stride);
    case KQ8_0: return kt_run<Ops, KQ8_0>(a, B, k, w, j0, j1, bias, y, stride);
    case KQ4_0: return kt_run<Ops, KQ4_0>(a, B, k, w, j0, j1, bias, y, stride);
    case KQ4_1: return kt_run<Ops, KQ4_1>(a, B, k, w, j0, j1, bias, y, stride);
    case KQ5_0: return kt_run<Ops, KQ5_0>(a, B, k, w, j0, j1, bias, y, stride);
    case KQ5_1: return kt_run<Ops, KQ5_1>(a, B, k, w, j0, j1, bias, y, stride);
    default: TORCH_CHECK(false, "GGUF type ", qtype, " is not one the block kernels read");
  }
}
#endif

}  // namespace

bool kq_tiles(const KqActs& a, int64_t B, int64_t k, const uint8_t* w, int64_t qtype, int64_t j0, int64_t j1,
              int64_t isa, const float* bias, float* y, int64_t stride) {
#if defined(TSERVE_KQ_X86)
  static const bool fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == KQ_AVX2 && fma) {
    kt_dispatch<KtAvx2>(a, B, k, w, qtype, j0, j1, bias, y, stride);
    return true;
  }
#if defined(TSERVE_KQ_VNNI)
  if (isa == KQ_VNNI && fma) {
    kt_dispatch<KtVnni>(a, B, k, w, qtype, j0, j1, bias, y, stride);
    return true;
  }
#endif
#endif
  return false;
}

}  // namespace tserve_native
