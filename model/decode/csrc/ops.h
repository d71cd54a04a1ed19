// The library's free operators, registered as torch.ops.tserve_native.* (register.cpp).
#pragma once

#include "common.h"

namespace tserve_native {

// The 4-bit kernel on its own, for tests and measurements: x (B, k) float32 -> (B, n);
// `portable`: the plain loops, whatever the CPU has.
Tensor q4_linear(Tensor x, Tensor runs, int64_t n, int64_t k, c10::optional<Tensor> bias, bool portable);

// The int8 kernel with activations quantized per run of 32 on its own (int8_blocks.cpp), for
// tests: x (B, k) float32, ints (n, k) int8, scales (n,) float32 -> (B, n).
Tensor int8_block_linear(Tensor x, Tensor ints, Tensor scales, c10::optional<Tensor> bias, bool portable);

// One new token per row attending over its cached positions where they lie in the block pool
// (ops.cpp says more). q (B, nh, hs) float32; k_pool, v_pool one layer's pool (nkv, blocks, BL, hs);
// tables (B, n) long; lengths (B,) long -> (B, nh, hs) float32.
Tensor paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, double scale,
                              int64_t window);

// One new token per row attending over its source's encoder memory (an encoder-decoder's
// cross-attention). q (B, nh, hs) float32; k_mem, v_mem (slots, nh, S, hs); slots, lengths (B,) long.
Tensor cross_decode_attention(Tensor q, Tensor k_mem, Tensor v_mem, Tensor slots, Tensor lengths, double scale);

// The vector units the kernels use in this process (common.h's cpu(), after TSERVE_NATIVE_ISA):
// any of "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx_int8".
std::vector<std::string> vector_units();

}  // namespace tserve_native
