// Attention over the paged KV cache, one (row, K/V head) item at a time (attend_item), and a
// Llama layer's rows shared out as items (attend_rows).
//
// Every query row attends in one arithmetic, fixed by the row alone: each score is a 16-lane dot
// product (lane j sums elements j, j + 16, ... with fused multiply-adds, the lanes then added
// pairwise: j + 8, j + 4, j + 2, j + 1), the softmax's exponentials are exp_canonical and its sum
// is 16 lanes by key index added the same way, and the weighted sum of values runs key by key,
// one fused multiply-add per element. Nothing depends on how many rows a call holds, where a
// prompt was cut into chunks, whether its keys were cached before or written in this call, or
// which instruction set runs it: the AVX2 kernels and the plain loops compute the same bits
// (tested), so a decode step, a prompt chunk, a speculative draft and a replay after preemption
// give the same row the same result on any CPU. Rows of one sequence at consecutive positions
// are taken in runs of up to kRunRows, so each key tile is read from memory once for the run.
#include "attention.h"

#include <utility>

namespace tserve_native {
namespace {

constexpr int64_t kBlockRows = 256;  // rows of one prompt block (the opt-in block path, attend_block)
constexpr int64_t kRunRows = 8;  // rows of one sequence attended together (key tiles shared)
constexpr int64_t kKeyTile = 64;  // keys a run's queries walk before the next tile

// The pairwise sum of 16 lanes: j + 8, then j + 4, j + 2, j + 1 (the AVX2 kernels' order).
inline float tree16(float* l) {
  for (int j = 0; j < 8; ++j) l[j] = l[j] + l[j + 8];
  for (int j = 0; j < 4; ++j) l[j] = l[j] + l[j + 4];
  for (int j = 0; j < 2; ++j) l[j] = l[j] + l[j + 2];
  return l[0] + l[1];
}

// q . k in 16 lanes: lane j = q_j k_j, then fma(q_{j+16c}, k_{j+16c}, lane) for c = 1, 2, ...
inline float dot16(const float* q, const float* k, int64_t hs) {
  float l[16];
  for (int j = 0; j < 16; ++j) l[j] = j < hs ? q[j] * k[j] : 0.0f;
  for (int64_t c = 16; c < hs; c += 16)
    for (int j = 0; j < 16 && c + j < hs; ++j) l[j] = std::fma(q[c + j], k[c + j], l[j]);
  return tree16(l);
}

// e^x for x <= 0 (a score minus its row's maximum): x = k ln2 + r, e^r by its degree-6 Taylor
// polynomial (fused multiply-adds), times 2^k through the exponent bits (k >= -126: normal).
inline float exp_canonical(float x) {
  x = x > -87.0f ? x : -87.0f;  // NaN -> -87, as the vector max
  const float k = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-k, 0.693145751953125f, x);
  r = std::fma(-k, 1.42860682030941723e-6f, r);
  float p = 1.0f / 720.0f;
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

// One query's scores row in place -> its exponentials, and their sum (16 lanes by key index).
inline float softmax_plain(float* s, int64_t n) {
  float top = -INFINITY;
  for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
  float l[16] = {0};
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_canonical(s[t] - top);
    l[t % 16] = l[t % 16] + s[t];
  }
  return tree16(l);
}

#if defined(TSERVE_AVX512)
// The AVX2 forms of the same arithmetic (8 lanes a register; 16 lanes are two).

TSERVE_TARGET_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TSERVE_TARGET_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Four keys' 16-lane sums, each already folded once (s[i], lanes j + 8), through the next two
// levels of tree16: -> [a0 a1 c0 c1 | b0 b1 d0 d1], each the sum of lanes j, j + 2 (mod 4) ... of its key.
TSERVE_TARGET_AVX2 inline __m256 fold4(const __m256* s) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20),
                                  _mm256_permute2f128_ps(s[0], s[1], 0x31));  // j + 4: [a0..3 | b0..3]
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(s[2], s[3], 0x20), _mm256_permute2f128_ps(s[2], s[3], 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // j + 2
}

// Eight keys' 16-lane sums, each folded once (j + 8: s[i]), in key order into out[0..8) times
// scale: the rest of tree16 for each.
TSERVE_TARGET_AVX2 inline void scores8_store(const __m256* s, float scale, float* out) {
  const __m256 u = fold4(s), v = fold4(s + 4);  // [a a c c | b b d d], [e e g g | f f h h]
  const __m256 sum = _mm256_add_ps(_mm256_shuffle_ps(u, v, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(u, v, _MM_SHUFFLE(3, 1, 3, 1)));  // j + 1: [a c e g | b d f h]
  const __m256 ordered = _mm256_permutevar8x32_ps(sum, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_ps(out, _mm256_mul_ps(ordered, _mm256_set1_ps(scale)));
}

// Eight keys' scores (q . k) * scale into out[0..8), in key order: per key, lane j (of 16) sums
// q[c + j] k[c + j] over c in order (a product, then fused multiply-adds), lanes 0-7 and 8-15 in
// two registers, then tree16.
template <typename T>
TSERVE_TARGET_AVX2 inline void scores8_avx2(const float* q, const T* const* k, int64_t hs, float scale, float* out) {
  __m256 s[8];
  for (int g = 0; g < 8; g += 4) {  // four keys at a time: 8 accumulators
    __m256 lo[4], hi[4];
    const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
    for (int i = 0; i < 4; ++i) {
      lo[i] = _mm256_mul_ps(q0, load8(k[g + i]));
      hi[i] = _mm256_mul_ps(q1, load8(k[g + i] + 8));
    }
    for (int64_t c = 16; c < hs; c += 16) {
      const __m256 a = _mm256_loadu_ps(q + c), b = _mm256_loadu_ps(q + c + 8);
      for (int i = 0; i < 4; ++i) {
        lo[i] = _mm256_fmadd_ps(a, load8(k[g + i] + c), lo[i]);
        hi[i] = _mm256_fmadd_ps(b, load8(k[g + i] + c + 8), hi[i]);
      }
    }
    for (int i = 0; i < 4; ++i) s[g + i] = _mm256_add_ps(lo[i], hi[i]);  // j + 8
  }
  scores8_store(s, scale, out);
}

// The same sums with AVX-512F: a key's 16 lanes are one register (lanes 0-7 and 8-15 the two
// above), so half the instructions, the same operations per lane in the same order: the same bits.
template <typename T>
TSERVE_TARGET_AVX512_FMA inline void scores8_avx512(const float* q, const T* const* k, int64_t hs, float scale, float* out) {
  __m512 a[8];
  const __m512 q0 = _mm512_loadu_ps(q);
  for (int i = 0; i < 8; ++i) a[i] = _mm512_mul_ps(q0, load16(k[i]));
  for (int64_t c = 16; c < hs; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int i = 0; i < 8; ++i) a[i] = _mm512_fmadd_ps(qc, load16(k[i] + c), a[i]);
  }
  __m256 s[8];
  for (int i = 0; i < 8; ++i)  // j + 8
    s[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
  scores8_store(s, scale, out);
}

TSERVE_TARGET_AVX2 inline __m256 exp_canonical8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

TSERVE_TARGET_AVX2 inline float tree16_avx2(__m256 lo, __m256 hi) {
  const __m256 s = _mm256_add_ps(lo, hi);  // j + 8
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // j + 4
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));  // j + 2
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));  // j + 1
  return _mm_cvtss_f32(x);
}

TSERVE_TARGET_AVX2 float softmax_avx2(float* s, int64_t n) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + t));
  float tops[8];
  _mm256_storeu_ps(tops, top8);
  float top = -INFINITY;
  for (int j = 0; j < 8; ++j) top = std::max(top, tops[j]);
  for (; t < n; ++t) top = std::max(top, s[t]);
  const __m256 m = _mm256_set1_ps(top);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes t % 16 < 8, >= 8
  for (t = 0; t + 16 <= n; t += 16) {
    const __m256 a = exp_canonical8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    const __m256 b = exp_canonical8(_mm256_sub_ps(_mm256_loadu_ps(s + t + 8), m));
    _mm256_storeu_ps(s + t, a);
    _mm256_storeu_ps(s + t + 8, b);
    lo = _mm256_add_ps(lo, a);
    hi = _mm256_add_ps(hi, b);
  }
  float l[16];
  _mm256_storeu_ps(l, lo);
  _mm256_storeu_ps(l + 8, hi);
  for (int64_t j = 0; t < n; ++t, ++j) {  // the tail: one lane each, as the plain loop adds them
    s[t] = exp_canonical(s[t] - top);
    l[j] = l[j] + s[t];
  }
  return tree16_avx2(_mm256_loadu_ps(l), _mm256_loadu_ps(l + 8));
}

// acc (hs) += p_t v_t for keys [t0, t1): one fused multiply-add per element and key, in key order.
template <typename T>
TSERVE_TARGET_AVX2 void weigh_avx2(const float* p, const PagedRows<T>& values, int64_t t0, int64_t t1, int64_t hs,
                                   float* acc) {
  for (int64_t c = 0; c < hs; c += 64) {  // 8 registers of the accumulator at a time
    const int64_t w = std::min<int64_t>(64, hs - c) / 8;
    __m256 a[8];
    for (int64_t i = 0; i < w; ++i) a[i] = _mm256_loadu_ps(acc + c + 8 * i);
    for (int64_t t = t0; t < t1; ++t) {
      const __m256 e = _mm256_set1_ps(p[t]);
      const T* v = values.row(t) + c;
      for (int64_t i = 0; i < w; ++i) a[i] = _mm256_fmadd_ps(e, load8(v + 8 * i), a[i]);
    }
    for (int64_t i = 0; i < w; ++i) _mm256_storeu_ps(acc + c + 8 * i, a[i]);
  }
}

// The same with AVX-512F: 128 elements of the accumulator at a time (8 registers), so a head of
// 128 takes one pass over the keys, not two; each element's fused multiply-adds are the same.
template <typename T>
TSERVE_TARGET_AVX512_FMA void weigh_avx512(const float* p, const PagedRows<T>& values, int64_t t0, int64_t t1, int64_t hs,
                                           float* acc) {
  for (int64_t c = 0; c < hs; c += 128) {
    const int64_t w = std::min<int64_t>(128, hs - c) / 16;
    __m512 a[8];
    for (int64_t i = 0; i < w; ++i) a[i] = _mm512_loadu_ps(acc + c + 16 * i);
    for (int64_t t = t0; t < t1; ++t) {
      const __m512 e = _mm512_set1_ps(p[t]);
      const T* v = values.row(t) + c;
      for (int64_t i = 0; i < w; ++i) a[i] = _mm512_fmadd_ps(e, load16(v + 16 * i), a[i]);
    }
    for (int64_t i = 0; i < w; ++i) _mm512_storeu_ps(acc + c + 16 * i, a[i]);
  }
}
#endif

// One query vector of an item: keys [off, off + n) of the item's keys, the result (hs) to `out`.
struct Query {
  const float* q;
  int64_t off, n;
  float* out;
};

// The queries' attention over their keys, each in the arithmetic above: scores a key tile at a
// time for every query (the tile read once for all of them), the softmax per query, then the
// values a tile at a time. Scratch: `scores` (queries x stride, stride >= every n), `acc`
// (queries x hs).
template <typename T>
void attend_queries(const Query* qs, int64_t nq, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t hs,
                    float scale, float* scores, int64_t stride, float* acc, float* totals) {
  int64_t lo = qs[0].off, hi = qs[0].off + qs[0].n;
  for (int64_t i = 1; i < nq; ++i) {
    lo = std::min(lo, qs[i].off);
    hi = std::max(hi, qs[i].off + qs[i].n);
  }
#if defined(TSERVE_AVX512)
  const bool vec = cpu().avx2 && hs % 16 == 0, wide = vec && cpu().avx512;
#else
  const bool vec = false;
#endif
  float scratch[512];  // a bfloat16 row widened (head sizes up to 512, checked at construction)
  for (int64_t t0 = lo; t0 < hi; t0 += kKeyTile) {
    const int64_t t1 = std::min(t0 + kKeyTile, hi);
    for (int64_t i = 0; i < nq; ++i) {
      const Query& Q = qs[i];
      const int64_t a = std::max(t0, Q.off), b = std::min(t1, Q.off + Q.n);
      float* s = scores + i * stride - Q.off;
      int64_t t = a;
#if defined(TSERVE_AVX512)
      if (vec) {
        for (; t + 8 <= b; t += 8) {
          const T* k[8];
          for (int j = 0; j < 8; ++j) k[j] = keys.row(t + j);
          wide ? scores8_avx512(Q.q, k, hs, scale, s + t) : scores8_avx2(Q.q, k, hs, scale, s + t);
        }
        if (t < b) {  // the last few keys, padded with the last one (its extra scores dropped)
          const T* k[8];
          float tail[8];
          for (int j = 0; j < 8; ++j) k[j] = keys.row(std::min(t + j, b - 1));
          wide ? scores8_avx512(Q.q, k, hs, scale, tail) : scores8_avx2(Q.q, k, hs, scale, tail);
          std::copy(tail, tail + (b - t), s + t);
          t = b;
        }
      }
#endif
      for (; t < b; ++t) s[t] = dot16(Q.q, row_as_float(keys.row(t), scratch, hs), hs) * scale;
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
#if defined(TSERVE_AVX512)
    if (vec) {
      totals[i] = softmax_avx2(scores + i * stride, qs[i].n);
      continue;
    }
#endif
    totals[i] = softmax_plain(scores + i * stride, qs[i].n);
  }
  std::fill(acc, acc + nq * hs, 0.0f);
  for (int64_t t0 = lo; t0 < hi; t0 += kKeyTile) {
    const int64_t t1 = std::min(t0 + kKeyTile, hi);
    for (int64_t i = 0; i < nq; ++i) {
      const Query& Q = qs[i];
      const int64_t a = std::max(t0, Q.off), b = std::min(t1, Q.off + Q.n);
      if (a >= b) continue;
      const float* p = scores + i * stride - Q.off;
      float* out = acc + i * hs;
#if defined(TSERVE_AVX512)
      if (vec) {
        wide ? weigh_avx512(p, values, a, b, hs, out) : weigh_avx2(p, values, a, b, hs, out);
        continue;
      }
#endif
      for (int64_t t = a; t < b; ++t) {
        const float* v = row_as_float(values.row(t), scratch, hs);
        for (int64_t e = 0; e < hs; ++e) out[e] = std::fma(p[t], v[e], out[e]);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = 1.0f / totals[i];
    for (int64_t e = 0; e < hs; ++e) qs[i].out[e] = acc[i * hs + e] * inv;
  }
}

}  // namespace

template <typename T>
void attend_item(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n, int64_t group,
                 int64_t hs, float scale, float* scores, float* total, float* out) {
  Query qs[64];
  TORCH_CHECK(group <= 64, "at most 64 query heads share a K/V head");
  for (int64_t h = 0; h < group; ++h) qs[h] = Query{q + h * hs, 0, n, out + h * hs};
  thread_local std::vector<float> acc;
  acc.resize(group * hs);
  attend_queries(qs, group, keys, values, hs, scale, scores, n, acc.data(), total);
}

template <typename T>
void attend_rows(const Heads& heads, const float* qkv, const T* k_base, const T* v_base, const int64_t* table,
                 int64_t width, const std::vector<int64_t>& positions, int64_t n_blocks, int64_t BL,
                 const Projection& out_proj, int64_t window, int64_t B, float* y, bool prompt,
                 const PromptAttention& prompt_attention, Partner* partner) {
  const int64_t nh = heads.nh, nkv = heads.nkv, hs = heads.hs;
  const float scale = heads.scale;
  const int64_t group = nh / nkv, q_w = nh * hs, row_w = q_w + 2 * nkv * hs;
  const int64_t shift = shift_of(BL);
  // Runs of rows of one sequence at consecutive positions (a prompt chunk, a sequence with its
  // drafts): [first row, end row). Long ones go as blocks where the block path is asked for
  // (set_prompt_attention > 0, prompts only), else in pieces of kRunRows sharing key tiles.
  std::vector<std::pair<int64_t, int64_t>> blocks, runs;
  const bool block_path = prompt && (window == 0 || window >= kBlockRows + 2) && prompt_attention.min_rows > 0;
  int64_t r0 = 0;
  for (int64_t b = 1; b <= B; ++b) {
    const bool continues = b < B && positions[b] == positions[b - 1] + 1 &&
                           std::memcmp(table + b * width, table + (b - 1) * width, width * sizeof(int64_t)) == 0;
    if (continues) continue;
    if (block_path && b - r0 >= prompt_attention.min_rows)  // in pieces of at most kBlockRows rows
      for (int64_t r = r0; r < b; r += kBlockRows) blocks.emplace_back(r, std::min(b, r + kBlockRows));
    else
      for (int64_t r = r0; r < b; r += kRunRows) runs.emplace_back(r, std::min(b, r + kRunRows));
    r0 = b;
  }
  const int64_t block_units = static_cast<int64_t>(blocks.size()) * nkv;  // items before the run items
  auto items = [&](int64_t begin, int64_t end, int64_t stride) {
    thread_local std::vector<float> scores, acc, result, totals;  // each thread's scratch, kept between calls
    for (int64_t item = begin; item < end; item += stride) {
      if (item < block_units) {  // a (block, K/V head) unit: the long ones, taken first
        const auto [b0, b1] = blocks[item / nkv];
        const int64_t g = item % nkv;
        const PagedRows<T> keys{k_base, table + b0 * width, shift, BL * hs, g * n_blocks * BL * hs, hs, 0};
        PagedRows<T> values = keys;
        values.base = v_base;
        attend_block(heads, qkv, keys, values, positions, b0, b1, g, window, out_proj, y, prompt_attention.bf16);
        continue;
      }
      const auto [b0, b1] = runs[(item - block_units) / nkv];
      const int64_t g = (item - block_units) % nkv;
      const int64_t rows = b1 - b0, nq = rows * group;
      auto first_of = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, positions[b] + 1 - window) : 0; };
      const int64_t lo = first_of(b0);  // the run's positions rise, so its first row's first key is the least
      int64_t stride = 0;
      Query qs[kRunRows * 64];
      TORCH_CHECK(group <= 64, "at most 64 query heads share a K/V head");
      result.resize(nq * hs);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t b = b0 + r, first = first_of(b), n = positions[b] + 1 - first;
        stride = std::max(stride, n);
        for (int64_t h = 0; h < group; ++h)
          qs[r * group + h] = Query{qkv + b * row_w + (g * group + h) * hs, first - lo, n, result.data() + (r * group + h) * hs};
      }
      const PagedRows<T> keys{k_base, table + b0 * width, shift, BL * hs, g * n_blocks * BL * hs, hs, lo};
      PagedRows<T> values = keys;
      values.base = v_base;
      scores.resize(nq * stride);
      acc.resize(nq * hs);
      totals.resize(nq);
      attend_queries(qs, nq, keys, values, hs, scale, scores.data(), stride, acc.data(), totals.data());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < group; ++h) {
          const int64_t head = g * group + h;
          const float* res = result.data() + (r * group + h) * hs;
          float* out = y + (b0 + r) * q_w + head * hs;
          for (int64_t i = 0; i < hs; ++i) out[i] = res[i] * out_proj.scale(head * hs + i);
        }
    }
  };
  const int64_t n_items = (static_cast<int64_t>(runs.size()) + static_cast<int64_t>(blocks.size())) * nkv;
  if (partner && n_items > 1 && at::get_num_threads() == 1) {
    // one item a chunk: whichever thread is free takes the next (a prompt's rows grow in cost
    // with their position)
    const int64_t per = (n_items + 4095) / 4096;  // items a chunk: at most 4,096 chunks
    partner->run((n_items + per - 1) / per,
                 [&](int64_t c) { items(c * per, std::min(n_items, (c + 1) * per), 1); });
  } else {
    at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) { items(begin, end, 1); });
  }
}
template void attend_item<float>(const float*, const PagedRows<float>&, const PagedRows<float>&, int64_t, int64_t,
                                 int64_t, float, float*, float*, float*);
template void attend_item<uint16_t>(const float*, const PagedRows<uint16_t>&, const PagedRows<uint16_t>&, int64_t,
                                    int64_t, int64_t, float, float*, float*, float*);
template void attend_rows<float>(const Heads&, const float*, const float*, const float*, const int64_t*, int64_t,
                                 const std::vector<int64_t>&, int64_t, int64_t, const Projection&, int64_t, int64_t,
                                 float*, bool, const PromptAttention&, Partner*);
template void attend_rows<uint16_t>(const Heads&, const float*, const uint16_t*, const uint16_t*, const int64_t*,
                                    int64_t, const std::vector<int64_t>&, int64_t, int64_t, const Projection&, int64_t,
                                    int64_t, float*, bool, const PromptAttention&, Partner*);

}  // namespace tserve_native
