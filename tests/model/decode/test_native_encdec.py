"""The native encoder-decoder step (model/decode/native.py ``NativeEncDecStep``; csrc
``EncDecDecoder``) and the row-wise int8 projections it reads (model/quant/int8.py
``RowwiseInt8Linear``; csrc ``Int8Linear``): the C++ step gives the Python step's logits bit for
bit (the same operations in the same order), for the layer shapes it takes; it is chosen where it
can run and refused by name where it cannot; the int8 translator's cached decoding equals its
full recomputation."""

from __future__ import annotations

import pytest
import torch
import torch.ao.nn.quantized.dynamic as nnqd
from torch.ao.quantization import per_channel_dynamic_qconfig

from model import SamplingParams, beam_search, generate
from model.decode import DecodeOptions, prepare
from model.decode.native import (
    NativeEncDecStep,
    attach_int8_kernels,
    encdec_unsupported_reason,
    native_attention,
    wants_native,
)
from model.decode.step import PythonStep
from model.quant.int8 import RowwiseInt8Linear, quantize_checkpoint_, quantize_int8_, rowwise_int8_linear
from tests.conftest import tiny_model
from tests.model.decode_steps import native_library_or_skip


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    native_library_or_skip()


# Layer shapes the step takes: the paper's / Marian's (post-norm, swish, sinusoidal, separate
# q/k/v), a pre-norm one with a final norm and erf GELU, and a fused-qkv one with learned
# positions, a scaled and normalised embedding, q/k/v biases and tanh GELU.
SHAPES = {
    "marian": {"activation": "swish"},
    "pre-norm": {"norm_placement": "pre", "final_norm": True, "activation": "gelu"},
    "fused": {"fused_qkv": True, "activation": "gelu_new", "positional": "learned", "scale_embedding": True,
              "embedding_norm": True, "qkv_bias": True},
}


def _int8_translator(shape: str, seed: int = 5):
    model = tiny_model("encoder-decoder", seed=seed, d_model=128, n_heads=2, d_ff=128, max_positions=64,
                       **SHAPES[shape])
    quantize_int8_(model, rowwise=True)
    model.optimize_for_inference()
    return model


def _sources(model, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() + [model.cfg.eos_token_id]
            for n in lengths]


def _python_step(model) -> PythonStep:
    """The Python step with the native library's kernels: what the C++ step replaces."""
    kernel = native_attention("native", model.device)
    attach_int8_kernels(model)
    return PythonStep(model, None, kernel)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_native_step_gives_the_python_steps_logits_bit_for_bit(shape, fresh_seed):
    """Ragged sources decoded together, greedy: the same tokens and the same log-probabilities to
    the last bit; beams: the same hypotheses and scores (beam forks share blocks, so the block
    tables change under the step)."""
    model = _int8_translator(shape)
    assert encdec_unsupported_reason(model) is None
    native, python = NativeEncDecStep(model), _python_step(model)
    sources = _sources(model, fresh_seed, (3, 17, 9, 30, 1))
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    ours = generate(model, sources, params, step=native)
    reference = generate(model, sources, params, step=python)
    assert [r.token_ids for r in ours] == [r.token_ids for r in reference]
    assert [r.logprobs for r in ours] == [r.logprobs for r in reference]
    beams = beam_search(model, sources, beam_size=3, max_new_tokens=10, step=native)
    reference_beams = beam_search(model, sources, beam_size=3, max_new_tokens=10, step=python)
    assert [(b.token_ids, b.score) for b in beams] == [(b.token_ids, b.score) for b in reference_beams]


def test_the_native_step_is_batch_invariant(fresh_seed):
    model = _int8_translator("marian")
    step = NativeEncDecStep(model)
    sources = _sources(model, fresh_seed, (12, 4, 25, 7))
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    together = generate(model, sources, params, step=step)
    alone = [generate(model, [s], params, step=step)[0] for s in sources]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    # The encoder's SDPA over padded sources differs from the unpadded one by float rounding
    # (~1e-7); now and then that moves an activation across an int8 rounding boundary in a
    # row-wise int8 projection, which moves a log-probability by up to ~3e-3 (the largest seen
    # over 200 random seeds was 2.6e-3). A row mixed up with another moves it by whole units.
    for a, b in zip(together, alone):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-2, rtol=0)


def test_int8_cached_decoding_equals_recomputation(fresh_seed):
    """Every projection row-wise int8, so a row's projections do not depend on how many rows
    go in: the teacher-forced full pass over the generated tokens gives the cached steps'
    tokens, and their log-probabilities up to what the attention kernels' float rounding can do
    downstream of an int8 rounding (below)."""
    model = _int8_translator("marian")
    source = _sources(model, fresh_seed, (11,))[0]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    out = generate(model, [source], params, step=NativeEncDecStep(model))[0]
    tgt = torch.tensor([[model.cfg.decoder_start_token_id, *out.token_ids[:-1]]])
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([source]), tgt).float(), -1)[0]
    assert full.argmax(-1).tolist() == out.token_ids
    chosen = full.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    # PyTorch's attention and the step's differ by float rounding (~1e-7). Most seeds agree to
    # 5e-7; about 1 in 100 sees an activation moved across an int8 rounding boundary in a
    # row-wise projection, one quantum of that row, which moves the later log-probabilities by up
    # to ~1e-3 (7.2e-4 over 300 seeds). The bound is the batch-invariance test's, for the same
    # reason; a wrong cache (a token attending to the wrong keys) moves them by whole units.
    torch.testing.assert_close(chosen, torch.tensor(out.logprobs), atol=1e-2, rtol=0)


def test_prepare_chooses_the_native_step_where_it_can_run():
    model = tiny_model("encoder-decoder", seed=2, d_model=128, n_heads=2, d_ff=128, max_positions=64)
    assert isinstance(prepare(model, DecodeOptions(quantize="none")), PythonStep)  # float: the Python step
    with pytest.raises(ValueError, match="row-wise int8"):
        wants_native("on", model)
    quantize_checkpoint_(model, None)  # the service's int8 for an encoder-decoder: row-wise, everywhere
    assert all(isinstance(m, RowwiseInt8Linear) for m in (model.lm_head.proj, model.encoder_layers[0].ffn.up,
                                                          model.decoder_layers[0].cross_attn.out_proj))
    assert isinstance(prepare(model, DecodeOptions()), NativeEncDecStep)
    assert isinstance(prepare(model, DecodeOptions(native="off")), PythonStep)
    per_call = tiny_model("encoder-decoder", seed=2, d_model=128, n_heads=2, d_ff=128, max_positions=64)
    quantize_int8_(per_call)  # fbgemm's one range per call: not the step's arithmetic
    assert "not row-wise int8" in encdec_unsupported_reason(per_call)


@pytest.mark.parametrize("field, value", [("norm", "rmsnorm"), ("positional", "rope"), ("n_kv_heads", 1),
                                          ("mlp", "gated")])
def test_what_the_native_step_lacks_is_refused_by_name(field, value):
    model = tiny_model("encoder-decoder", seed=3, d_model=64, n_heads=2, d_ff=64, max_positions=64, **{field: value})
    quantize_checkpoint_(model, None)
    why = encdec_unsupported_reason(model)
    assert why is not None and f"'{field}'" in why
    with pytest.raises(ValueError, match=f"'{field}'"):
        wants_native("on", model)
    assert not wants_native("auto", model) and isinstance(prepare(model, DecodeOptions()), PythonStep)


@pytest.mark.parametrize("bias, smoothed", [(True, False), (False, True)])
def test_the_native_int8_projection_is_the_python_one_bit_for_bit(bias, smoothed, fresh_seed):
    """``Int8Linear`` (csrc) against ``rowwise_int8_linear``: every row quantized on its own
    range, rows of very different scales and an all-zero row, with and without a bias and a
    smoothing scale; and a row gives the same result alone or in a batch."""
    g = torch.Generator().manual_seed(fresh_seed)
    plain = torch.nn.Linear(96, 40, bias=bias)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(40, 96, generator=g))
        if bias:
            plain.bias.copy_(torch.randn(40, generator=g))
    plain.qconfig = per_channel_dynamic_qconfig
    quantized = nnqd.Linear.from_float(plain)
    inv = torch.rand(96, generator=g) + 0.5 if smoothed else None
    layer = RowwiseInt8Linear(quantized, inv)
    rows = torch.randn(7, 96, generator=g) * torch.tensor([0.1, 1.0, 8.0, 1.0, 30.0, 0.5, 0.0])[:, None]
    python = layer(rows)
    w = quantized.weight()
    expected = rowwise_int8_linear(rows if inv is None else rows * inv, quantized._packed_params._packed_params,
                                   w.dequantize().float().sum(1), quantized.bias())
    assert torch.equal(python, expected)
    assert attach_int8_kernels(torch.nn.Sequential(layer)) == 1
    native = layer(rows)
    assert torch.equal(native, python)
    assert torch.equal(torch.cat([layer(rows[i:i + 1]) for i in range(7)]), native)
    with pytest.raises(RuntimeError, match="x must be"):
        layer.native.forward(rows[:, :95].contiguous())
