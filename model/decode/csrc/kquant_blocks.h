// What the GGUF block kernels share (kquant.cpp: a row at a time; kquant_tiles.cpp: a tile of
// outputs against many rows): the block formats, activations quantized per block, the
// unpacking helpers. kquant.h has the maths.
#pragma once

#include "kquant.h"

// AVX2 in a build without -mavx2 (the portable one) through the target attribute, chosen at run
// time; in a -march=native build on an AVX2 machine the flags already allow it.
#if defined(__GNUC__) && defined(__x86_64__)
#define TSERVE_KQ_X86 1
#if defined(__AVX2__)
#define TSERVE_KQ_AVX2
#else
#define TSERVE_KQ_AVX2 __attribute__((target("avx2")))
#endif
// VNNI only where the compiler flags enable it (-march=native on such a CPU): untested on the
// AVX2-only machines this was written on, so it is the AVX2 loops with two primitives swapped.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX2__)
#define TSERVE_KQ_VNNI 1
#endif
#endif

namespace tserve_native {

enum KqType : int64_t { KQ4_0 = 2, KQ4_1 = 3, KQ5_0 = 6, KQ5_1 = 7, KQ8_0 = 8, KQ4_K = 12, KQ5_K = 13, KQ6_K = 14 };

struct KqFormat {
  int64_t values = 0, bytes = 0;
};

inline KqFormat kq_format(int64_t qtype) {
  switch (qtype) {
    case KQ4_0: return {32, 18};
    case KQ4_1: return {32, 20};
    case KQ5_0: return {32, 22};
    case KQ5_1: return {32, 24};
    case KQ8_0: return {32, 34};
    case KQ4_K: return {256, 144};
    case KQ5_K: return {256, 176};
    case KQ6_K: return {256, 210};
    default: return {};
  }
}

inline float kq_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // exact, as the bit-by-bit conversion below
#endif
  return half_to_float(h);
}

// B rows of activations, quantized per block of `block` (256 or 32) values: r in [-127, 127]
// (round half to even), one scale per block, and the integer sum of every 16 (also as int16:
// |sum| <= 16 * 127, for the tiles' madd). Rows are independent: quantize(b0, b1) fills rows
// [b0, b1) after size(), so threads may share the rows.
struct KqActs {
  std::vector<int8_t> r;
  std::vector<float> scale;
  std::vector<int32_t> sum16;
  std::vector<int16_t> sum16h;
  void size(int64_t B, int64_t K, int64_t block) {
    r.resize(B * K);
    scale.resize(B * K / block);
    sum16.resize(B * K / 16);
    sum16h.resize(B * K / 16);
  }
  void quantize(const float* x, int64_t b0, int64_t b1, int64_t K, int64_t block) {
    for (int64_t u = b0 * K / block; u < b1 * K / block; ++u) {  // rows are whole blocks
      const float* xs = x + u * block;
      float top = 0.0f;
      for (int64_t i = 0; i < block; ++i) top = std::max(top, std::fabs(xs[i]));
      const float inv = top > 0.0f ? 127.0f / top : 0.0f;
      scale[u] = top / 127.0f;
      int8_t* rs = r.data() + u * block;
      for (int64_t i = 0; i < block; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xs[i] * inv));
        rs[i] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
      }
      for (int64_t g = 0; g < block / 16; ++g) {
        int32_t s = 0;
        for (int64_t i = 0; i < 16; ++i) s += rs[16 * g + i];
        sum16[u * block / 16 + g] = s;
        sum16h[u * block / 16 + g] = static_cast<int16_t>(s);
      }
    }
  }
};

// Rows [b0, b0 + R) of quantized activations as the tile loops read them: each row's values,
// its sums of 16 (int16 and int32) and its block scales (`blocks` a row).
template <int R>
struct KqRowViews {
  const int8_t* r[R];
  const int16_t* sum16h[R];
  const int32_t* sum16[R];
  const float* scale[R];
  KqRowViews(const KqActs& a, int64_t k, int64_t b0, int64_t blocks) {
    for (int x = 0; x < R; ++x) {
      r[x] = a.r.data() + (b0 + x) * k;
      sum16h[x] = a.sum16h.data() + (b0 + x) * (k / 16);
      sum16[x] = a.sum16.data() + (b0 + x) * (k / 16);
      scale[x] = a.scale.data() + (b0 + x) * blocks;
    }
  }
};

// Q4_K / Q5_K: the eight 6-bit scales and minima of a block's 12 bytes.
inline void scale_min_k4(const uint8_t* s, int32_t* sc, int32_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// i1 of Q4_K / Q5_K: sum_s m_s (sum r)_s over the eight sub-blocks of 32.
inline int32_t minima_dot(const int32_t* mn, const int32_t* sum16) {
  int32_t t = 0;
  for (int s = 0; s < 8; ++s) t += mn[s] * (sum16[2 * s] + sum16[2 * s + 1]);
  return t;
}

// value l (0-31) of a 32-value block whose low nibbles are values 0-15 and high nibbles 16-31
inline int32_t nib32(const uint8_t* qs, int l) { return l < 16 ? qs[l] & 15 : qs[l - 16] >> 4; }

#if defined(TSERVE_KQ_X86)
TSERVE_KQ_AVX2 inline __m256i loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 bytes: values 0-15 (low nibbles), then 16-31 (high nibbles).
TSERVE_KQ_AVX2 inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// The 32 bits of qh as bytes 0x10 (bit set) or 0 (clear), byte j for bit j.
TSERVE_KQ_AVX2 inline __m256i fifth_bits(uint32_t qh) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}
#endif

// The tiled kernels (kquant_tiles.cpp): y[b * stride + j] for rows [0, B) of `a` and outputs
// [j0, j1) of the (n, k) weights `w`, 8 outputs at a time (each weight block unpacked once for all
// B rows), bit for bit what the row-at-a-time loops give. False (nothing written) where this build
// or CPU has no tiled loops for `isa` (AVX2 needs FMA too).
bool kq_tiles(const KqActs& a, int64_t B, int64_t k, const uint8_t* w, int64_t qtype, int64_t j0, int64_t j1,
              int64_t isa, const float* bias, float* y, int64_t stride);

// Q4_K, Q6_K and the 32-value types repacked once (kquant_packed.cpp): 8 outputs per tile, values as
// stored (Q4_K's scales and minima a byte each), about the file's size. kq_packed_bytes: the buffer kq_pack fills for an
// (n, k) tensor of `qtype` (0 where that type is not packed); kq_packed_runs: whether this CPU has
// the loops (AVX2, FMA, F16C); kq_packed_rows: y for rows [0, B) of `a` and outputs [j0, j1),
// bit for bit the scalar loops.
bool kq_packed_type(int64_t qtype);
int64_t kq_packed_bytes(int64_t qtype, int64_t n, int64_t k);
void kq_pack(const uint8_t* w, int64_t qtype, int64_t n, int64_t k, uint8_t* out);
bool kq_packed_runs();
void kq_packed_rows(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t qtype, int64_t j0,
                    int64_t j1, const float* bias, float* y, int64_t stride);

}  // namespace tserve_native
