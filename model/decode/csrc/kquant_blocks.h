// What the GGUF block kernels share (kquant.cpp: a row at a time; kquant_packed.cpp: tiles of 8
// outputs repacked once, for the native step): the block formats, activations quantized per block, the
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

// B rows of activations, quantized per block of `block` (256 or 32) values onto KQ_LEVELS steps
// each side of zero: r in [-8191, 8191] (round half to even), one scale per block (max |x| / 8191),
// and the integer sum of every 16. 14-bit activations keep greedy answers with the float model's
// (int8 ones, as ggml's Q8_K / Q8_0, moved a third to two thirds of them: docs/benchmarks.md) and
// keep every block's integers exact in int32 (kquant.h). The vector loops read each value as two
// bytes, r = 128 hi + lo with hi = r >> 7 in [-64, 63] and lo = r & 127 in [0, 127], so that
// maddubs (unsigned x signed bytes) takes them: weights (unsigned, <= 63) times hi, lo times
// weights. Rows are independent: quantize(b0, b1) fills rows [b0, b1) after size(), so threads
// may share the rows.
constexpr int32_t KQ_LEVELS = 8191;

struct KqActs {
  std::vector<int16_t> r;
  std::vector<int8_t> hi;
  std::vector<uint8_t> lo;
  std::vector<float> scale;
  std::vector<int32_t> sum16;
  // Blocks of 256 only: per block its 8 sums of 32 (A, at most 32 x 8,191 in magnitude) split as
  // A = 32,768 hi + lo, lo in [0, 32,767], hi in [-8, 8), as int16 in fours per pair of sub-blocks
  // (lo_2q, lo_2q+1, hi_2q, hi_2q+1), so the minima's integer (sum over sub-blocks of m A) is
  // madds of int16 pairs (kw_rows).
  std::vector<int16_t> split32;
  void size(int64_t B, int64_t K, int64_t block) {
    r.resize(B * K);
    hi.resize(B * K);
    lo.resize(B * K);
    scale.resize(B * K / block);
    sum16.resize(B * K / 16);
    split32.resize(block == 256 ? B * K / 16 : 0);
  }
  bool empty() const { return r.empty(); }
  void quantize(const float* x, int64_t b0, int64_t b1, int64_t K, int64_t block) {
    for (int64_t u = b0 * K / block; u < b1 * K / block; ++u) {  // rows are whole blocks
      const float* __restrict xs = x + u * block;
      // max |x| in 16 lanes (GCC vectors: one running maximum was a chain of dependent scalar
      // maxima), then across them: the same value in any order, a NaN skipped either way (a
      // lane keeps its value unless it is less than the new one, as std::max(lane, v) does)
      typedef float f16 __attribute__((vector_size(64)));
      typedef int32_t i16 __attribute__((vector_size(64)));
      f16 lanes = {};
      for (int64_t i = 0; i < block; i += 16) {
        i16 bits;
        std::memcpy(&bits, xs + i, sizeof(bits));
        const f16 v = reinterpret_cast<f16>(bits & 0x7fffffff);  // |x|, exactly std::fabs's bits
        lanes = lanes < v ? v : lanes;
      }
      float top = 0.0f;
      for (int j = 0; j < 16; ++j) top = std::max(top, lanes[j]);
      const float inv = top > 0.0f ? static_cast<float>(KQ_LEVELS) / top : 0.0f;
      scale[u] = top / static_cast<float>(KQ_LEVELS);
      // the block's own pointers: written through the vectors' members, every store could move
      // their data pointers, and the loop ran a value at a time
      int16_t* __restrict rs = r.data() + u * block;
      int8_t* __restrict hs = hi.data() + u * block;
      uint8_t* __restrict ls = lo.data() + u * block;
      for (int64_t i = 0; i < block; ++i) {
        const int32_t v = std::max(-KQ_LEVELS, std::min(KQ_LEVELS, static_cast<int32_t>(std::nearbyint(xs[i] * inv))));
        rs[i] = static_cast<int16_t>(v);
        hs[i] = static_cast<int8_t>(v >> 7);  // arithmetic shift: floor(v / 128)
        ls[i] = static_cast<uint8_t>(v & 127);
      }
      for (int64_t g = 0; g < block / 16; ++g) {
        int32_t s = 0;
        for (int64_t i = 0; i < 16; ++i) s += rs[16 * g + i];
        sum16[u * block / 16 + g] = s;
      }
      if (block == 256)
        for (int64_t g = 0; g < 8; ++g) {
          const int32_t A = sum16[u * 16 + 2 * g] + sum16[u * 16 + 2 * g + 1];
          split32[u * 16 + 4 * (g / 2) + g % 2] = static_cast<int16_t>(A & 32767);
          split32[u * 16 + 4 * (g / 2) + 2 + g % 2] = static_cast<int16_t>(A >> 15);  // arithmetic: floor(A / 32,768)
        }
    }
  }
};

// Rows [b0, b0 + R) of quantized activations as the packed loops read them: each row's high and
// low bytes, its sums of 16 and its block scales (`blocks` a row).
template <int R>
struct KqRowViews {
  const int8_t* hi[R];
  const uint8_t* lo[R];
  const int32_t* sum16[R];
  const float* scale[R];
  KqRowViews(const KqActs& a, int64_t k, int64_t b0, int64_t blocks) {
    for (int x = 0; x < R; ++x) {
      hi[x] = a.hi.data() + (b0 + x) * k;
      lo[x] = a.lo.data() + (b0 + x) * k;
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

// How many integers a block gives (kquant.h): Q4_K i0, i1; Q5_K i0 over sub-blocks 0-3, i0 over
// 4-7, i1; Q6_K four partial sums; the 32-value types i0, i1.
inline int64_t kq_ints(int64_t qtype) { return qtype == KQ5_K ? 3 : qtype == KQ6_K ? 4 : 2; }

// value l (0-31) of a 32-value block whose low nibbles are values 0-15 and high nibbles 16-31
inline int32_t nib32(const uint8_t* qs, int l) { return l < 16 ? qs[l] & 15 : qs[l - 16] >> 4; }

#if defined(TSERVE_KQ_X86)
TSERVE_KQ_AVX2 inline __m256i loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
#endif

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
