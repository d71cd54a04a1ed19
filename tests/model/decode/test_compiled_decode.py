"""The compiled decode step (model/decode/compiled.py) against the eager one it replaces:
same logits and same K/V written, for ragged batches over scattered slots, in float32
(to float rounding) and int8 (to the int8 rounding its fused maths can flip)."""

from __future__ import annotations

import pytest
import torch

from model import build_model
from model.decode.compiled import CompiledDecoder, unsupported_reason, wants_compile
from model.quant.int8 import DecodeInt8Linear, quantize_int8_
from tests.conftest import tiny_model
from tests.model.decode_steps import greedy_generations, greedy_steps, ragged_cache, random_prompts
from tests.model.nn.test_llama import llama_config


def _model(seed: int, **overrides):
    return build_model(llama_config(max_positions=128, **overrides)).init_weights(seed).eval()


_steps = greedy_steps


def _ragged(model, seed: int):
    """A 6-slot cache holding three prompts of different lengths in slots 4, 0, 2."""
    return ragged_cache(model, seed, (21, 5, 40), (4, 0, 2), 6, 100)


@pytest.mark.parametrize("fused", [True, False])
def test_float32_steps_equal_eager_logits_and_cache(fused, fresh_seed):
    model = _model(fresh_seed, fused_qkv=fused)
    cache, first, slots, starts = _ragged(model, fresh_seed)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    eager = _steps(model, cache, first, slots, starts, 12)  # spans 32 and 64: crosses a bucket
    eager_k, eager_v = cache.k.clone(), cache.v.clone()

    cache.k.copy_(before_k)
    cache.v.copy_(before_v)
    compiled = model.compile_decode(warm_up=False)
    got = _steps(model, cache, first, slots, starts, 12)
    assert compiled.active, compiled.failed
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(cache.k, eager_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v, eager_v, atol=1e-5, rtol=1e-5)


def test_greedy_generation_identical_with_and_without_compile(fresh_seed):
    model = _model(fresh_seed)
    prompts = random_prompts(model, fresh_seed, (9, 1, 30, 14))
    eager = greedy_generations(model, prompts)
    model.compile_decode()  # warm-up compiles on a scratch cache; generate() brings another
    assert greedy_generations(model, prompts) == eager
    assert greedy_generations(model, prompts[1:2]) == eager[1:2]  # batch 1's own graph


def test_int8_steps_stay_close_to_eager_int8(fresh_seed):
    model = _model(fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed + 1)
    calibration = torch.randint(3, model.cfg.vocab_size, (1, 64), generator=g)
    quantize_int8_(model, calibration, decode_only=True)
    model.optimize_for_inference()
    assert isinstance(model.decoder_layers[0].ffn.down, DecodeInt8Linear)
    cache, first, slots, starts = _ragged(model, fresh_seed)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    eager = _steps(model, cache, first, slots, starts, 6)
    cache.k.copy_(before_k)
    cache.v.copy_(before_v)
    model.compile_decode(warm_up=False)
    got = _steps(model, cache, first, slots, starts, 6)
    for a, b in zip(got, eager):
        # Same int8 kernels on the same weights: only where fused float maths rounds an
        # activation across an int8 step can a logit move, by a fraction of its spread.
        assert (a - b).abs().max() <= 0.05 * (b.max() - b.min()), (a - b).abs().max()


def test_which_models_compile():
    gpt = tiny_model("decoder")
    assert unsupported_reason(gpt) == "positions are not rotary"
    assert "decoder-only" in unsupported_reason(tiny_model("encoder-decoder"))
    with pytest.raises(ValueError, match="TSERVE_COMPILE=on: positions are not rotary"):
        wants_compile("on", gpt)
    with pytest.raises(ValueError, match="no compiled decode step"):
        CompiledDecoder(gpt)
    llama = _model(0)
    assert wants_compile("on", llama) and not wants_compile("off", llama)
    assert not wants_compile("auto", llama)  # float32 steps: measured no faster compiled
    quantize_int8_(llama, decode_only=True)
    assert wants_compile("auto", llama)
    assert not wants_compile("auto", gpt)


def test_a_failed_compile_falls_back_to_eager_and_training_drops_it(fresh_seed):
    model = _model(fresh_seed)
    cache, first, slots, starts = _ragged(model, fresh_seed)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    eager = _steps(model, cache, first, slots, starts, 3)
    cache.k.copy_(before_k)
    cache.v.copy_(before_v)
    compiled = model.compile_decode(warm_up=False)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    compiled.compiled_layer = broken
    got = _steps(model, cache, first, slots, starts, 3)
    assert compiled.failed == "RuntimeError: no C++ compiler" and not compiled.active
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)
    model.train()
    assert model.compiled_decode is None
