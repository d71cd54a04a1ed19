"""Prompt throughput: the native step's ``prefill`` (int8 projections, activations quantized
row by row, a bfloat16 cache: what ``TSERVE_PREFILL=auto`` serves) against the model's float32
forward (``TSERVE_PREFILL=model``), one prompt of each length, in-process. With ``--bf16``, a
third column: the same forward with the model's weights in bfloat16 (oneDNN's AVX512-BF16
kernels on this CPU), and below the table each model's perplexity of the held-out text through
its float32 and bfloat16 forward (the quality bfloat16 prompts would cost).

    python -m benchmarks.studies.prefill [--models smollm2-135m-instruct gemma3-270m] [--lengths 16 64 256 1000 2000]

Both write the same prompt (the start of the docstrings ``benchmarks.harness.quality.heldout_text`` reads) into
a fresh cache of the dtype each path serves with; the medians of ``--reps`` runs, tokens/s and
the ratio. The quality side (perplexity, greedy agreement) is ``benchmarks.studies.int8_quality``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.quality import heldout_text


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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256, 1000, 2000])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="also time (and score) the forward in bfloat16")
    args = parser.parse_args(argv)

    from model import load_model
    from model.decode import DecodeOptions, prepare

    print(f"torch threads {torch.get_num_threads()}")
    bf16 = " bfloat16 forward tok/s | bfloat16 / float |" if args.bf16 else ""
    print("| model | prompt tokens | float32 forward tok/s | native int8 prefill tok/s | native / float |" + bf16)
    print("|---|---|---|---|---|" + ("---|---|" if args.bf16 else ""))
    scores = []
    for name in args.models:
        ckpt = load_model(REPO_ROOT / "weights" / name)
        model = ckpt.model.eval()
        half = load_model(REPO_ROOT / "weights" / name).model.eval().to(torch.bfloat16) if args.bf16 else None
        # prefill=model keeps the float weights the float forward reads (the served default,
        # auto, lets them go once its native step writes every prompt); the step's own prefill
        # is the same either way
        step = prepare(model, DecodeOptions(prefill="model"), ckpt.tokenizer)
        if not hasattr(step, "prefill"):
            raise SystemExit(f"{name}: no native step here ({step.name}); nothing to compare")
        ids = ckpt.tokenizer.encode(heldout_text() * -(-max(args.lengths) // 1500))  # ~1,700 tokens a copy
        for n in args.lengths:
            prompt = ids[:n]
            t_float = _prefill_seconds(model.prefill, model, model.dtype, prompt, args.reps)
            t_native = _prefill_seconds(step.prefill, model, step.kv_dtype, prompt, args.reps)
            extra = ""
            if half is not None:
                t_half = _prefill_seconds(half.prefill, half, torch.bfloat16, prompt, args.reps)
                extra = f" {len(prompt) / t_half:.0f} | {t_float / t_half:.2f}× |"
            print(f"| {name} | {len(prompt)} | {len(prompt) / t_float:.0f} | {len(prompt) / t_native:.0f} | "
                  f"**{t_float / t_native:.2f}×** |" + extra, flush=True)
        if half is not None:
            text = ids[:512]
            scores.append((name, len(text), _perplexity(model, text), _perplexity(half, text)))
    for name, n, p32, p16 in scores:
        print(f"{name}: perplexity of {n} held-out tokens through the forward: float32 {p32:.3f}, "
              f"bfloat16 {p16:.3f} ({p16 / p32:.3f}×)")


@torch.inference_mode()
def _perplexity(model, ids: list[int]) -> float:
    """exp(mean NLL) of ``ids[1:]`` through one teacher-forced forward, scored in float32."""
    logits = model(torch.tensor([ids]))[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp())


if __name__ == "__main__":
    main()
