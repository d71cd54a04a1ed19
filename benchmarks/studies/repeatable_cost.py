"""What repeatable temperature 0 costs (issue 40 §2): the native step of SmolLM2-135M-Instruct
as served by default, in-process.

    python -m benchmarks.studies.repeatable_cost [--lengths 256 1024 3000] [--reps 3]

- prompts: one prompt of each length written into a fresh cache by ``NativeStep.prefill``, its
  attention as one fixed arithmetic per row (the default now) against the block path it had
  (``set_prompt_attention(128)``: torch's flash attention over pieces of 256 rows, whose rounding
  depends on where a chunk starts), alternated in the same run; tokens/s and the ratio;
- decode steps: batch 1 and 8 at ``--context`` positions, ms a step (the attention kernel
  changed too: run this module under the old revision's tree for its figures, e.g.
  ``cd OLD_TREE && python -m benchmarks.studies.repeatable_cost --decode-only`` with this file copied there; the
  previous revision has no opt-in for its old decode kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _median_seconds(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _text_ids(tokenizer, n: int) -> list[int]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    from model import load_model
    from model.decode import DecodeOptions, prepare

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 3000])
    parser.add_argument("--context", type=int, default=1000, help="positions each decode row attends over")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-only", action="store_true")
    args = parser.parse_args(argv)
    ckpt = load_model(ROOT / "weights" / "smollm2-135m-instruct")
    model = ckpt.model.eval()
    step = prepare(model, DecodeOptions(), ckpt.tokenizer)
    dtype = step.kv_dtype
    print(f"SmolLM2-135M-Instruct, native step, KV cache {dtype}, {torch.get_num_threads()} threads")
    if not args.decode_only:
        print("| prompt tokens | block path (old) tok/s | rows (new) tok/s | new / old |")
        print("|---:|---:|---:|---:|")
        for n in args.lengths:
            prompt = _text_ids(ckpt.tokenizer, n)
            old, new = [], []
            for _ in range(args.reps):  # alternated, so a machine that gets busier shifts both alike
                old.append(_prefill_seconds(step, model, prompt, 128))
                new.append(_prefill_seconds(step, model, prompt, 0))
            o, w = statistics.median(old), statistics.median(new)
            print(f"| {n} | {n / o:,.0f} | {n / w:,.0f} | {o / w:.2f} |")
    print(f"| decode batch | ms a step at {args.context} positions |")
    print("|---:|---:|")
    for batch in (1, 8):
        seconds = _decode_seconds(step, model, _text_ids(ckpt.tokenizer, args.context), batch, args.reps)
        print(f"| {batch} | {seconds * 1e3:.2f} |")


def _prefill_seconds(step, model, prompt: list[int], min_rows: int) -> float:
    """One prompt into a fresh cache, its attention as blocks from ``min_rows`` rows (0: rows)."""
    step.plan.set_prompt_attention(min_rows)
    cache = model.new_cache(1, len(prompt) + 1, dtype=step.kv_dtype)
    cache.ensure(0, len(prompt))
    start = time.perf_counter()
    step.prefill(cache, [prompt], [0])
    seconds = time.perf_counter() - start
    step.plan.set_prompt_attention(0)
    return seconds


def _decode_seconds(step, model, prompt: list[int], batch: int, reps: int) -> float:
    """Seconds a decode step of ``batch`` rows, each after ``prompt``."""
    cache = model.new_cache(batch, len(prompt) + 2, dtype=step.kv_dtype)
    for row in range(batch):
        cache.ensure(row, len(prompt) + 1)
        step.prefill(cache, [prompt], [row])
    tokens = torch.tensor([prompt[-1]] * batch)

    def ten() -> None:
        for _ in range(10):
            step(cache, tokens, list(range(batch)), [len(prompt)] * batch)

    ten()
    return _median_seconds(ten, reps) / 10

if __name__ == "__main__":
    main()
