// One decode step of an encoder-decoder's decoder (a translator: Marian and its like), int8
// projections, in C++. The Python step runs the same layers as some forty Python-dispatched
// operations a layer; at 32 rows that dispatch, not arithmetic, was most of a step. Here every
// operation is the one the Python step calls (at::embedding, at::layer_norm, the activations,
// the adds; Projection::int8_rows unfused, which is RowwiseInt8Linear's int8 path; the decode
// attention operators of ops.h), on the same values in the same order, so a step gives the Python
// step's logits bit for bit (tested), with one call from Python instead of hundreds.
//
// Per layer: self-attention (q, k, v; the new K/V written into the paged pool; each row over its
// own positions), cross-attention (q; each row over its source's memory), the feed-forward
// (up -> activation -> down), each wrapped in residual + LayerNorm, pre or post.
#pragma once

#include <torch/custom_class.h>

#include <array>
#include <utility>

#include "projection.h"

namespace tserve_native {

class EncDecDecoder : public torch::CustomClassHolder {
 public:
  // activation: 0 relu, 1 gelu (erf), 2 gelu (tanh), 3 silu
  EncDecDecoder(int64_t n_heads, int64_t head_dim, double self_scale, double cross_scale, bool pre_norm,
                int64_t activation, double eps);

  // tokens (V, d); scale: the embedding scale (1: none); positions (P, d): added by position
  // (a sinusoid table or learned embeddings); norm: the embedding LayerNorm's weight and bias
  void set_embedding(Tensor tokens, double scale, Tensor positions, c10::optional<Tensor> norm_w,
                     c10::optional<Tensor> norm_b);

  // norms: (weight, bias) of the self-attention, cross-attention and feed-forward LayerNorms.
  // Then its projections, in order: q, k, v (or one fused qkv), out; cross q, cross out; up, down.
  void add_layer(std::vector<Tensor> norms, bool fused_qkv);

  // the next projection: fbgemm's packed int8 weights (RowwiseInt8Linear's) and its optional
  // smoothing scale; after the last layer's, the output head's
  void add_projection(c10::IValue packed, c10::optional<Tensor> inv_scale);

  // final: the decoder's final LayerNorm (weight, bias), or none
  void set_final_norm(c10::optional<Tensor> w, c10::optional<Tensor> b);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // tokens (B,) at positions (B,); k_pool, v_pool (layers, nkv, blocks, BL, hs) the cache's pools;
  // tables (B, n) long; cross_k, cross_v (layers, slots, nh, S, hs); slots (B,) long: each row's
  // memory row; src_lengths (B,) long -> logits (B, V) float32
  Tensor step(Tensor tokens, Tensor positions, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor cross_k,
              Tensor cross_v, Tensor slots, Tensor src_lengths);

 private:
  struct Proj {
    Projection q;
    Tensor inv_scale;
    Tensor operator()(const Tensor& x) const {
      return q.int8_rows(inv_scale.defined() ? (x * inv_scale).contiguous() : x.contiguous(), true);
    }
  };
  using Norm = std::pair<Tensor, Tensor>;
  struct Layer {
    std::array<Norm, 3> norms;  // self, cross, feed-forward
    bool fused = false;
    std::vector<Proj> proj;
  };
  static size_t wanted(const Layer& L) { return (L.fused ? 1 : 3) + 1 + 2 + 2; }
  static bool complete(const Layer& L) { return L.proj.size() == wanted(L); }

  Tensor norm(const Tensor& x, const Norm& n) const;
  template <typename F>
  Tensor residual(const Tensor& x, const Norm& n, const F& fn) const;
  Tensor activate(Tensor x) const;
  Tensor feed_forward(const Layer& L, const Tensor& h) const;
  Tensor self_attention(const Layer& L, const Tensor& h, const Tensor& kp, const Tensor& vp, const Tensor& tables,
                        const int64_t* p, const Tensor& lengths) const;

  int64_t nh_, hs_, d_ = 0;
  double self_scale_, cross_scale_;
  bool pre_norm_;
  int64_t activation_;
  double eps_;
  Tensor tokens_, positions_;
  double embed_scale_ = 1.0;
  Norm embed_norm_, final_norm_;
  std::vector<Layer> layers_;
  Proj head_;
  bool head_set_ = false;
};

}  // namespace tserve_native
