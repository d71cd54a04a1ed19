"""Shared by the tests of the decode steps (model.decode): a cache holding ragged prompts in
scattered slots, and greedy decode steps over it."""

from __future__ import annotations

import torch


def greedy_steps(step, cache, first: torch.Tensor, slots: list[int], starts: list[int], n: int) -> list[torch.Tensor]:
    """n greedy decode steps of ``step`` (a ``DecodeStep``) from ``first`` (B,) at positions
    ``starts`` of ``slots``: each step's logits."""
    logits, tokens = [], first
    with torch.inference_mode():
        for i in range(n):
            out = step(cache, tokens, slots, [s + i for s in starts])
            logits.append(out)
            tokens = out.argmax(-1)
    return logits


def ragged_cache(model, seed: int, lengths: tuple[int, ...], slots: tuple[int, ...], n_slots: int, max_len: int,
                 dtype: torch.dtype | None = None):
    """Random prompts of ``lengths`` prefilled into ``slots`` of a new cache: (cache, the first
    greedy tokens (B,), slots, the prompts' lengths = where decoding starts)."""
    prompts = random_prompts(model, seed, lengths)
    cache = model.new_cache(n_slots, max_len, dtype=dtype)
    cache.k.zero_()  # the pool is allocated empty (blocks are zeroed on first use): tests that run two
    cache.v.zero_()  # steps from a copy of this cache compare whole pools, unused blocks too
    with torch.inference_mode():
        first = model.prefill(cache, prompts, list(slots)).argmax(-1)
    return cache, first, list(slots), list(lengths)


def random_prompts(model, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def greedy_generations(model, prompts: list[list[int]], n: int = 20, step=None) -> list[list[int]]:
    """``n`` greedy tokens per prompt through the engine core (``model.generate``) and ``step``."""
    from model import SamplingParams, generate

    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in generate(model, prompts, params, step=step)]


def native_library_or_skip() -> None:
    """Builds (or finds) the native library; a test without it skips, naming why: no C++ compiler
    or ninja here is a real missing resource."""
    import pytest

    from model.decode.native import build

    try:
        build()
    except RuntimeError as exc:
        pytest.skip(str(exc))
