// One projection y = W (x * inv_scale) + b, whose weights may come in several formats: GGUF blocks
// as stored (kquant.cpp), 4-bit runs (q4.cpp), fbgemm int8 (int8.cpp), or float (at::linear). Each format's kernel is a method
// defined in that format's file; operator() picks the one a call takes.
#pragma once

#include <ATen/native/quantized/PackedParams.h>

#include "common.h"
#include "partner.h"

namespace tserve_native {

struct Projection {
  c10::intrusive_ptr<LinearPackedParamsBase> packed;
  // The same weights as two packs of output features [0, split) and [split, N), for a step
  // shared with the partner thread (set when the decoder has one and the projection is wide
  // enough to split; `partner` is set whenever the decoder has one).
  c10::intrusive_ptr<LinearPackedParamsBase> first, second;
  int64_t split = 0;
  Partner* partner = nullptr;
  Tensor weight, bias;  // the float path
  Tensor q4;  // the 4-bit path: uint8, (N / 16) * (K / 32) runs of Q4_RUN_BYTES
  int64_t q4_n = 0, q4_k = 0;
  std::vector<float> q4_bias;  // empty: none
  std::vector<float> unsmooth;  // 1 / inv_scale: the 4-bit weights take the int8 ones' smoothed input back
  Partner* q4_partner = nullptr;  // shares the 4-bit tiles (the int8 halves have their own `partner`)
  std::vector<float> inv_scale;  // SmoothQuant's 1 / s per input channel; empty: none
  std::vector<float> row_sum, int8_bias;  // int8: W 1 (dequantized weights summed over inputs), b (or empty)
  int64_t int8_in = 0;  // int8: input features
  // The int8 weights again, plainly (N, K) row-major with a scale per output, for activations
  // quantized per run of 32 (int8_blocks.cpp); empty: none. `i8_prompts`: prompts take them too.
  std::vector<int8_t> i8;
  std::vector<float> i8_scale;
  int64_t i8_k = 0;
  bool i8_prompts = true;
  // GGUF blocks as stored (kquant.cpp): parts stacked by outputs, each its own ggml type
  std::vector<Tensor> kq_raw;
  std::vector<Tensor> kq_packed;  // per part: its blocks repacked (kquant_packed.cpp), or undefined
  std::vector<int64_t> kq_type, kq_n;
  int64_t kq_k = 0;
  std::vector<float> kq_bias;  // empty: none
  Partner* kq_partner = nullptr;  // shares the output rows with the step's thread

  // 4-bit runs when `q4` is set, fbgemm int8 when `packed` is set, else float. `prompt`: rows of
  // prompts, which take the int8 weights where the projection has both: at tens to thousands of
  // rows fbgemm's int8 GEMM is 2-3x faster than the 4-bit kernel, whose float scale per run of 32
  // costs arithmetic that only a step of a few rows, waiting for its bytes, hides. Decode steps
  // take the 4-bit weights whatever their rows, so a row's logits never depend on the batch.
  Tensor operator()(const Tensor& x, bool prompt = false) const {
    if (!kq_raw.empty()) return kq_rows(x.contiguous());
    if (q4.defined() && !(prompt && packed)) return q4_rows(x.contiguous());
    if (!i8.empty() && (!prompt || i8_prompts)) return int8_block_rows(x.contiguous());
    if (packed) return int8_rows(x.contiguous());
    return at::linear(x, weight, bias.defined() ? c10::optional<Tensor>(bias) : c10::nullopt);
  }

  // x (B, in) -> (B, out) through the int8 weights, each row quantized over its own range
  // (int8.cpp). `unfused`: the correction rounds each product on its own, as the Python step's
  // rowwise_int8_linear does.
  Tensor int8_rows(const Tensor& x, bool unfused = false) const;

  // The int8 weights kept plainly (`i8`) from the fbgemm pack, where its inputs come in runs of 32
  // and its weights are symmetric; false (nothing kept) otherwise.
  bool attach_int8_blocks();

  // x (B, K) -> (B, N) through `i8`, activations quantized per run of 32 (int8_blocks.cpp);
  // `portable`: the plain loops whatever the CPU.
  Tensor int8_block_rows(const Tensor& x, bool portable = false) const;

  // x (B, K) -> (B, N) through the 4-bit runs (q4.cpp); `portable`: the plain loops whatever the CPU.
  Tensor q4_rows(const Tensor& x, bool portable = false) const;

  // x (B, K) -> (B, N) through the GGUF blocks (kquant.cpp), decode rows and prompts alike.
  Tensor kq_rows(const Tensor& x) const;

  // The smoothing scale of input j (1 where there is none).
  float scale(int64_t j) const { return inv_scale.empty() ? 1.0f : inv_scale[j]; }
};

// A float32 CPU tensor, contiguous, checked (`name` in the error).
inline Tensor float_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  return t.detach().contiguous();
}

// Its n values as a vector, checked.
inline std::vector<float> to_vector(const Tensor& t, int64_t n, const char* name) {
  Tensor c = float_contiguous(t, name);
  TORCH_CHECK(c.numel() == n, name, " has ", c.numel(), " values, expected ", n);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + n);
}

}  // namespace tserve_native
