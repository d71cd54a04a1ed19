"""Prompt throughput: the native step's ``prefill`` (int8 projections, activations quantized
row by row, a bfloat16 cache: what ``TSERVE_PREFILL=auto`` serves) against the model's float32
forward (``TSERVE_PREFILL=model``), one prompt of each length, in-process.

    python -m benchmarks.prefill [--models smollm2-135m-instruct gemma3-270m] [--lengths 16 64 256 1000 2000]

Both write the same prompt (the start of the docstrings ``chat_model.heldout_text`` reads) into
a fresh cache of the dtype each path serves with; the medians of ``--reps`` runs, tokens/s and
the ratio. The quality side (perplexity, greedy agreement) is ``benchmarks.int8_quality``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.chat_model import heldout_text

REPO = Path(__file__).resolve().parents[1]


def _time(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def _prefill_seconds(prefill, model, dtype: torch.dtype, prompt: list[int], reps: int) -> float:
    """Median seconds of ``prefill`` writing ``prompt`` into a fresh one-row cache."""
    def run() -> None:
        cache = model.new_cache(1, len(prompt) + 1, dtype=dtype)
        cache.ensure(0, len(prompt))
        prefill(cache, [prompt], [0])

    return _time(run, reps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256, 1000, 2000])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    from model import load_model
    from model.decode import DecodeOptions, prepare

    print(f"torch threads {torch.get_num_threads()}")
    print("| model | prompt tokens | float32 forward tok/s | native int8 prefill tok/s | native / float |")
    print("|---|---|---|---|---|")
    for name in args.models:
        ckpt = load_model(REPO / "weights" / name)
        model = ckpt.model.eval()
        step = prepare(model, DecodeOptions(), ckpt.tokenizer)
        if not hasattr(step, "prefill"):
            raise SystemExit(f"{name}: no native step here ({step.name}); nothing to compare")
        ids = ckpt.tokenizer.encode(heldout_text() * 4)
        for n in args.lengths:
            prompt = ids[:n]
            t_float = _prefill_seconds(model.prefill, model, model.dtype, prompt, args.reps)
            t_native = _prefill_seconds(step.prefill, model, step.kv_dtype, prompt, args.reps)
            print(f"| {name} | {len(prompt)} | {len(prompt) / t_float:.0f} | {len(prompt) / t_native:.0f} | "
                  f"**{t_float / t_native:.2f}×** |", flush=True)

if __name__ == "__main__":
    main()
