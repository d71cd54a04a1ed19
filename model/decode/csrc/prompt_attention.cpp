// A prompt's rows attending as a block (attend_block, attention.h): over a bfloat16 cache with
// the CPU's AVX512-BF16 dot products where it has them, else torch's CPU flash attention over
// the keys gathered once as float32.
#include "attention.h"

#include <tuple>
#include <type_traits>

namespace tserve_native {
namespace {

#if defined(TSERVE_AVX512)
// Prompt rows attending as a block over a bfloat16 cache with the CPU's bfloat16 dot products
// (AVX512-BF16's vdpbf16ps: 32 products a vector into 16 float32 sums, twice float32 FMA's rate),
// flash style: keys in tiles of 64, an online softmax per query row, nothing the size of
// rows x keys in memory. What is rounded to bfloat16: q (times the softmax scale) and each
// tile's probabilities before they weight V; K and V already are. Scores, the softmax and the
// sums stay float32. So it is close to, not bit for bit, the float32 path (torch's flash
// attention over the keys widened to float32), which it replaces where the CPU has the
// instructions.
//
// The unit: `n` rows of one sequence at positions p0 .. p0 + n - 1 (row i: its `group` query
// heads at q(i, h) = qkv + i * row_w + h * HS), one K/V head (keys/values, PagedRows with
// first = 0: row(p) is position p). Row i sees key positions [lo_i, p0 + i], lo_i = 0 or, with a
// window, p0 + i - window + 1. Out: y + i * y_w + h * HS, times out_scale (HS per head) where
// given. Scratch is the calling thread's own.
template <int HS>
TSERVE_TARGET_BF16 void attend_block_bf16(const float* qkv, int64_t row_w, int64_t group, const PagedRows<uint16_t>& keys,
                                          const PagedRows<uint16_t>& values, int64_t p0, int64_t n, int64_t window,
                                          float scale, float* y, int64_t y_w, const float* out_scale) {
  constexpr int64_t PAIRS = HS / 2, TILE = 64, TV = TILE / 16, RB = 4, OV = HS / 16;  // TV, OV: float vectors per tile, per output row
  static_assert(HS % 64 == 0, "head sizes of 64, 128, 256");
  const int64_t lo_all = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0, end = p0 + n;
  const int64_t tiles = (end - lo_all + TILE - 1) / TILE;
  // K as VNNI pairs: tile t, pair d2 -> TILE keys' (k[2 d2], k[2 d2 + 1]) words; V as key pairs:
  // tile t, pair j -> HS words (v_{2j}[d], v_{2j+1}[d]). Keys past the end are zero.
  thread_local std::vector<uint32_t> kp, vp, qb;
  kp.assign(tiles * PAIRS * TILE, 0u);
  vp.assign(tiles * (TILE / 2) * HS, 0u);
  for (int64_t p = lo_all; p < end; ++p) {
    const int64_t t = (p - lo_all) / TILE, c = (p - lo_all) % TILE;
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(keys.row(p));
    uint32_t* kd = kp.data() + t * PAIRS * TILE + c;
    for (int64_t d2 = 0; d2 < PAIRS; ++d2) kd[d2 * TILE] = kr[d2];
    const uint16_t* vr = values.row(p);
    uint16_t* vd = reinterpret_cast<uint16_t*>(vp.data() + (t * (TILE / 2) + c / 2) * HS) + (c & 1);
    for (int64_t d = 0; d < HS; ++d) vd[2 * d] = vr[d];
  }
  // q rows (i, h) in order r = i * group + h, times the scale, as bfloat16 pairs
  const int64_t R = n * group;
  qb.resize(R * PAIRS);
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qkv + (r / group) * row_w + (r % group) * HS;
    for (int64_t c = 0; c < HS; c += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + c), _mm512_set1_ps(scale));
      const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q + c + 16), _mm512_set1_ps(scale));
      _mm512_storeu_si512(qb.data() + r * PAIRS + c / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Each row's running max, denominator (16 partial sums, added up at the end) and output: kept
  // across chunks of keys, so every row block walks one chunk (K and V of 512 keys, 128 kB at
  // head size 64) while it is in this core's cache, not the whole span (768 kB at 3,000 keys).
  thread_local std::vector<float> st_m, st_l, st_o;
  st_m.assign(R, -std::numeric_limits<float>::infinity());
  st_l.assign(R * 16, 0.0f);
  st_o.assign(R * HS, 0.0f);
  constexpr int64_t CHUNK_TILES = 512 / TILE;
  for (int64_t t_begin = 0; t_begin < tiles; t_begin += CHUNK_TILES) {
    const int64_t t_end = std::min(tiles, t_begin + CHUNK_TILES);
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const int64_t rb = std::min<int64_t>(RB, R - r0);
      int64_t lo[RB], hi[RB];
      float* m = st_m.data() + r0;
      float(*l)[16] = reinterpret_cast<float(*)[16]>(st_l.data() + r0 * 16);
      float(*o)[HS] = reinterpret_cast<float(*)[HS]>(st_o.data() + r0 * HS);
      alignas(64) uint32_t pp[RB][TILE / 2];
      int64_t first_key = end, last_key = 0;
      const uint32_t* qrow[RB];  // a short last block repeats its last row
      for (int64_t r = 0; r < RB; ++r) {
        qrow[r] = qb.data() + (r0 + std::min(r, rb - 1)) * PAIRS;
        const int64_t i = (r0 + std::min(r, rb - 1)) / group;
        hi[r] = p0 + i;
        lo[r] = window > 0 ? std::max<int64_t>(0, p0 + i - window + 1) : 0;
        first_key = std::min(first_key, lo[r]);
        last_key = std::max(last_key, hi[r]);
      }
      const int64_t t0 = std::max(t_begin, (first_key - lo_all) / TILE);
      const int64_t t1 = std::min(t_end - 1, (last_key - lo_all) / TILE);
      for (int64_t t = t0; t <= t1; ++t) {
        const int64_t key0 = lo_all + t * TILE;
        const uint32_t* kt = kp.data() + t * PAIRS * TILE;
        __m512 s[RB][TV];  // unrolled: the sixteen sums stay in registers
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
          for (int v = 0; v < TV; ++v) s[r][v] = _mm512_setzero_ps();
        for (int64_t d2 = 0; d2 < PAIRS; ++d2) {
          __m512bh k[TV];
#pragma GCC unroll 4
          for (int v = 0; v < TV; ++v) k[v] = (__m512bh)_mm512_loadu_si512(kt + d2 * TILE + 16 * v);
#pragma GCC unroll 4
          for (int r = 0; r < RB; ++r) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[r][d2]));
#pragma GCC unroll 4
            for (int v = 0; v < TV; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], qv, k[v]);
          }
        }
        alignas(64) float sc[RB][TILE];  // the softmax below indexes rows at run time: from memory
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
          for (int v = 0; v < TV; ++v) _mm512_store_ps(sc[r] + 16 * v, s[r][v]);
        for (int64_t r = 0; r < rb; ++r) {
          // keys of this tile the row sees: lo <= key0 + c <= hi
          const __m512i vlo = _mm512_set1_epi32(static_cast<int>(lo[r])), vhi = _mm512_set1_epi32(static_cast<int>(hi[r]));
          __mmask16 in[TV];
          __mmask16 any = 0;
          for (int v = 0; v < TV; ++v) {
            const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(key0 + 16 * v)), iota);
            in[v] = _mm512_cmpge_epi32_mask(pos, vlo) & _mm512_cmple_epi32_mask(pos, vhi);
            any |= in[v];
          }
          if (any == 0) {
            std::fill(pp[r], pp[r] + TILE / 2, 0u);
            continue;
          }
          __m512 a[TV];
          __m512 top_v = neg_inf;
          for (int v = 0; v < TV; ++v) {
            a[v] = _mm512_mask_mov_ps(neg_inf, in[v], _mm512_load_ps(sc[r] + 16 * v));
            top_v = _mm512_max_ps(top_v, a[v]);
          }
          const float m_new = std::max(m[r], _mm512_reduce_max_ps(top_v));
          const float alpha = m_new == m[r] ? 1.0f : std::exp(m[r] - m_new);  // 0 on the row's first tile (m = -inf)
          const __m512 shift = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          for (int v = 0; v < TV; ++v) {
            a[v] = _mm512_maskz_mov_ps(in[v], exp_nonpositive(_mm512_sub_ps(a[v], shift)));
            sum = _mm512_add_ps(sum, a[v]);
          }
          _mm512_storeu_ps(l[r], _mm512_fmadd_ps(_mm512_loadu_ps(l[r]), _mm512_set1_ps(alpha), sum));
          m[r] = m_new;
          if (alpha != 1.0f)
            for (int64_t c = 0; c < OV; ++c)
              _mm512_storeu_ps(o[r] + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o[r] + 16 * c), _mm512_set1_ps(alpha)));
          for (int v = 0; v < TV; v += 2)  // 32 probabilities as 16 bfloat16 pairs: keys 16 v .. 16 v + 31
            _mm512_store_si512(pp[r] + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(a[v + 1], a[v]));
        }
        const uint32_t* vt = vp.data() + t * (TILE / 2) * HS;
        for (int64_t r = 0; r < rb; r += 2) {  // two rows at a time share each V load
          const bool two = r + 1 < rb;
          for (int64_t cg = 0; cg < HS; cg += 64) {  // 64 outputs at a time: 8 sums in registers
            __m512 acc0[4], acc1[4];
            for (int64_t c = 0; c < 4; ++c) {
              acc0[c] = _mm512_loadu_ps(o[r] + cg + 16 * c);
              acc1[c] = two ? _mm512_loadu_ps(o[r + 1] + cg + 16 * c) : _mm512_setzero_ps();
            }
            for (int64_t j = 0; j < TILE / 2; ++j) {
              const __m512bh p0v = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][j]));
              const __m512bh p1v = (__m512bh)_mm512_set1_epi32(static_cast<int>(two ? pp[r + 1][j] : 0u));
              for (int64_t c = 0; c < 4; ++c) {
                const __m512bh v = (__m512bh)_mm512_loadu_si512(vt + j * HS + cg + 16 * c);
                acc0[c] = _mm512_dpbf16_ps(acc0[c], p0v, v);
                acc1[c] = _mm512_dpbf16_ps(acc1[c], p1v, v);
              }
            }
            for (int64_t c = 0; c < 4; ++c) {
              _mm512_storeu_ps(o[r] + cg + 16 * c, acc0[c]);
              if (two) _mm512_storeu_ps(o[r + 1] + cg + 16 * c, acc1[c]);
            }
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / group, h = r % group;
    float* dst = y + i * y_w + h * HS;
    const float* o = st_o.data() + r * HS;
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(st_l.data() + r * 16));
    for (int64_t d = 0; d < HS; ++d) dst[d] = o[d] * inv * (out_scale ? out_scale[h * HS + d] : 1.0f);
  }
}
#endif

}  // namespace

template <typename T>
void attend_block(const Heads& heads, const float* qkv, const PagedRows<T>& keys, const PagedRows<T>& values,
                  const std::vector<int64_t>& positions, int64_t r0, int64_t r1, int64_t g, int64_t window,
                  const Projection& out_proj, float* y, bool bf16) {
  const int64_t nh = heads.nh, nkv = heads.nkv, hs = heads.hs;
  const float scale = heads.scale;
  const int64_t group = nh / nkv, q_w = nh * hs, row_w = q_w + 2 * nkv * hs;
  const int64_t n = r1 - r0, before = positions[r0], total = before + n;
#if defined(TSERVE_AVX512)
  if constexpr (std::is_same_v<T, uint16_t>) {  // a bfloat16 cache: its own dot products where the CPU has them
    if (bf16 && cpu().avx512_bf16 && (hs == 64 || hs == 128 || hs == 256)) {
      const int64_t at = g * group * hs;
      const float* os = out_proj.inv_scale.empty() ? nullptr : out_proj.inv_scale.data() + at;
      const float* q = qkv + r0 * row_w + at;
      float* out = y + r0 * q_w + at;
      if (hs == 64)
        attend_block_bf16<64>(q, row_w, group, keys, values, before, n, window, scale, out, q_w, os);
      else if (hs == 128)
        attend_block_bf16<128>(q, row_w, group, keys, values, before, n, window, scale, out, q_w, os);
      else
        attend_block_bf16<256>(q, row_w, group, keys, values, before, n, window, scale, out, q_w, os);
      return;
    }
  }
#endif
  const int64_t first = window > 0 ? std::max<int64_t>(0, before - window + 1) : 0;  // earliest key seen
  const int64_t span = total - first, earlier_keys = before - first;
  auto opts = at::TensorOptions().dtype(at::kFloat);
  Tensor q = at::empty({1, group, n, hs}, opts), k = at::empty({1, 1, span, hs}, opts),
         v = at::empty({1, 1, span, hs}, opts);
  float* qp = q.data_ptr<float>();
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(qkv + (r0 + i) * row_w + (g * group + h) * hs, hs, qp + (h * n + i) * hs);
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < span; ++t) {
    const T* kr = keys.row(first + t);
    const T* vr = values.row(first + t);
    for (int64_t i = 0; i < hs; ++i) {
      kp[t * hs + i] = to_float(kr[i]);
      vp[t * hs + i] = to_float(vr[i]);
    }
  }
  auto flash = [&](const Tensor& kk, const Tensor& vv, bool causal, const c10::optional<Tensor>& mask) {
    const int64_t m = kk.size(2);
    return at::_scaled_dot_product_flash_attention_for_cpu(q, kk.expand({1, group, m, hs}),
                                                           vv.expand({1, group, m, hs}), 0.0, causal, mask,
                                                           static_cast<double>(scale));
  };
  std::tuple<Tensor, Tensor> own =
      flash(k.narrow(2, earlier_keys, n), v.narrow(2, earlier_keys, n), true, c10::nullopt);
  Tensor out = std::get<0>(own).contiguous(), lse = std::get<1>(own);
  if (earlier_keys > 0) {  // merge with the rows' attention over the keys before the block
    c10::optional<Tensor> mask = c10::nullopt;
    if (window > 0) {
      // additive: -inf where key position first + j <= p0 + i - window (out of row i's window)
      Tensor m = at::zeros({n, earlier_keys}, opts);
      float* mp = m.data_ptr<float>();
      const float neg = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < earlier_keys && first + j <= before + i - window; ++j) mp[i * earlier_keys + j] = neg;
      mask = m;
    }
    std::tuple<Tensor, Tensor> earlier = flash(k.narrow(2, 0, earlier_keys), v.narrow(2, 0, earlier_keys), false, mask);
    Tensor out0 = std::get<0>(earlier), lse0 = std::get<1>(earlier);
    Tensor top = at::maximum(lse, lse0);
    Tensor a = (lse - top).exp(), b = (lse0 - top).exp();
    out = (out * a.unsqueeze(-1) + out0.contiguous() * b.unsqueeze(-1)) / (a + b).unsqueeze(-1);
    out = out.contiguous();
  }
  const float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < group; ++h) {
    const int64_t head = g * group + h;
    for (int64_t i = 0; i < n; ++i) {
      float* dst = y + (r0 + i) * q_w + head * hs;
      const float* src = op + (h * n + i) * hs;
      for (int64_t j = 0; j < hs; ++j) dst[j] = src[j] * out_proj.scale(head * hs + j);
    }
  }
}

template void attend_block<float>(const Heads&, const float*, const PagedRows<float>&, const PagedRows<float>&,
                                  const std::vector<int64_t>&, int64_t, int64_t, int64_t, int64_t, const Projection&,
                                  float*, bool);
template void attend_block<uint16_t>(const Heads&, const float*, const PagedRows<uint16_t>&,
                                     const PagedRows<uint16_t>&, const std::vector<int64_t>&, int64_t, int64_t, int64_t,
                                     int64_t, const Projection&, float*, bool);

}  // namespace tserve_native
