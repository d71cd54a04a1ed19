// Decode attention over the paged KV cache, row by row: one (row, K/V head) item at a time, plain
// loops or AVX-512 (attend_item), and a Llama layer's rows shared out as items (attend_rows).
#include "attention.h"

#include <utility>

namespace tserve_native {
namespace {

constexpr int64_t kBlockRows = 256;  // rows of one prompt block (a piece of a longer run)

// attend_item's plain loops, for any head size up to 512.
template <typename T>
void attend_one(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n, int64_t group,
                int64_t hs, float scale, float* scores, float* total, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    float scratch[512];  // head sizes up to 512 (checked at construction)
    const float* k = row_as_float(keys.row(t), scratch, hs);
    for (int64_t h = 0; h < group; ++h) scores[h * n + t] = dot(q + h * hs, k, hs) * scale;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * n;
    const float top = *std::max_element(row, row + n);
    total[h] = 0.0f;
    for (int64_t t = 0; t < n; ++t) total[h] += (row[t] = std::exp(row[t] - top));
  }
  std::fill(out, out + group * hs, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    float scratch[512];
    const float* v = row_as_float(values.row(t), scratch, hs);
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * n + t];
      float* a = out + h * hs;
      for (int64_t i = 0; i < hs; ++i) a[i] += p * v[i];
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < hs; ++i) out[h * hs + i] /= total[h];
}

#if defined(TSERVE_AVX512)
// The same with 16-float vectors, for head sizes that are a multiple of 16 (C = hs / 16
// vectors per row): each K/V row is loaded (and widened from bfloat16) once for the whole
// group, and the softmax's exponentials are vectorised too.
template <int C, typename T>
TSERVE_TARGET_AVX512 void attend_one_avx512(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n,
                                            int64_t group, float scale, float* scores, float* total, float* out) {
  constexpr int64_t hs = 16 * C;
  for (int64_t t = 0; t < n; ++t) {
    __m512 k[C];
    const T* key = keys.row(t);
    for (int c = 0; c < C; ++c) k[c] = load16(key + 16 * c);
    for (int64_t h = 0; h < group; ++h) {
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q + h * hs), k[0]);
      for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * hs + 16 * c), k[c], s);
      scores[h * n + t] = _mm512_reduce_add_ps(s) * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * n;
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(row + t));
    float top = _mm512_reduce_max_ps(top16);
    for (; t < n; ++t) top = std::max(top, row[t]);
    __m512 sum16 = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + t), _mm512_set1_ps(top)));
      _mm512_storeu_ps(row + t, e);
      sum16 = _mm512_add_ps(sum16, e);
    }
    if (t < n) {  // the tail, masked
      const __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1u);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), _mm512_set1_ps(top)));
      _mm512_mask_storeu_ps(row + t, m, e);
      sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(m, e));
    }
    total[h] = _mm512_reduce_add_ps(sum16);
  }
  for (int64_t h = 0; h < group; ++h) {
    __m512 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    const float* p = scores + h * n;
    for (int64_t t = 0; t < n; ++t) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const T* value = values.row(t);
      for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(w, load16(value + 16 * c), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / total[h]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + h * hs + 16 * c, _mm512_mul_ps(acc[c], inv));
  }
}
#endif

}  // namespace

template <typename T>
void attend_item(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n, int64_t group,
                 int64_t hs, float scale, float* scores, float* total, float* out) {
#if defined(TSERVE_AVX512)
  const bool avx512 = cpu().avx512;
  if (avx512 && hs == 64) return attend_one_avx512<4>(q, keys, values, n, group, scale, scores, total, out);
  if (avx512 && hs == 128) return attend_one_avx512<8>(q, keys, values, n, group, scale, scores, total, out);
  if (avx512 && hs == 256) return attend_one_avx512<16>(q, keys, values, n, group, scale, scores, total, out);  // Gemma 3
#endif
  attend_one(q, keys, values, n, group, hs, scale, scores, total, out);
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
  std::vector<std::pair<int64_t, int64_t>> blocks;  // [first row, end row) attended as blocks
  std::vector<int64_t> rows;  // the rest, row by row
  if (prompt && (window == 0 || window >= kBlockRows + 2) && prompt_attention.min_rows > 0) {
    int64_t r0 = 0;
    for (int64_t b = 1; b <= B; ++b) {
      const bool continues = b < B && positions[b] == positions[b - 1] + 1 &&
                             std::memcmp(table + b * width, table + (b - 1) * width, width * sizeof(int64_t)) == 0;
      if (continues) continue;
      if (b - r0 >= prompt_attention.min_rows)  // in pieces of at most kBlockRows rows, for the threads to share
        for (int64_t r = r0; r < b; r += kBlockRows) blocks.emplace_back(r, std::min(b, r + kBlockRows));
      else
        for (int64_t r = r0; r < b; ++r) rows.push_back(r);
      r0 = b;
    }
  } else {
    rows.resize(B);
    for (int64_t b = 0; b < B; ++b) rows[b] = b;
  }
  const int64_t block_units = static_cast<int64_t>(blocks.size()) * nkv;  // items before the row items
  auto items = [&](int64_t begin, int64_t end, int64_t stride) {
    thread_local std::vector<float> scores, acc, total;  // each thread's scratch, kept between calls
    acc.resize(group * hs);
    total.resize(group);
    for (int64_t item = begin; item < end; item += stride) {
      if (item < block_units) {  // a (block, K/V head) unit: the long ones, taken first
        const auto [r0, r1] = blocks[item / nkv];
        const int64_t g = item % nkv;
        const PagedRows<T> keys{k_base, table + r0 * width, shift, BL * hs, g * n_blocks * BL * hs, hs, 0};
        PagedRows<T> values = keys;
        values.base = v_base;
        attend_block(heads, qkv, keys, values, positions, r0, r1, g, window, out_proj, y, prompt_attention.bf16);
        continue;
      }
      const int64_t b = rows[(item - block_units) / nkv], g = (item - block_units) % nkv;
      const int64_t first = window > 0 ? std::max<int64_t>(0, positions[b] + 1 - window) : 0;
      const int64_t n = positions[b] + 1 - first;
      const PagedRows<T> keys{k_base, table + b * width, shift, BL * hs, g * n_blocks * BL * hs, hs, first};
      PagedRows<T> values = keys;
      values.base = v_base;
      scores.resize(group * n);
      attend_item(qkv + b * row_w + g * group * hs, keys, values, n, group, hs, scale, scores.data(),
                  total.data(), acc.data());
      for (int64_t h = 0; h < group; ++h) {
        const int64_t head = g * group + h;
        float* out = y + b * q_w + head * hs;
        for (int64_t i = 0; i < hs; ++i) out[i] = acc[h * hs + i] * out_proj.scale(head * hs + i);
      }
    }
  };
  const int64_t n_items = (static_cast<int64_t>(rows.size()) + static_cast<int64_t>(blocks.size())) * nkv;
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
