"""The native step on a model whose weights are 4-bit runs (a GGUF Q4_0 / Q4_1 file, here a tiny
Llama made so): its decode steps run the 4-bit kernel (``NativeStep(weights4=True)``, the
default) and its prompts the int8 one, and it keeps the properties the int8 step has: a row's
logits do not depend on the batch, the partner thread changes no bit; and its logits stay close
to the float model's."""

from __future__ import annotations

import torch
from torch import nn

from model.decode import DecodeOptions, prepare
from model.decode.native import NativeStep
from model.decode.step import PythonStep
from model.quant import q4
from tests.model.decode.test_native_decode import (
    _int8,
    _model,
    _ragged,
    assert_rows_alone_equal_rows_in_a_batch,
    assert_the_partner_changes_no_bit,
)
from tests.model.decode.test_native_prefill import _token_by_token
from tests.model.decode_steps import greedy_steps, random_prompts


def _q4_float(seed: int):
    """A tiny Llama (head size 64, widths multiples of 32) whose decoder projections hold 4-bit
    runs, dequantized: what importing a Q4_1 file gives."""
    model = _model(seed, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512)
    with torch.no_grad():
        for layer in model.decoder_layers:
            for module in layer.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(q4.dequantize(*q4.q4_runs(module.weight)))
    return model


def _projections(model) -> int:
    return 5 * len(model.decoder_layers)


def test_the_projections_of_a_q4_model_run_4_bit(fresh_seed):
    model = _int8(_q4_float(fresh_seed), fresh_seed)
    step = NativeStep(model)
    assert step.weights4 == _projections(model)  # the head (the embeddings, not 4-bit runs) stays int8
    assert NativeStep(model, weights4=False).weights4 == 0
    plain = _int8(_model(fresh_seed, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512), fresh_seed)
    assert NativeStep(plain).weights4 == 0  # float weights: not 4-bit runs
    # the service's option
    assert prepare(_int8(_q4_float(fresh_seed), fresh_seed), DecodeOptions(weights="int8")).weights4 == 0


def test_4_bit_steps_stay_close_to_the_float_model(fresh_seed):
    """Greedy steps of the 4-bit native step against the float model's own steps on the same
    (4-bit) weights: activations rounded to 8 bits per run of 32 are all that differ. The 4-bit
    weights are exact, so the 4-bit step is closer to the float model than the all-int8 step
    (which also rounds the weights) on the same model; over 26 seeds the 4-bit step's worst
    relative error was 1.5-2.1% and 0.55-0.66 of the int8 step's."""
    reference = _q4_float(fresh_seed)
    model = _int8(_q4_float(fresh_seed), fresh_seed)
    cache, first, slots, starts = _ragged(model, fresh_seed, dtype=torch.float32)
    before = cache.k.clone(), cache.v.clone()
    want = greedy_steps(PythonStep(reference), cache, first, slots, starts, 12)

    def worst_error(weights4: bool) -> float:
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        # teacher-forced on the reference's tokens: each step's logits compared, not a diverged path
        step = NativeStep(model, kv_dtype=torch.float32, weights4=weights4)
        assert bool(step.weights4) == weights4
        tokens, worst = first, 0.0
        with torch.inference_mode():
            for i, logits in enumerate(want):
                got = step(cache, tokens, slots, [s + i for s in starts])
                worst = max(worst, float((got - logits).norm() / logits.norm()))
                assert float((got.argmax(-1) == logits.argmax(-1)).float().mean()) >= 0.75, i
                tokens = logits.argmax(-1)
        return worst

    four, eight = worst_error(True), worst_error(False)
    assert four < 0.03
    assert four < 0.8 * eight, (four, eight)


def test_a_4_bit_row_gives_the_same_logits_alone_or_in_any_batch(fresh_seed):
    assert_rows_alone_equal_rows_in_a_batch(_int8(_q4_float(fresh_seed), fresh_seed), fresh_seed)


def test_prompts_take_the_int8_weights_and_decode_steps_the_4_bit_ones(fresh_seed):
    """A prompt written through ``prefill`` gives bit for bit what the all-int8 step writes (its
    K/V and last logits); one decode step per token gives the 4-bit step's, close to those."""
    model = _int8(_q4_float(fresh_seed), fresh_seed)
    four, eight = NativeStep(model, kv_dtype=torch.float32), NativeStep(model, kv_dtype=torch.float32, weights4=False)
    assert four.weights4 and not eight.weights4
    a, b = random_prompts(model, fresh_seed, (40, 23))
    caches = [model.new_cache(4, 64, dtype=torch.float32) for _ in range(2)]
    for c in caches:  # the pools are allocated empty: zeroed, so that whole pools compare
        c.k.zero_()
        c.v.zero_()
    with torch.inference_mode():
        got, want = (step.prefill(c, [a, b], [2, 0]) for step, c in zip((four, eight), caches))
    assert torch.equal(got, want)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    steps = model.new_cache(4, 64, dtype=torch.float32)
    last_a = _token_by_token(four, steps, a, 2)[-1]
    assert not torch.equal(last_a, got[0])  # the 4-bit weights, not the int8 ones
    # the two roundings apart: over 150 seeds a median of 3.5%, p95 4.5%, the worst 5.2%
    assert (last_a - got[0]).norm() / got[0].norm() < 0.08


def test_the_partner_thread_gives_the_same_4_bit_bits(fresh_seed):
    """With a partner the 4-bit tiles are shared as they lie (chunks of four): no bit changes."""
    model = _int8(_q4_float(fresh_seed), fresh_seed)
    alone, shared = assert_the_partner_changes_no_bit(model, fresh_seed)
    assert alone.weights4 == shared.weights4 == _projections(model)
