// GGUF weights as the file stores them (model/quant/kquant.py holds them; its dequantize is the
// reference for what each block means): Q4_K, Q5_K, Q6_K (256 weights a block, 6- or 8-bit
// scales per sub-block of 32 or 16) and the 32-weight Q8_0, Q4_0, Q4_1, Q5_0, Q5_1. A
// projection is n rows of k / (values a block) blocks each, exactly the file's bytes.
//
// The activations go in as 8-bit integers, one float scale per block of the weight type's size
// (256 for the K-quants, as ggml's Q8_K; 32 for the others, as its Q8_0) and the integer sum of
// every 16. Each weight block then gives one or two exact integers (ints_*):
//   Q4_K, Q5_K  i0 = sum_s sc_s (q . r)_s, i1 = sum_s m_s (sum r)_s    w = d sc q - dmin m
//   Q6_K        i0 = sum_s sc_s ((q . r)_s - 32 (sum r)_s)              w = d sc (q - 32)
//   Q8_0, Q4_0, Q5_0  i0 = q . r - offset sum r (offset 0, 8, 16)       w = d (q - offset)
//   Q4_1, Q5_1  i0 = q . r, i1 = sum r                                  w = d q + m
// and a row is the float sum over blocks, in block order, of fma(d s_a, i0) (and
// fma(-dmin s_a, i1) or fma(m s_a, i1)): one function (combine) whatever computed the integers.
// The integers are exact in any order, so the scalar loops and the AVX2 (and AVX512-VNNI) ones
// give the same bits, and a row's result never depends on the rows beside it.
#pragma once

#include "projection.h"

namespace tserve_native {

// Which loops compute the integers: -1 the default (the best this CPU has, or the scalar ones
// where TSERVE_NATIVE_ISA=scalar is set when the library is first used), 0 scalar, 1 AVX2,
// 2 AVX512-VNNI (only in a build whose compiler flags enable AVX512-VNNI and AVX512-VL), 3 the
// AVX2 loops over Q4_K, Q6_K and the 32-value types repacked once (kquant_packed.cpp; what the native step's projections take
// where AVX2 is the default; kquant_linear packs on each call, for tests).
constexpr int64_t KQ_AUTO = -1, KQ_SCALAR = 0, KQ_AVX2 = 1, KQ_VNNI = 2, KQ_PACKED = 3;

// x (B, k) float32, raw the (n, k) tensor's blocks (uint8, n * row bytes) of ggml type `qtype`
// -> (B, n) float32 (+ bias). `isa` as above; asking for loops this build or CPU lacks is an error.
Tensor kquant_linear(Tensor x, Tensor raw, int64_t qtype, int64_t n, int64_t k, c10::optional<Tensor> bias,
                     int64_t isa);

// The native step's projection over such blocks: parts of n[i] outputs each (raw[i] of type
// qtype[i], uint8, contiguous), stacked by outputs, k inputs; checked. Projection::kq_rows runs it.
Projection kquant_projection(const std::vector<Tensor>& raw, const std::vector<int64_t>& qtype,
                             const std::vector<int64_t>& n, int64_t k, const c10::optional<Tensor>& bias);

// One row of k values of ggml type `qtype` (its k / values blocks at `row`) -> out[0, k) float32,
// bit for bit model/quant/kquant.py's dequantize (the step's token embeddings read as stored).
void kquant_dequantize_row(int64_t qtype, const uint8_t* row, int64_t k, float* out);

// Bytes of one row of k values of `qtype`; 0 where the type is not one the kernels read or k is
// not a multiple of its block.
int64_t kquant_row_bytes(int64_t qtype, int64_t k);

// The rows `ids` of an (n, k) tensor's blocks (raw: n rows of kquant_row_bytes) as float32 (len, k).
Tensor kquant_rows(Tensor raw, int64_t qtype, int64_t k, Tensor ids);

// Whether `isa` can run here (KQ_AUTO: the one the default picks).
int64_t kquant_isa(int64_t isa);

}  // namespace tserve_native
