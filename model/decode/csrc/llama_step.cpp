// LlamaDecoder (llama_step.h): its construction from the model's weights, and a step: embedding,
// each layer's norms, projections, RoPE, cache write, attention and feed-forward, the head.
#include "llama_step.h"

#include <tuple>

#include "int8.h"
#include "kquant.h"
#include "q4.h"

namespace tserve_native {
namespace {

// out[j] = x[j] / rms(x) * w[j] * inv[j] for one row of width d (RMSNorm, then a smoothing scale).
void rms_row(const float* x, const float* w, const Projection& next, float eps, int64_t d, float* out) {
  double sum = 0.0;
  for (int64_t j = 0; j < d; ++j) sum += static_cast<double>(x[j]) * x[j];
  const float r = 1.0f / std::sqrt(static_cast<float>(sum / d) + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = x[j] * r * w[j] * next.scale(j);
}

// RMSNorm of each of `heads` rows of width hs, in place.
void rms_heads(float* x, const float* w, float eps, int64_t heads, int64_t hs) {
  for (int64_t h = 0; h < heads; ++h, x += hs) {
    double sum = 0.0;
    for (int64_t j = 0; j < hs; ++j) sum += static_cast<double>(x[j]) * x[j];
    const float r = 1.0f / std::sqrt(static_cast<float>(sum / hs) + eps);
    for (int64_t j = 0; j < hs; ++j) x[j] = x[j] * r * w[j];
  }
}

// Rotate each (x_i, x_{i+hs/2}) pair of `heads` heads by the angles of one position.
void rope_row(float* x, const float* cos, const float* sin, int64_t heads, int64_t hs) {
  const int64_t half = hs / 2;
  for (int64_t h = 0; h < heads; ++h, x += hs) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// Rows of a prompt through the feed-forward at a time: a multiple of the projections' row groups
// (kquant_packed.cpp), small enough that a chunk's gate and up outputs (2 x 256 x 4 x features
// bytes: 18 MB at 8,960) come from reused heap, not fresh pages.
constexpr int64_t kFeedForwardRows = 256;

// g[j] = act(g[j]) * u[j] * s[j] over one row. tanh GELU through tanh(z) = 1 - 2 / (1 + e^{2z})
// (at the extremes e^{2z} saturates and tanh goes to -1 or 1).
// (Without a scale the product skips it: the bits of x * 1.0f.) One loop per variant, which the
// compiler vectorizes.
template <int64_t kAct, bool kScaled>
void act_row(float* g, const float* u, const float* s, int64_t ff) {
  for (int64_t j = 0; j < ff; ++j) {
    const float a = g[j];
    float act;
    if constexpr (kAct == kSilu) {
      act = a / (1.0f + fast_exp(-a));
    } else {
      const float inner = 0.7978845608028654f * (a + 0.044715f * a * a * a);  // sqrt(2 / pi)
      act = 0.5f * a * (2.0f - 2.0f / (1.0f + fast_exp(2.0f * inner)));
    }
    g[j] = kScaled ? act * u[j] * s[j] : act * u[j];
  }
}

}  // namespace

LlamaDecoder::LlamaDecoder(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, double scale)
    : nh_(n_heads), nkv_(n_kv), hs_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
  TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0, "n_heads must be a multiple of n_kv");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "head_dim must be even (rotary pairs) and at most 512");
}

void LlamaDecoder::set_model(Tensor embed, Tensor final_norm, Tensor rope) {
  TORCH_CHECK(embed.device().is_cpu() && (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16),
              "embed must be a float32 or bfloat16 CPU tensor");
  embed_ = embed.detach().contiguous();
  embed_qtype_ = -1;
  d_ = embed_.size(1);
  final_norm_ = to_vector(final_norm, d_, "final_norm");
  rope_ = float_contiguous(rope, "rope");
  TORCH_CHECK(rope_.dim() == 3 && rope_.size(0) == 2 && rope_.size(2) == hs_, "rope must be (2, P, head_dim)");
}

void LlamaDecoder::set_embedding_blocks(Tensor raw, int64_t qtype) {
  TORCH_CHECK(d_ > 0, "set_model first");
  const int64_t row = kquant_row_bytes(qtype, d_);
  TORCH_CHECK(row > 0, "GGUF type ", qtype, " rows of ", d_, " are not read");
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.size(1) == row,
              "embedding blocks must be (V, ", row, ") uint8");
  embed_ = raw.contiguous();
  embed_qtype_ = qtype;
}

void LlamaDecoder::set_features(double embed_scale, int64_t activation, c10::optional<Tensor> rope_local) {
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "activation must be 0 (SiLU) or 1 (tanh GELU)");
  embed_scale_ = static_cast<float>(embed_scale);
  activation_ = activation;
  if (rope_local) {
    rope_local_ = float_contiguous(*rope_local, "rope_local");
    TORCH_CHECK(rope_local_.sizes() == rope_.sizes(), "rope_local must have the shape of rope");
  }
}

void LlamaDecoder::set_layer_features(c10::optional<Tensor> q_norm, c10::optional<Tensor> k_norm,
                                      c10::optional<Tensor> post_attn_norm, c10::optional<Tensor> post_ffn_norm,
                                      int64_t window, bool local_rope) {
  TORCH_CHECK(!layers_.empty() && !has_head_, "set_layer_features follows its add_layer");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
  TORCH_CHECK(post_attn_norm.has_value() == post_ffn_norm.has_value(), "the two post-norms come together");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(!local_rope || rope_local_.defined(), "a layer reads the local rotary table but none was set");
  Layer& L = layers_.back();
  if (q_norm) {
    L.q_norm = to_vector(*q_norm, hs_, "q_norm");
    L.k_norm = to_vector(*k_norm, hs_, "k_norm");
  }
  if (post_attn_norm) {
    L.post_attn_norm = to_vector(*post_attn_norm, d_, "post_attn_norm");
    L.post_ffn_norm = to_vector(*post_ffn_norm, d_, "post_ffn_norm");
  }
  L.window = window;
  L.local_rope = local_rope;
}

void LlamaDecoder::add_layer(Tensor attn_norm, Tensor ffn_norm) {
  TORCH_CHECK(layers_.empty() || next_ == 5, "a layer needs its five projections before the next");
  TORCH_CHECK(!has_head_, "layers come before the output head");
  next_ = 0;
  layers_.emplace_back();
  layers_.back().attn_norm = to_vector(attn_norm, d_, "attn_norm");
  layers_.back().ffn_norm = to_vector(ffn_norm, d_, "ffn_norm");
}

void LlamaDecoder::add_int8(c10::IValue packed, c10::optional<Tensor> inv_scale) {
  Projection p = int8_projection(packed);
  if (partner_) {
    auto unpacked = p.packed->unpack();
    split_for_partner(p, partner_.get(), std::get<0>(unpacked), std::get<1>(unpacked));
  }
  if (int8_blocks_ > 0 && p.attach_int8_blocks()) p.i8_prompts = int8_blocks_ > 1;
  finish(std::move(p), inv_scale);
}

void LlamaDecoder::add_float(Tensor weight, c10::optional<Tensor> bias, c10::optional<Tensor> inv_scale) {
  Projection p;
  p.weight = float_contiguous(weight, "weight");
  if (bias) p.bias = float_contiguous(*bias, "bias");
  finish(std::move(p), inv_scale);
}

void LlamaDecoder::add_kquant(std::vector<Tensor> raw, std::vector<int64_t> qtype, std::vector<int64_t> n, int64_t k,
                              c10::optional<Tensor> bias) {
  Projection p = kquant_projection(raw, qtype, n, k, bias);
  p.kq_partner = partner_.get();
  finish(std::move(p), c10::nullopt);
}

void LlamaDecoder::attach_q4(Tensor runs, int64_t n, int64_t k, c10::optional<Tensor> bias) {
  TORCH_CHECK(has_head_ || (!layers_.empty() && next_ > 0), "attach_q4 follows the projection it is for");
  Projection& p = has_head_ ? head_ : *slots(layers_.back())[next_ - 1];
  TORCH_CHECK(p.packed && !p.q4.defined(), "4-bit weights attach once, to an int8 projection");
  TORCH_CHECK(static_cast<int64_t>(p.row_sum.size()) == n, "the 4-bit weights have ", n, " outputs, the int8 ones ",
              p.row_sum.size());
  Projection q = q4_projection(runs, n, k, bias);
  p.q4 = q.q4;
  p.q4_n = n;
  p.q4_k = k;
  p.q4_bias = std::move(q.q4_bias);
  p.q4_partner = partner_.get();
  // The int8 weights are smoothed: their input arrives multiplied by inv_scale. The 4-bit ones
  // are the model's own, so their input is divided back.
  p.unsmooth.clear();
  for (float v : p.inv_scale) p.unsmooth.push_back(1.0f / v);
}

void LlamaDecoder::use_partner(bool on) {
  TORCH_CHECK(layers_.empty() && !has_head_, "use_partner comes before the layers");
  if (on && !partner_) partner_ = std::make_unique<Partner>();
  if (!on) partner_.reset();
}

void LlamaDecoder::use_int8_blocks(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "use_int8_blocks takes 0, 1 or 2");
  int8_blocks_ = mode;
}

void LlamaDecoder::set_prompt_attention(int64_t min_rows) {
  TORCH_CHECK(min_rows >= 0, "min_rows must be >= 0");
  prompt_.min_rows = min_rows;
}

bool LlamaDecoder::set_prompt_bf16(bool on) {
  prompt_.bf16 = on;
  return cpu().avx512_bf16;
}

Tensor LlamaDecoder::step(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables, std::vector<int64_t> positions) {
  return run(tokens, k_cache, v_cache, tables, positions, nullptr, false);
}

Tensor LlamaDecoder::prefill(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables,
                             std::vector<int64_t> positions, std::vector<int64_t> logit_rows) {
  TORCH_CHECK(!logit_rows.empty(), "logit_rows must name at least one row");
  for (int64_t r : logit_rows)
    TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(positions.size()), "logit row ", r, " out of range");
  return run(tokens, k_cache, v_cache, tables, positions, &logit_rows, true);
}

Tensor LlamaDecoder::replay(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables,
                            std::vector<int64_t> positions, std::vector<int64_t> logit_rows) {
  TORCH_CHECK(!logit_rows.empty(), "logit_rows must name at least one row");
  for (int64_t r : logit_rows)
    TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(positions.size()), "logit row ", r, " out of range");
  return run(tokens, k_cache, v_cache, tables, positions, &logit_rows, false);
}

Tensor LlamaDecoder::run(const Tensor& tokens, const Tensor& k_cache, const Tensor& v_cache, const Tensor& tables,
                         const std::vector<int64_t>& positions, const std::vector<int64_t>* logit_rows,
                         bool prompt) {
  TORCH_CHECK(has_head_ && !layers_.empty(), "the decoder is not fully built (no layers or no output head)");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.device().is_cpu(),
              "tables must be a (B, n) long CPU tensor");
  Tensor table_rows = tables.contiguous();
  const int64_t B = table_rows.size(0), width = table_rows.size(1);
  TORCH_CHECK(B > 0 && static_cast<int64_t>(positions.size()) == B && tokens.numel() == B,
              "tokens, tables and positions must have one entry per row");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must have the same shape and dtype");
  const int64_t n_blocks = k_cache.size(2), BL = k_cache.size(3);
  TORCH_CHECK(BL > 0 && (BL & (BL - 1)) == 0, "the block length must be a power of two, got ", BL);
  const int64_t* block_table = table_rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(positions[b] >= 0 && positions[b] < width * BL && positions[b] < rope_.size(1),
                "position ", positions[b], " is past the block table or the rotary table");
    for (int64_t i = 0; i <= positions[b] / BL; ++i)
      TORCH_CHECK(block_table[b * width + i] >= 0 && block_table[b * width + i] < n_blocks, "block ",
                  block_table[b * width + i], " out of range [0, ", n_blocks, ")");
  }
  Tensor ids = tokens.to(at::kLong).contiguous().view({-1});
  const int64_t V = embed_.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  auto opts = embed_.options().dtype(at::kFloat);
  Tensor x = at::empty({B, d_}, opts);
  const bool bf16 = embed_.scalar_type() == at::kBFloat16;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(id[b] >= 0 && id[b] < V, "token id ", id[b], " out of range [0, ", V, ")");
    float* xb = x.data_ptr<float>() + b * d_;
    if (embed_qtype_ >= 0) {  // the row's blocks, dequantized, then scaled as the float rows are
      kquant_dequantize_row(embed_qtype_, embed_.data_ptr<uint8_t>() + id[b] * embed_.size(1), d_, xb);
      if (embed_scale_ != 1.0f)
        for (int64_t j = 0; j < d_; ++j) xb[j] *= embed_scale_;
      continue;
    }
    if (bf16) {  // exact in float32, then scaled as the float rows are (x * 1.0f is x)
      const uint16_t* e = reinterpret_cast<const uint16_t*>(embed_.data_ptr<at::BFloat16>()) + id[b] * d_;
      for (int64_t j = 0; j < d_; ++j) xb[j] = to_float(e[j]) * embed_scale_;
      continue;
    }
    const float* e = embed_.data_ptr<float>() + id[b] * d_;
    if (embed_scale_ == 1.0f)
      std::copy_n(e, d_, xb);
    else
      for (int64_t j = 0; j < d_; ++j) xb[j] = e[j] * embed_scale_;
  }
  const int64_t q_w = nh_ * hs_, kv_w = nkv_ * hs_;
  Tensor h = at::empty({B, d_}, opts), h2 = at::empty({B, d_}, opts), y = at::empty({B, q_w}, opts);
  float* xs = x.data_ptr<float>();
  const Heads heads{nh_, nkv_, hs_, scale_};
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    norm_rows(xs, L.attn_norm.data(), L.qkv, B, h.data_ptr<float>());
    Tensor qkv = L.qkv(h, prompt).contiguous();  // (B, q_w + 2 kv_w)
    const Tensor& table = L.local_rope ? rope_local_ : rope_;
    over_rows(partner_.get(), B, q_w + 2 * kv_w, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {  // (q/k norms, then) RoPE on q and k
        float* row = qkv.data_ptr<float>() + b * (q_w + 2 * kv_w);
        if (!L.q_norm.empty()) {
          rms_heads(row, L.q_norm.data(), eps_, nh_, hs_);
          rms_heads(row + q_w, L.k_norm.data(), eps_, nkv_, hs_);
        }
        const float* cos = table.data_ptr<float>() + positions[b] * hs_;
        const float* sin = cos + table.size(1) * hs_;
        rope_row(row, cos, sin, nh_, hs_);
        rope_row(row + q_w, cos, sin, nkv_, hs_);
      }
    });
    const int64_t layer_at = static_cast<int64_t>(l) * n_blocks * nkv_ * BL * hs_;
    auto cache_layer = [&](auto* k_base, auto* v_base) {  // float or bfloat16 bits
      write_kv(qkv.data_ptr<float>(), k_base, v_base, block_table, width, positions, n_blocks, BL, B);
      attend_rows(heads, qkv.data_ptr<float>(), k_base, v_base, block_table, width, positions, n_blocks, BL, L.o,
                  L.window, B, y.data_ptr<float>(), prompt, prompt_, partner_.get());
    };
    with_kv_bits(k_cache, v_cache, [&](auto* k, auto* v) { cache_layer(k + layer_at, v + layer_at); });
    add_output(xs, L.o(y, prompt), L.post_attn_norm, B);
    // act(gate) * up, scaled for the down projection where it is smoothed
    const float* down_scale = L.down.inv_scale.empty() ? nullptr : L.down.inv_scale.data();
    // The feed-forward a chunk of rows at a time (each row's arithmetic is its own, so the bits
    // are those of all rows at once): a 2,000-token prompt's gate and up outputs were 72 MB each
    // on the 1.5B (8,960 features), fresh pages every layer, written and read back from memory.
    for (int64_t r0 = 0; r0 < B; r0 += kFeedForwardRows) {
      const int64_t rn = std::min(kFeedForwardRows, B - r0);
      float* xr = xs + r0 * d_;
      Tensor hr = h.narrow(0, r0, rn), h2r = h2.narrow(0, r0, rn);
      norm_rows(xr, L.ffn_norm.data(), L.gate, rn, hr.data_ptr<float>());
      Tensor g = L.gate(hr, prompt).contiguous();
      if (L.up_has_own_input) norm_rows(xr, L.ffn_norm.data(), L.up, rn, h2r.data_ptr<float>());
      Tensor u = L.up(L.up_has_own_input ? h2r : hr, prompt).contiguous();
      const int64_t ff = g.size(1);
      float* gs = g.data_ptr<float>();
      const float* us = u.data_ptr<float>();
      over_rows(partner_.get(), rn, ff, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          float* row = gs + b * ff;
          const float* up = us + b * ff;
          if (activation_ == kSilu)
            down_scale ? act_row<kSilu, true>(row, up, down_scale, ff) : act_row<kSilu, false>(row, up, nullptr, ff);
          else
            down_scale ? act_row<kGeluTanh, true>(row, up, down_scale, ff)
                       : act_row<kGeluTanh, false>(row, up, nullptr, ff);
        }
      });
      add_output(xr, L.down(g, prompt), L.post_ffn_norm, rn);
    }
  }
  if (logit_rows != nullptr) {  // the rows whose logits are wanted, gathered first
    const int64_t R = static_cast<int64_t>(logit_rows->size());
    Tensor picked = at::empty({R, d_}, opts);
    for (int64_t r = 0; r < R; ++r) std::copy_n(xs + (*logit_rows)[r] * d_, d_, picked.data_ptr<float>() + r * d_);
    Tensor hr = at::empty({R, d_}, opts);
    norm_rows(picked.data_ptr<float>(), final_norm_.data(), head_, R, hr.data_ptr<float>());
    return head_(hr, prompt).to(at::kFloat);
  }
  norm_rows(xs, final_norm_.data(), head_, B, h.data_ptr<float>());
  return head_(h).to(at::kFloat);
}

void LlamaDecoder::finish(Projection p, const c10::optional<Tensor>& inv_scale) {
  if (inv_scale) {
    Tensor s = float_contiguous(*inv_scale, "inv_scale");
    p.inv_scale.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
  }
  TORCH_CHECK(!layers_.empty(), "add_layer comes before its projections");
  Layer& L = layers_.back();
  if (next_ < 5) {
    *slots(L)[next_++] = std::move(p);
    if (next_ == 5) L.up_has_own_input = L.up.inv_scale != L.gate.inv_scale;
    return;
  }
  TORCH_CHECK(!has_head_, "every projection is already set");
  head_ = std::move(p);
  has_head_ = true;
}

void LlamaDecoder::check_cache(const Tensor& c, const char* name) const {
  TORCH_CHECK(c.device().is_cpu() && (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16) &&
                  c.is_contiguous(),
              name, " must be a contiguous float32 or bfloat16 CPU tensor");
  TORCH_CHECK(c.dim() == 5 && c.size(0) == num_layers() && c.size(1) == nkv_ && c.size(4) == hs_, name,
              " must be (layers, n_kv, blocks, block_len, head_dim)");
}

void LlamaDecoder::norm_rows(const float* x, const float* w, const Projection& next, int64_t B, float* out) const {
  over_rows(partner_.get(), B, d_, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rms_row(x + b * d_, w, next, eps_, d_, out + b * d_);
  });
}

// x += N(delta) row by row where the layer has a post-norm `w`, else x += delta.
void LlamaDecoder::add_output(float* x, const Tensor& delta, const std::vector<float>& w, int64_t B) const {
  Tensor c = delta.contiguous();
  const float* dp = c.data_ptr<float>();
  static const Projection unscaled;
  over_rows(partner_.get(), B, d_, [&](int64_t b0, int64_t b1) {
    if (w.empty()) {
      for (int64_t i = b0 * d_; i < b1 * d_; ++i) x[i] += dp[i];
      return;
    }
    std::vector<float> normed(d_);
    for (int64_t b = b0; b < b1; ++b) {
      rms_row(dp + b * d_, w.data(), unscaled, eps_, d_, normed.data());
      for (int64_t j = 0; j < d_; ++j) x[b * d_ + j] += normed[j];
    }
  });
}

// Each row's new k and v (after RoPE, in its qkv row) into its block at its position.
template <typename T>
void LlamaDecoder::write_kv(const float* qkv, T* k_base, T* v_base, const int64_t* table, int64_t width,
                            const std::vector<int64_t>& positions, int64_t n_blocks, int64_t BL, int64_t B) const {
  const int64_t q_w = nh_ * hs_, kv_w = nkv_ * hs_;
  over_rows(partner_.get(), B, 2 * kv_w, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = qkv + b * (q_w + 2 * kv_w);
      const int64_t block = table[b * width + positions[b] / BL], offset = positions[b] % BL;
      for (int64_t g = 0; g < nkv_; ++g) {
        const int64_t at_pos = ((g * n_blocks + block) * BL + offset) * hs_;
        for (int64_t i = 0; i < hs_; ++i) {
          store(row[q_w + g * hs_ + i], k_base + at_pos + i);
          store(row[q_w + kv_w + g * hs_ + i], v_base + at_pos + i);
        }
      }
    }
  });
}

}  // namespace tserve_native
