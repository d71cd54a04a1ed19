// 4-bit weights as GGUF's Q4_0 / Q4_1 store them: each run of 32 inputs of an output row has its
// own scale d and offset m (float16), w = d q + m with q in [0, 15]. Activations go in as 8-bit
// integers with one scale per run of 32 of the row (a = s_a r, r in [-127, 127]), so a run's
// product is one integer dot product:
//   sum_k w_k a_k = s_a (d sum_k q_k r_k + m sum_k r_k).
// Half the bytes of int8 per weight (0.625 with the two scales), which is what a step of a few
// rows waits for. Each (row, output) sums its runs in the same order whatever the rows beside
// it, so a row's result never depends on the batch.
//
// Layout, built by model/quant/q4.py (pack_q4): outputs in tiles of 16, each tile's runs one after
// the other, a run in Q4_RUN_BYTES = 320 bytes: four 64-byte chunks of nibbles, then the 16 d, then
// the 16 m (float16 bits). Byte 4j + t of chunk c holds, for output j of the tile, input
// 8c + t of the run in its low nibble and input 8c + 4 + t in its high nibble: so a chunk's low
// nibbles and its high nibbles are each one VNNI operand (16 outputs x 4 consecutive inputs).
#pragma once

#include "projection.h"

namespace tserve_native {

constexpr int64_t Q4_TILE = 16, Q4_RUN = 32, Q4_RUN_BYTES = 320;

// A 4-bit projection of n outputs (a multiple of 16) and k inputs (a multiple of 32) over `runs`
// (uint8, as pack_q4 lays them out), no int8 weights, no partner; checked. Projection::q4_rows runs it.
Projection q4_projection(const Tensor& runs, int64_t n, int64_t k, const c10::optional<Tensor>& bias);

}  // namespace tserve_native
