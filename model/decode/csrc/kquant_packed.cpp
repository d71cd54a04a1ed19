// Every type repacked once, when a projection is built (kquant.h has the maths), so that no step
// unpacks a weight block into a buffer first (that cost as much as two rows of work) and a
// one-row step is not bound by per-block scalar work. Per tile of 8 outputs and per block of 256
// values of Q4_K, 1,184 bytes (the file: 8 x 144 = 1,152):
//   - 32 vectors of nibbles: vector 8c + t holds, for output j in bytes 4j..4j+3, the file's bytes
//     qs[32c + 4t .. 32c + 4t + 3] of that output: low nibbles are values 64c + 4t + (0..3)
//     (sub-block 2c), high nibbles the same + 32 (sub-block 2c + 1);
//   - the 8 sub-block scales, then the 8 minima, one byte per (sub-block, output): byte 8s + j;
//   - d, then dmin: the 8 outputs' IEEE halves, as stored.
// Q5_K the same, then 8 vectors of its fifth bits (vector t: qh[4t .. 4t + 3] of each output).
// Q6_K likewise at the file's size (its layout is above kp_rows6).
// The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) the same way, at exactly the file's size: per
// tile and block of 32, vector t holds for output j its bytes 4t .. 4t + 3 of the values (nibbles:
// low = values 4t.., high = 16 + 4t..; Q8_0: 8 vectors of signed values), then the 8 outputs'
// fifth bits as stored (Q5_0, Q5_1: 32 bits each), d and (Q4_1, Q5_1) m as halves.
// Below 8 rows a step runs against it as it is: an AND (and a shift) gives 4 values of all 8
// outputs per vector, the 4 activations' high and low bytes are broadcast to the 8 lanes
// (kquant_blocks.h), and a lane's integers are exactly those of kquant.h. From 8 rows on each
// (tile, block) is first widened to int16 (kw_run, below). The float combination is the scalar
// loops' (the same operations per lane in the same order), so every (row, output) has the bits
// of the scalar loops, for 1 row or 33.
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
constexpr int64_t KP_BLOCK = 32 * 32 + 64 + 64 + 16 + 16;  // bytes per (tile, block) of Q4_K
constexpr int64_t KP5_BLOCK = KP_BLOCK + 8 * 32;           // Q5_K: the same, then the fifth bits
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

// The two halves of the products of unsigned weight bytes q (<= 63) with 4 activations of a row:
// pairs of q hi (hi in [-64, 63]) and of lo q (lo in [0, 127]), as int16; the products with r are
// 128 hi-pairs + lo-pairs.
struct KpHalves {
  __m256i h, l;
};
TSERVE_KP_TARGET inline KpHalves kp_dot(__m256i q, const int8_t* hi, const uint8_t* lo) {
  return {_mm256_maddubs_epi16(q, kp_bcast(hi)), _mm256_maddubs_epi16(kp_bcast(lo), q)};
}

// sum_s c_s S_s over 8 (or `n`) sub-blocks as int32 lanes: c (one byte per output, unsigned or
// signed) times the row's sums S (broadcast); exact within int32 (kquant.h's bounds).
template <bool SIGNED>
TSERVE_KP_TARGET inline __m256i kp_weighted(const uint8_t* c, __m256i s) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  return _mm256_mullo_epi32(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b), s);
}

// Values l .. l + 3 (l = 4u), + 32, + 64, + 96 of half h of a packed Q6_K block, 8 outputs each:
// the low or high nibbles topped up by bits 0-1, 2-3, 4-5, 6-7 of qh (unsigned, 0-63).
TSERVE_KP_TARGET inline void kp_q6(const uint8_t* blk, int h, int u, __m256i* v) {
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  const __m256i A = loadu(blk + 32 * (16 * h + u)), B = loadu(blk + 32 * (16 * h + 8 + u));
  const __m256i H = loadu(blk + 1024 + 32 * (8 * h + u));
  v[0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_and_si256(_mm256_slli_epi16(H, 4), top));
  v[1] = _mm256_or_si256(_mm256_and_si256(B, low), _mm256_and_si256(_mm256_slli_epi16(H, 2), top));
  v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low), _mm256_and_si256(H, top));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low), _mm256_and_si256(_mm256_srli_epi16(H, 2), top));
}

// Q5_K: the fifth bits of vector t of sub-blocks 2c (into lo) and 2c + 1 (into hi), from the
// tile's qh vector h: bit 2c of qh[l] tops up value l of sub-block 2c, bit 2c + 1 of 2c + 1
// (shifts within 16-bit lanes: only bit 4 of each byte is kept).
TSERVE_KP_TARGET inline void kp_fifth_k(__m256i h, int c, __m256i& lo, __m256i& hi) {
  const __m256i bit = _mm256_set1_epi8(0x10);
  const int up = 4 - 2 * c;
  const __m256i b0 = up >= 0 ? _mm256_slli_epi16(h, up) : _mm256_srli_epi16(h, -up);
  const __m256i b1 = up - 1 >= 0 ? _mm256_slli_epi16(h, up - 1) : _mm256_srli_epi16(h, 1 - up);
  lo = _mm256_or_si256(lo, _mm256_and_si256(b0, bit));
  hi = _mm256_or_si256(hi, _mm256_and_si256(b1, bit));
}

// Rows [b0, b0 + R) against one tile of Q4_K (FIVE: Q5_K): out[r][j] = row b0 + r times output j.
template <int R, bool FIVE>
TSERVE_KP_TARGET void kp_rows(const uint8_t* tile, int64_t blocks, const KqActs& a, int64_t k, int64_t b0,
                              float (*out)[KP]) {
  constexpr int64_t BB = FIVE ? KP5_BLOCK : KP_BLOCK;
  const __m256i low = _mm256_set1_epi8(15);
  const KqRowViews<R> rows(a, k, b0, blocks);
  __m256 acc[R];
  for (int x = 0; x < R; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * BB;
    const uint8_t* sc = blk + 1024;
    const uint8_t* mn = sc + 64;
    const uint8_t* qh = blk + KP_BLOCK;  // Q5_K: vector t holds qh[4t .. 4t + 3] of each output
    __m256i i0[R], part[R];
    for (int x = 0; x < R; ++x) i0[x] = part[x] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // values 64c .. 64c + 63: sub-blocks 2c (low nibbles), 2c + 1 (high)
      const __m256i slo = kp_pairs(sc + 8 * (2 * c)), shi = kp_pairs(sc + 8 * (2 * c + 1));
      const __m256i slo7 = _mm256_slli_epi16(slo, 7), shi7 = _mm256_slli_epi16(shi, 7);  // x 128: <= 8,064
      // The halves of a sub-block's vectors are summed as int16 before one madd by the scale: a
      // hi-pair is at most 2 x 31 x 64 = 3,968, a lo-pair 2 x 31 x 127 = 7,874; eight hi-pairs
      // (31,744) and four lo-pairs (31,496) of Q5_K stay exact, eight lo-pairs of Q4_K
      // (8 x 3,810 = 30,480) too.
      constexpr int LO_RUN = FIVE ? 4 : 8;
      __m256i ph[R][2], pl[R][2];
      for (int x = 0; x < R; ++x) ph[x][0] = ph[x][1] = pl[x][0] = pl[x][1] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        if (t % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + 32 * (8 * c + t)), _MM_HINT_T0);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (8 * c + t)));
        __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if constexpr (FIVE) kp_fifth_k(loadu(qh + 32 * t), c, lo, hi);
        for (int x = 0; x < R; ++x) {
          const int64_t o = i * 256 + 64 * c + 4 * t;
          const KpHalves u = kp_dot(lo, rows.hi[x] + o, rows.lo[x] + o);
          const KpHalves v = kp_dot(hi, rows.hi[x] + o + 32, rows.lo[x] + o + 32);
          ph[x][0] = _mm256_add_epi16(ph[x][0], u.h);
          pl[x][0] = _mm256_add_epi16(pl[x][0], u.l);
          ph[x][1] = _mm256_add_epi16(ph[x][1], v.h);
          pl[x][1] = _mm256_add_epi16(pl[x][1], v.l);
          if ((t + 1) % LO_RUN == 0) {
            i0[x] = _mm256_add_epi32(i0[x], _mm256_add_epi32(_mm256_madd_epi16(pl[x][0], slo), _mm256_madd_epi16(pl[x][1], shi)));
            pl[x][0] = pl[x][1] = _mm256_setzero_si256();
          }
        }
      }
      for (int x = 0; x < R; ++x)
        i0[x] = _mm256_add_epi32(i0[x], _mm256_add_epi32(_mm256_madd_epi16(ph[x][0], slo7), _mm256_madd_epi16(ph[x][1], shi7)));
      if constexpr (FIVE) {  // Q5_K's i0 in two halves: sub-blocks 0-3, then 4-7
        if (c == 1)
          for (int x = 0; x < R; ++x) {
            part[x] = i0[x];
            i0[x] = _mm256_setzero_si256();
          }
      }
    }
    for (int64_t line = 1024; line < BB; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + line), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1152)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1168)));
    for (int x = 0; x < R; ++x) {
      __m256i i1 = _mm256_setzero_si256();  // sum_s m_s (sum r)_s
      for (int s = 0; s < 8; ++s)
        i1 = _mm256_add_epi32(i1, kp_weighted<false>(mn + 8 * s, _mm256_set1_epi32(rows.sum16[x][i * 16 + 2 * s] + rows.sum16[x][i * 16 + 2 * s + 1])));
      const __m256 sa = _mm256_set1_ps(rows.scale[x][i]), dd = _mm256_mul_ps(d, sa);
      if constexpr (FIVE) acc[x] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(part[x]), acc[x]);
      acc[x] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(i0[x]), acc[x]);
      acc[x] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, sa), _mm256_cvtepi32_ps(i1), acc[x]);
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
// indices each: the low or high nibbles, topped up by bits 0-1, 2-3, 4-5, 6-7 of qh. Bytes
// l < 16 are sub-blocks 8h + 2c, l >= 16 sub-blocks 8h + 2c + 1: the groups of kquant.h, in order.
constexpr int64_t KP6_BLOCK = 32 * 32 + 16 * 32 + 128 + 16;

// 8 signed bytes (one per output) as int32 lanes holding the value in both 16-bit halves
TSERVE_KP_TARGET inline __m256i kp_signed_pairs(const uint8_t* p) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(x, 16));
}

template <int R>
TSERVE_KP_TARGET void kp_rows6(const uint8_t* tile, int64_t blocks, const KqActs& a, int64_t k, int64_t b0,
                               float (*out)[KP]) {
  const KqRowViews<R> rows(a, k, b0, blocks);
  __m256 acc[R];
  for (int x = 0; x < R; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * KP6_BLOCK;
    const uint8_t* sc = blk + 1536;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1664)));
    __m256 dd[R];
    for (int x = 0; x < R; ++x) dd[x] = _mm256_mul_ps(d, _mm256_set1_ps(rows.scale[x][i]));
    for (int h = 0; h < 2; ++h)
      for (int o = 0; o < 2; ++o) {  // group 2h + o: bytes l = 16o .. 16o + 15 of the half
        __m256i i0[R];
        for (int x = 0; x < R; ++x) i0[x] = _mm256_setzero_si256();
        for (int u2 = 2 * o; u2 < 2 * o + 2; ++u2) {  // bytes l = 8 u2 .. 8 u2 + 7: sub-blocks 8h + o + 2w, w = 0-3
          // Two groups of 4 bytes share their sub-blocks: their int16 halves are exact (a hi-pair
          // is at most 2 x 63 x 64 = 8,064, a lo-pair 2 x 63 x 127 = 16,002; two of each 16,128
          // and 32,004) before one madd by each scale (x 128 for the hi-pairs: at most 16,384 in size).
          __m256i f[4], f7[4], ph[R][4], pl[R][4];
          for (int w = 0; w < 4; ++w) {
            f[w] = kp_signed_pairs(sc + 8 * (8 * h + o + 2 * w));
            f7[w] = _mm256_slli_epi16(f[w], 7);
          }
          for (int x = 0; x < R; ++x)
            for (int v = 0; v < 4; ++v) ph[x][v] = pl[x][v] = _mm256_setzero_si256();
          for (int uu = 0; uu < 2; ++uu) {
            const int u = 2 * u2 + uu;
            _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * KP6_BLOCK + 128 * (8 * h + u)), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * KP6_BLOCK + 128 * (8 * h + u) + 64), _MM_HINT_T0);
            __m256i v[4];
            kp_q6(blk, h, u, v);
            for (int x = 0; x < R; ++x) {
              const int64_t at = i * 256 + 128 * h + 4 * u;
              for (int w = 0; w < 4; ++w) {
                const KpHalves m = kp_dot(v[w], rows.hi[x] + at + 32 * w, rows.lo[x] + at + 32 * w);
                ph[x][w] = _mm256_add_epi16(ph[x][w], m.h);
                pl[x][w] = _mm256_add_epi16(pl[x][w], m.l);
              }
            }
          }
          for (int w = 0; w < 4; ++w)
            for (int x = 0; x < R; ++x)
              i0[x] = _mm256_add_epi32(i0[x], _mm256_add_epi32(_mm256_madd_epi16(ph[x][w], f7[w]), _mm256_madd_epi16(pl[x][w], f[w])));
        }
        for (int x = 0; x < R; ++x) {  // minus 32 sum_s sc_s (sum r)_s over the group's sub-blocks
          __m256i off = _mm256_setzero_si256();
          for (int w = 0; w < 4; ++w) {
            const int s = 8 * h + o + 2 * w;
            off = _mm256_add_epi32(off, kp_weighted<true>(sc + 8 * s, _mm256_set1_epi32(rows.sum16[x][i * 16 + s])));
          }
          const __m256i q = _mm256_sub_epi32(i0[x], _mm256_slli_epi32(off, 5));
          acc[x] = _mm256_fmadd_ps(dd[x], _mm256_cvtepi32_ps(q), acc[x]);
        }
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

// How many blocks ahead the 32-value loops ask for their bytes (7-11 KB: a Q8_0 block is 272
// bytes a tile, Q5_0's 176). One row reads each byte once and waits on memory: on the 0.5B
// (Q8_0 head, Q5_0 projections), 2 threads, in-process batch-1 steps alternated over 4 rounds,
// 40 blocks took 0.87x the time of 4 (27.1 against 31.1 ms); 16, 80 and 160 did no better.
constexpr int64_t KP32_AHEAD = 40;

// Rows [b0, b0 + R) against one tile of a 32-value type.
template <int64_t T, int R>
TSERVE_KP_TARGET void kp_rows32(const uint8_t* tile, int64_t blocks, const KqActs& a, int64_t k, int64_t b0,
                                float (*out)[KP]) {
  constexpr int64_t BB = kp_block32(T), VB = T == KQ8_0 ? 256 : 128;
  constexpr int32_t zero = T == KQ5_0 ? 16 : T == KQ4_0 ? 8 : 0;  // the value that stands for 0
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), h128 = _mm256_set1_epi16(128);
  const KqRowViews<R> rows(a, k, b0, blocks);
  __m256 acc[R];
  for (int x = 0; x < R; ++x) acc[x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * BB;
    for (int64_t line = 0; line < BB; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + KP32_AHEAD * BB + line), _MM_HINT_T0);
    __m256i i0[R];
    for (int x = 0; x < R; ++x) i0[x] = _mm256_setzero_si256();
    if constexpr (T == KQ8_0) {
      for (int t = 0; t < 8; ++t) {
        // hi: |q| against hi with q's sign (|-128| reads as 128 unsigned; a pair is at most
        // 2 x 128 x 64); lo (unsigned) against q (signed): a pair at most 2 x 127 x 128 = 32,512
        const __m256i q = loadu(blk + 32 * t), u = _mm256_sign_epi8(q, q);
        for (int x = 0; x < R; ++x) {
          const int64_t o = i * 32 + 4 * t;
          const __m256i ph = _mm256_maddubs_epi16(u, _mm256_sign_epi8(kp_bcast(rows.hi[x] + o), q));
          const __m256i pl = _mm256_maddubs_epi16(kp_bcast(rows.lo[x] + o), q);
          i0[x] = _mm256_add_epi32(i0[x], _mm256_add_epi32(_mm256_madd_epi16(ph, h128), _mm256_madd_epi16(pl, ones)));
        }
      }
    } else {
      // int16 sums over the block: hi-pairs at most 2 x 31 x 64 = 3,968 (eight: 31,744), lo-pairs
      // 2 x 31 x 127 = 7,874 (four a sum: 31,496), so the low and high nibbles' lo-pairs apart
      const __m256i qh = kp_five(T) ? loadu(blk + 128) : _mm256_setzero_si256();
      __m256i ph[R], pl0[R], pl1[R];
      for (int x = 0; x < R; ++x) ph[x] = pl0[x] = pl1[x] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {  // values 4t .. 4t + 3 (low nibbles) and 16 + 4t .. (high)
        const __m256i q = loadu(blk + 32 * t);
        __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if constexpr (kp_five(T)) {
          lo = _mm256_or_si256(lo, kp_fifth(qh, t));
          hi = _mm256_or_si256(hi, kp_fifth(qh, 4 + t));
        }
        for (int x = 0; x < R; ++x) {
          const int64_t o = i * 32 + 4 * t;
          const KpHalves u = kp_dot(lo, rows.hi[x] + o, rows.lo[x] + o);
          const KpHalves v = kp_dot(hi, rows.hi[x] + o + 16, rows.lo[x] + o + 16);
          ph[x] = _mm256_add_epi16(ph[x], _mm256_add_epi16(u.h, v.h));
          pl0[x] = _mm256_add_epi16(pl0[x], u.l);
          pl1[x] = _mm256_add_epi16(pl1[x], v.l);
        }
      }
      for (int x = 0; x < R; ++x)
        i0[x] = _mm256_add_epi32(_mm256_madd_epi16(ph[x], h128),
                                 _mm256_add_epi32(_mm256_madd_epi16(pl0[x], ones), _mm256_madd_epi16(pl1[x], ones)));
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

#if defined(TSERVE_AVX512)
// --- one row with AVX512-VNNI (256-bit vectors) ----------------------------------------------------
// The loops above take a row's 14-bit activations as two bytes (hi, lo) through maddubs, sum the
// int16 pairs of a sub-block and madd them by its scale: per 4 values x 8 outputs, two maddubs and
// two int16 adds for each of hi and lo. vpdpbusd (unsigned weight bytes times signed activation
// bytes, four products into each int32 lane) does each half in one instruction, so a sub-block's
// hi sum H and lo sum L come straight out as int32 lanes and its part of the block's integer is
// sc (128 H + L), one 32-bit multiply a sub-block. The integers are kquant.h's exact ones (int32
// sums wrap the same whatever the order), so the float combination, the same operations in the
// same order, gives the AVX2 loops' bits. Eight accumulators a pair of sub-blocks (the even and
// odd vectors apart), since a vpdpbusd's latency is several cycles and a single row has no other
// independent work.
#define TSERVE_KP_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define TSERVE_KP_DB(acc, u, s) asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))

// The one-row VNNI loops run where the CPU has AVX512-VNNI on 256-bit vectors (and not under
// TSERVE_NATIVE_ISA=avx2 or scalar).
inline bool kp_row_vnni() {
  static const bool on = cpu().avx512_vnni && __builtin_cpu_supports("avx512vl");
  return on;
}

// 8 scale bytes (one per output) as int32 lanes
template <bool SIGNED>
TSERVE_KP_TARGET_VNNI inline __m256i kp_lanes(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}

// sc (128 H + L) for the lanes of one sub-block
TSERVE_KP_TARGET_VNNI inline __m256i kp_scaled(__m256i h, __m256i l, __m256i sc) {
  return _mm256_mullo_epi32(_mm256_add_epi32(_mm256_slli_epi32(h, 7), l), sc);
}

// Row b against one tile of Q4_K (FIVE: Q5_K): kp_rows<1, FIVE>'s result.
template <bool FIVE>
TSERVE_KP_TARGET_VNNI __attribute__((noinline)) void kp_row_k4_vnni(const uint8_t* tile, int64_t blocks, const KqActs& a,
                                                                    int64_t k, int64_t b, float* out) {
  constexpr int64_t BB = FIVE ? KP5_BLOCK : KP_BLOCK;
  const __m256i low = _mm256_set1_epi8(15);
  const KqRowViews<1> row(a, k, b, blocks);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * BB;
    const uint8_t* sc = blk + 1024;
    const uint8_t* mn = sc + 64;
    const uint8_t* qh = blk + KP_BLOCK;
    __m256i i0 = _mm256_setzero_si256(), part = i0;
    for (int c = 0; c < 4; ++c) {  // values 64c .. 64c + 63: sub-blocks 2c (low nibbles), 2c + 1 (high)
      __m256i h0 = _mm256_setzero_si256(), l0 = h0, h1 = h0, l1 = h0, g0 = h0, m0 = h0, g1 = h0, m1 = h0;
      const int64_t o0 = i * 256 + 64 * c;
      for (int t = 0; t < 8; t += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + 32 * (8 * c + t)), _MM_HINT_T0);
        const __m256i q = loadu(blk + 32 * (8 * c + t)), p = loadu(blk + 32 * (8 * c + t + 1));
        __m256i qlo = _mm256_and_si256(q, low), qhi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        __m256i plo = _mm256_and_si256(p, low), phi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        if constexpr (FIVE) {
          kp_fifth_k(loadu(qh + 32 * t), c, qlo, qhi);
          kp_fifth_k(loadu(qh + 32 * (t + 1)), c, plo, phi);
        }
        const int64_t o = o0 + 4 * t;
        TSERVE_KP_DB(h0, qlo, kp_bcast(row.hi[0] + o));
        TSERVE_KP_DB(l0, qlo, kp_bcast(row.lo[0] + o));
        TSERVE_KP_DB(h1, qhi, kp_bcast(row.hi[0] + o + 32));
        TSERVE_KP_DB(l1, qhi, kp_bcast(row.lo[0] + o + 32));
        TSERVE_KP_DB(g0, plo, kp_bcast(row.hi[0] + o + 4));
        TSERVE_KP_DB(m0, plo, kp_bcast(row.lo[0] + o + 4));
        TSERVE_KP_DB(g1, phi, kp_bcast(row.hi[0] + o + 36));
        TSERVE_KP_DB(m1, phi, kp_bcast(row.lo[0] + o + 36));
      }
      i0 = _mm256_add_epi32(i0, kp_scaled(_mm256_add_epi32(h0, g0), _mm256_add_epi32(l0, m0), kp_lanes<false>(sc + 16 * c)));
      i0 = _mm256_add_epi32(i0, kp_scaled(_mm256_add_epi32(h1, g1), _mm256_add_epi32(l1, m1), kp_lanes<false>(sc + 16 * c + 8)));
      if constexpr (FIVE) {  // Q5_K's i0 in two halves: sub-blocks 0-3, then 4-7
        if (c == 1) {
          part = i0;
          i0 = _mm256_setzero_si256();
        }
      }
    }
    for (int64_t line = 1024; line < BB; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + line), _MM_HINT_T0);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1152)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1168)));
    __m256i i1 = _mm256_setzero_si256();  // sum_s m_s (sum r)_s
    for (int s = 0; s < 8; ++s)
      i1 = _mm256_add_epi32(i1, _mm256_mullo_epi32(kp_lanes<false>(mn + 8 * s), _mm256_set1_epi32(row.sum16[0][i * 16 + 2 * s] + row.sum16[0][i * 16 + 2 * s + 1])));
    const __m256 sa = _mm256_set1_ps(row.scale[0][i]), dd = _mm256_mul_ps(d, sa);
    if constexpr (FIVE) acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(part), acc);
    acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(i0), acc);
    acc = _mm256_fnmadd_ps(_mm256_mul_ps(dm, sa), _mm256_cvtepi32_ps(i1), acc);
  }
  _mm256_storeu_ps(out, acc);
}
#endif

#if defined(TSERVE_AVX512)
// Row b against one tile of Q6_K: kp_rows6<1>'s result. A group's four sub-blocks each take their
// hi and lo sums over the group's four vectors (16 values) before one multiply by the signed scale.
TSERVE_KP_TARGET_VNNI __attribute__((noinline)) void kp_row6_vnni(const uint8_t* tile, int64_t blocks, const KqActs& a,
                                                                  int64_t k, int64_t b, float* out) {
  const KqRowViews<1> row(a, k, b, blocks);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* blk = tile + i * KP6_BLOCK;
    const uint8_t* sc = blk + 1536;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1664)));
    const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(row.scale[0][i]));
    for (int h = 0; h < 2; ++h)
      for (int o = 0; o < 2; ++o) {  // group 2h + o: bytes l = 16o .. 16o + 15 of the half, sub-blocks 8h + o + 2w
        __m256i H0 = _mm256_setzero_si256(), H1 = H0, H2 = H0, H3 = H0, L0 = H0, L1 = H0, L2 = H0, L3 = H0;
        for (int u = 4 * o; u < 4 * o + 4; ++u) {
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * KP6_BLOCK + 128 * (8 * h + u)), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * KP6_BLOCK + 128 * (8 * h + u) + 64), _MM_HINT_T0);
          __m256i v[4];
          kp_q6(blk, h, u, v);
          const int64_t at = i * 256 + 128 * h + 4 * u;
          TSERVE_KP_DB(H0, v[0], kp_bcast(row.hi[0] + at));
          TSERVE_KP_DB(L0, v[0], kp_bcast(row.lo[0] + at));
          TSERVE_KP_DB(H1, v[1], kp_bcast(row.hi[0] + at + 32));
          TSERVE_KP_DB(L1, v[1], kp_bcast(row.lo[0] + at + 32));
          TSERVE_KP_DB(H2, v[2], kp_bcast(row.hi[0] + at + 64));
          TSERVE_KP_DB(L2, v[2], kp_bcast(row.lo[0] + at + 64));
          TSERVE_KP_DB(H3, v[3], kp_bcast(row.hi[0] + at + 96));
          TSERVE_KP_DB(L3, v[3], kp_bcast(row.lo[0] + at + 96));
        }
        const uint8_t* g = sc + 8 * (8 * h + o);  // sub-block 8h + o + 2w at g + 16 w
        __m256i i0 = kp_scaled(H0, L0, kp_lanes<true>(g));
        i0 = _mm256_add_epi32(i0, kp_scaled(H1, L1, kp_lanes<true>(g + 16)));
        i0 = _mm256_add_epi32(i0, kp_scaled(H2, L2, kp_lanes<true>(g + 32)));
        i0 = _mm256_add_epi32(i0, kp_scaled(H3, L3, kp_lanes<true>(g + 48)));
        __m256i off = _mm256_setzero_si256();  // sum_s sc_s (sum r)_s over the group's sub-blocks
        for (int w = 0; w < 4; ++w) {
          const int s = 8 * h + o + 2 * w;
          off = _mm256_add_epi32(off, _mm256_mullo_epi32(kp_lanes<true>(sc + 8 * s), _mm256_set1_epi32(row.sum16[0][i * 16 + s])));
        }
        const __m256i q = _mm256_sub_epi32(i0, _mm256_slli_epi32(off, 5));
        acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(q), acc);
      }
  }
  _mm256_storeu_ps(out, acc);
}
#undef TSERVE_KP_DB
#endif

// Outputs [j0, j1) of every row (fewer than KW_MIN): each tile from `tile(t0)` (its first output
// t0) against the rows one by one through rows1.
template <class Rows1, class Tile>
void kp_walk(int64_t B, int64_t j0, int64_t j1, Tile tile, Rows1 rows1, const float* bias, float* y, int64_t stride) {
  for (int64_t t0 = j0 / KP * KP; t0 < j1; t0 += KP) {
    const uint8_t* t = tile(t0);
    float out[1][KP];
    for (int64_t b = 0; b < B; ++b) {
      rows1(t, b, out);
      for (int64_t j = std::max(t0, j0); j < std::min(t0 + KP, j1); ++j) {
        const float v = out[0][j - t0];
        y[b * stride + j] = bias == nullptr ? v : v + bias[j];
      }
    }
  }
}

template <int64_t T>
void kp_run32(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t j0, int64_t j1, const float* bias,
              float* y, int64_t stride) {
  const int64_t blocks = k / 32;
  kp_walk(B, j0, j1, [&](int64_t t0) { return packed + t0 / KP * blocks * kp_block32(T); },
          [&](const uint8_t* t, int64_t b, float (*out)[KP]) { kp_rows32<T, 1>(t, blocks, a, k, b, out); },
          bias, y, stride);
}

// Rows [b0, b1)'s sums of one tile (KP floats a row, from `sums`) into y's outputs [j0, j1) of the
// tile at t0, plus the bias
inline void kp_store(const float* sums, int64_t b0, int64_t b1, int64_t t0, int64_t j0, int64_t j1, const float* bias,
                     float* y, int64_t stride) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t j = std::max(t0, j0); j < std::min(t0 + KP, j1); ++j) {
      const float v = sums[(b - b0) * KP + (j - t0)];
      y[b * stride + j] = bias == nullptr ? v : v + bias[j];
    }
}

// Q4_K / Q5_K: the minima of a packed block (mn: byte 8s + j) as pairs of sub-blocks, mp[q] holding
// (m_2q, m_2q+1) for each output as int16, for madd or vpdpwssd against a row's split sums
TSERVE_KP_TARGET inline void kw_minima_pairs(const uint8_t* mn, __m256i* mp) {
  for (int q = 0; q < 4; ++q) {
    const __m128i e = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + 16 * q)));
    const __m128i f = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + 16 * q + 8)));
    mp[q] = _mm256_set_m128i(_mm_unpackhi_epi16(e, f), _mm_unpacklo_epi16(e, f));
  }
}

// The block two ahead of blk (`bytes` each; a projection's tiles are contiguous): a loop that
// prepares each block before its rows would otherwise wait on memory there.
inline void kp_prefetch_ahead(const uint8_t* blk, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * bytes + line), _MM_HINT_T0);
}

// --- many rows: each tile's block widened once to int16 -------------------------------------------
// From KW_MIN rows on (the loops above unpack each block again for every row, and their int16
// sums would need more registers than there are for several rows at once), each (tile, block) is widened once per call into int16 weights, each already
// times its sub-block scale (Q4_K: at most 15 x 63; Q5_K 31 x 63; Q6_K's q - 32 times its signed
// scale: 32 x 128; the 32-value types' q minus their offset), in pairs of values per output, so a
// madd against 4 activations broadcast (two int16 pairs) gives 16 scaled products: no unpacking
// and no scale per row. For quad m (values 4m .. 4m + 3) of the block, W[2m] holds outputs 0, 1, 4, 5
// and W[2m + 1] outputs 2, 3, 6, 7, each as (values 4m, 4m + 1), (4m + 2, 4m + 3); a hadd of the two
// lane sums gives the 8 outputs in order. The integers are the same exact ones as the loops above
// (kquant.h), and the float combination the same operations per lane in the same order, so a row's
// bits do not depend on which loops ran: the batch size only picks the faster ones.
constexpr int64_t KW_MIN = 4;
constexpr int KW_ROWS = 4;
// Q4_K from KW_MIN rows up to KB_MAX through the byte loops (kb_run_k4) where the CPU has VNNI:
// in-process on the 1.5B (2 threads, alternated) 4 rows 0.82-0.85x the one-tile widened path's time,
// 8 rows ~0.95x; from 16 rows the widened path with two tiles a pass (kw_dot8x2_vnni) is as fast or
// faster (32 rows 0.90-0.98x the byte loops' time); prompts keep the widened path and its row groups.
// Where the CPU has AMX, Q4_K's tiles take over from KA_MIN_K4 rows (below).
constexpr int64_t KB_MAX = 16;
constexpr int64_t KW_L2_BYTES = 192 * 1024;  // the activations a group of rows may hold (a core's L2: 512 KB here)

// 8 scale bytes (one per output) as the int16 factors of W[2m] and W[2m + 1]
template <bool SIGNED>
TSERVE_KP_TARGET inline void kw_scales(const uint8_t* s, __m256i& a, __m256i& b) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  const __m256i x = SIGNED ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  const __m256i p = _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(x, 16));
  a = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 0, 1, 1, 4, 4, 5, 5));
  b = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(2, 2, 3, 3, 6, 6, 7, 7));
}

// One vector of 4 values x 8 outputs (bytes; signed where SIGNED) as W[2m], W[2m + 1]: minus
// `zero`, times the factors (sa, sb; none where SCALED is false).
template <bool SIGNED, bool SCALED, bool OFFSET = false>
TSERVE_KP_TARGET inline void kw_put(__m256i q, __m256i zero, __m256i sa, __m256i sb, __m256i* w) {
  const __m256i ext = SIGNED ? _mm256_cmpgt_epi8(_mm256_setzero_si256(), q) : _mm256_setzero_si256();
  __m256i a = _mm256_unpacklo_epi8(q, ext), b = _mm256_unpackhi_epi8(q, ext);
  if constexpr (OFFSET) {
    a = _mm256_sub_epi16(a, zero);
    b = _mm256_sub_epi16(b, zero);
  }
  if constexpr (SCALED) {
    a = _mm256_mullo_epi16(a, sa);
    b = _mm256_mullo_epi16(b, sb);
  }
  _mm256_storeu_si256(w, a);
  _mm256_storeu_si256(w + 1, b);
}

// Q4_K (FIVE: Q5_K) block of a packed tile -> W[0 .. 128)
template <bool FIVE>
TSERVE_KP_TARGET void kw_widen_k4(const uint8_t* blk, __m256i* w) {
  const __m256i low = _mm256_set1_epi8(15), none = _mm256_setzero_si256();
  const uint8_t* sc = blk + 1024;
  const uint8_t* qh = blk + KP_BLOCK;
  for (int c = 0; c < 4; ++c) {
    __m256i la, lb, ha, hb;
    kw_scales<false>(sc + 8 * (2 * c), la, lb);
    kw_scales<false>(sc + 8 * (2 * c + 1), ha, hb);
    for (int t = 0; t < 8; ++t) {
      const __m256i q = loadu(blk + 32 * (8 * c + t));
      __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      if constexpr (FIVE) kp_fifth_k(loadu(qh + 32 * t), c, lo, hi);
      kw_put<false, true>(lo, none, la, lb, w + 2 * (16 * c + t));      // values 64c + 4t ..
      kw_put<false, true>(hi, none, ha, hb, w + 2 * (16 * c + 8 + t));  // values 64c + 32 + 4t ..
    }
  }
}

// Q6_K block of a packed tile -> W[0 .. 128)
TSERVE_KP_TARGET void kw_widen_k6(const uint8_t* blk, __m256i* w) {
  const __m256i m32 = _mm256_set1_epi16(32);
  const uint8_t* sc = blk + 1536;
  __m256i fa[16], fb[16];  // each sub-block's factors, once
  for (int s = 0; s < 16; ++s) kw_scales<true>(sc + 8 * s, fa[s], fb[s]);
  for (int h = 0; h < 2; ++h)
    for (int u = 0; u < 8; ++u) {  // bytes l = 4u .. 4u + 3: sub-blocks 8h + 2c + u / 4
      __m256i v[4];
      kp_q6(blk, h, u, v);
      for (int c = 0; c < 4; ++c) {
        const int sb = 8 * h + 2 * c + u / 4;
        kw_put<false, true, true>(v[c], m32, fa[sb], fb[sb], w + 2 * (32 * h + 8 * c + u));
      }
    }
}

// a 32-value type's block of a packed tile -> W[0 .. 16)
template <int64_t T>
TSERVE_KP_TARGET void kw_widen32(const uint8_t* blk, __m256i* w) {
  const __m256i none = _mm256_setzero_si256();
  if constexpr (T == KQ8_0) {
    for (int t = 0; t < 8; ++t) kw_put<true, false>(loadu(blk + 32 * t), none, none, none, w + 2 * t);
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i zero = _mm256_set1_epi16(T == KQ5_0 ? 16 : T == KQ4_0 ? 8 : 0);
    const __m256i qh = kp_five(T) ? loadu(blk + 128) : none;
    for (int t = 0; t < 4; ++t) {
      const __m256i q = loadu(blk + 32 * t);
      __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      if constexpr (kp_five(T)) {
        lo = _mm256_or_si256(lo, kp_fifth(qh, t));
        hi = _mm256_or_si256(hi, kp_fifth(qh, 4 + t));
      }
      kw_put<false, false, true>(lo, zero, none, none, w + 2 * t);
      kw_put<false, false, true>(hi, zero, none, none, w + 2 * (4 + t));
    }
  }
}

// Rows' integer over `runs` runs of `len` quads of a widened block, run u from quad m0 + u stride
// (Q6_K's groups are 4 runs of 4): the 8 outputs' lane sums (R rows at r[x] + 4 m), added to out.
// Written out for one and four rows with named registers: with arrays the compiler kept the row
// pointers and weights on the stack inside the loop (a third the speed).
TSERVE_KP_TARGET __attribute__((noinline)) void kw_dot4(const __m256i* __restrict w, int m0, int len, int runs, int stride,
                                                         const int16_t* __restrict r0, const int16_t* __restrict r1,
                                                         const int16_t* __restrict r2, const int16_t* __restrict r3,
                                                         __m256i* __restrict out) {
  __m256i a0 = _mm256_setzero_si256(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  for (int run = 0; run < runs; ++run) {
    const int end = m0 + run * stride + len;
    for (int m = m0 + run * stride; m < end; ++m) {
      const __m256i wa = _mm256_loadu_si256(w + 2 * m), wb = _mm256_loadu_si256(w + 2 * m + 1);
      int64_t v0, v1, v2, v3;
      std::memcpy(&v0, r0 + 4 * m, 8);
      std::memcpy(&v1, r1 + 4 * m, 8);
      std::memcpy(&v2, r2 + 4 * m, 8);
      std::memcpy(&v3, r3 + 4 * m, 8);
      const __m256i x0 = _mm256_set1_epi64x(v0), x1 = _mm256_set1_epi64x(v1);
      const __m256i x2 = _mm256_set1_epi64x(v2), x3 = _mm256_set1_epi64x(v3);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(wa, x0));
      b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(wb, x0));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(wa, x1));
      b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(wb, x1));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(wa, x2));
      b2 = _mm256_add_epi32(b2, _mm256_madd_epi16(wb, x2));
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(wa, x3));
      b3 = _mm256_add_epi32(b3, _mm256_madd_epi16(wb, x3));
    }
  }
  out[0] = _mm256_add_epi32(out[0], _mm256_hadd_epi32(a0, b0));
  out[1] = _mm256_add_epi32(out[1], _mm256_hadd_epi32(a1, b1));
  out[2] = _mm256_add_epi32(out[2], _mm256_hadd_epi32(a2, b2));
  out[3] = _mm256_add_epi32(out[3], _mm256_hadd_epi32(a3, b3));
}

TSERVE_KP_TARGET __attribute__((noinline)) void kw_dot1(const __m256i* __restrict w, int m0, int len, int runs, int stride,
                                                         const int16_t* __restrict r0, __m256i* __restrict out) {
  __m256i a0 = _mm256_setzero_si256(), b0 = a0;
  for (int run = 0; run < runs; ++run) {
    const int end = m0 + run * stride + len;
    for (int m = m0 + run * stride; m < end; ++m) {
      int64_t v0;
      std::memcpy(&v0, r0 + 4 * m, 8);
      const __m256i x0 = _mm256_set1_epi64x(v0);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_loadu_si256(w + 2 * m), x0));
      b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(_mm256_loadu_si256(w + 2 * m + 1), x0));
    }
  }
  out[0] = _mm256_add_epi32(out[0], _mm256_hadd_epi32(a0, b0));
}

// The same with AVX512-VNNI, where the CPU has it: W[2m] and W[2m + 1] are one 512-bit vector,
// and one vpdpwssd per row and quad does what two madds and two adds do above (a 4-value
// activation broadcast to all 8 quadwords meets every output's two pairs). The lane sums are the
// same exact integers, so the bits are the AVX2 loops' (tested: TSERVE_NATIVE_ISA=avx2 turns
// these off).
#if defined(TSERVE_AVX512)
TSERVE_TARGET_VNNI inline __m256i kw_fold(__m512i s) {
  return _mm256_hadd_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}

// acc += the int16 pair products of w and x (vpdpwssd). Written as asm: GCC 12 copies the
// accumulator into a fresh register before each intrinsic and back after (two moves a product).
#define TSERVE_KW_DP(acc, w, x) asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))

// 4 activations (int16) of a row broadcast to every quadword
TSERVE_TARGET_VNNI inline __m512i kw_bcast4(const int16_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// Two quads a pass, into two sets of accumulators (a vpdpwssd's latency is several cycles, and
// four rows alone would wait on it); the sets are added at the end (exact integers). Row n's
// step: quad m into a_n, quad m + 1 into c_n; its last odd quad into a_n; its lane sums folded out.
#define TSERVE_KW_STEP(n)                                 \
  TSERVE_KW_DP(a##n, wm, kw_bcast4(r##n + 4 * m));        \
  TSERVE_KW_DP(c##n, wn, kw_bcast4(r##n + 4 * m + 4));
#define TSERVE_KW_LAST(n) TSERVE_KW_DP(a##n, wm, kw_bcast4(r##n + 4 * m));
#define TSERVE_KW_FOLD(n) out[n] = _mm256_add_epi32(out[n], kw_fold(_mm512_add_epi32(a##n, c##n)));
// The run loop of the one-tile passes, ROWS(X) applying X to each row
#define TSERVE_KW_RUNS(ROWS)                                                                       \
  for (int run = 0; run < runs; ++run) {                                                           \
    const int m1 = m0 + run * stride + len;                                                        \
    int m = m0 + run * stride;                                                                     \
    for (; m + 2 <= m1; m += 2) {                                                                  \
      const __m512i wm = _mm512_loadu_si512(w + 2 * m), wn = _mm512_loadu_si512(w + 2 * m + 2);    \
      ROWS(TSERVE_KW_STEP)                                                                         \
    }                                                                                              \
    if (m < m1) {                                                                                  \
      const __m512i wm = _mm512_loadu_si512(w + 2 * m);                                           \
      ROWS(TSERVE_KW_LAST)                                                                         \
    }                                                                                              \
  }
#define TSERVE_KW_ROWS4(X) X(0) X(1) X(2) X(3)
#define TSERVE_KW_ROWS8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

TSERVE_TARGET_VNNI __attribute__((noinline)) void kw_dot4_vnni(const __m256i* __restrict w, int m0, int len, int runs, int stride,
                                                                const int16_t* __restrict r0, const int16_t* __restrict r1,
                                                                const int16_t* __restrict r2, const int16_t* __restrict r3,
                                                                __m256i* __restrict out) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
  TSERVE_KW_RUNS(TSERVE_KW_ROWS4)
  TSERVE_KW_ROWS4(TSERVE_KW_FOLD)
}

// Eight rows a pass (AVX-512 has 32 registers: 16 accumulators, the two weight vectors and the
// broadcasts fit): each weight vector loaded once for twice the rows.
TSERVE_TARGET_VNNI __attribute__((noinline)) void kw_dot8_vnni(const __m256i* __restrict w, int m0, int len, int runs, int stride,
                                                                const int16_t* const* __restrict r, __m256i* __restrict out) {
  const int16_t *r0 = r[0], *r1 = r[1], *r2 = r[2], *r3 = r[3], *r4 = r[4], *r5 = r[5], *r6 = r[6], *r7 = r[7];
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i c0 = a0, c1 = a0, c2 = a0, c3 = a0, c4 = a0, c5 = a0, c6 = a0, c7 = a0;
  TSERVE_KW_RUNS(TSERVE_KW_ROWS8)
  TSERVE_KW_ROWS8(TSERVE_KW_FOLD)
}

TSERVE_TARGET_VNNI __attribute__((noinline)) void kw_dot1_vnni(const __m256i* __restrict w, int m0, int len, int runs, int stride,
                                                                const int16_t* __restrict r0, __m256i* __restrict out) {
  __m512i a0 = _mm512_setzero_si512(), c0 = a0;
#define TSERVE_KW_ROWS1(X) X(0)
  TSERVE_KW_RUNS(TSERVE_KW_ROWS1)
  TSERVE_KW_ROWS1(TSERVE_KW_FOLD)
#undef TSERVE_KW_ROWS1
}
// Eight rows against two tiles (w, v) in one pass: each row's broadcast serves both tiles, so a
// pass loads 10 vectors for 16 products where kw_dot8_vnni loads 18 (on this CPU's L1-resident
// loop, 5.4 against 4.4 G products a second). Tile w's sums to out[0, 8), tile v's to out[8, 16).
TSERVE_TARGET_VNNI __attribute__((noinline)) void kw_dot8x2_vnni(const __m256i* __restrict w, const __m256i* __restrict v,
                                                                  int m0, int len, int runs, int stride,
                                                                  const int16_t* const* __restrict r, __m256i* __restrict out) {
  const int16_t *r0 = r[0], *r1 = r[1], *r2 = r[2], *r3 = r[3], *r4 = r[4], *r5 = r[5], *r6 = r[6], *r7 = r[7];
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i c0 = a0, c1 = a0, c2 = a0, c3 = a0, c4 = a0, c5 = a0, c6 = a0, c7 = a0;
  for (int run = 0; run < runs; ++run) {
    const int m1 = m0 + run * stride + len;
    for (int m = m0 + run * stride; m < m1; ++m) {
      const __m512i wm = _mm512_loadu_si512(w + 2 * m), vm = _mm512_loadu_si512(v + 2 * m);
      // row n's broadcast against both tiles
#define TSERVE_KW_TWO(n)                  \
  {                                       \
    const __m512i x = kw_bcast4(r##n + 4 * m); \
    TSERVE_KW_DP(a##n, wm, x);            \
    TSERVE_KW_DP(c##n, vm, x);            \
  }
      TSERVE_KW_ROWS8(TSERVE_KW_TWO)
#undef TSERVE_KW_TWO
    }
  }
#define TSERVE_KW_FOLD2(n)                                  \
  out[n] = _mm256_add_epi32(out[n], kw_fold(a##n));         \
  out[8 + n] = _mm256_add_epi32(out[8 + n], kw_fold(c##n));
  TSERVE_KW_ROWS8(TSERVE_KW_FOLD2)
#undef TSERVE_KW_FOLD2
}
#undef TSERVE_KW_STEP
#undef TSERVE_KW_LAST
#undef TSERVE_KW_FOLD
#undef TSERVE_KW_RUNS
#undef TSERVE_KW_ROWS4
#undef TSERVE_KW_ROWS8
#undef TSERVE_KW_DP
#endif

#if defined(TSERVE_AVX512)
// The minima's integers of `rows` rows (kw_rows): each pair q of sub-blocks' (m_2q, m_2q+1) in
// both dwords of an output's quadword, against a row's (lo pair, hi pair) broadcast to every
// quadword: one vpdpwssd gives each output's lo sum (even dword) and hi sum (odd), then
// lo + 2^15 hi per quadword, narrowed to the 8 outputs.
TSERVE_TARGET_VNNI __attribute__((noinline)) void kw_minima_vnni(const __m256i* mp, const int16_t* const* sp, int rows,
                                                                  __m256i* i1) {
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i shift = _mm512_setr_epi32(0, 15, 0, 15, 0, 15, 0, 15, 0, 15, 0, 15, 0, 15, 0, 15);
  __m512i m2[4];
  for (int q = 0; q < 4; ++q) m2[q] = _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(mp[q]));
  for (int x = 0; x < rows; ++x) {
    __m512i s = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
      int64_t v;
      std::memcpy(&v, sp[x] + 4 * q, 8);
      s = _mm512_dpwssd_epi32(s, m2[q], _mm512_set1_epi64(v));
    }
    s = _mm512_sllv_epi32(s, shift);
    s = _mm512_add_epi32(s, _mm512_srli_epi64(s, 32));
    i1[x] = _mm512_cvtepi64_epi32(s);
  }
}
#endif

inline bool kw_vnni() {
  static const bool on = cpu().avx512_vnni;
  return on;
}

template <int R>
TSERVE_KP_TARGET inline void kw_dot(const __m256i* w, int m0, int len, int runs, int stride, const int16_t* const* r,
                                    __m256i* out) {
  static_assert(R == 1 || R == 4 || R == 8, "one, four or eight rows");
#if defined(TSERVE_AVX512)
  if (kw_vnni()) {
    if constexpr (R == 8) kw_dot8_vnni(w, m0, len, runs, stride, r, out);
    else if constexpr (R == 4) kw_dot4_vnni(w, m0, len, runs, stride, r[0], r[1], r[2], r[3], out);
    else kw_dot1_vnni(w, m0, len, runs, stride, r[0], out);
    return;
  }
#endif
  if constexpr (R == 8) {  // not run: eight-row passes are VNNI's (kw_run); the same sums in two halves
    kw_dot4(w, m0, len, runs, stride, r[0], r[1], r[2], r[3], out);
    kw_dot4(w, m0, len, runs, stride, r[4], r[5], r[6], r[7], out + 4);
  } else if constexpr (R == 4) kw_dot4(w, m0, len, runs, stride, r[0], r[1], r[2], r[3], out);
  else kw_dot1(w, m0, len, runs, stride, r[0], out);
}

template <int R>
TSERVE_KP_TARGET inline void kw_clear(__m256i* p) {
  for (int x = 0; x < R; ++x) p[x] = _mm256_setzero_si256();
}

// acc += (d s_a) p, per row
template <int R>
TSERVE_KP_TARGET inline void kw_add(__m256 d, const __m256* sa, const __m256i* p, __m256* acc) {
  for (int x = 0; x < R; ++x) acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(d, sa[x]), _mm256_cvtepi32_ps(p[x]), acc[x]);
}

// The widened blocks' dot products of R rows for TILES tiles (p: tile u's rows at p + u R)
template <int R, int TILES>
TSERVE_KP_TARGET inline void kw_dotn(const __m256i* const* w, int m0, int len, int runs, int stride,
                                     const int16_t* const* r, __m256i* p) {
#if defined(TSERVE_AVX512)
  if constexpr (TILES == 2) {
    if (kw_vnni()) return kw_dot8x2_vnni(w[0], w[1], m0, len, runs, stride, r, p);
  }
#endif
  for (int u = 0; u < TILES; ++u) kw_dot<R>(w[u], m0, len, runs, stride, r, p + u * R);
}

// acc[u R + x] += (d_u s_a) p[u R + x] for each tile u
template <int R, int TILES>
TSERVE_KP_TARGET inline void kw_add_all(const __m256* d, const __m256* sa, const __m256i* p, __m256* acc) {
  for (int u = 0; u < TILES; ++u) kw_add<R>(d[u], sa, p + u * R, acc + u * R);
}

// Rows [b0, b0 + R) of one block i against its widened weights, for TILES tiles (w[u], blk[u]):
// acc[u R + x] (8 outputs of tile u, row b0 + x) takes the block's terms, in kquant.h's order.
// Two tiles share each row's activation broadcasts (kw_dot8x2_vnni): eight rows only, VNNI only.
template <int64_t T, int R, int TILES = 1>
TSERVE_KP_TARGET void kw_rows(const __m256i* const* w, const uint8_t* const* blk, const KqActs& a, int64_t k, int64_t i,
                              int64_t b0, __m256* acc) {
  static_assert(TILES == 1 || R == 8, "two tiles a pass take eight rows");
  constexpr int64_t V = T == KQ4_K || T == KQ5_K || T == KQ6_K ? 256 : 32;
  constexpr int N = TILES * R;
  const int64_t blocks = k / V;
  const int16_t* r[R];
  const int32_t* s16[R];
  __m256 sa[R];
  for (int x = 0; x < R; ++x) {
    r[x] = a.r.data() + (b0 + x) * k + i * V;
    s16[x] = a.sum16.data() + (b0 + x) * (k / 16) + i * (V / 16);
    sa[x] = _mm256_set1_ps(a.scale[(b0 + x) * blocks + i]);
  }
  __m256 d[TILES];
  __m256i p[N];
  if constexpr (T == KQ4_K || T == KQ5_K) {
    for (int u = 0; u < TILES; ++u) d[u] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[u] + 1152)));
    kw_clear<N>(p);
    if constexpr (T == KQ5_K) {
      kw_dotn<R, TILES>(w, 0, 32, 1, 0, r, p);
      kw_add_all<R, TILES>(d, sa, p, acc);
      kw_clear<N>(p);
      kw_dotn<R, TILES>(w, 32, 32, 1, 0, r, p);
    } else {
      kw_dotn<R, TILES>(w, 0, 64, 1, 0, r, p);
    }
    kw_add_all<R, TILES>(d, sa, p, acc);
    // i1 = sum_s m_s A_s per output, as pairs of sub-blocks: mp[q] holds (m_2q, m_2q+1) per output,
    // and a row's A split in int16 halves (KqActs::split32) meets it in two madds a pair.
    const int16_t* sp[R];
    for (int x = 0; x < R; ++x) sp[x] = a.split32.data() + (b0 + x) * (k / 16) + i * 16;
    for (int u = 0; u < TILES; ++u) {
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[u] + 1168)));
      __m256i mp[4];
      kw_minima_pairs(blk[u] + 1088, mp);
      __m256i i1[R];
#if defined(TSERVE_AVX512)
      if (kw_vnni()) {
        kw_minima_vnni(mp, sp, R, i1);
      } else
#endif
      {
        for (int x = 0; x < R; ++x) {
          __m256i lo = _mm256_setzero_si256(), hi = lo;
          for (int q = 0; q < 4; ++q) {
            int32_t l, h;
            std::memcpy(&l, sp[x] + 4 * q, 4);
            std::memcpy(&h, sp[x] + 4 * q + 2, 4);
            lo = _mm256_add_epi32(lo, _mm256_madd_epi16(mp[q], _mm256_set1_epi32(l)));
            hi = _mm256_add_epi32(hi, _mm256_madd_epi16(mp[q], _mm256_set1_epi32(h)));
          }
          i1[x] = _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 15));
        }
      }
      for (int x = 0; x < R; ++x)
        acc[u * R + x] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, sa[x]), _mm256_cvtepi32_ps(i1[x]), acc[u * R + x]);
    }
  } else if constexpr (T == KQ6_K) {
    for (int u = 0; u < TILES; ++u) d[u] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[u] + 1664)));
    for (int h = 0; h < 2; ++h)
      for (int o = 0; o < 2; ++o) {  // group 2h + o: values 128h + 32c + 16o .. + 15, c = 0-3
        kw_clear<N>(p);
        kw_dotn<R, TILES>(w, 32 * h + 4 * o, 4, 4, 8, r, p);  // quads 32h + 8c + 4o .. + 3, c = 0-3
        kw_add_all<R, TILES>(d, sa, p, acc);
      }
  } else {
    constexpr int64_t VB = T == KQ8_0 ? 256 : 128;
    constexpr int64_t HALVES = VB + (kp_five(T) ? 32 : 0);
    for (int u = 0; u < TILES; ++u) d[u] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[u] + HALVES)));
    kw_clear<N>(p);
    kw_dotn<R, TILES>(w, 0, 8, 1, 0, r, p);
    kw_add_all<R, TILES>(d, sa, p, acc);
    if constexpr (kp_min(T)) {
      for (int u = 0; u < TILES; ++u) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[u] + HALVES + 16)));
        for (int x = 0; x < R; ++x)
          acc[u * R + x] = _mm256_fmadd_ps(_mm256_mul_ps(m, sa[x]), _mm256_set1_ps(static_cast<float>(s16[x][0] + s16[x][1])),
                                           acc[u * R + x]);
      }
    }
  }
}

// Outputs [j0, j1) of every row (B >= KW_MIN) through the widened blocks: per tile, each block
// widened once, then every row against it, rows' sums kept in order per (row, output).
template <int64_t T>
TSERVE_KP_TARGET void kw_run(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t block_bytes, int64_t j0, int64_t j1,
            const float* bias, float* y, int64_t stride) {
  constexpr int64_t V = T == KQ4_K || T == KQ5_K || T == KQ6_K ? 256 : 32;
  const int64_t blocks = k / V;
  // Rows in groups whose int16 activations (2 k bytes a row) stay in a core's L2 across the
  // tiles: a prompt of 2,000 rows read its whole 6-36 MB of activations again for every tile of
  // 8 outputs (the 1.5B's 2,000-token prompt took 76 s, in-process ~1.8x the int8 loops). Each
  // group widens the tile's blocks again (~0.2 us a block), so at least 16 rows a group.
  const int64_t group = std::max<int64_t>(16, std::min<int64_t>(256, KW_L2_BYTES / (2 * k)) / KW_ROWS * KW_ROWS);
  thread_local std::vector<int16_t> wide_buf;  // two tiles' widened blocks: 2 V / 4 vectors each (loadu / storeu)
  thread_local std::vector<float> sums;        // two tiles' sums, `per_tile` floats each
  const int64_t vectors = 2 * V / 4, per_tile = std::min(B, group) * KP;
  wide_buf.resize(2 * vectors * 16);
  sums.resize(2 * per_tile);
  __m256i* const wide[2] = {reinterpret_cast<__m256i*>(wide_buf.data()),
                            reinterpret_cast<__m256i*>(wide_buf.data()) + vectors};
  for (int64_t g0 = 0; g0 < B; g0 += group) {
    const int64_t g1 = std::min(B, g0 + group);
    // two tiles a pass where eight-row passes run (VNNI): each row's broadcasts serve both
    for (int64_t t0 = j0 / KP * KP, tiles; t0 < j1; t0 += tiles * KP) {
      tiles = kw_vnni() && g1 - g0 >= 2 * KW_ROWS && t0 + KP < j1 ? 2 : 1;
      const uint8_t* blk[2];
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t i = 0; i < blocks; ++i) {
        for (int u = 0; u < tiles; ++u) {
          blk[u] = packed + (t0 / KP + u) * blocks * block_bytes + i * block_bytes;
          kp_prefetch_ahead(blk[u], block_bytes);
          if constexpr (T == KQ4_K || T == KQ5_K) kw_widen_k4<T == KQ5_K>(blk[u], wide[u]);
          else if constexpr (T == KQ6_K) kw_widen_k6(blk[u], wide[u]);
          else kw_widen32<T>(blk[u], wide[u]);
        }
        int64_t b = g0;
        if (tiles == 2)
          for (; b + 2 * KW_ROWS <= g1; b += 2 * KW_ROWS) {
            __m256 acc[4 * KW_ROWS];
            for (int u = 0; u < 2; ++u)
              for (int x = 0; x < 2 * KW_ROWS; ++x)
                acc[u * 2 * KW_ROWS + x] = _mm256_loadu_ps(sums.data() + u * per_tile + (b - g0 + x) * KP);
            kw_rows<T, 2 * KW_ROWS, 2>(wide, blk, a, k, i, b, acc);
            for (int u = 0; u < 2; ++u)
              for (int x = 0; x < 2 * KW_ROWS; ++x)
                _mm256_storeu_ps(sums.data() + u * per_tile + (b - g0 + x) * KP, acc[u * 2 * KW_ROWS + x]);
          }
        for (int u = 0; u < tiles; ++u) {
          float* const su = sums.data() + u * per_tile;
          int64_t c = b;
          if (kw_vnni())
            for (; c + 2 * KW_ROWS <= g1; c += 2 * KW_ROWS) {
              float* s = su + (c - g0) * KP;
              __m256 acc[2 * KW_ROWS];
              for (int x = 0; x < 2 * KW_ROWS; ++x) acc[x] = _mm256_loadu_ps(s + x * KP);
              kw_rows<T, 2 * KW_ROWS>(&wide[u], &blk[u], a, k, i, c, acc);
              for (int x = 0; x < 2 * KW_ROWS; ++x) _mm256_storeu_ps(s + x * KP, acc[x]);
            }
          for (; c + KW_ROWS <= g1; c += KW_ROWS) {
            float* s = su + (c - g0) * KP;
            __m256 acc[KW_ROWS];
            for (int x = 0; x < KW_ROWS; ++x) acc[x] = _mm256_loadu_ps(s + x * KP);
            kw_rows<T, KW_ROWS>(&wide[u], &blk[u], a, k, i, c, acc);
            for (int x = 0; x < KW_ROWS; ++x) _mm256_storeu_ps(s + x * KP, acc[x]);
          }
          for (; c < g1; ++c) {
            float* s = su + (c - g0) * KP;
            __m256 acc[1] = {_mm256_loadu_ps(s)};
            kw_rows<T, 1>(&wide[u], &blk[u], a, k, i, c, acc);
            _mm256_storeu_ps(s, acc[0]);
          }
        }
      }
      for (int u = 0; u < tiles; ++u) kp_store(sums.data() + u * per_tile, g0, g1, t0 + u * KP, j0, j1, bias, y, stride);
    }
  }
}

#if defined(TSERVE_AVX512)
// --- a few rows (4-15) with AVX512-VNNI: the blocks as bytes, no widening -------------------------------
// The widened path above pays for each (tile, block) once per call: 128 int16 vectors, each value
// times its scale (~1,300 instructions a Q4_K block), which at 8 rows cost more than the rows'
// products themselves. Here a Q4_K block is only regrouped, once per call, into 32 vectors of
// bytes (vpdpbusd's unsigned operand): vector 4s + u of sub-block s holds, in dword lanes 2j and
// 2j + 1 of output j (in the order 0, 1, 4, 5, 2, 3, 6, 7 of kw_fold), the values
// 32s + 8u .. 32s + 8u + 7, so a row's 8 activation bytes there, broadcast as a quadword, meet all
// 8 outputs in one vpdpbusd. Each row's hi and lo bytes take one each; a sub-block's sums H and L
// (int32 lanes, 16 values each) then give sc (128 H + L) by one 32-bit multiply, as the one-row
// loop does. The integers are kquant.h's exact ones, and the float combination the widened path's
// (kw_rows) operations in its order, so every row keeps its bits. Q4_K only (most of a Q4_K_M
// file's bytes); the other types keep the widened path.
#define TSERVE_KB_DB(acc, u, s) asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))

// Q4_K block of a packed tile -> z[32] (above) and sc[8]: sub-block s's scale in the lanes of its output
TSERVE_KP_TARGET_VNNI inline void kb_prep_k4(const uint8_t* blk, __m512i* z, __m512i* sc) {
  const __m512i low = _mm512_set1_epi8(15);
  const __m512i order = _mm512_setr_epi32(0, 0, 1, 1, 4, 4, 5, 5, 2, 2, 3, 3, 6, 6, 7, 7);
  for (int c = 0; c < 4; ++c)
    for (int u = 0; u < 4; ++u) {
      const __m256i a = loadu(blk + 32 * (8 * c + 2 * u)), b = loadu(blk + 32 * (8 * c + 2 * u + 1));
      const __m512i p = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi32(a, b)), _mm256_unpackhi_epi32(a, b), 1);
      z[8 * c + u] = _mm512_and_si512(p, low);                             // sub-block 2c: low nibbles
      z[8 * c + 4 + u] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);   // sub-block 2c + 1: high
    }
  for (int s = 0; s < 8; ++s)
    sc[s] = _mm512_permutexvar_epi32(order, _mm512_castsi256_si512(kp_lanes<false>(blk + 1024 + 8 * s)));
}

// a row's 8 activation bytes at p as a quadword in every lane pair
TSERVE_KP_TARGET_VNNI inline __m512i kb_bq(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// i0 of R rows (hi bytes at h + x k, lo bytes at h + dl + x k: one block's) against one prepared block
template <int R>
TSERVE_KP_TARGET_VNNI __attribute__((noinline)) void kb_dot_k4(const __m512i* __restrict z, const __m512i* __restrict sc,
                                                               const int8_t* h, std::ptrdiff_t dl, int64_t k,
                                                               __m256i* __restrict out) {
  __m512i i0[R];
  for (int x = 0; x < R; ++x) i0[x] = _mm512_setzero_si512();
  for (int s = 0; s < 8; ++s) {
    __m512i H[R], L[R];
    for (int x = 0; x < R; ++x) H[x] = L[x] = _mm512_setzero_si512();
    for (int u = 0; u < 4; ++u) {
      const __m512i w = z[4 * s + u];
      const int8_t* at = h + 32 * s + 8 * u;
      for (int x = 0; x < R; ++x) {
        TSERVE_KB_DB(H[x], w, kb_bq(at + x * k));
        TSERVE_KB_DB(L[x], w, kb_bq(at + dl + x * k));
      }
    }
    for (int x = 0; x < R; ++x)
      i0[x] = _mm512_add_epi32(i0[x], _mm512_mullo_epi32(_mm512_add_epi32(_mm512_slli_epi32(H[x], 7), L[x]), sc[s]));
  }
  for (int x = 0; x < R; ++x) out[x] = kw_fold(i0[x]);
}

// Rows [b, b + R) of block i against the prepared block: acc[x] takes the block's terms, as kw_rows<KQ4_K> does
template <int R>
TSERVE_KP_TARGET_VNNI inline void kb_rows_k4(const __m512i* z, const __m512i* sc, const __m256i* mp, const uint8_t* blk,
                                             const KqActs& a, int64_t k, int64_t i, int64_t b, __m256* acc) {
  const int64_t blocks = k / 256;
  const int8_t* h = a.hi.data() + b * k + i * 256;
  const std::ptrdiff_t dl = reinterpret_cast<const int8_t*>(a.lo.data()) - a.hi.data();
  __m256i p[R], i1[R];
  kb_dot_k4<R>(z, sc, h, dl, k, p);
  const int16_t* sp[R];
  for (int x = 0; x < R; ++x) sp[x] = a.split32.data() + (b + x) * (k / 16) + i * 16;
  kw_minima_vnni(mp, sp, R, i1);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1152)));
  const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1168)));
  for (int x = 0; x < R; ++x) {
    const __m256 sa = _mm256_set1_ps(a.scale[(b + x) * blocks + i]);
    acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(d, sa), _mm256_cvtepi32_ps(p[x]), acc[x]);
    acc[x] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, sa), _mm256_cvtepi32_ps(i1[x]), acc[x]);
  }
}

// Outputs [j0, j1) of rows [0, B) of Q4_K through the byte loops (kw_run's structure: per tile,
// each block prepared once, then the rows in eights, fours and ones).
TSERVE_KP_TARGET_VNNI void kb_run_k4(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t j0, int64_t j1,
                                     const float* bias, float* y, int64_t stride) {
  const int64_t blocks = k / 256;
  thread_local std::vector<float> sums;
  sums.resize(B * KP);
  alignas(64) __m512i z[32], sc[8];
  for (int64_t t0 = j0 / KP * KP; t0 < j1; t0 += KP) {
    const uint8_t* tile = packed + t0 / KP * blocks * KP_BLOCK;
    std::fill(sums.begin(), sums.end(), 0.0f);
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* blk = tile + i * KP_BLOCK;
      kp_prefetch_ahead(blk, KP_BLOCK);
      kb_prep_k4(blk, z, sc);
      __m256i mp[4];
      kw_minima_pairs(blk + 1088, mp);
      int64_t b = 0;
      for (; b + 8 <= B; b += 8) {
        __m256 acc[8];
        for (int x = 0; x < 8; ++x) acc[x] = _mm256_loadu_ps(sums.data() + (b + x) * KP);
        kb_rows_k4<8>(z, sc, mp, blk, a, k, i, b, acc);
        for (int x = 0; x < 8; ++x) _mm256_storeu_ps(sums.data() + (b + x) * KP, acc[x]);
      }
      for (; b + 4 <= B; b += 4) {
        __m256 acc[4];
        for (int x = 0; x < 4; ++x) acc[x] = _mm256_loadu_ps(sums.data() + (b + x) * KP);
        kb_rows_k4<4>(z, sc, mp, blk, a, k, i, b, acc);
        for (int x = 0; x < 4; ++x) _mm256_storeu_ps(sums.data() + (b + x) * KP, acc[x]);
      }
      for (; b < B; ++b) {
        __m256 acc[1] = {_mm256_loadu_ps(sums.data() + b * KP)};
        kb_rows_k4<1>(z, sc, mp, blk, a, k, i, b, acc);
        _mm256_storeu_ps(sums.data() + b * KP, acc[0]);
      }
    }
    kp_store(sums.data(), 0, B, t0, j0, j1, bias, y, stride);
  }
}
#undef TSERVE_KB_DB
#endif

#if defined(TSERVE_AVX512)
// --- prompts and large batches through AMX tiles (Q4_K) ---------------------------------------------
// Where the CPU has AMX with int8 products (and the kernel grants it: common.h), a 16-row by
// 16-output tile of a block's integer i0 = sum_v sc_s(v) q_v r_v is a handful of tile products
// rather than 2,048 vpdpwssd. The weights of a pair of packed tiles (16 outputs) are prepared once
// per block and row group: w = sc q (at most 63 x 15 = 945) split as w = 32 w1 + w0, w1 in [0, 29],
// w0 in [0, 31], bytes; a row's r = 128 hi + lo as its two bytes, as ever. Then per 64 values,
// hi x w1, lo x w1, hi x w0, lo x w0 (tdpbsud for the signed hi, tdpbuud for lo) into four int32
// tiles, and after the block's four chunks i0 = 32 (128 C1H + C1L) + 128 C0H + C0L: the exact
// integer of kquant.h, so the float combination (kw_rows<KQ4_K>'s operations in its order) gives
// every row the scalar loops' bits. A B-tile row holds, for each of the 16 outputs, 4 consecutive
// values; packus puts the pair's outputs in the order kKaOrder (columns of the C tiles), undone
// when the sums are stored. Tiles: 0-3 C (1H, 1L, 0H, 0L), 4 A hi, 5 A lo, 6 B1, 7 B0.
#define TSERVE_KA_TARGET \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

// Rows from which the tiles run (in-process, the Qwen2.5-Coder files, 2 threads, alternated). Q4_K
// from 9 and Q6_K from 10, where the tiles' preparation of each block has come to cost less than the
// products it saves (measured 2026-11-30 on the 1.5B's step, 2-3 rounds a row count, against the
// byte loops for Q4_K and the widened int16 loops for Q6_K): Q4_K's tiles alone 8 rows 0.97-1.04x
// the step's time (a wash: left to the byte loops), 9 rows 0.95x; both types' tiles 4 rows 1.3x,
// 9 rows 1.0x, 10 rows 0.9x, 11 rows 0.84x, 12 rows 0.87x, 14 rows 0.80x. The 32-value types
// from 3 (whose preparation is a few byte operations: 3 rows 0.93x, 4 rows 0.89x, 8 rows 0.83x;
// 2 rows 1.16x).
constexpr int64_t KA_MIN_K4 = 9;
constexpr int64_t KA_MIN_K6 = 10;
constexpr int64_t KA32_MIN = 3;
constexpr int64_t KA_L2_BYTES = 1280 * 1024;  // a row group's activation bytes (hi and lo), in a core's L2
constexpr int kKaOrder[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};  // column -> output of the pair

// kKaOrder as the dword indices of a permutation: a pair's 16 per-output values into column order
TSERVE_KA_TARGET inline __m512i ka_order() { return _mm512_loadu_si512(kKaOrder); }

inline bool ka_amx() {
  static const bool on = cpu().amx_int8;
  return on;
}

struct alignas(64) KaConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-5 (C and A) of `rows` rows (1-16), the B tiles 16
TSERVE_KA_TARGET inline void ka_configure(int rows) {
  KaConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
    c.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(c));  // not _tile_loadconfig: see common.h's touch_tiles
}

// Sub-block s's scale of every output of the pair as the int16 factor of its 4 values (words
// 4j .. 4j + 3 of tile u's vector)
TSERVE_KA_TARGET inline __m512i ka_factor(const uint8_t* sc) {
  const __m512i spread = _mm512_set_epi16(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1,
                                          1, 1, 0, 0, 0, 0);
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
  return _mm512_permutexvar_epi16(spread, _mm512_castsi256_si512(_mm256_cvtepu8_epi16(raw)));
}

TSERVE_KA_TARGET inline __m512i ka_factor_signed(const uint8_t* sc) {
  const __m512i spread = _mm512_set_epi16(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1,
                                          1, 1, 0, 0, 0, 0);
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
  return _mm512_permutexvar_epi16(spread, _mm512_castsi256_si512(_mm256_cvtepi8_epi16(raw)));
}

// One block of a pair of Q4_K tiles -> the B tiles: bw + 2048 c
// holds chunk c's w1 (16 rows of 64 bytes), bw + 2048 c + 1024 its w0. Row t of chunk c: values
// 64c + 4t .. (low nibbles of vector 8c + t, sub-block 2c); row 8 + t: values 64c + 32 + 4t ..
// (high nibbles, sub-block 2c + 1).
TSERVE_KA_TARGET void ka_prep_k4(const uint8_t* const* blk, uint8_t* bw) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m512i five = _mm512_set1_epi16(31);
  for (int c = 0; c < 4; ++c)
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * c + half;
      const __m512i fa = ka_factor(blk[0] + 1024 + 8 * s), fb = ka_factor(blk[1] + 1024 + 8 * s);
      for (int t = 0; t < 8; ++t) {
        __m256i qa = loadu(blk[0] + 32 * (8 * c + t)), qb = loadu(blk[1] + 32 * (8 * c + t));
        if (half) {
          qa = _mm256_srli_epi16(qa, 4);
          qb = _mm256_srli_epi16(qb, 4);
        }
        const __m512i wa = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(qa, low)), fa);
        const __m512i wb = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(qb, low)), fb);
        uint8_t* row = bw + 2048 * c + 64 * (8 * half + t);
        _mm512_store_si512(row, _mm512_packus_epi16(_mm512_srli_epi16(wa, 5), _mm512_srli_epi16(wb, 5)));
        _mm512_store_si512(row + 1024, _mm512_packus_epi16(_mm512_and_si512(wa, five), _mm512_and_si512(wb, five)));
      }
    }
}

// A pair's d (or dmin) halves as 16 floats in column order
TSERVE_KA_TARGET inline __m512 ka_halves(const uint8_t* const* blk, int64_t at) {
  const __m512i order = ka_order();
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[0] + at))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[1] + at)), 1);
  return _mm512_permutexvar_ps(order, _mm512_cvtph_ps(h));
}

// The four C tiles cleared; one chunk's four products (A hi and lo from h and l, rows k apart; B w1
// and w0 at bt, bt + 1,024; SIGNED: w1 is signed, Q6_K's); the four C tiles into ct (1H, 1L, 0H, 0L)
TSERVE_KA_TARGET inline void ka_clear4() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

template <bool SIGNED>
TSERVE_KA_TARGET inline void ka_chunk(const void* h, const void* l, int64_t k, const uint8_t* bt) {
  _tile_loadd(4, h, k);
  _tile_loadd(5, l, k);
  _tile_loadd(6, bt, 64);
  _tile_loadd(7, bt + 1024, 64);
  if constexpr (SIGNED) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbusd(1, 5, 6);
  } else {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbuud(1, 5, 6);
  }
  _tile_dpbsud(2, 4, 7);
  _tile_dpbuud(3, 5, 7);
}

TSERVE_KA_TARGET inline void ka_store4(int32_t* ct) {
  _tile_stored(0, ct, 64);
  _tile_stored(1, ct + 256, 64);
  _tile_stored(2, ct + 512, 64);
  _tile_stored(3, ct + 768, 64);
}

// What a pair's block gives every row tile besides its B tiles, made once a block (ka_terms_k4):
// the minima pairs (m_2q, m_2q+1) as a lane's int16 halves in column order, and d and dmin.
struct KaTermsK4 {
  __m512i mq[4];
  __m512 d, dm;
};

TSERVE_KA_TARGET inline void ka_terms_k4(const uint8_t* const* blk, KaTermsK4& t) {
  const __m512i order = ka_order();
  __m256i mp0[4], mp1[4];
  kw_minima_pairs(blk[0] + 1088, mp0);
  kw_minima_pairs(blk[1] + 1088, mp1);
  for (int q = 0; q < 4; ++q)
    t.mq[q] = _mm512_permutexvar_epi32(order, _mm512_inserti64x4(_mm512_castsi256_si512(mp0[q]), mp1[q], 1));
  t.d = ka_halves(blk, 1152);
  t.dm = ka_halves(blk, 1168);
}

// Rows [b, b + R) (R <= 16, the tiles configured so) of block i against the prepared pair: acc (R
// rows of 16 floats, column order) takes the block's terms. C tiles through `ct` (4 x 16 x 16 int32).
TSERVE_KA_TARGET void ka_rows16(const uint8_t* bw, const KaTermsK4& t, const KqActs& a, int64_t k, int64_t i,
                                int64_t b, int R, int32_t* ct, float* acc) {
  const int64_t blocks = k / 256;
  const int8_t* h = a.hi.data() + b * k + i * 256;
  const uint8_t* l = a.lo.data() + b * k + i * 256;
  ka_clear4();
  for (int c = 0; c < 4; ++c) ka_chunk<false>(h + 64 * c, l + 64 * c, k, bw + 2048 * c);
  ka_store4(ct);
  // The minima's integer i1 = sum_s m_s A_s of the pair's 16 outputs at once: the row's lo pair and
  // hi pair of A (KqActs::split32) broadcast against t.mq: i1 = lo sums + 2^15 hi sums, the
  // integers kw_minima_vnni gives.
  for (int x = 0; x < R; ++x) {
    const int16_t* sp = a.split32.data() + (b + x) * (k / 16) + i * 16;
    __m512i slo = _mm512_setzero_si512(), shi = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
      int32_t lo, hi;
      std::memcpy(&lo, sp + 4 * q, 4);
      std::memcpy(&hi, sp + 4 * q + 2, 4);
      slo = _mm512_dpwssd_epi32(slo, t.mq[q], _mm512_set1_epi32(lo));
      shi = _mm512_dpwssd_epi32(shi, t.mq[q], _mm512_set1_epi32(hi));
    }
    const __m512i i1 = _mm512_add_epi32(slo, _mm512_slli_epi32(shi, 15));
    const __m512i c1h = _mm512_load_si512(ct + 16 * x), c1l = _mm512_load_si512(ct + 256 + 16 * x);
    const __m512i c0h = _mm512_load_si512(ct + 512 + 16 * x), c0l = _mm512_load_si512(ct + 768 + 16 * x);
    const __m512i w1 = _mm512_add_epi32(_mm512_slli_epi32(c1h, 7), c1l);
    const __m512i i0 = _mm512_add_epi32(_mm512_slli_epi32(w1, 5), _mm512_add_epi32(_mm512_slli_epi32(c0h, 7), c0l));
    const __m512 sa = _mm512_set1_ps(a.scale[(b + x) * blocks + i]);
    __m512 v = _mm512_loadu_ps(acc + 16 * x);
    v = _mm512_fmadd_ps(_mm512_mul_ps(t.d, sa), _mm512_cvtepi32_ps(i0), v);
    v = _mm512_fnmadd_ps(_mm512_mul_ps(t.dm, sa), _mm512_cvtepi32_ps(i1), v);
    _mm512_storeu_ps(acc + 16 * x, v);
  }
}

// Q6_K the same way, with w = (q - 32) sc (signed, |w| <= 4,096) = 64 w1 + w0, w1 in [-64, 64]
// (tdpbssd against hi, tdpbusd against lo), w0 in [0, 63]. Its block gives four integers, one a
// group of four sub-blocks of 16 (kquant.h; group g = 2h + o: values 128h + 32c + 16o .., c =
// 0-3), whose runs of 16 interleave with the other group's of the same half. The rows'
// activations are regrouped once per row group (ka_regroup6: each block's group g as its 64
// bytes 64g ..), so a chunk of 64 values is one group: four chunks a block, as Q4_K's, and no
// product spent on another group's zeros. bw + 2048 g: chunk g's w1 (16 rows of 64 bytes), + 1,024
// its w0; row 4c + u' holds values 128h + 32c + 16o + 4u' .. (u' = 0-3).
TSERVE_KA_TARGET void ka_prep_k6(const uint8_t* const* blk, uint8_t* bw6) {
  const __m512i m32 = _mm512_set1_epi16(32), six = _mm512_set1_epi16(63);
  for (int h = 0; h < 2; ++h)
    for (int u = 0; u < 8; ++u) {
      __m256i va[4], vb[4];
      kp_q6(blk[0], h, u, va);
      kp_q6(blk[1], h, u, vb);
      const int o = u / 4;
      for (int c = 0; c < 4; ++c) {
        const int s = 8 * h + 2 * c + o;
        const __m512i fa = ka_factor_signed(blk[0] + 1536 + 8 * s), fb = ka_factor_signed(blk[1] + 1536 + 8 * s);
        const __m512i wa = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(va[c]), m32), fa);
        const __m512i wb = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(vb[c]), m32), fb);
        uint8_t* row = bw6 + 2048 * (2 * h + o) + 64 * (4 * c + u % 4);
        _mm512_store_si512(row, _mm512_packs_epi16(_mm512_srai_epi16(wa, 6), _mm512_srai_epi16(wb, 6)));
        _mm512_store_si512(row + 1024, _mm512_packus_epi16(_mm512_and_si512(wa, six), _mm512_and_si512(wb, six)));
      }
    }
}

// Rows [g0, g1)'s hi and lo bytes, each block's groups in turn (group g = 2h + o at 64g: its runs
// of 16 at 128h + 32c + 16o, c = 0-3), into hi6 / lo6 (rows k apart, as the activations are)
TSERVE_KA_TARGET void ka_regroup6(const KqActs& a, int64_t k, int64_t g0, int64_t g1, int8_t* hi6, uint8_t* lo6) {
  for (int64_t b = g0; b < g1; ++b) {
    const int8_t* h = a.hi.data() + b * k;
    const uint8_t* l = a.lo.data() + b * k;
    int8_t* H = hi6 + (b - g0) * k;
    uint8_t* L = lo6 + (b - g0) * k;
    for (int64_t v = 0; v < k; v += 256)
      for (int g = 0; g < 4; ++g)
        for (int c = 0; c < 4; ++c) {
          const int64_t from = v + 128 * (g / 2) + 32 * c + 16 * (g % 2), to = v + 64 * g + 16 * c;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(H + to), _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + from)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(L + to), _mm_loadu_si128(reinterpret_cast<const __m128i*>(l + from)));
        }
  }
}

// Rows [b, b + R) of block i, their regrouped activations (ka_regroup6) from h6 / l6, rows k apart
TSERVE_KA_TARGET void ka_rows16_k6(const uint8_t* bw6, const uint8_t* const* blk, const KqActs& a, const int8_t* h6,
                                   const uint8_t* l6, int64_t k, int64_t i, int64_t b, int R, int32_t* ct, float* acc) {
  const int64_t blocks = k / 256;
  const int8_t* hp = h6 + i * 256;
  const uint8_t* lp = l6 + i * 256;
  const __m512 d = ka_halves(blk, 1664);
  __m512 dd[16];
  for (int x = 0; x < R; ++x) dd[x] = _mm512_mul_ps(d, _mm512_set1_ps(a.scale[(b + x) * blocks + i]));
  for (int g = 0; g < 4; ++g) {
    ka_clear4();
    ka_chunk<true>(hp + 64 * g, lp + 64 * g, k, bw6 + 2048 * g);
    ka_store4(ct);
    for (int x = 0; x < R; ++x) {
      const __m512i c1h = _mm512_load_si512(ct + 16 * x), c1l = _mm512_load_si512(ct + 256 + 16 * x);
      const __m512i c0h = _mm512_load_si512(ct + 512 + 16 * x), c0l = _mm512_load_si512(ct + 768 + 16 * x);
      const __m512i w1 = _mm512_add_epi32(_mm512_slli_epi32(c1h, 7), c1l);
      const __m512i ig = _mm512_add_epi32(_mm512_slli_epi32(w1, 6), _mm512_add_epi32(_mm512_slli_epi32(c0h, 7), c0l));
      _mm512_storeu_ps(acc + 16 * x, _mm512_fmadd_ps(dd[x], _mm512_cvtepi32_ps(ig), _mm512_loadu_ps(acc + 16 * x)));
    }
  }
}

// The 32-value types without a minimum (Q8_0, Q5_0, Q4_0) the same way, more simply: a block's
// weights minus their offset are signed bytes already (Q5_0: q - 16 in [-16, 15]), so a pair of
// tiles' block is 8 B-tile rows of 64 bytes (row t: values 4t .. 4t + 3 of the 16 outputs in
// order), prepared for every block of the pair at once; a block of 32 values is one chunk (hi x w
// through tdpbssd, lo x w through tdpbusd), its integer i0 = 128 C_H + C_L, Q5_0's and Q4_0's
// equal to the loops' i0 - zero (sum r). A row tile keeps its 16 rows' sums in registers over
// the blocks. Tiles: 0 C_H, 1 C_L, 4 A hi, 5 A lo (R rows of 32 bytes), 6 B (8 rows of 64).
TSERVE_KA_TARGET inline void ka_configure32(int rows) {
  KaConfig c;
  c.rows[0] = c.rows[1] = static_cast<uint8_t>(rows);
  c.colsb[0] = c.colsb[1] = 64;
  c.rows[4] = c.rows[5] = static_cast<uint8_t>(rows);
  c.colsb[4] = c.colsb[5] = 32;
  c.rows[6] = 8;
  c.colsb[6] = 64;
  asm volatile("ldtilecfg %0" : : "m"(c));
}

template <int64_t T>
TSERVE_KA_TARGET void ka_prep32(const uint8_t* const* blk, uint8_t* bw) {
  if constexpr (T == KQ8_0) {
    for (int t = 0; t < 8; ++t)
      for (int u = 0; u < 2; ++u) _mm256_store_si256(reinterpret_cast<__m256i*>(bw + 64 * t + 32 * u), loadu(blk[u] + 32 * t));
  } else {
    const __m256i low = _mm256_set1_epi8(15), zero = _mm256_set1_epi8(T == KQ5_0 ? 16 : 8);
    for (int u = 0; u < 2; ++u) {
      const __m256i qh = kp_five(T) ? loadu(blk[u] + 128) : _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i q = loadu(blk[u] + 32 * t);
        __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if constexpr (kp_five(T)) {
          lo = _mm256_or_si256(lo, kp_fifth(qh, t));
          hi = _mm256_or_si256(hi, kp_fifth(qh, 4 + t));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(bw + 64 * t + 32 * u), _mm256_sub_epi8(lo, zero));
        _mm256_store_si256(reinterpret_cast<__m256i*>(bw + 64 * (4 + t) + 32 * u), _mm256_sub_epi8(hi, zero));
      }
    }
  }
}

// Rows [b, b + R) against a prepared pair (all its blocks), into y's outputs [j0, j1) of the pair at t0
template <int64_t T>
TSERVE_KA_TARGET void ka_rows32(const uint8_t* bw, const uint8_t* tiles, const KqActs& a, int64_t k, int64_t b, int R,
                                int32_t* ct, int64_t t0, int64_t j0, int64_t j1, const float* bias, float* y,
                                int64_t stride) {
  constexpr int64_t BB = kp_block32(T), HALVES = (T == KQ8_0 ? 256 : 128) + (kp_five(T) ? 32 : 0);
  const int64_t blocks = k / 32, pair_stride = blocks * BB;  // tile t0 + 8's blocks follow tile t0's
  __m512 acc[16];
  for (int x = 0; x < 16; ++x) acc[x] = _mm512_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, a.hi.data() + b * k + 32 * i, k);
    _tile_loadd(5, a.lo.data() + b * k + 32 * i, k);
    _tile_loadd(6, bw + 512 * i, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbusd(1, 5, 6);
    _tile_stored(0, ct, 64);
    _tile_stored(1, ct + 256, 64);
    const uint8_t* blk = tiles + i * BB;
    const __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + HALVES))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + pair_stride + HALVES)), 1);
    const __m512 d = _mm512_cvtph_ps(h);
    for (int x = 0; x < R; ++x) {
      const __m512i i0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ct + 16 * x), 7), _mm512_load_si512(ct + 256 + 16 * x));
      const __m512 sa = _mm512_set1_ps(a.scale[(b + x) * blocks + i]);
      acc[x] = _mm512_fmadd_ps(_mm512_mul_ps(d, sa), _mm512_cvtepi32_ps(i0), acc[x]);
    }
  }
  alignas(64) float out[16];
  for (int x = 0; x < R; ++x) {
    _mm512_store_ps(out, acc[x]);
    for (int col = 0; col < 16; ++col) {
      const int64_t j = t0 + col;
      if (j < j0 || j >= j1) continue;
      y[(b + x) * stride + j] = bias == nullptr ? out[col] : out[col] + bias[j];
    }
  }
}

// Outputs [j0, j1) of every row of a 32-value type through the tiles (ka_run's shape); returns
// the first output of a last tile left alone
template <int64_t T>
TSERVE_KA_TARGET int64_t ka_run32(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t j0, int64_t j1,
                                  const float* bias, float* y, int64_t stride) {
  constexpr int64_t BB = kp_block32(T);
  const int64_t blocks = k / 32;
  const int64_t group = std::max<int64_t>(16, std::min<int64_t>(512, KA_L2_BYTES / (2 * k)) / 16 * 16);
  // 512 bytes a block, aligned to 64 by hand: a std::vector<__m512i> is not (in a build without
  // -mavx512f, GCC drops __m512i's alignment in a template argument, and the vector's operator new
  // gave 16-byte blocks: the portable library faulted on the first aligned store)
  thread_local std::vector<uint8_t> prepared;
  prepared.resize(512 * blocks + 63);
  uint8_t* const bw = prepared.data() + (-reinterpret_cast<uintptr_t>(prepared.data()) & 63);
  alignas(64) static thread_local int32_t ct[512];
  int64_t pairs_end = j0 / KP * KP;
  while (pairs_end + KP < j1) pairs_end += 2 * KP;
  int configured = 0;
  for (int64_t g0 = 0; g0 < B; g0 += group) {
    const int64_t g1 = std::min(B, g0 + group);
    for (int64_t t0 = j0 / KP * KP; t0 < pairs_end; t0 += 2 * KP) {
      const uint8_t* tiles = packed + (t0 / KP) * blocks * BB;
      for (int64_t i = 0; i < blocks; ++i) {
        const uint8_t* blk[2] = {tiles + i * BB, tiles + blocks * BB + i * BB};
        ka_prep32<T>(blk, bw + 512 * i);
      }
      for (int64_t b = g0; b < g1; b += 16) {
        const int R = static_cast<int>(std::min<int64_t>(16, g1 - b));
        if (R != configured) ka_configure32(configured = R);
        ka_rows32<T>(bw, tiles, a, k, b, R, ct, t0, j0, j1, bias, y, stride);
      }
    }
  }
  _tile_release();
  return std::min(pairs_end, j1);
}

// Outputs [j0, j1) of every row through the tiles, by pairs of packed tiles, sixteen rows at a time
// and the rest in one shorter tile (configured for it in turn); returns the first output of a last
// tile left alone (j1 where none is), which the caller runs otherwise.
template <int64_t T>
TSERVE_KA_TARGET int64_t ka_run(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t j0, int64_t j1,
                                const float* bias, float* y, int64_t stride) {
  constexpr int64_t BB = T == KQ6_K ? KP6_BLOCK : KP_BLOCK;
  const int64_t blocks = k / 256, rows = B;
  const int64_t group = std::max<int64_t>(16, std::min<int64_t>(512, KA_L2_BYTES / (2 * k)) / 16 * 16);
  thread_local std::vector<float> sums;
  sums.resize(std::min(rows, group) * 16);
  alignas(64) static thread_local uint8_t bw[8192];
  thread_local std::vector<uint8_t> regrouped;  // Q6_K: a row group's activations, hi then lo (ka_regroup6)
  if constexpr (T == KQ6_K) regrouped.resize(2 * std::min(rows, group) * k);
  alignas(64) static thread_local int32_t ct[1024];
  int configured = 0;
  auto rows_of = [&](int R) {
    if (R != configured) ka_configure(configured = R);
  };
  int64_t pairs_end = j0 / KP * KP;  // the tiles in pairs: [j0 / KP * KP, pairs_end)
  while (pairs_end + KP < j1) pairs_end += 2 * KP;
  // row groups outside: a group's activations stay in L2 across the chunk's tiles (at most 16)
  for (int64_t g0 = 0; g0 < rows; g0 += group) {
    const int64_t g1 = std::min(rows, g0 + group);
    int8_t* hi6 = nullptr;
    uint8_t* lo6 = nullptr;
    if constexpr (T == KQ6_K) {
      hi6 = reinterpret_cast<int8_t*>(regrouped.data());
      lo6 = regrouped.data() + (g1 - g0) * k;
      ka_regroup6(a, k, g0, g1, hi6, lo6);
    }
    for (int64_t t0 = j0 / KP * KP; t0 < pairs_end; t0 += 2 * KP) {
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t i = 0; i < blocks; ++i) {
        const uint8_t* blk[2] = {packed + (t0 / KP) * blocks * BB + i * BB, packed + (t0 / KP + 1) * blocks * BB + i * BB};
        kp_prefetch_ahead(blk[0], BB);
        kp_prefetch_ahead(blk[1], BB);
        if constexpr (T == KQ6_K) {
          ka_prep_k6(blk, bw);
          for (int64_t b = g0; b < g1; b += 16) {
            const int R = static_cast<int>(std::min<int64_t>(16, g1 - b));
            rows_of(R);
            ka_rows16_k6(bw, blk, a, hi6 + (b - g0) * k, lo6 + (b - g0) * k, k, i, b, R, ct, sums.data() + (b - g0) * 16);
          }
        } else {
          ka_prep_k4(blk, bw);
          KaTermsK4 terms;
          ka_terms_k4(blk, terms);
          for (int64_t b = g0; b < g1; b += 16) {
            const int R = static_cast<int>(std::min<int64_t>(16, g1 - b));
            rows_of(R);
            ka_rows16(bw, terms, a, k, i, b, R, ct, sums.data() + (b - g0) * 16);
          }
        }
      }
      for (int64_t b = g0; b < g1; ++b)
        for (int col = 0; col < 16; ++col) {
          const int64_t j = t0 + kKaOrder[col];
          if (j < j0 || j >= j1) continue;
          const float v = sums[(b - g0) * 16 + col];
          y[b * stride + j] = bias == nullptr ? v : v + bias[j];
        }
    }
  }
  _tile_release();
  return std::min(pairs_end, j1);
}
#endif

}  // namespace

bool kq_packed_type(int64_t qtype) {
  return qtype == KQ4_K || qtype == KQ5_K || qtype == KQ6_K || qtype == KQ8_0 || qtype == KQ4_0 || qtype == KQ4_1 || qtype == KQ5_0 || qtype == KQ5_1;
}

int64_t kq_packed_bytes(int64_t qtype, int64_t n, int64_t k) {
  if (!kq_packed_type(qtype) || k % kq_format(qtype).values != 0) return 0;
  if (qtype == KQ6_K) return (n + KP - 1) / KP * (k / 256) * KP6_BLOCK;
  if (qtype == KQ5_K) return (n + KP - 1) / KP * (k / 256) * KP5_BLOCK;
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
  // Q4_K, or Q5_K (its values after 32 bytes of fifth bits, which follow the tile's Q4_K layout)
  const bool five = qtype == KQ5_K;
  kp_each(w, n, k, 256, five ? 176 : 144, five ? KP5_BLOCK : KP_BLOCK, out, [five](uint8_t* blk, const uint8_t* src, int64_t j) {
    const uint8_t* qs = src + (five ? 48 : 16);
    for (int64_t v = 0; v < 32; ++v) std::memcpy(blk + 32 * v + 4 * j, qs + 4 * v, 4);
    int32_t sc[8], mn[8];
    scale_min_k4(src + 4, sc, mn);
    for (int s = 0; s < 8; ++s) {
      blk[1024 + 8 * s + j] = static_cast<uint8_t>(sc[s]);
      blk[1088 + 8 * s + j] = static_cast<uint8_t>(mn[s]);
    }
    std::memcpy(blk + 1152 + 2 * j, src, 2);
    std::memcpy(blk + 1168 + 2 * j, src + 2, 2);
    if (five)
      for (int64_t t = 0; t < 8; ++t) std::memcpy(blk + KP_BLOCK + 32 * t + 4 * j, src + 16 + 4 * t, 4);
  });
}

bool kq_packed_runs() {
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return runs;
}

void kq_packed_rows(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t qtype, int64_t j0,
                    int64_t j1, const float* bias, float* y, int64_t stride) {
#if defined(TSERVE_AVX512)
  if (((qtype == KQ4_K && B >= KA_MIN_K4) || (qtype == KQ6_K && B >= KA_MIN_K6)) && ka_amx()) {
    const bool six = qtype == KQ6_K;
    const int64_t bb = kq_packed_bytes(qtype, KP, 256);
    const int64_t alone = six ? ka_run<KQ6_K>(a, B, k, packed, j0, j1, bias, y, stride)
                              : ka_run<KQ4_K>(a, B, k, packed, j0, j1, bias, y, stride);
    if (alone < j1 && six) kw_run<KQ6_K>(a, B, k, packed, bb, alone, j1, bias, y, stride);  // a last tile without a pair
    if (alone < j1 && !six) kw_run<KQ4_K>(a, B, k, packed, bb, alone, j1, bias, y, stride);
    return;
  }
  if ((qtype == KQ8_0 || qtype == KQ5_0 || qtype == KQ4_0) && B >= KA32_MIN && ka_amx()) {
    const int64_t bb = kq_packed_bytes(qtype, KP, 32);
    switch (qtype) {
      case KQ8_0: {
        const int64_t alone = ka_run32<KQ8_0>(a, B, k, packed, j0, j1, bias, y, stride);
        if (alone < j1) kw_run<KQ8_0>(a, B, k, packed, bb, alone, j1, bias, y, stride);
        return;
      }
      case KQ5_0: {
        const int64_t alone = ka_run32<KQ5_0>(a, B, k, packed, j0, j1, bias, y, stride);
        if (alone < j1) kw_run<KQ5_0>(a, B, k, packed, bb, alone, j1, bias, y, stride);
        return;
      }
      default: {
        const int64_t alone = ka_run32<KQ4_0>(a, B, k, packed, j0, j1, bias, y, stride);
        if (alone < j1) kw_run<KQ4_0>(a, B, k, packed, bb, alone, j1, bias, y, stride);
        return;
      }
    }
  }
  if (qtype == KQ4_K && B >= KW_MIN && B < KB_MAX && kp_row_vnni()) return kb_run_k4(a, B, k, packed, j0, j1, bias, y, stride);
#endif
  if (B >= KW_MIN) {
    const int64_t bb = kq_packed_bytes(qtype, KP, kq_format(qtype).values);  // bytes per (tile, block)
    switch (qtype) {
      case KQ8_0: return kw_run<KQ8_0>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      case KQ4_0: return kw_run<KQ4_0>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      case KQ4_1: return kw_run<KQ4_1>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      case KQ5_0: return kw_run<KQ5_0>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      case KQ5_1: return kw_run<KQ5_1>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      case KQ4_K: return kw_run<KQ4_K>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      case KQ5_K: return kw_run<KQ5_K>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      case KQ6_K: return kw_run<KQ6_K>(a, B, k, packed, bb, j0, j1, bias, y, stride);
      default: break;
    }
  }
  switch (qtype) {
    case KQ8_0: return kp_run32<KQ8_0>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ4_0: return kp_run32<KQ4_0>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ4_1: return kp_run32<KQ4_1>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ5_0: return kp_run32<KQ5_0>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ5_1: return kp_run32<KQ5_1>(a, B, k, packed, j0, j1, bias, y, stride);
    case KQ6_K: {
      const int64_t blocks = k / 256;
      return kp_walk(B, j0, j1, [&](int64_t t0) { return packed + t0 / KP * blocks * KP6_BLOCK; },
                     [&](const uint8_t* t, int64_t b, float (*out)[KP]) {
#if defined(TSERVE_AVX512)
                       if (kp_row_vnni()) return kp_row6_vnni(t, blocks, a, k, b, out[0]);
#endif
                       kp_rows6<1>(t, blocks, a, k, b, out);
                     },
                     bias, y, stride);
    }
    default: break;
  }
  const int64_t blocks = k / 256;
  if (qtype == KQ5_K)
    return kp_walk(B, j0, j1, [&](int64_t t0) { return packed + t0 / KP * blocks * KP5_BLOCK; },
                   [&](const uint8_t* t, int64_t b, float (*out)[KP]) {
#if defined(TSERVE_AVX512)
                     if (kp_row_vnni()) return kp_row_k4_vnni<true>(t, blocks, a, k, b, out[0]);
#endif
                     kp_rows<1, true>(t, blocks, a, k, b, out);
                   },
                   bias, y, stride);
  kp_walk(B, j0, j1, [&](int64_t t0) { return packed + t0 / KP * blocks * KP_BLOCK; },
          [&](const uint8_t* t, int64_t b, float (*out)[KP]) {
#if defined(TSERVE_AVX512)
            if (kp_row_vnni()) return kp_row_k4_vnni<false>(t, blocks, a, k, b, out[0]);
#endif
            kp_rows<1, false>(t, blocks, a, k, b, out);
          },
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
