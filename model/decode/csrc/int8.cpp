// The int8 projection (int8.h): each row onto fbgemm's shared activation grid and back, with the
// row passes vectorised where the CPU has AVX-512 (the same bits as the plain loops).
#include "int8.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <tuple>

namespace tserve_native {
namespace {

// From this many rows an int8 projection shared with the partner splits its rows, not its outputs.
constexpr int64_t kRowSplit = 64;

// One row of rowwise_int8_linear's correction, out = s ((out - b) - z W1) + b, with every product
// rounded on its own (no fused multiply-add): the arithmetic of its tensor operations, bit for bit.
__attribute__((optimize("fp-contract=off"))) void correct_row_unfused_plain(float* out, int64_t m, float s, float z,
                                                                            const float* row_sum, const float* bias) {
  if (bias == nullptr) {
    for (int64_t j = 0; j < m; ++j) out[j] = s * (out[j] - z * row_sum[j]);
    return;
  }
  for (int64_t j = 0; j < m; ++j) out[j] = s * ((out[j] - bias[j]) - z * row_sum[j]) + bias[j];
}

// A row's int8 range, lo = min(0, min x), hi = max(0, max x) (NaN skipped, as std::min / std::max
// skip it), and its values on the shared grid, u = x / s + z.
void row_range_plain(const float* row, int64_t n, float& lo, float& hi) {
  lo = hi = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    lo = std::min(lo, row[k]);
    hi = std::max(hi, row[k]);
  }
}
void to_grid_plain(const float* row, int64_t n, float s, float z, float* u) {
  for (int64_t k = 0; k < n; ++k) u[k] = row[k] / s + z;
}

#if defined(TSERVE_AVX512)
// The same three on 16-float vectors, every operation the scalar one (min / max pick what
// std::min / std::max pick, NaN included; division, products and sums each rounded on their
// own), so the same bits: at an encoder's thousands of rows these passes cost as much as the
// product, and the compiler leaves the range's min / max and the unfused correction scalar.
TSERVE_TARGET_AVX512 void row_range_avx512(const float* row, int64_t n, float& lo, float& hi) {
  __m512 l = _mm512_setzero_ps(), h = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 x = _mm512_loadu_ps(row + k);
    l = _mm512_min_ps(x, l);  // (x < l) ? x : l, as std::min(l, x)
    h = _mm512_max_ps(x, h);  // (x > h) ? x : h, as std::max(h, x)
  }
  lo = _mm512_reduce_min_ps(l);
  hi = _mm512_reduce_max_ps(h);
  for (; k < n; ++k) {
    lo = std::min(lo, row[k]);
    hi = std::max(hi, row[k]);
  }
}
__attribute__((target("avx512f"), optimize("fp-contract=off"))) void to_grid_avx512(const float* row, int64_t n, float s,
                                                                                    float z, float* u) {
  const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) _mm512_storeu_ps(u + k, _mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(row + k), sv), zv));
  for (; k < n; ++k) u[k] = row[k] / s + z;
}
// (the compiler would fuse the intrinsics' product and difference into one rounding otherwise)
__attribute__((target("avx512f"), optimize("fp-contract=off"))) void correct_row_unfused_avx512(
    float* out, int64_t m, float s, float z, const float* row_sum, const float* bias) {
  const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
  int64_t j = 0;
  for (; j + 16 <= m; j += 16) {
    __m512 y = _mm512_loadu_ps(out + j);
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + j) : _mm512_setzero_ps();
    if (bias != nullptr) y = _mm512_sub_ps(y, b);
    y = _mm512_mul_ps(sv, _mm512_sub_ps(y, _mm512_mul_ps(zv, _mm512_loadu_ps(row_sum + j))));
    if (bias != nullptr) y = _mm512_add_ps(y, b);
    _mm512_storeu_ps(out + j, y);
  }
  if (j < m) correct_row_unfused_plain(out + j, m - j, s, z, row_sum + j, bias != nullptr ? bias + j : nullptr);
}
#endif

void row_range(const float* row, int64_t n, float& lo, float& hi) {
#if defined(TSERVE_AVX512)
  if (cpu().avx512) return row_range_avx512(row, n, lo, hi);
#endif
  row_range_plain(row, n, lo, hi);
}
void to_grid(const float* row, int64_t n, float s, float z, float* u) {
#if defined(TSERVE_AVX512)
  if (cpu().avx512) return to_grid_avx512(row, n, s, z, u);
#endif
  to_grid_plain(row, n, s, z, u);
}
void correct_row_unfused(float* out, int64_t m, float s, float z, const float* row_sum, const float* bias) {
#if defined(TSERVE_AVX512)
  if (cpu().avx512) return correct_row_unfused_avx512(out, m, s, z, row_sum, bias);
#endif
  correct_row_unfused_plain(out, m, s, z, row_sum, bias);
}

}  // namespace

// Each row's activations quantized to 7 bits over the row's own range, as
// model.quant.int8.rowwise_int8_linear does (its docstring has the algebra): a row's result
// never depends on the rows beside it. fbgemm takes one activation scale per call, so each
// row goes onto the shared grid u = x / s + z in [0, 127] and is corrected back afterwards.
// `unfused`: the correction rounds each product on its own, as rowwise_int8_linear's tensor
// operations do (Int8Linear: the Python step's projections, which must give its bits).
Tensor Projection::int8_rows(const Tensor& x, bool unfused) const {
  const int64_t B = x.size(0), n = x.size(1);
  Tensor u = at::empty_like(x);
  std::vector<float> scale(B), zero(B);
  const float* xp = x.data_ptr<float>();
  float* up = u.data_ptr<float>();
  // rows in pieces (an encoder's or a prompt's hundreds of rows shared between the threads; a
  // decode step's few rows in one piece)
  over_rows(partner, B, n, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = xp + b * n;
      float lo, hi;
      row_range(row, n, lo, hi);
      float s = (hi - lo) / 127.0f;
      if (!(s > 0.0f)) s = 1.0f;
      const float z = std::nearbyint(-lo / s);
      scale[b] = s;
      zero[b] = z;
      to_grid(row, n, s, z, up + b * n);
    }
  });
  // Shared with the partner (torch on one thread): a step of a few rows as the two packs'
  // output halves; a prompt's rows in pieces through the whole pack (each piece quantized once,
  // where the halves would each quantize every row). fbgemm sums each output in int32 and
  // rescales it on its own, so the bits do not depend on the split. The pieces are copied into
  // one output by the correction pass below.
  std::vector<Tensor> parts;
  int64_t piece_rows = 0;  // > 0: parts are row pieces of this many rows; 0: output halves
  Tensor y;
  if (partner != nullptr && at::get_num_threads() == 1 && (B >= kRowSplit || first)) {
    if (B >= kRowSplit) {
      const int64_t pieces = std::min<int64_t>(4, B / (kRowSplit / 2));
      piece_rows = (B + pieces - 1) / pieces;
      parts.resize((B + piece_rows - 1) / piece_rows);
      partner->run(static_cast<int64_t>(parts.size()), [&](int64_t c) {
        const int64_t r0 = c * piece_rows;
        parts[c] = packed->apply_with_input_q_dq_qweight_dq_output_fp32(
            u.narrow(0, r0, std::min(B, r0 + piece_rows) - r0), 1.0, 0);
      });
    } else {
      parts.resize(2);
      partner->run(2, [&](int64_t c) {
        parts[c] = (c == 0 ? first : second)->apply_with_input_q_dq_qweight_dq_output_fp32(u, 1.0, 0);
      });
    }
    y = at::empty({B, static_cast<int64_t>(row_sum.size())}, x.options());  // every output feature
  } else {
    y = packed->apply_with_input_q_dq_qweight_dq_output_fp32(u, 1.0, 0);
  }
  const int64_t m = y.size(1);
  float* yp = y.data_ptr<float>();
  const bool has_bias = !int8_bias.empty();
  // Rows in pieces: a prompt's or a vocabulary-wide head's correction is shared between the
  // threads, a decode step's layer stays in one piece (each output's arithmetic is the same
  // whichever thread does it).
  over_rows(partner, B, m, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* out = yp + b * m;
      if (piece_rows > 0) {
        const Tensor& part = parts[b / piece_rows];
        std::copy_n(part.data_ptr<float>() + (b % piece_rows) * m, m, out);
      } else if (!parts.empty()) {
        const int64_t m0 = parts[0].size(1);
        std::copy_n(parts[0].data_ptr<float>() + b * m0, m0, out);
        std::copy_n(parts[1].data_ptr<float>() + b * (m - m0), m - m0, out + m0);
      }
      const float* bias = has_bias ? int8_bias.data() : nullptr;
      if (unfused)
        correct_row_unfused(out, m, scale[b], zero[b], row_sum.data(), bias);
      else
        for (int64_t j = 0; j < m; ++j) {
          const float bj = has_bias ? bias[j] : 0.0f;
          out[j] = scale[b] * ((out[j] - bj) - zero[b] * row_sum[j]) + bj;
        }
    }
  });
  return y;
}

Projection int8_projection(const c10::IValue& packed) {
  TORCH_CHECK(packed.isObject(), "packed must be fbgemm's packed linear parameters");
  Projection p;
  // A script object holds its C++ instance in its first slot (a capsule).
  auto holder = packed.toObjectRef().getSlot(0).toCapsule();
  p.packed = c10::static_intrusive_pointer_cast<LinearPackedParamsBase>(holder);
  auto unpacked = p.packed->unpack();
  Tensor row_sum = std::get<0>(unpacked).dequantize().to(at::kFloat).sum(1);
  p.row_sum = to_vector(row_sum, row_sum.numel(), "row_sum");
  if (std::get<1>(unpacked)) p.int8_bias = to_vector(*std::get<1>(unpacked), row_sum.numel(), "bias");
  p.int8_in = std::get<0>(unpacked).size(1);
  return p;
}

void split_for_partner(Projection& p, Partner* partner, const Tensor& qweight, const c10::optional<Tensor>& bias) {
  p.partner = partner;  // a prompt's rows are shared through the whole pack
  const int64_t n = qweight.size(0);
  const int64_t half = (n / 2 + 63) / 64 * 64;
  if (n < 128 || half >= n || qweight.qscheme() != at::kPerChannelAffine) return;
  static auto prepack = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("quantized::linear_prepack", "")
                            .typed<c10::intrusive_ptr<LinearPackedParamsBase>(Tensor, c10::optional<Tensor>)>();
  Tensor ints = qweight.int_repr(), scales = qweight.q_per_channel_scales(),
         zeros = qweight.q_per_channel_zero_points();
  auto part = [&](int64_t a, int64_t b) {
    Tensor w = at::_make_per_channel_quantized_tensor(ints.slice(0, a, b).contiguous(),
                                                      scales.slice(0, a, b).contiguous(),
                                                      zeros.slice(0, a, b).contiguous(), 0);
    c10::optional<Tensor> pb = bias ? c10::optional<Tensor>(bias->slice(0, a, b).contiguous()) : c10::nullopt;
    return prepack.call(w, pb);
  };
  p.first = part(0, half);
  p.second = part(half, n);
  p.split = half;
}

Int8Linear::Int8Linear(c10::IValue packed, c10::optional<Tensor> inv_scale, bool blocks)
    : p_(int8_projection(packed)) {
  if (blocks) p_.attach_int8_blocks();
  if (inv_scale) {
    TORCH_CHECK(inv_scale->device().is_cpu() && inv_scale->scalar_type() == at::kFloat && inv_scale->dim() == 1 &&
                    inv_scale->size(0) == p_.int8_in,
                "inv_scale must be a (", p_.int8_in, ",) float32 CPU tensor");
    inv_scale_ = inv_scale->detach().contiguous();
  }
}

Tensor Int8Linear::forward(Tensor x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(1) == p_.int8_in,
              "x must be (B, ", p_.int8_in, ") float32 on the CPU");
  const Tensor in = inv_scale_.defined() ? (x * inv_scale_).contiguous() : x.contiguous();
  return p_.i8.empty() ? p_.int8_rows(in, true) : p_.int8_block_rows(in);
}

}  // namespace tserve_native
