// GGUF weights as the file stores them (model/quant/kquant.py holds them; its dequantize is the
// reference for what each block means): Q4_K, Q5_K, Q6_K (256 weights a block, 6- or 8-bit
// scales per sub-block of 32 or 16) and the 32-weight Q8_0, Q4_0, Q4_1, Q5_0, Q5_1. A
// projection is n rows of k / (values a block) blocks each, exactly the file's bytes.
//
// The activations go in as 14-bit integers (r in [-8191, 8191], KqActs in kquant_blocks.h), one
// float scale per block of the weight type's size (256 for the K-quants, 32 for the others) and
// the integer sum of every 16. Each weight block then gives a few exact integers (ints_*):
//   Q4_K        i0 = sum_s sc_s (q . r)_s, i1 = sum_s m_s (sum r)_s          w = d sc q - dmin m
//   Q5_K        the same, i0 in two halves (sub-blocks 0-3, 4-7), i1
//   Q6_K        p_g = sum_{s in g} sc_s ((q - 32) . r)_s, four groups g of   w = d sc (q - 32)
//               sub-blocks {8h + o + 2c : c = 0-3} (g = 2h + o)
//   Q8_0, Q4_0, Q5_0  i0 = q . r - offset sum r (offset 0, 8, 16)       w = d (q - offset)
//   Q4_1, Q5_1  i0 = q . r, i1 = sum r                                  w = d q + m
// Each fits in int32 at any weights and activations: |Q4_K i0| <= 15 x 8191 x 256 x 63 =
// 1,981,566,720; a Q5_K half 31 x 8191 x 128 x 63 = 2,047,618,944; a Q6_K group
// 32 x 8191 x 64 x 128 = 2,147,221,504; all < 2^31 - 1. Loops may wrap on the way (int32 sums
// are exact modulo 2^32, so a result within range is exact whatever the order). A row is then
// the float sum over blocks, in block order, of fma(d s_a, i, acc) for each scaled integer in
// order (and fma(-dmin s_a, i1) or fma(m s_a, i1)): one function (combine) whatever computed the
// integers. So the scalar loops and the AVX2 ones give the same bits, and a row's result never
// depends on the rows beside it.
#pragma once

#include "projection.h"

namespace tserve_native {

// Which loops compute the integers: -1 the default (the best this CPU has, or the scalar ones
// where TSERVE_NATIVE_ISA=scalar is set when the library is first used), 0 scalar, 1 AVX2 a row
// at a time, 3 the AVX2 loops over every type repacked once (kquant_packed.cpp; what the native
// step's projections take where AVX2 is the default; kquant_linear packs on each call, for tests).
// Within 3, a CPU with AVX512-VNNI takes vpdpbusd loops for one row at a time and for Q4_K's 4-15
// rows, and vpdpwssd loops over the widened blocks for the rest from 4 rows on, eight rows against
// two tiles a pass (the same exact integers; TSERVE_NATIVE_ISA=avx2 turns them off); with AMX
// (int8 tiles, granted by the kernel), Q4_K from 9 rows, Q6_K from 10 and Q8_0, Q5_0, Q4_0 from 3 go
// through tile products (ka_run, ka_run32; TSERVE_NATIVE_ISA=avx512 turns them off). (2 was AVX512-VNNI over 8-bit
// activations, removed with them.)
constexpr int64_t KQ_AUTO = -1, KQ_SCALAR = 0, KQ_AVX2 = 1, KQ_PACKED = 3;

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
