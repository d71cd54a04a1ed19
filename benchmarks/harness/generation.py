"""Our side of a comparison and the checks on it: greedy generation and translation as the
sections call them, whether two runs produced the same tokens, and the per-step time."""

from __future__ import annotations

import torch

from benchmarks.harness.report import loud
from benchmarks.harness.timing import Stat
from model import SamplingParams, beam_search, generate


def ours_generate(model, prompts: torch.Tensor, n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in generate(model, prompts.tolist(), params)]


def ours_translate(model, groups: list[list[list[int]]], beam: int, n: int, step=None) -> list[list[int]]:
    out = []
    for sources in groups:
        if beam == 1:
            params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            out += [r.token_ids for r in generate(model, sources, params, step=step)]
        else:
            out += [r.token_ids for r in beam_search(model, sources, beam, 1.0, n, step=step)]
    return out


def compare_tokens(ours: list[list[int]], peer: list[list[int]], eos_id: int | None, what: str,
                   exact: bool = True) -> str:
    """'tokens identical' or a loud description of the first difference. With ``exact=False``
    (a peer that computes differently on purpose, e.g. int8) only the agreement is reported."""
    if ours == peer:
        return "tokens identical"
    if not exact:
        pairs = [(x, y) for a, b in zip(ours, peer) for x, y in zip(a, b)]
        same = sum(x == y for x, y in pairs)
        return f"{same / max(len(pairs), 1):.0%} tokens agree (not expected identical)"
    for row, (a, b) in enumerate(zip(ours, peer)):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            why = ""
            if at < len(a) and a[at] == eos_id:
                why = " (ours chose EOS there, which ignore_eos allows and min_new_tokens forbids)"
            loud(f"MISMATCH in {what}: row {row} differs from the peer at generated token {at}: "
                 f"ours {a[at:at + 5]} vs peer {b[at:at + 5]}{why}")
            return f"MISMATCH row {row} token {at}{why and ' (EOS)'}"
    loud(f"MISMATCH in {what}: different numbers of sequences or lengths")
    return "MISMATCH (lengths)"


def exact_dtype(dtype: torch.dtype) -> bool:
    """Whether two implementations should agree token for token: in fp32 the rounding
    differences between them stay far below the gaps between logits; in bf16/fp16 (3
    significant digits) a different order of the same sums can flip an argmax."""
    return dtype == torch.float32


def step_time(full: Stat, first: Stat, n: int) -> Stat:
    """Seconds per decode step from the N-token and 1-token timings (spread from the N-token runs)."""
    return full.map(lambda t: max(t - first.median, 0.0) / max(n - 1, 1))
