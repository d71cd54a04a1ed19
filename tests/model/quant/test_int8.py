"""int8 decoding: smoothing keeps the float function, decode-only int8 keeps prompts exact,
and the service's choice of which models get int8."""

from __future__ import annotations

import torch
import torch.ao.nn.quantized.dynamic as nnqd
from torch.ao.quantization import per_channel_dynamic_qconfig

from model import SamplingParams, build_model, generate
from model.config import ModelConfig
from model.nn.layers import FeedForward
from model.quant.int8 import (
    DecodeInt8Linear,
    RowwiseInt8Linear,
    blockwise_int8_linear,
    quantize_int8_,
    smooth_gated_ffn_,
    wants_int8,
)
from tests.model.nn.test_llama import llama_config


def _outlier_model(seed: int):
    """A tiny Llama whose SwiGLU products have a few huge channels, as real ones do."""
    model = build_model(llama_config(max_positions=128)).init_weights(seed).eval()
    with torch.no_grad():
        for layer in model.decoder_layers:
            layer.ffn.up.weight[:3] *= 60.0  # channels 0-2 of act(gate x) * up x blow up
            layer.ffn.down.weight[:, :3] /= 60.0  # ... and the model's function stays sane
    return model


def _down_input_spread(model, ids) -> float:
    """max over channels / median over channels of max |x| at the first down projection."""
    seen = {}
    ffn = model.decoder_layers[0].ffn
    h = ffn.down.register_forward_pre_hook(lambda _m, a: seen.setdefault("x", a[0].abs().amax((0, 1))))
    with torch.no_grad():
        model(ids)
    h.remove()
    return float(seen["x"].max() / seen["x"].median())


def test_smoothing_keeps_the_float_function_and_flattens_the_outliers(fresh_seed):
    model = _outlier_model(fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 24), generator=g)
    calib = torch.randint(3, model.cfg.vocab_size, (1, 40), generator=g)
    with torch.no_grad():
        before = model(ids).float()
    spread_before = _down_input_spread(model, ids)
    assert smooth_gated_ffn_(model, calib) == model.cfg.n_decoder_layers
    with torch.no_grad():
        after = model(ids).float()
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)  # the same function in float
    assert _down_input_spread(model, ids) < spread_before / 4  # the range moved into the weights


def test_smoothed_int8_is_closer_to_float_than_unsmoothed_all_int8(fresh_seed):
    ref_model = _outlier_model(fresh_seed)
    vocab = ref_model.cfg.vocab_size
    g = torch.Generator().manual_seed(fresh_seed)
    calib = torch.randint(3, vocab, (1, 40), generator=g)
    ids = torch.randint(3, vocab, (4, 1), generator=g)  # decode-shaped rows

    def decode_logits(model):
        cache = model.new_cache(4, 8)
        with torch.inference_mode():
            return model.decode_step(cache, ids.view(-1), [0, 1, 2, 3], [0, 0, 0, 0]).float()

    ref = decode_logits(ref_model)
    smoothed = _outlier_model(fresh_seed)
    quantize_int8_(smoothed, calib)
    naive = _outlier_model(fresh_seed)
    quantize_int8_(naive)  # every projection but the down ones ...
    for ffn in naive.modules():
        if isinstance(ffn, FeedForward):  # ... which are quantized here without smoothing
            plain = torch.nn.Linear(ffn.down.in_features, ffn.down.out_features, bias=False)
            plain.weight = ffn.down.weight
            plain.qconfig = per_channel_dynamic_qconfig
            ffn.down = nnqd.Linear.from_float(plain)
    err_smoothed = (decode_logits(smoothed) - ref).abs().mean()
    err_naive = (decode_logits(naive) - ref).abs().mean()
    assert err_smoothed < err_naive


def test_decode_only_int8_keeps_prompts_exact_and_decodes_in_int8(fresh_seed):
    model = build_model(llama_config(max_positions=128)).init_weights(fresh_seed).eval()
    g = torch.Generator().manual_seed(fresh_seed)
    prompt = torch.randint(3, model.cfg.vocab_size, (1, 20), generator=g)
    calib = torch.randint(3, model.cfg.vocab_size, (1, 40), generator=g)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        full_before = model(prompt).float()
    n = quantize_int8_(model, calib, decode_only=True)
    wrapped = [m for m in model.modules() if isinstance(m, DecodeInt8Linear)]
    assert n == len(wrapped) > 0
    assert all(isinstance(f.down, DecodeInt8Linear) for f in model.modules() if isinstance(f, FeedForward))
    model.optimize_for_inference()
    with torch.no_grad():  # a multi-token pass takes the float layers: smoothing is exact in float
        torch.testing.assert_close(model(prompt).float()[:, :-1], full_before[:, :-1], rtol=1e-4, atol=1e-4)
    calls = {"int8": 0}
    def counting(int8):
        def run(x):
            calls["int8"] += 1
            return int8(x)
        return run

    for m in wrapped:
        m.int8 = counting(m.int8)
    out = generate(model, [prompt[0].tolist()], params)[0].token_ids
    assert len(out) == 6 and calls["int8"] > 0  # decode steps went through int8
    calls["int8"] = 0
    cache = model.new_cache(1, 32)
    with torch.inference_mode():  # a one-token prompt chunk is still a prompt: float
        model.forward_cached(cache, prompt[:, :1], [0], [0], [1])
    assert calls["int8"] == 0


def test_which_models_the_service_quantizes():
    llama = llama_config()
    gpt = ModelConfig(family="decoder", vocab_size=64, d_model=32, n_heads=4, n_decoder_layers=1, d_ff=64)
    assert wants_int8("auto", llama, "cpu") and not wants_int8("auto", llama, "cuda")
    assert not wants_int8("auto", gpt, "cpu")  # our small GPT-style models stay float by default
    translator = ModelConfig(family="encoder-decoder", vocab_size=64, d_model=32, n_heads=4, d_ff=64,
                             decoder_start_token_id=0)
    assert wants_int8("auto", translator, "cpu") and not wants_int8("auto", translator, "cuda")
    assert wants_int8("int8", gpt, "cpu") and not wants_int8("none", llama, "cpu")


def test_int8_rows_do_not_depend_on_the_rows_beside_them(fresh_seed):
    """Each row's activations are quantized on their own: a row gives the same output alone or in
    any batch (one range per batch did not). Per row (an encoder-decoder's ``RowwiseInt8Linear``)
    a row alone is fbgemm's dynamic int8 linear on that row to float rounding; per run of 32 (a
    decoder's ``DecodeInt8Linear``) it is ``blockwise_int8_linear`` on the int8 weights."""
    g = torch.Generator().manual_seed(fresh_seed)
    plain = torch.nn.Linear(96, 40)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(40, 96, generator=g))
        plain.bias.copy_(torch.randn(40, generator=g))
    plain.qconfig = per_channel_dynamic_qconfig
    quantized = nnqd.Linear.from_float(plain)
    rows = torch.randn(6, 96, generator=g) * torch.tensor([0.1, 1.0, 8.0, 1.0, 30.0, 0.5])[:, None]
    for layer in (RowwiseInt8Linear(quantized), DecodeInt8Linear(plain, quantized)):
        together = layer.int8(rows)
        alone = torch.cat([layer.int8(rows[i:i + 1]) for i in range(6)])
        assert torch.equal(together, alone)
    w = quantized.weight()
    assert torch.equal(together, blockwise_int8_linear(rows, w.int_repr().float(), w.q_per_channel_scales().float(),
                                                       quantized.bias()))
    alone = torch.cat([RowwiseInt8Linear(quantized).int8(rows[i:i + 1]) for i in range(6)])
    for i in range(6):
        torch.testing.assert_close(alone[i:i + 1], quantized(rows[i:i + 1]), atol=1e-4 * rows[i].abs().max(), rtol=1e-4)
    assert not torch.equal(quantized(rows)[:1], quantized(rows[:1]))  # what one range per batch did
