// EncDecDecoder (encdec_step.h): an encoder-decoder's decoder step, operation for operation the
// Python step's.
#include "encdec_step.h"

#include "attention.h"
#include "int8.h"
#include "ops.h"

namespace tserve_native {

EncDecDecoder::EncDecDecoder(int64_t n_heads, int64_t head_dim, double self_scale, double cross_scale, bool pre_norm,
                             int64_t activation, double eps)
    : nh_(n_heads), hs_(head_dim), self_scale_(self_scale), cross_scale_(cross_scale), pre_norm_(pre_norm),
      activation_(activation), eps_(eps) {
  TORCH_CHECK(n_heads > 0 && head_dim > 0 && head_dim <= 512, "n_heads > 0 and 0 < head_dim <= 512");
  TORCH_CHECK(activation >= 0 && activation <= 3, "activation code ", activation, " not in [0, 3]");
}

void EncDecDecoder::set_embedding(Tensor tokens, double scale, Tensor positions, c10::optional<Tensor> norm_w,
                                  c10::optional<Tensor> norm_b) {
  TORCH_CHECK(tokens.dim() == 2 && positions.dim() == 2 && positions.size(1) == tokens.size(1),
              "tokens (V, d) and positions (P, d)");
  tokens_ = tokens.detach();
  positions_ = positions.detach();
  embed_scale_ = scale;
  d_ = tokens.size(1);
  if (norm_w) embed_norm_ = {norm_w->detach(), norm_b ? norm_b->detach() : Tensor()};
}

void EncDecDecoder::add_layer(std::vector<Tensor> norms, bool fused_qkv) {
  TORCH_CHECK(norms.size() == 6, "a layer takes six norm tensors");
  TORCH_CHECK(layers_.empty() || complete(layers_.back()), "a layer needs all its projections before the next");
  TORCH_CHECK(!head_set_, "layers come before the head");
  Layer L;
  for (int i = 0; i < 3; ++i) L.norms[i] = {norms[2 * i].detach(), norms[2 * i + 1].detach()};
  L.fused = fused_qkv;
  layers_.push_back(std::move(L));
}

void EncDecDecoder::add_projection(c10::IValue packed, c10::optional<Tensor> inv_scale) {
  Proj p;
  p.q = int8_projection(packed);
  if (inv_scale) p.inv_scale = inv_scale->detach().to(at::kFloat).contiguous();
  if (!layers_.empty() && !complete(layers_.back())) {
    layers_.back().proj.push_back(std::move(p));
    return;
  }
  TORCH_CHECK(!head_set_, "every projection is already set");
  head_ = std::move(p);
  head_set_ = true;
}

void EncDecDecoder::set_final_norm(c10::optional<Tensor> w, c10::optional<Tensor> b) {
  if (w) final_norm_ = {w->detach(), b ? b->detach() : Tensor()};
}

// x + f(x) written into f(x)'s own (fresh) output: an add is the same either way round
template <typename F>
Tensor EncDecDecoder::residual(const Tensor& x, const Norm& n, const F& fn) const {
  if (pre_norm_) return fn(norm(x, n)).add_(x);
  return norm(fn(x).add_(x), n);
}

Tensor EncDecDecoder::step(Tensor tokens, Tensor positions, Tensor k_pool, Tensor v_pool, Tensor tables,
                           Tensor cross_k, Tensor cross_v, Tensor slots, Tensor src_lengths) {
  TORCH_CHECK(head_set_ && !layers_.empty() && complete(layers_.back()), "the decoder is not fully built");
  const int64_t n_layers = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(k_pool.dim() == 5 && k_pool.size(0) == n_layers && cross_k.dim() == 5 && cross_k.size(0) == n_layers,
              "k_pool (layers, nkv, blocks, BL, hs) and cross_k (layers, slots, nh, S, hs) for ", n_layers,
              " layers");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && cross_k.sizes() == cross_v.sizes(),
              "K and V must have one shape");
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16,
              "the pool must be float32 or bfloat16");
  Tensor ids = tokens.to(at::kLong).contiguous().view({-1});
  Tensor pos = positions.to(at::kLong).contiguous().view({-1});
  const int64_t B = ids.size(0);
  TORCH_CHECK(B > 0 && pos.size(0) == B && tables.dim() == 2 && tables.size(0) == B,
              "tokens, positions and tables need one entry per row");
  const int64_t V = tokens_.size(0);
  Tensor table_rows = tables.contiguous();
  const int64_t nkv = k_pool.size(1), n_blocks = k_pool.size(2), BL = k_pool.size(3);
  TORCH_CHECK(k_pool.size(4) == hs_ && nkv > 0 && nh_ % nkv == 0, "the pool's heads do not fit the model's");
  TORCH_CHECK(BL > 0 && (BL & (BL - 1)) == 0, "the block length must be a power of two");
  const int64_t width = table_rows.size(1);
  const int64_t* table = table_rows.data_ptr<int64_t>();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(id[b] >= 0 && id[b] < V, "token id ", id[b], " out of range [0, ", V, ")");
    TORCH_CHECK(p[b] >= 0 && p[b] < positions_.size(0), "position ", p[b], " is past the position table (",
                positions_.size(0), ")");
    TORCH_CHECK(p[b] < width * BL, "position ", p[b], " is past row ", b, "'s block table");
    const int64_t blk = table[b * width + p[b] / BL];
    TORCH_CHECK(blk >= 0 && blk < n_blocks, "block ", blk, " out of range [0, ", n_blocks, ")");
  }
  Tensor lengths = pos + 1;

  // the embeddings, as model.nn.layers.Embeddings computes them
  Tensor x = at::embedding(tokens_, ids);
  if (embed_scale_ != 1.0) x = x * embed_scale_;
  x = x + positions_.index_select(0, pos).to(x.scalar_type());
  if (embed_norm_.first.defined()) x = norm(x, embed_norm_);

  for (int64_t l = 0; l < n_layers; ++l) {
    const Layer& L = layers_[l];
    Tensor kp = k_pool.select(0, l), vp = v_pool.select(0, l);
    x = residual(x, L.norms[0], [&](const Tensor& h) { return self_attention(L, h, kp, vp, table_rows, p, lengths); });
    x = residual(x, L.norms[1], [&](const Tensor& h) {
      const size_t c = L.fused ? 2 : 4;  // cross q, cross out
      Tensor q = L.proj[c](h).view({B, nh_, hs_});
      Tensor y = cross_decode_attention(q, cross_k.select(0, l), cross_v.select(0, l), slots, src_lengths, cross_scale_);
      return L.proj[c + 1](y.view({B, nh_ * hs_}));
    });
    x = residual(x, L.norms[2], [&](const Tensor& h) { return feed_forward(L, h); });
  }
  if (final_norm_.first.defined()) x = norm(x, final_norm_);
  return head_(x).to(at::kFloat);
}

Tensor EncDecDecoder::norm(const Tensor& x, const Norm& n) const {
  return at::layer_norm(x, {d_}, n.first, n.second.defined() ? c10::optional<Tensor>(n.second) : c10::nullopt, eps_);
}

// in place on the up projection's fresh output: the same values as torch's functions
Tensor EncDecDecoder::activate(Tensor x) const {
  switch (activation_) {
    case 0: return at::relu_(x);
    case 1: return at::gelu(x);
    case 2: return at::gelu(x, "tanh");
    default: return at::silu_(x);
  }
}

Tensor EncDecDecoder::feed_forward(const Layer& L, const Tensor& h) const {
  const size_t f = (L.fused ? 1 : 3) + 3;  // up, then down
  return L.proj[f + 1](activate(L.proj[f](h)));
}

Tensor EncDecDecoder::self_attention(const Layer& L, const Tensor& h, const Tensor& kp, const Tensor& vp,
                                     const Tensor& tables, const int64_t* p, const Tensor& lengths) const {
  const int64_t B = h.size(0), nkv = kp.size(0);
  Tensor q, k, v;
  if (L.fused) {
    Tensor qkv = L.proj[0](h);
    q = qkv.narrow(1, 0, nh_ * hs_);
    k = qkv.narrow(1, nh_ * hs_, nkv * hs_);
    v = qkv.narrow(1, (nh_ + nkv) * hs_, nkv * hs_);
  } else {
    q = L.proj[0](h);
    k = L.proj[1](h);
    v = L.proj[2](h);
  }
  // the new K/V into the pool: row b's position p[b] lies in block tables[b, p / BL] at p % BL
  const int64_t n_blocks = kp.size(1), BL = kp.size(2), width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  // rows read where they lie (a fused qkv's k and v are column slices of its output)
  Tensor kc = k.stride(1) == 1 ? k : k.contiguous(), vc = v.stride(1) == 1 ? v : v.contiguous();
  const float* ks = kc.data_ptr<float>();
  const float* vs = vc.data_ptr<float>();
  const int64_t k_row = kc.stride(0), v_row = vc.stride(0);
  with_kv_bits(kp, vp, [&](auto* k_base, auto* v_base) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t blk = table[b * width + p[b] / BL], off = p[b] % BL;
      for (int64_t g = 0; g < nkv; ++g) {
        const int64_t dst = ((g * n_blocks + blk) * BL + off) * hs_;
        const float* src_k = ks + b * k_row + g * hs_;
        const float* src_v = vs + b * v_row + g * hs_;
        for (int64_t i = 0; i < hs_; ++i) {
          store(src_k[i], k_base + dst + i);
          store(src_v[i], v_base + dst + i);
        }
      }
    }
  });
  Tensor y = paged_decode_attention(q.view({B, nh_, hs_}), kp, vp, tables, lengths, self_scale_, 0);
  return L.proj[L.fused ? 1 : 3](y.view({B, nh_ * hs_}));
}

}  // namespace tserve_native
