// The torch registration: torch.ops.tserve_native.* and torch.classes.tserve_native.*, what
// model/decode/native.py calls.
#include <torch/library.h>

#include "encdec_step.h"
#include "int8.h"
#include "kquant.h"
#include "llama_step.h"
#include "ops.h"

using namespace tserve_native;  // NOLINT: the registration names every class and operator

TORCH_LIBRARY(tserve_native, m) {
  m.def("cross_decode_attention", &cross_decode_attention);
  m.def("q4_linear", &q4_linear);
  m.def("int8_block_linear", &int8_block_linear);
  m.def("kquant_linear", &kquant_linear);
  m.def("kquant_isa", &kquant_isa);
  m.def("kquant_rows", &kquant_rows);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("vector_units", &vector_units);
  m.class_<Int8Linear>("Int8Linear")
      .def(torch::init<c10::IValue, c10::optional<Tensor>, bool>())
      .def("forward", &Int8Linear::forward)
      .def("in_features", &Int8Linear::in_features)
      .def("out_features", &Int8Linear::out_features);
  m.class_<EncDecDecoder>("EncDecDecoder")
      .def(torch::init<int64_t, int64_t, double, double, bool, int64_t, double>())
      .def("set_embedding", &EncDecDecoder::set_embedding)
      .def("add_layer", &EncDecDecoder::add_layer)
      .def("add_projection", &EncDecDecoder::add_projection)
      .def("set_final_norm", &EncDecDecoder::set_final_norm)
      .def("num_layers", &EncDecDecoder::num_layers)
      .def("step", &EncDecDecoder::step);
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("set_model", &LlamaDecoder::set_model)
      .def("set_embedding_blocks", &LlamaDecoder::set_embedding_blocks)
      .def("set_features", &LlamaDecoder::set_features)
      .def("set_layer_features", &LlamaDecoder::set_layer_features)
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("add_int8", &LlamaDecoder::add_int8)
      .def("add_float", &LlamaDecoder::add_float)
      .def("add_kquant", &LlamaDecoder::add_kquant)
      .def("attach_q4", &LlamaDecoder::attach_q4)
      .def("num_layers", &LlamaDecoder::num_layers)
      .def("use_partner", &LlamaDecoder::use_partner)
      .def("use_int8_blocks", &LlamaDecoder::use_int8_blocks)
      .def("set_prompt_attention", &LlamaDecoder::set_prompt_attention)
      .def("set_prompt_bf16", &LlamaDecoder::set_prompt_bf16)
      .def("step", &LlamaDecoder::step)
      .def("prefill", &LlamaDecoder::prefill)
      .def("replay", &LlamaDecoder::replay);
}
