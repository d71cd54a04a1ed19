// Q4_K, Q6_K and the 32-value types repacked once, when a projection is built (kquant.h has the maths). The tiled loops
// (kquant_tiles.cpp) unpack 8 outputs' blocks on every call into a one-byte-per-value buffer,
// which costs as much as two rows of work, so a batch-1 step kept the row-at-a-time loops, whose
// per-block scalar work (scales, a horizontal sum, the float combination) bound them at a quarter
// of this CPU's read bandwidth. Here the same tile is kept packed, at about the file's size:
//   per tile of 8 outputs and per block of 256 values, 1,184 bytes (the file: 8 x 144 = 1,152):
//   - 32 vectors of nibbles: vector 8c + t holds, for output j in bytes 4j..4j+3, the file's bytes
//     qs[32c + 4t .. 32c + 4t + 3] of that output: low nibbles are values 64c + 4t + (0..3)
//     (sub-block 2c), high nibbles the same + 32 (sub-block 2c + 1);
//   - the 8 sub-block scales, then the 8 minima, one byte per (sub-block, output): byte 8s + j;
//   - d, then dmin: the 8 outputs' IEEE halves, as stored.
// Q6_K likewise at the file's size (its layout is above kp_rows6).
// The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) the same way, at exactly the file's size: per
// tile and block of 32, vector t holds for output j its bytes 4t .. 4t + 3 of the values (nibbles:
// low = values 4t.., high = 16 + 4t..; Q8_0: 8 vectors of signed values), then the 8 outputs'
// fifth bits as stored (Q5_0, Q5_1: 32 bits each), d and (Q4_1, Q5_1) m as halves.
// Every step, whatever its rows, runs against it: an AND (and a shift) gives 4 values of all 8
// outputs per vector, each group of 4 activation bytes is broadcast to the 8 lanes, and a lane's
// integers are exactly i0, i1 of kquant.h; the float combination is the tiles' (the same
// operations per lane in the same block order), so every (row, output) has the bits of the
// scalar loops, for 1 row or 33.
#include "kquant_blocks.h"

namespace tserve_native {

#if defined(TSERVE_KQ_X86)
namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TSERVE_KP_TARGET
#else
#define TSERVE_KP_TARGET __attribute__((target("avx2,fma,f16c")))
#endif

constexpr int64_t KP = 8;                       // outputs per tile, one per 32-bit lane
constexpr int64_t KP_BLOCK = 32 * 32 + 64 + 64 + 16 + 16;  // bytes per (tile, block)
constexpr int KP_ROWS = 4;                      // activation rows per pass over a tile
constexpr int64_t KP_PREFETCH = 2 * KP_BLOCK;   // how far ahead the loops ask for the next bytes

TSERVE_KP_TARGET inline __m256i kp_bcast(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 bytes (one per output) as int32 lanes holding the value in both 16-bit halves: a madd
// factor for int16 pairs that share it.
TSERVE_KP_TARGET inline __m256i kp_pairs(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(x, _mm256_slli_epi32(x, 16));
}

// Rows [b0, b0 + R) against one tile: out[r][j] = row b0 + r times output j.
template <int R>
TSERVE_KP_TARGET void kp_rows(const uint8_t* tile, int64_t blocks, const KqActs& a, int64_t k, int64_t b0,
                              float (*out)[KP]) {
  const __m256i low = _mm256_set1_epi8(15);
  const KqRowViews<R> rows(a, k, b0, blocks);
  __m256 acc[R];
  for (int x = 0; x < R; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * KP_BLOCK;
    const uint8_t* sc = blk + 1024;
    const uint8_t* mn = sc + 64;
    __m256i i0[R], i1[R];
    for (int x = 0; x < R; ++x) i0[x] = i1[x] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // values 64c .. 64c + 63: sub-blocks 2c (low nibbles), 2c + 1 (high)
      const __m256i slo = kp_pairs(sc + 8 * (2 * c)), shi = kp_pairs(sc + 8 * (2 * c + 1));
      // At one or two rows the 8 vectors of a sub-block are summed as int16 before one madd by its
      // scale: a pair is at most 2 x 15 x 127 = 3,810, eight 30,480, so the sums stay exact. Four
      // rows would need more registers than there are; they take the madd per vector.
      __m256i plo[R], phi[R];
      for (int x = 0; x < R; ++x) plo[x] = phi[x] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        // the block two ahead (the next tile's first ones at a tile's end: tiles are contiguous),
        // a line per two vectors: the stream outruns the hardware prefetcher at one row
        if (t % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + 32 * (8 * c + t)), _MM_HINT_T0);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (8 * c + t)));
        const __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        for (int x = 0; x < R; ++x) {
          const int8_t* rv = rows.r[x] + i * 256 + 64 * c + 4 * t;
          if constexpr (R <= 2) {
            plo[x] = _mm256_add_epi16(plo[x], _mm256_maddubs_epi16(lo, kp_bcast(rv)));
            phi[x] = _mm256_add_epi16(phi[x], _mm256_maddubs_epi16(hi, kp_bcast(rv + 32)));
          } else {
            i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, kp_bcast(rv)), slo));
            i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, kp_bcast(rv + 32)), shi));
          }
        }
      }
      if constexpr (R <= 2)
        for (int x = 0; x < R; ++x)
          i0[x] = _mm256_add_epi32(i0[x], _mm256_add_epi32(_mm256_madd_epi16(plo[x], slo), _mm256_madd_epi16(phi[x], shi)));
    }
    for (int64_t line = 1024; line < KP_BLOCK; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + line), _MM_HINT_T0);
    for (int s = 0; s < 8; ++s) {  // i1 = sum_s m_s (sum r)_s: the two sums of 16 of sub-block s as a pair
      const __m256i m = kp_pairs(mn + 8 * s);
      for (int x = 0; x < R; ++x) i1[x] = _mm256_add_epi32(i1[x], _mm256_madd_epi16(m, kp_bcast(rows.sum16h[x] + i * 16 + 2 * s)));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1152)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1168)));
    for (int x = 0; x < R; ++x) {
      const __m256 sa = _mm256_set1_ps(rows.scale[x][i]);
      acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(d, sa), _mm256_cvtepi32_ps(i0[x]), acc[x]);
      acc[x] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, sa), _mm256_cvtepi32_ps(i1[x]), acc[x]);
    }
  }
  for (int x = 0; x < R; ++x) _mm256_storeu_ps(out[x], acc[x]);
}

// Q6_K, per tile of 8 outputs and block of 256, 1,680 bytes (the file's 8 x 210):
//   - 32 vectors of low bits: vector g holds, for output j in bytes 4j..4j+3, the file's ql[4g .. 4g + 3];
//   - 16 vectors of top bits: vector 32 + g holds qh[4g .. 4g + 3] the same way;
//   - the 16 signed sub-block scales, byte 8s + j; then the 8 outputs' d as halves.
// In half h (values 128h ..), bytes l .. l + 3 of ql (vector 16h + l / 4), of ql + 32 (16h + 8 + l / 4)
// and of qh (32 + 8h + l / 4) give values l, l + 32, l + 64, l + 96 (+ 128h) of 4 consecutive
// indices each: the low or high nibbles, topped up by bits 0-1, 2-3, 4-5, 6-7 of qh.
constexpr int64_t KP6_BLOCK = 32 * 32 + 16 * 32 + 128 + 16;

// 8 signed bytes (one per output) as int32 lanes holding the value in both 16-bit halves
TSERVE_KP_TARGET inline __m256i kp_signed_pairs(const uint8_t* p) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(x, 16));
}

template <int R>
TSERVE_KP_TARGET void kp_rows6(const uint8_t* tile, int64_t blocks, const KqActs& a, int64_t k, int64_t b0,
                               float (*out)[KP]) {
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30), half = _mm256_set1_epi32(0xffff);
  const KqRowViews<R> rows(a, k, b0, blocks);
  __m256 acc[R];
  for (int x = 0; x < R; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * KP6_BLOCK;
    const uint8_t* sc = blk + 1536;
    __m256i i0[R], i1[R];
    for (int x = 0; x < R; ++x) i0[x] = i1[x] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h)
      for (int u2 = 0; u2 < 4; ++u2) {  // bytes l = 8 u2 .. 8 u2 + 7: sub-blocks 8h + u2 / 2 + 0, 2, 4, 6
        // Two groups of 4 bytes share their sub-blocks: at one or two rows their int16 sums are
        // exact (a pair is at most 2 x 63 x 127 = 16,002, two 32,004) before one madd by each
        // scale; four rows take the madd per vector (registers).
        __m256i f[4], part[R][4];
        for (int w = 0; w < 4; ++w) f[w] = kp_signed_pairs(sc + 8 * (8 * h + u2 / 2 + 2 * w));
        for (int x = 0; x < R; ++x)
          for (int v = 0; v < 4; ++v) part[x][v] = _mm256_setzero_si256();
        for (int uu = 0; uu < 2; ++uu) {
          const int u = 2 * u2 + uu;
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * KP6_BLOCK + 128 * (8 * h + u)), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * KP6_BLOCK + 128 * (8 * h + u) + 64), _MM_HINT_T0);
          const __m256i A = loadu(blk + 32 * (16 * h + u)), B = loadu(blk + 32 * (16 * h + 8 + u));
          const __m256i H = loadu(blk + 1024 + 32 * (8 * h + u));
          const __m256i v[4] = {
              _mm256_or_si256(_mm256_and_si256(A, low), _mm256_and_si256(_mm256_slli_epi16(H, 4), top)),
              _mm256_or_si256(_mm256_and_si256(B, low), _mm256_and_si256(_mm256_slli_epi16(H, 2), top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low), _mm256_and_si256(H, top)),
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low),
                              _mm256_and_si256(_mm256_srli_epi16(H, 2), top))};
          for (int x = 0; x < R; ++x) {
            const int8_t* rv = rows.r[x] + i * 256 + 128 * h + 4 * u;
            for (int w = 0; w < 4; ++w) {
              const __m256i m = _mm256_maddubs_epi16(v[w], kp_bcast(rv + 32 * w));
              if constexpr (R <= 2) part[x][w] = _mm256_add_epi16(part[x][w], m);
              else i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(m, f[w]));
            }
          }
        }
        if constexpr (R <= 2)
          for (int w = 0; w < 4; ++w)
            for (int x = 0; x < R; ++x) i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(part[x][w], f[w]));
      }
    for (int p = 0; p < 8; ++p) {  // i1 = sum_s sc_s (sum r)_s, sub-blocks 2p and 2p + 1 as a pair
      const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * p)));
      const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * p + 8)));
      const __m256i f = _mm256_or_si256(_mm256_and_si256(lo, half), _mm256_slli_epi32(hi, 16));
      for (int x = 0; x < R; ++x) i1[x] = _mm256_add_epi32(i1[x], _mm256_madd_epi16(f, kp_bcast(rows.sum16h[x] + i * 16 + 2 * p)));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1664)));
    for (int x = 0; x < R; ++x) {
      const __m256i q = _mm256_sub_epi32(i0[x], _mm256_slli_epi32(i1[x], 5));  // the scalar loops' i0
      acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(rows.scale[x][i])), _mm256_cvtepi32_ps(q), acc[x]);
    }
  }
  for (int x = 0; x < R; ++x) _mm256_storeu_ps(out[x], acc[x]);
}

// fill(blk, src, j) for every (tile, block, output j) of an (n, k) tensor of `bytes`-byte blocks of
// `values` values: blk is the tile's block in `out` (`block_bytes` each), src output j's block in the
// file (the last row fills a short tile).
template <class Fill>
void kp_each(const uint8_t* w, int64_t n, int64_t k, int64_t values, int64_t bytes, int64_t block_bytes, uint8_t* out,
             Fill fill) {
  const int64_t blocks = k / values, row = blocks * bytes, tiles = (n + KP - 1) / KP;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < blocks; ++i)
        for (int64_t j = 0; j < KP; ++j)
          fill(out + (t * blocks + i) * block_bytes, w + std::min(t * KP + j, n - 1) * row + i * bytes, j);
  });
}

void kp_pack6(const uint8_t* w, int64_t n, int64_t k, uint8_t* out) {
  kp_each(w, n, k, 256, 210, KP6_BLOCK, out, [](uint8_t* blk, const uint8_t* src, int64_t j) {
    for (int64_t g = 0; g < 32; ++g) std::memcpy(blk + 32 * g + 4 * j, src + 4 * g, 4);
    for (int64_t g = 0; g < 16; ++g) std::memcpy(blk + 1024 + 32 * g + 4 * j, src + 128 + 4 * g, 4);
    for (int64_t s = 0; s < 16; ++s) blk[1536 + 8 * s + j] = src[192 + s];
    std::memcpy(blk + 1664 + 2 * j, src + 208, 2);
  });
}

constexpr bool kp_five(int64_t t) { return t == KQ5_0 || t == KQ5_1; }
constexpr bool kp_min(int64_t t) { return t == KQ4_1 || t == KQ5_1; }
// bytes per (tile, block of 32): values, fifth bits, d, m
constexpr int64_t kp_block32(int64_t t) {
  return (t == KQ8_0 ? 256 : 128) + (kp_five(t) ? 32 : 0) + 16 + (kp_min(t) ? 16 : 0);
}

// The fifth bits of 4 values per lane as bytes 0x10 or 0: bits 4h .. 4h + 3 of each lane's qh
// (h = 0-7), byte b of the lane from bit 4h + b. The shuffle repeats byte h / 2 of each lane
// (lanes are 4 bytes, 4 to a 128-bit half) across the lane; the mask picks bit b of nibble h % 2.
TSERVE_KP_TARGET inline __m256i kp_fifth(__m256i qh, int h) {
  const __m256i base = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808, 0x0c0c0c0c);
  const __m256i bytes = _mm256_shuffle_epi8(qh, _mm256_add_epi32(base, _mm256_set1_epi32(0x01010101 * (h / 2))));
  const __m256i bit = _mm256_set1_epi32(h % 2 ? static_cast<int32_t>(0x80402010u) : 0x08040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// Rows [b0, b0 + R) against one tile of a 32-value type.
template <int64_t T, int R>
TSERVE_KP_TARGET void kp_rows32(const uint8_t* tile, int64_t blocks, const KqActs& a, int64_t k, int64_t b0,
                                float (*out)[KP]) {
  constexpr int64_t BB = kp_block32(T), VB = T == KQ8_0 ? 256 : 128;
  constexpr int32_t zero = T == KQ5_0 ? 16 : T == KQ4_0 ? 8 : 0;  // the value that stands for 0
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const KqRowViews<R> rows(a, k, b0, blocks);
  __m256 acc[R];
  for (int x = 0; x < R; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * BB;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * BB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * BB + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * BB + 128), _MM_HINT_T0);
    if (T == KQ8_0) _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * BB + 192), _MM_HINT_T0);
    __m256i i0[R];
    for (int x = 0; x < R; ++x) i0[x] = _mm256_setzero_si256();
    if constexpr (T == KQ8_0) {
      for (int t = 0; t < 8; ++t) {  // |q| against r with q's sign (|-128| reads as 128 unsigned)
        const __m256i q = loadu(blk + 32 * t), u = _mm256_sign_epi8(q, q);
        for (int x = 0; x < R; ++x) {
          const __m256i sv = _mm256_sign_epi8(kp_bcast(rows.r[x] + i * 32 + 4 * t), q);
          i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(_mm256_maddubs_epi16(u, sv), ones));
        }
      }
    } else {
      const __m256i qh = kp_five(T) ? loadu(blk + 128) : _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {  // values 4t .. 4t + 3 (low nibbles) and 16 + 4t .. (high)
        const __m256i q = loadu(blk + 32 * t);
        __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if constexpr (kp_five(T)) {
          lo = _mm256_or_si256(lo, kp_fifth(qh, t));
          hi = _mm256_or_si256(hi, kp_fifth(qh, 4 + t));
        }
        for (int x = 0; x < R; ++x) {
          const int8_t* rv = rows.r[x] + i * 32 + 4 * t;
          i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, kp_bcast(rv)), ones));
          i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, kp_bcast(rv + 16)), ones));
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + VB + (kp_five(T) ? 32 : 0))));
    for (int x = 0; x < R; ++x) {
      const int32_t sum = rows.sum16[x][2 * i] + rows.sum16[x][2 * i + 1];
      const __m256 sa = _mm256_set1_ps(rows.scale[x][i]);
      if (zero != 0) i0[x] = _mm256_sub_epi32(i0[x], _mm256_set1_epi32(zero * sum));
      acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(d, sa), _mm256_cvtepi32_ps(i0[x]), acc[x]);
      if constexpr (kp_min(T)) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + VB + (kp_five(T) ? 32 : 0) + 16)));
        acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(m, sa), _mm256_set1_ps(static_cast<float>(sum)), acc[x]);
      }
    }
  }
  for (int x = 0; x < R; ++x) _mm256_storeu_ps(out[x], acc[x]);
}

template <int64_t T>
void kp_pack32(const uint8_t* w, int64_t n, int64_t k, uint8_t* out) {
  constexpr int64_t qs = kp_min(T) ? 4 : 2, at = qs + (kp_five(T) ? 4 : 0);  // offsets of qh and the values
  constexpr int64_t VB = T == KQ8_0 ? 256 : 128, f = VB + (kp_five(T) ? 32 : 0);  // values, then halves at f
  kp_each(w, n, k, 32, kq_format(T).bytes, kp_block32(T), out, [](uint8_t* blk, const uint8_t* src, int64_t j) {
    for (int64_t v = 0; v < VB / 32; ++v) std::memcpy(blk + 32 * v + 4 * j, src + at + 4 * v, 4);
    if (kp_five(T)) std::memcpy(blk + VB + 4 * j, src + qs, 4);
    std::memcpy(blk + f + 2 * j, src, 2);
    if (kp_min(T)) std::memcpy(blk + f + 16 + 2 * j, src + 2, 2);
  });
}

// Outputs [j0, j1) of every row: each tile from `tile(t0)` (its first output t0) against the
// rows, KP_ROWS at a time through rows4, the rest one by one through rows1.
template <class Rows4, class Rows1, class Tile>
void kp_walk(int64_t B, int64_t j0, int64_t j1, Tile tile, Rows4 rows4, Rows1 rows1, const float* bias, float* y,
             int64_t stride) {
  for (int64_t t0 = j0 / KP * KP; t0 < j1; t0 += KP) {
    const uint8_t* t = tile(t0);
    float out[KP_ROWS][KP];
    auto emit = [&](int64_t b, int x) {
      for (int64_t j = std::max(t0, j0); j < std::min(t0 + KP, j1); ++j) {
        const float v = out[x][j - t0];
        y[b * stride + j] = bias == nullptr ? v : v + bias[j];
      }
    };
    int64_t b = 0;
    for (; b + KP_ROWS <= B; b += KP_ROWS) {
      rows4(t, b, out);
      for (int x = 0; x < KP_ROWS; ++x) emit(b + x, x);
    }
    for (; b < B; ++b) {
      rows1(t, b, out);
      emit(b, 0);
    }
  }
}

template <int64_t T>
void kp_run32(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t j0, int64_t j1, const float* bias,
              float* y, int64_t stride) {
  const int64_t blocks = k / 32;
  kp_walk(B, j0, j1, [&](int64_t t0) { return packed + t0 / KP * blocks * kp_block32(T); },
          [&](const uint8_t* t, int64_t b, float (*out)[KP]) { kp_rows32<T, KP_ROWS>(t, blocks, a, k, b, out); },
          [&](const uint8_t* t, int64_t b, float (*out)[KP]) { kp_rows32<T, 1>(t, blocks, a, k, b, out); },
          bias, y, stride);
}

}  // namespace

bool kq_packed_type(int64_t qtype) {
  return qtype == KQ4_K || qtype == KQ6_K || qtype == KQ8_0 || qtype == KQ4_0 || qtype == KQ4_1 || qtype == KQ5_0 || qtype == KQ5_1;
}

int64_t kq_packed_bytes(int64_t qtype, int64_t n, int64_t k) {
  if (!kq_packed_type(qtype) || k % kq_format(qtype).values != 0) return 0;
  if (qtype == KQ6_K) return (n + KP - 1) / KP * (k / 256) * KP6_BLOCK;
  if (qtype != KQ4_K) return (n + KP - 1) / KP * (k / 32) * kp_block32(qtype);
  return (n + KP - 1) / KP * (k / 256) * KP_BLOCK;
}

void kq_pack(const uint8_t* w, int64_t qtype, int64_t n, int64_t k, uint8_t* out) {
  TORCH_CHECK(kq_packed_bytes(qtype, n, k) > 0, "GGUF type ", qtype, " rows of ", k, " are not packed");
  switch (qtype) {
    case KQ8_0: return kp_pack32<KQ8_0>(w, n, k, out);
    case KQ4_0: return kp_pack32<KQ4_0>(w, n, k, out);
    case KQ4_1: return kp_pack32<KQ4_1>(w, n, k, out);
    case KQ5_0: return kp_pack32<KQ5_0>(w, n, k, out);
    case KQ5_1: return kp_pack32<KQ5_1>(w, n, k, out);
    case KQ6_K: return kp_pack6(w, n, k, out);
    default: break;
  }
  kp_each(w, n, k, 256, 144, KP_BLOCK, out, [](uint8_t* blk, const uint8_t* src, int64_t j) {
    for (int64_t v = 0; v < 32; ++v) std::memcpy(blk + 32 * v + 4 * j, src + 16 + 4 * v, 4);
    int32_t sc[8], mn[8];
    scale_min_k4(src + 4, sc, mn);
    for (int s = 0; s < 8; ++s) {
      blk[1024 + 8 * s + j] = static_cast<uint8_t>(sc[s]);
      blk[1088 + 8 * s + j] = static_cast<uint8_t>(mn[s]);
    }
    std::memcpy(blk + 1152 + 2 * j, src, 2);
    std::memcpy(blk + 1168 + 2 * j, src + 2, 2);
  });
}

bool kq_packed_runs() {
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return runs;
}

void kq_packed_rows(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t qtype, int64_t j0,
                    int64_t j1, const float* bias, float* y, int64_t stride) {
  switch (qtype) {
    case KQ8_0: return kp_run32<KQ8_0>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ4_0: return kp_run32<KQ4_0>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ4_1: return kp_run32<KQ4_1>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ5_0: return kp_run32<KQ5_0>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ5_1: return kp_run32<KQ5_1>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ6_K: {
      const int64_t blocks = k / 256;
      return kp_walk(B, j0, j1, [&](int64_t t0) { return packed + t0 / KP * blocks * KP6_BLOCK; },
                     [&](const uint8_t* t, int64_t b, float (*out)[KP]) { kp_rows6<KP_ROWS>(t, blocks, a, k, b, out); },
                     [&](const uint8_t* t, int64_t b, float (*out)[KP]) { kp_rows6<1>(t, blocks, a, k, b, out); },
                     bias, y, stride);
    }
    default: break;
  }
  const int64_t blocks = k / 256;
  kp_walk(B, j0, j1, [&](int64_t t0) { return packed + t0 / KP * blocks * KP_BLOCK; },
          [&](const uint8_t* t, int64_t b, float (*out)[KP]) { kp_rows<KP_ROWS>(t, blocks, a, k, b, out); },
          [&](const uint8_t* t, int64_t b, float (*out)[KP]) { kp_rows<1>(t, blocks, a, k, b, out); },
          bias, y, stride);
}

#else
bool kq_packed_type(int64_t) { return false; }
int64_t kq_packed_bytes(int64_t, int64_t, int64_t) { return 0; }
void kq_pack(const uint8_t*, int64_t, int64_t, int64_t, uint8_t*) { TORCH_CHECK(false, "no packed loops here"); }
bool kq_packed_runs() { return false; }
void kq_packed_rows(const KqActs&, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, const float*, float*,
                    int64_t) {
  TORCH_CHECK(false, "no packed loops here");
}
#endif

}  // namespace tserve_native
