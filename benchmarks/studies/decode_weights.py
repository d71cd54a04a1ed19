"""The native decode step with a GGUF's own 4-bit weights (``TSERVE_DECODE_WEIGHTS=auto``, the
default) against the same step all int8 (``int8``), in-process: milliseconds per decode step at
each batch size, both built from one loaded model and alternated.

    python -m benchmarks.studies.decode_weights [--models smollm2-135m-instruct] [--batches 1 8 32] [--reps 3]

Each repetition runs ``--steps`` greedy-shaped decode steps per side over a fresh bfloat16 cache
(positions 0..steps-1, every row its own slot) and keeps their median; the table reports the
median over repetitions and int8 / 4-bit. Quality (perplexity, greedy agreement with float32)
is ``benchmarks.studies.int8_quality``, which gives the 4-bit step a row of its own.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.quality import heldout_text


@torch.inference_mode()
def _step_ms(step, model, tokens: list[int], batch: int, steps: int) -> float:
    cache = model.new_cache(batch, steps + 1, dtype=torch.bfloat16)
    ids = torch.tensor((tokens * batch)[:batch])
    times = []
    for position in range(steps):
        start = time.perf_counter()
        step(cache, ids, list(range(batch)), [position] * batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.decode_weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    from model import load_model
    from model.decode import DecodeOptions, prepare

    print(f"torch threads {torch.get_num_threads()}")
    print("| model | batch | int8 step ms | 4-bit step ms | int8 / 4-bit |")
    print("|---|---|---|---|---|")
    for name in args.models:
        ckpt = load_model(REPO_ROOT / "weights" / name)
        model = ckpt.model.eval()
        four = prepare(model, DecodeOptions(), ckpt.tokenizer)
        eight = prepare(model, DecodeOptions(weights="int8"), ckpt.tokenizer)
        if not getattr(four, "weights4", 0):
            print(f"| {name} | - | - | - | no 4-bit runs in this model's file: int8 only |")
            continue
        tokens = ckpt.tokenizer.encode(heldout_text())[:64]
        for batch in args.batches:
            times: dict[str, list[float]] = {"int8": [], "4-bit": []}
            for _ in range(args.reps):
                for label, step in (("int8", eight), ("4-bit", four)):
                    times[label].append(_step_ms(step, model, tokens, batch, args.steps))
            a, b = statistics.median(times["int8"]), statistics.median(times["4-bit"])
            print(f"| {name} | {batch} | {a:.2f} | {b:.2f} | **{a / b:.2f}×** |", flush=True)


if __name__ == "__main__":
    main()
