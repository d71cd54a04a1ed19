"""Our decode step under ``torch.compile`` vs the same loop in eager mode.

``model.generate`` does per-step host bookkeeping (trackers, detokenization) around
``decode_step``; to isolate what compiling the step buys, both sides here run one plain
greedy loop (prefill, then ``decode_step`` + argmax) over one preallocated cache that is
reused across calls (a new cache object per call would invalidate the compiled guards).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.config import BenchConfig
from benchmarks.decode import compare_tokens, exact_dtype
from benchmarks.report import Row, RunReport, say
from benchmarks.timing import time_interleaved
from benchmarks.workspace import Workspace


def greedy_loop(model, cache, prompts: torch.Tensor, n: int, step: Callable) -> list[list[int]]:
    b, p = prompts.shape
    slots = list(range(b))
    with torch.inference_mode():
        logits = model.prefill(cache, prompts.tolist(), slots)
        token = logits.argmax(dim=-1)  # (B,)
        out = [token]
        for i in range(n - 1):
            token = step(cache, token, slots, [p + i] * b).argmax(dim=-1)
            out.append(token)
    return torch.stack(out, dim=1).tolist()


def measure_compiled_decode(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str, device: str,
                            dtype: torch.dtype, mode: str) -> None:
    model = ws.gpt2_ours(device, dtype)
    n, p = cfg.decode_new_tokens, cfg.decode_prompt_len
    gen = torch.Generator().manual_seed(cfg.seed + 9)
    compiled = torch.compile(model.decode_step, mode=mode)
    for b in cfg.decode_batches:
        prompts = torch.randint(8, model.cfg.vocab_size, (b, p), generator=gen).to(device)
        cache = model.new_cache(b, p + n)
        say(f"{section}: torch.compile(mode={mode!r}) decode step, batch {b} (the warm-up run compiles)")
        def loop(step: Callable, cache=cache, prompts: torch.Tensor = prompts) -> list[list[int]]:
            return greedy_loop(model, cache, prompts, n, step)

        # The default warm-up runs the full loop once, so every shape is compiled before timing.
        stats, outs = time_interleaved({"compiled": lambda: loop(compiled), "eager": lambda: loop(model.decode_step)},
                                       cfg.repetitions, device)
        check = compare_tokens(outs["compiled"], outs["eager"], None, f"compiled decode batch {b}",
                               exact=exact_dtype(dtype))
        report.rows.append(Row(
            section, f"GPT-2 {cfg.gpt2_layers}L d{cfg.gpt2_d_model} {device} {str(dtype).removeprefix('torch.')}, "
                     f"batch {b}, prompt {p}, {n} new, greedy loop",
            "tokens/s", stats["compiled"].map(lambda t, b=b: b * n / t), peer="same loop, eager decode_step",
            peer_value=stats["eager"].map(lambda t, b=b: b * n / t), check=check,
            note=f"ours = torch.compile(decode_step, mode={mode!r}); compile time excluded (warm-up run)"))
        say(f"{section}: batch {b}: compiled {b * n / stats['compiled'].median:.1f} tok/s, "
            f"eager {b * n / stats['eager'].median:.1f} tok/s; {check}")
