// int8 weights through fbgemm, each row of activations quantized over its own range (the
// algebra: model.quant.int8.rowwise_int8_linear): a projection's packs, its halves for the
// partner thread, and Int8Linear, one such projection on its own for the Python step.
#pragma once

#include <torch/custom_class.h>

#include "projection.h"

namespace tserve_native {

// An int8 projection of fbgemm's packed weights, given as their script object
// (torch.classes.quantized.LinearPackedParamsBase): the pack, W 1 and the bias.
Projection int8_projection(const c10::IValue& packed);

// Shares `p` with `partner`: a prompt's rows through the whole pack, and, where the projection
// is wide enough, a step's outputs as two packs, [0, N/2) and [N/2, N) (rounded to 64
// features), quantized exactly as the whole: the int8 values and per-channel scales sliced.
void split_for_partner(Projection& p, Partner* partner, const Tensor& qweight, const c10::optional<Tensor>& bias);

// One int8 projection on its own: the int8 path of the Python decode step's projections
// (model.quant.int8.DecodeInt8Linear on the CPU, where the library is built), which is
// model.quant.int8.rowwise_int8_linear bit for bit in one call. In Python that is some fifteen
// tensor operations around fbgemm's product, each a pass over the rows: ~100 us a layer at 32
// rows of 512, and five passes over 32 x 58k floats for a translator's vocabulary-wide head. Here
// it is one loop before the product and one after (Projection::int8_rows, the native step's).
class Int8Linear : public torch::CustomClassHolder {
 public:
  // inv_scale (in,) float32 or None: SmoothQuant's explicit scale, x * inv_scale goes in.
  // `blocks`: activations quantized per run of 32 (int8_blocks.cpp: a decoder-only model's decode
  // copies, as the native step runs them), where the weights allow; else per row.
  Int8Linear(c10::IValue packed, c10::optional<Tensor> inv_scale, bool blocks);

  // x (B, in) float32 -> (B, out) float32; each row quantized on its own (per row or per run)
  Tensor forward(Tensor x) const;

  int64_t in_features() const { return p_.int8_in; }
  int64_t out_features() const { return static_cast<int64_t>(p_.row_sum.size()); }

 private:
  Projection p_;
  Tensor inv_scale_;
};

}  // namespace tserve_native
