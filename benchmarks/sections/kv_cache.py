"""3. KV cache: cached decoding vs full recomputation, at several total lengths.

Same GPT-2 weights as section 1, batch 1, greedy. For a total length T:
- cached: a prompt of T - n tokens, then n new tokens through ``model.generate``; the
  per-token time is (t(n) - t(1)) / (n - 1), the decode steps alone;
- recomputation: each new token runs the whole sequence through ``model.hidden_states``
  (no cache) and projects only the last position (the cheapest honest no-cache decoder).
  Only k tokens are timed (each costs a whole prefill); they are the last k tokens before
  T, so their mean is the per-token cost at lengths T-k+1..T, measured, not extrapolated.
The recomputed tokens are compared with the cached run's tokens at the same positions.
"""

from __future__ import annotations

import torch

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.generation import compare_tokens, exact_dtype, ours_generate, step_time
from benchmarks.harness.report import Row, RunReport, Target, say
from benchmarks.harness.timing import time_interleaved
from benchmarks.harness.workspace import Workspace

KV_TARGET_LENGTH = 1024  # the issue: cached >= 10x recomputation at 1024 tokens


@torch.inference_mode()
def recompute_generate(model, ids: torch.Tensor, k: int) -> list[list[int]]:
    """Greedy, k tokens, no cache: a full forward over the growing sequence per token."""
    new = []
    for _ in range(k):
        last = model.hidden_states(ids)[:, -1]  # (B, d), final norm applied
        token = model.lm_head(last).argmax(dim=-1)  # (B,)
        new.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
    return torch.stack(new, dim=1).tolist()


def measure_kv_cache(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str,
                     device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    model = ws.gpt2_ours(device, dtype)
    n, k = cfg.kv_cached_new_tokens, cfg.kv_recompute_new_tokens
    if not 1 <= k <= n - 1:
        raise ValueError(f"kv_recompute_new_tokens must be in [1, kv_cached_new_tokens - 1 = {n - 1}], got {k}")
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    for total in cfg.kv_lengths:
        if total > model.cfg.max_positions:
            raise ValueError(f"kv_lengths: {total} exceeds the model's {model.cfg.max_positions} positions "
                             "(raise gpt2_positions)")
        prompt = torch.randint(8, model.cfg.vocab_size, (1, total - n), generator=gen).to(device)
        cached_tokens = ours_generate(model, prompt, n)[0]
        # Recompute the last k tokens from the same history, so both produce tokens T-k+1..T.
        history = torch.cat([prompt, torch.tensor([cached_tokens[: n - k]], device=device)], dim=1)
        say(f"{section}: total length {total} ({cfg.repetitions} repetitions)")
        def cached(m: int, prompt: torch.Tensor = prompt) -> list[list[int]]:
            return ours_generate(model, prompt, m)

        def recompute(m: int, history: torch.Tensor = history) -> list[list[int]]:
            return recompute_generate(model, history, m)

        stats, outs = time_interleaved(
            {"cached": lambda: cached(n), "cached_1": lambda: cached(1), "recompute": lambda: recompute(k)},
            cfg.repetitions, device, warmups={"recompute": lambda: recompute(1)})
        check = compare_tokens([outs["cached"][0][n - k:]], outs["recompute"], model.cfg.eos_token_id,
                               f"KV cache vs recomputation at {total}", exact=exact_dtype(dtype))
        cached_step = step_time(stats["cached"], stats["cached_1"], n)
        target = Target(">=", 10.0, text="≥ 10×") if total == KV_TARGET_LENGTH else None
        report.rows.append(Row(
            section, f"batch 1, total length {total}", "tokens/s", cached_step.map(lambda s: 1.0 / s),
            peer="full recomputation", peer_value=stats["recompute"].map(lambda t: k / t), target=target,
            check=check,
            note=f"cached: {n} new tokens after a {total - n}-token prompt, decode steps only; recomputation: "
                 f"the last {k} tokens, one full forward each, LM head on the last position only"))
        say(f"{section}: {total}: cached {1 / cached_step.median:.1f} tok/s, recompute "
            f"{k / stats['recompute'].median:.2f} tok/s; {check}")


@torch.inference_mode()
def measure_slot_layout(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str,
                        device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """One decode step of 8 sequences in consecutive slots (the scheduler keeps them so: the
    cache is read through a view) against every other slot (holes left by finished
    sequences: every layer gathers each history). Same tokens, positions and histories."""
    model = ws.gpt2_ours(device, dtype)
    batch, history = 8, min(cfg.slot_layout_history, model.cfg.max_positions - 2)
    cache = model.new_cache(3 * batch, history + 1)
    gen = torch.Generator().manual_seed(cfg.seed + 4)
    prompts = torch.randint(8, model.cfg.vocab_size, (batch, history), generator=gen).tolist()
    tokens = torch.randint(8, model.cfg.vocab_size, (batch,), generator=gen).to(device)
    # the same 8 histories in slots 0..7, and again in slots 8, 10, .., 22
    layouts = {"contiguous": list(range(batch)), "holes": list(range(batch, 3 * batch, 2))}
    for slots in layouts.values():
        model.prefill(cache, prompts, slots)

    def step(slots: list[int]) -> torch.Tensor:
        return model.decode_step(cache, tokens, slots, [history] * batch)

    say(f"{section}: decode step, slot layout ({cfg.repetitions * 10} repetitions)")
    stats, outs = time_interleaved({name: (lambda s=slots: step(s)) for name, slots in layouts.items()},
                                   cfg.repetitions * 10, device)
    same = torch.equal(outs["contiguous"].argmax(-1), outs["holes"].argmax(-1))
    report.rows.append(Row(
        section, f"decode step, batch {batch} at {history} tokens of history: slots 0..{batch - 1}",
        "steps/s", stats["contiguous"].map(lambda t: 1.0 / t), peer="slots with holes (gathered reads)",
        peer_value=stats["holes"].map(lambda t: 1.0 / t),
        check="next tokens identical" if same else "MISMATCH: next tokens differ",
        note="why the scheduler moves sequences down into freed slots"))


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    measure_kv_cache(ws, cfg, report, "3. KV cache")
    measure_slot_layout(ws, cfg, report, "3. KV cache")
