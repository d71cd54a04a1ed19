// The free operators (ops.h): argument checks, then the kernels of q4.cpp and attention.cpp.
#include "ops.h"

#include <type_traits>

#include "attention.h"
#include "q4.h"

namespace tserve_native {
namespace {

// q (B, nh, hs) as the decode-attention ops read it: each row's heads contiguous, the rows
// wherever they lie (a fused qkv's q is a column slice of its output), else a contiguous copy.
Tensor rows_in_place(const Tensor& q) { return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous(); }

// The K/V pair a decode-attention op reads (a layer's pool, or its cross-attention memory):
// contiguous CPU tensors of one shape and dtype, float32 or bfloat16, (·, ·, ·, hs) with q's hs.
void check_kv_pair(const Tensor& q, const Tensor& k, const Tensor& v, const char* layout) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(), "q must be (B, nh, hs) float32");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.is_contiguous() &&
                  v.is_contiguous() && k.device().is_cpu(),
              "the K/V pair must be contiguous ", layout, " CPU tensors of one shape and dtype");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16, "the K/V pair must be float32 or bfloat16");
  TORCH_CHECK(k.size(3) == q.size(2) && q.size(2) <= 512, "the K/V head size must be q's (at most 512)");
}

}  // namespace

Tensor q4_linear(Tensor x, Tensor runs, int64_t n, int64_t k, c10::optional<Tensor> bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be (B, k) float32");
  c10::optional<Tensor> b;
  if (bias) b = bias->to(at::kFloat);
  return q4_projection(runs.contiguous(), n, k, b).q4_rows(x.contiguous(), portable);
}

// One new token per row attending over its cached positions where they lie in the block pool:
// the Python step's decode attention on the CPU (an encoder-decoder's self-attention, a model the
// native step does not run). It replaces a gather of every row's history into a padded copy
// (twice: K and V, on every layer of every step) and SDPA over that copy with a length mask.
// q (B, nh, hs) float32; k_pool, v_pool one layer's pool (nkv, blocks, BL, hs), float32 or
// bfloat16; tables (B, n) long; lengths (B,) long: row b attends to its positions
// [max(0, lengths[b] - window), lengths[b]) (window 0: all of them). -> (B, nh, hs) float32.
// The attention of each (row, K/V head) is the native step's (attend_item), so a row's result
// does not depend on the rows beside it.
Tensor paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, double scale,
                              int64_t window) {
  check_kv_pair(q, k_pool, v_pool, "(nkv, blocks, block_len, hs)");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2);
  const int64_t nkv = k_pool.size(0), n_blocks = k_pool.size(1), BL = k_pool.size(2);
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "query heads must be a multiple of the pool's K/V heads");
  TORCH_CHECK(BL > 0 && (BL & (BL - 1)) == 0, "the block length must be a power of two, got ", BL);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong && tables.device().is_cpu(),
              "tables must be a (B, n) long CPU tensor");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == at::kLong && lengths.device().is_cpu(),
              "lengths must be a (B,) long CPU tensor");
  Tensor qc = rows_in_place(q), table_rows = tables.contiguous(), ends = lengths.contiguous();
  const int64_t q_row = qc.stride(0);
  const int64_t width = table_rows.size(1), group = nh / nkv;
  const int64_t* table = table_rows.data_ptr<int64_t>();
  const int64_t* end = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(end[b] >= 1 && end[b] <= width * BL, "row ", b, " attends to ", end[b], " positions; its table holds ",
                width * BL);
    for (int64_t i = 0; i < (end[b] + BL - 1) / BL; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < n_blocks, "block ", table[b * width + i],
                  " out of range [0, ", n_blocks, ")");
  }
  const int64_t shift = shift_of(BL);
  Tensor out = at::empty({B, nh, hs}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  with_kv_bits(k_pool, v_pool, [&](const auto* k_base, const auto* v_base) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(k_base)>>;
    at::parallel_for(0, B * nkv, 1, [&](int64_t begin, int64_t stop) {
      std::vector<float> scores, total(group);
      for (int64_t item = begin; item < stop; ++item) {
        const int64_t b = item / nkv, g = item % nkv;
        const int64_t first = window > 0 ? std::max<int64_t>(0, end[b] - window) : 0, n = end[b] - first;
        const PagedRows<T> keys{k_base, table + b * width, shift, BL * hs, g * n_blocks * BL * hs, hs, first};
        PagedRows<T> values = keys;
        values.base = v_base;
        scores.resize(group * n);
        attend_item(qp + b * q_row + g * group * hs, keys, values, n, group, hs, static_cast<float>(scale),
                    scores.data(), total.data(), op + (b * nh + g * group) * hs);
      }
    });
  });
  return out;
}

// One new token per row attending over its source's encoder memory (an encoder-decoder's
// cross-attention): q (B, nh, hs) float32; k_mem, v_mem one layer's memory (slots, nh, S, hs),
// float32 or bfloat16, contiguous; slots (B,) long: the memory row each row reads; lengths (B,)
// long: its source's tokens (the rest of S is padding, never read). -> (B, nh, hs) float32. The
// same per-row attention as paged_decode_attention (a source is one block of S rows).
Tensor cross_decode_attention(Tensor q, Tensor k_mem, Tensor v_mem, Tensor slots, Tensor lengths, double scale) {
  check_kv_pair(q, k_mem, v_mem, "(slots, nh, S, hs)");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2), n_slots = k_mem.size(0), S = k_mem.size(2);
  TORCH_CHECK(k_mem.size(1) == nh, "the memory's heads must be q's");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong && lengths.dim() == 1 &&
                  lengths.size(0) == B && lengths.scalar_type() == at::kLong && slots.device().is_cpu() &&
                  lengths.device().is_cpu(),
              "slots and lengths must be (B,) long CPU tensors");
  Tensor qc = rows_in_place(q), rows = slots.contiguous(), ends = lengths.contiguous();
  const int64_t q_row = qc.stride(0);
  const int64_t* slot = rows.data_ptr<int64_t>();
  const int64_t* end = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < n_slots, "slot ", slot[b], " out of range [0, ", n_slots, ")");
    TORCH_CHECK(end[b] >= 1 && end[b] <= S, "row ", b, " has ", end[b], " source tokens; the memory holds ", S);
  }
  Tensor out = at::empty({B, nh, hs}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  with_kv_bits(k_mem, v_mem, [&](const auto* k_base, const auto* v_base) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(k_base)>>;
    at::parallel_for(0, B * nh, 1, [&](int64_t begin, int64_t stop) {
      std::vector<float> scores;
      float total = 0.0f;
      for (int64_t item = begin; item < stop; ++item) {
        const int64_t b = item / nh, h = item % nh;
        // one block holding all S rows: the shift keeps every position in block 0 (the row's slot)
        const PagedRows<T> keys{k_base, slot + b, 62, nh * S * hs, h * S * hs, hs, 0};
        PagedRows<T> values = keys;
        values.base = v_base;
        scores.resize(end[b]);
        attend_item(qp + b * q_row + h * hs, keys, values, end[b], 1, hs, static_cast<float>(scale), scores.data(), &total,
                    op + item * hs);
      }
    });
  });
  return out;
}

std::vector<std::string> vector_units() {
  const CpuFeatures& f = cpu();
  std::vector<std::string> units;
  if (f.avx2) units.emplace_back("avx2");
  if (f.avx512) units.emplace_back("avx512");
  if (f.avx512_vnni) units.emplace_back("avx512_vnni");
  if (f.avx512_bf16) units.emplace_back("avx512_bf16");
  if (f.amx_int8) units.emplace_back("amx_int8");
  return units;
}

}  // namespace tserve_native
