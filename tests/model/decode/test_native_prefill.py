"""Prompts through the native step (``NativeStep.prefill``): a prompt's rows at consecutive
positions of its slot, in one call, against the same prompt fed one token per step, and against
the model's own float prefill through the engine core (chunked prompts, prefix hits); a model
whose float copies the native prefill let go (``drop_float_copies``) decodes as before."""

from __future__ import annotations

import os

import pytest
import torch

from model import EngineCore, EngineRequest, SamplingParams
from model.decode import native as native_decode
from model.decode.native import NativeStep
from model.nn.layers import Linear
from model.quant.int8 import DecodeInt8Linear
from tests.model.decode.test_native_decode import _int8, _model
from tests.model.decode_steps import random_prompts


def _token_by_token(step, cache, prompt: list[int], slot: int, start: int = 0) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([step(cache, torch.tensor([t]), [slot], [start + i]) for i, t in enumerate(prompt)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_prefill_equals_the_prompt_fed_one_token_per_step(dtype, fresh_seed):
    """Activations are quantized row by row and every row attends over its own positions, so a
    prompt written in one call gives bit for bit the logits and the K/V of one step per token;
    here two prompts share the call, one of them a chunk continuing at position 9, across block
    boundaries."""
    model = _int8(_model(fresh_seed, d_model=256, n_heads=4, n_kv_heads=2), fresh_seed)
    step = NativeStep(model, kv_dtype=dtype)
    a, b = random_prompts(model, fresh_seed, (40, 23))
    reference = model.new_cache(4, 64, dtype=dtype)
    last_a = _token_by_token(step, reference, a, 2)[-1]
    _token_by_token(step, reference, b[:9], 0)
    last_b = _token_by_token(step, reference, b[9:], 0, start=9)[-1]
    cache = model.new_cache(4, 64, dtype=dtype)
    with torch.inference_mode():
        _token_by_token(step, cache, b[:9], 0)
        logits = step.prefill(cache, [a, b[9:]], [2, 0], starts=[0, 9])
    assert logits.shape == (2, model.cfg.vocab_size)
    assert torch.equal(logits[0], last_a) and torch.equal(logits[1], last_b)
    for s in (0, 2):  # each cache's own blocks of the slot (allocated in another order)
        mine, theirs = (c.tables[s][c.tables[s] > 0] for c in (cache, reference))
        assert torch.equal(cache.k[:, :, mine], reference.k[:, :, theirs])
        assert torch.equal(cache.v[:, :, mine], reference.v[:, :, theirs])


def test_a_float32_prefill_equals_the_model_prefill(fresh_seed):
    model = _model(fresh_seed)
    step = NativeStep(model, kv_dtype=torch.float32)
    prompts = random_prompts(model, fresh_seed, (31, 1, 17))
    ours, theirs = model.new_cache(3, 64, dtype=torch.float32), model.new_cache(3, 64, dtype=torch.float32)
    with torch.inference_mode():
        got = step.prefill(ours, prompts, [1, 0, 2])
        want = model.prefill(theirs, prompts, [1, 0, 2])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    for s in range(3):
        mine, held = (c.tables[s][c.tables[s] > 0] for c in (ours, theirs))
        torch.testing.assert_close(ours.k[:, :, mine], theirs.k[:, :, held], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.v[:, :, mine], theirs.v[:, :, held], atol=1e-5, rtol=1e-5)


def _core_generations(model, step, prompts, max_prefill_tokens: int, prefix_cache: bool) -> list[list[int]]:
    core = EngineCore(model, None, n_slots=4, max_len=96, max_prefill_tokens=max_prefill_tokens,
                      prefix_cache=prefix_cache, step=step)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        core.add(EngineRequest(str(i), list(p), params))
    while core.has_work:
        for event in core.step().events:
            out[event.request_id] += event.token_ids
    return [out[str(i)] for i in range(len(prompts))]


def test_the_engine_gives_the_same_tokens_whichever_path_writes_the_prompts(fresh_seed):
    """Greedy tokens through the engine core with the native prefill (float32 weights and cache,
    so both paths agree to float rounding) and with the model's forward writing the prompts:
    prompts chunked over several steps, two sharing a prefix (a prefix-cache hit continues at a
    later position)."""
    model = _model(fresh_seed)
    shared, a, b, c = random_prompts(model, fresh_seed, (32, 9, 41, 3))
    prompts = [shared + a, b, shared + c, c]
    reference = _core_generations(model, NativeStep(model, kv_dtype=torch.float32, prefills=False), prompts,
                                  16, False)
    native = NativeStep(model, kv_dtype=torch.float32)
    assert _core_generations(model, native, prompts, 16, True) == reference
    assert _core_generations(model, native, prompts, 256, False) == reference


@pytest.mark.parametrize("window", [None, 300], ids=["no window", "window 300"])
def test_a_long_prompt_attends_as_blocks_close_to_row_by_row(window, fresh_seed):
    """From ``PROMPT_ATTENTION_ROWS`` rows of one sequence on, a prompt chunk attends as blocks
    (torch's flash attention over its keys, in pieces merged by their log-sum-exp, the keys
    before the chunk included): float32 logits within float rounding of the row-by-row walk, and
    with blocks switched off (0) an int8 prompt is still bit for bit one step per token. A short
    prompt in the same call walks its rows. With a window (Gemma 3's local layers; here every
    layer, a window of 300 against 640 rows in 256-row pieces), the blocks gather only the keys
    inside it and mask those that leave a row's window."""
    from model import build_model
    from tests.model.nn.test_llama import llama_config

    windowed = {} if window is None else dict(sliding_window=window)  # every layer windowed

    def tiny():
        return build_model(llama_config(max_positions=720, d_model=128, n_heads=4, n_kv_heads=2,
                                        **windowed)).init_weights(fresh_seed).eval()

    def chunked(step, model, min_rows: int) -> list[torch.Tensor]:
        step.plan.set_prompt_attention(min_rows)
        cache = model.new_cache(4, 720, dtype=torch.float32)
        with torch.inference_mode():  # 60 rows first, then 640 continuing (and the short prompt beside them)
            first = step.prefill(cache, [long[:60]], [1])
            rest = step.prefill(cache, [long[60:], short], [1, 3], starts=[60, 0])
        step.plan.set_prompt_attention(native_decode.PROMPT_ATTENTION_ROWS)
        return [first[0], rest[0], rest[1]]

    model = tiny()
    step = NativeStep(model, kv_dtype=torch.float32)
    long, short = random_prompts(model, fresh_seed, (700, 30))
    blocks, by_rows = chunked(step, model, 128), chunked(step, model, 0)
    torch.testing.assert_close(blocks[1], by_rows[1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(blocks[1], by_rows[1])  # the block path did run: not the row-by-row bits
    assert torch.equal(blocks[0], by_rows[0]) and torch.equal(blocks[2], by_rows[2])  # under 128 rows: rows

    int8 = _int8(tiny(), fresh_seed)
    step = NativeStep(int8, kv_dtype=torch.float32)
    reference = int8.new_cache(4, 720, dtype=torch.float32)
    rows = _token_by_token(step, reference, long, 1)
    exact = chunked(step, int8, 0)
    assert torch.equal(exact[0], rows[59]) and torch.equal(exact[1], rows[-1])


@pytest.mark.parametrize("window,d_model,n_heads,n_kv_heads", [(None, 128, 2, 1), (300, 384, 6, 2), (None, 256, 2, 1)],
                         ids=["head 64", "window 300, groups of 3", "head 128"])
def test_blocks_over_a_bfloat16_cache_use_bfloat16_dot_products_close_to_the_row_walk(
        window, d_model, n_heads, n_kv_heads, fresh_seed):
    """Over a bfloat16 cache, prompt blocks attend with the CPU's bfloat16 dot products
    (csrc attend_block_bf16: q and each tile's probabilities rounded to bfloat16, scores and
    sums float32), flash style with per-row causal and window limits. Every row's logits (a
    float model, so nothing but attention differs) stay close to the row walk, which reads the
    same cache in float32, as close as torch's flash attention over the widened keys is; and the
    kernel did run (other bits than that path). 641 rows in pieces of 256, 256 and 129 with
    groups of 3: a last block of query rows shorter than the kernel's four."""
    from model import build_model
    from model.decode.native import _tables
    from tests.model.nn.test_llama import llama_config

    windowed = {} if window is None else dict(sliding_window=window)
    model = build_model(llama_config(max_positions=720, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                     **windowed)).init_weights(fresh_seed).eval()
    step = NativeStep(model, kv_dtype=torch.bfloat16)
    if not step.plan.set_prompt_bf16(True):
        pytest.skip("this CPU has no AVX512-BF16: blocks over a bfloat16 cache take torch's flash attention")
    prompt = random_prompts(model, fresh_seed, (700,))[0]

    def every_row(min_rows: int, bf16: bool) -> torch.Tensor:
        step.plan.set_prompt_attention(min_rows)
        step.plan.set_prompt_bf16(bf16)
        cache = model.new_cache(1, 720, dtype=torch.bfloat16)
        cache.ensure(0, 700)
        out = []
        with torch.inference_mode():  # 59 rows (the row walk either way), then 641 continuing
            for lo, hi in ((0, 59), (59, 700)):
                positions, tables = _tables(cache, [0] * (hi - lo), list(range(lo, hi)))
                out.append(step.plan.prefill(torch.tensor(prompt[lo:hi]), cache.k, cache.v, tables, positions,
                                             list(range(hi - lo))))
        step.plan.set_prompt_attention(native_decode.PROMPT_ATTENTION_ROWS)
        step.plan.set_prompt_bf16(True)
        return torch.cat(out)

    walk, flash, bf16 = every_row(0, False), every_row(128, False), every_row(128, True)
    assert torch.equal(bf16[:59], walk[:59])  # under 128 rows: the row walk
    flash_error = (flash - walk).abs().max().item()
    bf16_error = (bf16 - walk).abs().max().item()
    assert 0 < bf16_error < max(4 * flash_error, 2e-3 * walk.abs().max().item()), (bf16_error, flash_error)
    assert not torch.equal(bf16, flash)
    assert (bf16.argmax(-1) == walk.argmax(-1)).float().mean() > 0.99


def test_serving_under_the_native_prefill_lets_the_float_copies_go(fresh_seed):
    """``prepare`` under the native step's prefill keeps only what the step reads
    (``drop_float_copies``, ``halve_embeddings``): fewer bytes; against the full model with its
    token table rounded to bfloat16 alike, the same prompt logits bit for bit and the same
    greedy tokens through the engine (chunked prompts, a prefix hit); and the model's own
    forward still runs, in int8, as the full model's forward does inside decode steps. The float
    prefill asks for the copies and is refused by name."""
    from model.decode import DecodeOptions, prepare
    from model.quant.int8 import decode_step_context
    from service.models.memory import weights_bytes

    full, lean = (_int8(_model(fresh_seed), fresh_seed) for _ in range(2))
    with torch.no_grad():
        full.embed.tokens.weight.copy_(full.embed.tokens.weight.bfloat16().float())
    kept = NativeStep(full, kv_dtype=torch.bfloat16)
    before = weights_bytes(lean)
    step = prepare(lean, DecodeOptions(native="on"))
    int8 = [m for m in lean.modules() if isinstance(m, DecodeInt8Linear)]
    assert step.prefills and int8 and all(m.dense is None for m in int8)
    assert all(m.packed is None for m in lean.modules() if isinstance(m, Linear))
    assert lean.embed.tokens.weight.dtype == torch.bfloat16 and lean.dtype == torch.float32
    assert weights_bytes(lean) < 0.6 * before
    shared, a, b = random_prompts(full, fresh_seed, (30, 7, 50))
    prompts = [shared + a, b, shared + b[:5]]
    with torch.inference_mode():
        logits = [s.prefill(m.new_cache(3, 96, dtype=torch.bfloat16), prompts, [0, 1, 2])
                  for m, s in ((lean, step), (full, kept))]
    assert torch.equal(*logits)
    for chunk in (16, 256):
        assert _core_generations(lean, step, prompts, chunk, True) == _core_generations(full, kept, prompts, chunk,
                                                                                          True)
    ids = torch.tensor([shared + a])
    with torch.inference_mode():
        with decode_step_context():
            want = full(ids)
        assert torch.equal(lean(ids), want)
    with pytest.raises(ValueError, match="prefill='model' needs the float weights"):
        prepare(lean, DecodeOptions(native="on", prefill="model"))
    with pytest.raises(ValueError, match="4-bit weights are read from the float weights"):
        NativeStep(lean)
    assert NativeStep(lean, weights4=False).prefills  # int8 only: nothing to read from them


def _mapped_rss_kib(path) -> int:
    """This process's resident KiB of the mappings of ``path`` (/proc/self/smaps)."""
    total, current = 0, None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            current = fields[5] if len(fields) > 5 else None
        elif fields[0] == "Rss:" and current == str(path):
            total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_dropped_tensors_give_back_their_mapped_pages_and_nothing_else(tmp_path):
    """A tensor read from a memory-mapped safetensors file (as the weights cache serves a
    converted checkpoint) keeps its pages resident while any tensor of the file lives;
    ``_forget_pages`` drops them, and reading them again gives the file's values. A heap tensor
    is left alone (its values stay)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"big": torch.randn(2048, 2048), "small": torch.randn(16)}, str(path))
    with safe_open(str(path), framework="pt") as f:
        big, small = f.get_tensor("big"), f.get_tensor("small")
    expected = big.clone()
    assert float(big.sum()) == float(expected.sum())  # every page read
    resident = _mapped_rss_kib(path.resolve())
    if resident < 8_000:
        pytest.skip("safetensors copied the tensor instead of mapping the file here")
    native_decode._forget_pages([big])
    assert _mapped_rss_kib(path.resolve()) < resident - 8_000  # 16 MiB mapped, nearly all of it given back
    assert torch.equal(big, expected) and small.numel() == 16  # read again from the file
    heap = torch.randn(1024, 1024)
    kept = heap.clone()
    native_decode._forget_pages([heap])
    assert torch.equal(heap, kept)
