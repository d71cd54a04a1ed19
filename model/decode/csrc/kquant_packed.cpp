// Q4_K repacked once, when a projection is built (kquant.h has the maths). The tiled loops
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
  const int8_t* r[R];
  const int16_t* sums[R];
  const float* scale[R];
  for (int x = 0; x < R; ++x) {
    r[x] = a.r.data() + (b0 + x) * k;
    sums[x] = a.sum16h.data() + (b0 + x) * (k / 16);
    scale[x] = a.scale.data() + (b0 + x) * blocks;
  }
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
      for (int t = 0; t < 8; ++t) {
        // the block two ahead (the next tile's first ones at a tile's end: tiles are contiguous),
        // a line per two vectors: the stream outruns the hardware prefetcher at one row
        if (t % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + 32 * (8 * c + t)), _MM_HINT_T0);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (8 * c + t)));
        const __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        for (int x = 0; x < R; ++x) {
          const int8_t* rv = r[x] + i * 256 + 64 * c + 4 * t;
          i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, kp_bcast(rv)), slo));
          i0[x] = _mm256_add_epi32(i0[x], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, kp_bcast(rv + 32)), shi));
        }
      }
    }
    for (int64_t line = 1024; line < KP_BLOCK; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + KP_PREFETCH + line), _MM_HINT_T0);
    for (int s = 0; s < 8; ++s) {  // i1 = sum_s m_s (sum r)_s: the two sums of 16 of sub-block s as a pair
      const __m256i m = kp_pairs(mn + 8 * s);
      for (int x = 0; x < R; ++x) i1[x] = _mm256_add_epi32(i1[x], _mm256_madd_epi16(m, kp_bcast(sums[x] + i * 16 + 2 * s)));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1152)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1168)));
    for (int x = 0; x < R; ++x) {
      const __m256 sa = _mm256_set1_ps(scale[x][i]);
      acc[x] = _mm256_fmadd_ps(_mm256_mul_ps(d, sa), _mm256_cvtepi32_ps(i0[x]), acc[x]);
      acc[x] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, sa), _mm256_cvtepi32_ps(i1[x]), acc[x]);
    }
  }
  for (int x = 0; x < R; ++x) _mm256_storeu_ps(out[x], acc[x]);
}

}  // namespace

bool kq_packed_type(int64_t qtype) { return qtype == KQ4_K; }

int64_t kq_packed_bytes(int64_t qtype, int64_t n, int64_t k) {
  if (!kq_packed_type(qtype) || k % 256 != 0) return 0;
  return (n + KP - 1) / KP * (k / 256) * KP_BLOCK;
}

void kq_pack(const uint8_t* w, int64_t qtype, int64_t n, int64_t k, uint8_t* out) {
  TORCH_CHECK(kq_packed_type(qtype) && k % 256 == 0, "only Q4_K rows of a multiple of 256 are packed");
  const int64_t blocks = k / 256, row = blocks * 144, tiles = (n + KP - 1) / KP;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < blocks; ++i) {
        uint8_t* blk = out + (t * blocks + i) * KP_BLOCK;
        for (int64_t j = 0; j < KP; ++j) {
          const uint8_t* src = w + std::min(t * KP + j, n - 1) * row + i * 144;  // the last row fills a short tile
          for (int64_t v = 0; v < 32; ++v) std::memcpy(blk + 32 * v + 4 * j, src + 16 + 4 * v, 4);
          int32_t sc[8], mn[8];
          scale_min_k4(src + 4, sc, mn);
          for (int s = 0; s < 8; ++s) {
            blk[1024 + 8 * s + j] = static_cast<uint8_t>(sc[s]);
            blk[1088 + 8 * s + j] = static_cast<uint8_t>(mn[s]);
          }
          std::memcpy(blk + 1152 + 2 * j, src, 2);
          std::memcpy(blk + 1168 + 2 * j, src + 2, 2);
        }
      }
  });
}

bool kq_packed_runs() {
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  return runs;
}

void kq_packed_rows(const KqActs& a, int64_t B, int64_t k, const uint8_t* packed, int64_t j0, int64_t j1,
                    const float* bias, float* y, int64_t stride) {
  const int64_t blocks = k / 256;
  for (int64_t t0 = j0 / KP * KP; t0 < j1; t0 += KP) {
    const uint8_t* tile = packed + t0 / KP * blocks * KP_BLOCK;
    float out[KP_ROWS][KP];
    auto emit = [&](int64_t b, int x) {
      for (int64_t j = std::max(t0, j0); j < std::min(t0 + KP, j1); ++j) {
        const float v = out[x][j - t0];
        y[b * stride + j] = bias == nullptr ? v : v + bias[j];
      }
    };
    int64_t b = 0;
    for (; b + KP_ROWS <= B; b += KP_ROWS) {
      kp_rows<KP_ROWS>(tile, blocks, a, k, b, out);
      for (int x = 0; x < KP_ROWS; ++x) emit(b + x, x);
    }
    for (; b < B; ++b) {
      kp_rows<1>(tile, blocks, a, k, b, out);
      emit(b, 0);
    }
  }
}

#else
bool kq_packed_type(int64_t) { return false; }
int64_t kq_packed_bytes(int64_t, int64_t, int64_t) { return 0; }
void kq_pack(const uint8_t*, int64_t, int64_t, int64_t, uint8_t*) { TORCH_CHECK(false, "no packed loops here"); }
bool kq_packed_runs() { return false; }
void kq_packed_rows(const KqActs&, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*, int64_t) {
  TORCH_CHECK(false, "no packed loops here");
}
#endif

}  // namespace tserve_native
