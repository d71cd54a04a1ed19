// Attention over the paged KV cache: each row's positions read in place from the blocks its
// table names (attention.cpp), and a prompt's rows attending as a block (prompt_attention.cpp).
#pragma once

#include "projection.h"

namespace tserve_native {

// The cached rows of one (sequence, K/V head): position first + t lies in the block its table
// names, at its offset there; rows within a block are contiguous.
template <typename T>
struct PagedRows {
  const T* base;  // this layer's pool, K or V
  const int64_t* table;  // the sequence's block table
  int64_t shift, block_stride, head_offset, hs, first;  // block_len = 1 << shift (a shift, not a division, per key)
  const T* row(int64_t t) const {
    const int64_t p = first + t;
    return base + table[p >> shift] * block_stride + head_offset + (p & ((int64_t{1} << shift) - 1)) * hs;
  }
};

// log2 of a block length (a power of two): PagedRows' shift.
inline int64_t shift_of(int64_t block_len) {
  int64_t shift = 0;
  while ((int64_t{1} << shift) < block_len) ++shift;
  return shift;
}

// fn(k, v) with a K/V pair's base pointers: float32, or bfloat16 as its bits (uint16_t).
template <typename F>
void with_kv_bits(const Tensor& k, const Tensor& v, const F& fn) {
  if (k.scalar_type() == at::kBFloat16)
    fn(reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>()), reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()));
  else
    fn(k.data_ptr<float>(), v.data_ptr<float>());
}

// A layer's heads: nh query heads in groups of nh / nkv sharing each of nkv K/V heads, hs values
// a head, and the softmax scale.
struct Heads {
  int64_t nh, nkv, hs;
  float scale;
};

// How a prompt's rows attend (LlamaDecoder::set_prompt_attention, set_prompt_bf16).
struct PromptAttention {
  int64_t min_rows = 0;  // a run of this many rows of one sequence attends as a block; 0: row by row
  bool bf16 = true;  // blocks over a bfloat16 cache through the AVX512-BF16 kernel where the CPU has it
};

// Attention of one (row, K/V head) item: `group` query heads q (group, hs) over n cached
// positions -> out (group, hs) = softmax(q k^T * scale) v. Scratch from the caller (no
// allocation per item): `scores` group * n floats, `total` group floats. AVX-512 at head sizes
// 64, 128 and 256 where the CPU has it, else the plain loops. (T: float, or uint16_t bfloat16 bits.)
template <typename T>
void attend_item(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n, int64_t group,
                 int64_t hs, float scale, float* scores, float* total, float* out);

// y (B, nh * hs) = softmax(q k^T * scale) v for each row over its own positions
// 0..position (with a window: the last `window` of them), one work item per (row, key/value
// head): the group's query heads share each K/V row they read. Scaled on the way out for the
// output projection's smoothing.
//
// `prompt`: rows of prompts. There a run of at least `prompt_attention.min_rows` rows of one
// sequence at consecutive positions is attended as a block (attend_block: torch's flash
// attention over the sequence's keys gathered once), since walking each row's positions one by
// one costs a prompt of n rows at position p about n p scalar dot products with their
// reductions. Only float rounding differs between the two. On a layer with a window, blocks
// need a window wider than a block and one more key (every row of a block then sees its whole
// block and at least one earlier key); narrower windows keep the row walk.
//
// qkv (B, row_w): each row's q, k, v (after RoPE); the layer's K/V pool at k_base / v_base;
// table (B, width): each row's blocks; y (B, nh * hs). With a partner (torch on one thread) the
// items are shared with it.
template <typename T>
void attend_rows(const Heads& heads, const float* qkv, const T* k_base, const T* v_base, const int64_t* table,
                 int64_t width, const std::vector<int64_t>& positions, int64_t n_blocks, int64_t BL,
                 const Projection& out_proj, int64_t window, int64_t B, float* y, bool prompt,
                 const PromptAttention& prompt_attention, Partner* partner);

// Rows [r0, r1) of one sequence (positions p0 .. p0 + n - 1, its keys 0 .. p0 + n - 1 in the
// cache), K/V head g: its keys and values gathered as float32 once, then torch's CPU flash
// attention in two parts merged by their log-sum-exp: the rows over the keys before the block
// and over the block's own keys (causal, a square). Scaled on the way out as attend_rows. With a
// window (wider than the block: attend_rows' condition) only the keys some row still sees are
// gathered, from p0 - window + 1, and the earlier part is masked where a key has left a row's
// window (row i sees key position j when j > p0 + i - window).
// `bf16`: over a bfloat16 cache, the AVX512-BF16 kernel where the CPU has it (prompt_attention.cpp).
template <typename T>
void attend_block(const Heads& heads, const float* qkv, const PagedRows<T>& keys, const PagedRows<T>& values,
                  const std::vector<int64_t>& positions, int64_t r0, int64_t r1, int64_t g, int64_t window,
                  const Projection& out_proj, float* y, bool bf16);

}  // namespace tserve_native
