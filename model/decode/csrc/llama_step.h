// One decode step of a Llama-architecture decoder in C++ (see model/decode/native.py for why and how
// it is built). The projections are fbgemm int8 linears, activations quantized row by row, or 4-bit
// runs for decode steps where the model has them, or float ones (at::linear): the same kernels the
// eager int8 path calls. Everything between them (RMSNorm, smoothing scales, RoPE, the K/V write
// into the paged cache, grouped-query attention over each row's own history, read block by block
// where it lies, SiLU gating, residuals) is plain loops over contiguous float32 rows, so a step
// costs its kernels and little else.
//
// The lineages after Llama are described by data, never by a second copy per lineage: a q/k/v
// bias rides in the projection; per layer, optional q/k norms (over each head, before RoPE),
// optional norms on each sublayer's output (Gemma's post-norms), a sliding window and which of
// two rotary tables it reads; per model, an embedding scale and the gate's activation (SiLU or
// tanh GELU). set_features / set_layer_features set them; without those calls it is a Llama.
#pragma once

#include <torch/custom_class.h>

#include <array>
#include <memory>

#include "attention.h"
#include "projection.h"

namespace tserve_native {

struct Layer {
  std::vector<float> attn_norm, ffn_norm;
  Projection qkv, o, gate, up, down;
  bool up_has_own_input = false;  // up's smoothing scale differs from gate's: its input is its own
  std::vector<float> q_norm, k_norm;  // (hs,) each, or empty: RMSNorm over each head of q / k before RoPE
  std::vector<float> post_attn_norm, post_ffn_norm;  // (d,) each, or empty: a norm on each sublayer's output
  int64_t window = 0;  // > 0: attend to the last `window` positions only
  bool local_rope = false;  // read the second rotary table
};

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

class LlamaDecoder : public torch::CustomClassHolder {
 public:
  LlamaDecoder(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, double scale);

  // Model-level tensors: token embeddings (V, d), the final norm (d,), the rotary table (2, P, hs).
  // The embeddings may be bfloat16 (a served model's, halved: only a row per token is read).
  void set_model(Tensor embed, Tensor final_norm, Tensor rope);
  // After set_model: the token embeddings as a GGUF tensor's blocks (kquant.h; V rows of d values
  // of ggml type `qtype`, uint8, e.g. a view of the mapped file), each token's row dequantized as
  // it is read; replaces set_model's table.
  void set_embedding_blocks(Tensor raw, int64_t qtype);

  // What the whole model does beyond a Llama: token embeddings times `embed_scale`, the gate's
  // activation (Activation), and a second rotary table (2, P, hs) for layers that ask for it.
  void set_features(double embed_scale, int64_t activation, c10::optional<Tensor> rope_local);

  // The last added layer's features beyond a Llama (each optional; window 0: none).
  void set_layer_features(c10::optional<Tensor> q_norm, c10::optional<Tensor> k_norm,
                          c10::optional<Tensor> post_attn_norm, c10::optional<Tensor> post_ffn_norm, int64_t window,
                          bool local_rope);

  void add_layer(Tensor attn_norm, Tensor ffn_norm);

  // Projections in the order qkv, o, gate, up, down of each layer, then the head once.
  void add_int8(c10::IValue packed, c10::optional<Tensor> inv_scale);
  void add_float(Tensor weight, c10::optional<Tensor> bias, c10::optional<Tensor> inv_scale);
  // A projection over GGUF blocks as stored (kquant.h): parts of n[i] outputs each, stacked.
  void add_kquant(std::vector<Tensor> raw, std::vector<int64_t> qtype, std::vector<int64_t> n, int64_t k,
                  c10::optional<Tensor> bias);

  // 4-bit weights for the projection added last, an int8 one: decode steps read these, prompts the
  // int8 ones. `runs` (uint8) as model/quant/q4.py packs them for n outputs (a multiple of 16) of
  // k inputs (a multiple of 32), an optional bias (n,). With a partner, the tiles are split
  // between the two threads as they lie (no second copy).
  void attach_q4(Tensor runs, int64_t n, int64_t k, c10::optional<Tensor> bias);

  // Steps of a few rows share each int8 projection with a second thread (see Partner). Call
  // before the projections are added.
  void use_partner(bool on);
  // Which int8 projections added from now on take activations quantized per run of 32
  // (int8_blocks.cpp) instead of per row: 0 none, 1 decode steps, 2 decode steps and prompts.
  void use_int8_blocks(int64_t mode);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Prompts: a run of at least `min_rows` rows of one sequence is attended as a block (on layers
  // with a window, one wider than a block; see attend_rows); 0 = always row by row, as decode
  // steps are.
  void set_prompt_attention(int64_t min_rows);

  // Whether blocks over a bfloat16 cache use the CPU's bfloat16 dot products (attend_block_bf16;
  // the default, where the CPU has AVX512-BF16) or torch's flash attention over the keys widened
  // to float32. Returns whether the bfloat16 kernel can run here at all.
  bool set_prompt_bf16(bool on);

  // tokens (B,) long at `positions` -> next-token logits (B, V) float32. Writes each row's K/V
  // at its position in k_cache / v_cache (layers, blocks, nkv, BL, hs) through its block table
  // (tables (B, n) long) and attends over its positions 0..position, block by block in place.
  // Every row's K/V is written before any row attends, so rows of one sequence at consecutive
  // positions (speculative drafts, a prompt) attend causally to each other.
  Tensor step(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables, std::vector<int64_t> positions);

  // A prompt (or several) as rows: like `step`, but the logits (R, V) of the rows `logit_rows`
  // only (each prompt's last token), so a long prompt does not pay the vocabulary projection on
  // every token.
  Tensor prefill(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables, std::vector<int64_t> positions,
                 std::vector<int64_t> logit_rows);

  // `prefill`'s rows computed as decode steps compute them (the 4-bit weights where a projection
  // has them): the output a preempted sequence replays, whose K/V its decode steps wrote, so
  // that it goes on with the bits it had (a prompt's rows take the int8 weights).
  Tensor replay(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables, std::vector<int64_t> positions,
                std::vector<int64_t> logit_rows);

 private:
  Tensor run(const Tensor& tokens, const Tensor& k_cache, const Tensor& v_cache, const Tensor& tables,
             const std::vector<int64_t>& positions, const std::vector<int64_t>* logit_rows, bool prompt);
  void finish(Projection p, const c10::optional<Tensor>& inv_scale);
  static std::array<Projection*, 5> slots(Layer& L) { return {&L.qkv, &L.o, &L.gate, &L.up, &L.down}; }
  void check_cache(const Tensor& c, const char* name) const;
  void norm_rows(const float* x, const float* w, const Projection& next, int64_t B, float* out) const;
  void add_output(float* x, const Tensor& delta, const std::vector<float>& w, int64_t B) const;
  template <typename T>
  void write_kv(const float* qkv, T* k_base, T* v_base, const int64_t* table, int64_t width,
                const std::vector<int64_t>& positions, int64_t n_blocks, int64_t BL, int64_t B) const;

  PromptAttention prompt_;  // min_rows 0: prompts attend row by row (set_prompt_attention)
  int64_t nh_, nkv_, hs_, d_ = 0;
  float eps_, scale_;
  float embed_scale_ = 1.0f;
  int64_t embed_qtype_ = -1;  // >= 0: embed_ holds GGUF blocks of this type (set_embedding_blocks)
  int64_t activation_ = kSilu;
  Tensor embed_, rope_, rope_local_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  Projection head_;
  bool has_head_ = false;
  int64_t int8_blocks_ = 0;
  std::unique_ptr<Partner> partner_;  // declared after the projections that point to it: destroyed first
  int next_ = 0;
};

}  // namespace tserve_native
