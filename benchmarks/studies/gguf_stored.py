"""A GGUF model's projections read as stored (``TSERVE_GGUF_WEIGHTS=stored``: ``KQuantLinear``,
the native step's block kernels) against the default (the file dequantized, then int8 decode
copies), in-process, both imported from the same file and alternated:

    python -m benchmarks.studies.gguf_stored FILE.gguf [FILE.gguf ...] [--batches 1 8] [--reps 3] [--prompt 512]

Per model: weight bytes a decode step reads (batch 1), milliseconds per decode step and tokens/s
(median over repetitions of the median of ``--steps`` steps over a fresh float32 cache), the
share of the bandwidth floor (bytes per token / read bandwidth, over the measured time), and
fidelity: greedy continuations of ``--prompts`` held-out snippets against the float model's
(identical continuations, and the mean length of the prefix that matches). Then one prompt of
``--prompt`` tokens through each step's prefill (the native step's where it takes prompts, else
the model's), milliseconds per prompt, median over repetitions. Each row gives the ratio of
stored to int8 measured in the same repetitions (the host may be shared: compare ratios).
The read bandwidth is a sum over a 512 MiB array at 1 and 2 torch threads (best of 5).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.machine import read_bandwidth
from benchmarks.harness.quality import heldout_text


def step_bytes(model) -> int:
    """Weight bytes a batch-1 decode step reads: every projection in the format its step reads."""
    from model.quant.int8 import DecodeInt8Linear
    from model.quant.kquant import KQuantLinear

    total = 0
    for m in model.modules():
        if isinstance(m, KQuantLinear):
            total += m.weight_bytes
        elif isinstance(m, DecodeInt8Linear):
            total += m.quantized.in_features * m.quantized.out_features
    return total


@torch.inference_mode()
def step_ms(step, model, tokens: list[int], batch: int, steps: int) -> float:
    cache = model.new_cache(batch, steps + 1, dtype=torch.float32)
    ids = torch.tensor((tokens * batch)[:batch])
    times = []
    for position in range(steps):
        start = time.perf_counter()
        step(cache, ids, list(range(batch)), [position] * batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


@torch.inference_mode()
def prompt_ms(step, model, tokens: list[int]) -> float:
    """Milliseconds for one prompt of ``tokens`` into a fresh cache: the step's prefill where it
    takes prompts (the engine's path), else the model's."""
    cache = model.new_cache(1, len(tokens) + 1, dtype=torch.float32)
    start = time.perf_counter()
    if getattr(step, "prefills", False):
        step.prefill(cache, [tokens], [0])
    else:
        model.prefill(cache, [tokens], [0])
    return (time.perf_counter() - start) * 1e3


def greedy(model, step, tokenizer, prompts: list[list[int]], new: int) -> list[list[int]]:
    from model.engine.offline import generate
    from model.engine.sampling import SamplingParams

    return [r.token_ids for r in generate(model, prompts, SamplingParams(max_new_tokens=new, temperature=0.0),
                                          tokenizer, step=step)]


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[int, float]:
    prefix = []
    for a, b in zip(got, want):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n)
    return sum(a == b for a, b in zip(got, want)), statistics.mean(prefix)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.gguf_stored", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512, help="tokens of the prompt row (0: none)")
    args = parser.parse_args(argv)

    from model.decode import DecodeOptions, prepare
    from model.formats.gguf_import import load_gguf
    from model.quant.kquant import KQuantLinear

    bandwidth = {t: read_bandwidth(t) for t in (1, 2)}
    print(f"torch threads {torch.get_num_threads()}; read bandwidth "
          + ", ".join(f"{t} thread(s) {b / 1e9:.2f} GB/s" for t, b in bandwidth.items()))
    for path in args.files:
        before = os.environ.get("TSERVE_GGUF_WEIGHTS")
        try:
            os.environ["TSERVE_GGUF_WEIGHTS"] = "float"  # the default import: float32, then int8 decode copies
            g = load_gguf(path)
            os.environ["TSERVE_GGUF_WEIGHTS"] = "stored"
            stored = load_gguf(path).model.eval()
        finally:
            if before is None:
                del os.environ["TSERVE_GGUF_WEIGHTS"]
            else:
                os.environ["TSERVE_GGUF_WEIGHTS"] = before
        model, tok = g.model.eval(), g.tokenizer
        swapped = sum(isinstance(m, KQuantLinear) for m in stored.modules())
        text = heldout_text()
        prompts = [tok.encode(text[i * 400:i * 400 + 300]) for i in range(args.prompts)]
        reference = greedy(model, prepare(model, DecodeOptions.reference(), tok), tok, prompts, args.new)
        steps = {"int8": prepare(model, DecodeOptions(), tok), "stored": prepare(stored, DecodeOptions(), tok)}
        models = {"int8": model, "stored": stored}
        print(f"\n{path.name}: {swapped} projections stored; steps: "
              + ", ".join(f"{k} {type(s).__name__}" for k, s in steps.items()))
        print("| weights | bytes/step | greedy = float | mean matching prefix | batch | step ms | tok/s "
              "| floor share (1 thr / 2 thr) | stored / int8 time |")
        print("|---|---|---|---|---|---|---|---|---|")
        fidelity = {k: agreement(greedy(models[k], s, tok, prompts, args.new), reference) for k, s in steps.items()}
        tokens = prompts[0][:64]
        for batch in args.batches:
            times: dict[str, list[float]] = {k: [] for k in steps}
            for _ in range(args.reps):
                for k, s in steps.items():
                    times[k].append(step_ms(s, models[k], tokens, batch, args.steps))
            ratio = statistics.median(a / b for a, b in zip(times["stored"], times["int8"]))
            for k in steps:
                ms = statistics.median(times[k])
                nbytes = step_bytes(models[k])
                floors = [nbytes / bandwidth[t] * 1e3 / ms for t in (1, 2)]
                same, prefix = fidelity[k]
                print(f"| {k} | {nbytes / 1e6:.1f} MB | {same}/{len(prompts)} | {prefix:.1f}/{args.new} | {batch} "
                      f"| {ms:.2f} | {1e3 * batch / ms:.1f} | {floors[0]:.0%} / {floors[1]:.0%} "
                      f"| {ratio if k == 'stored' else 1.0:.2f} |", flush=True)
        if args.prompt > 0:
            ids = (tok.encode(text) * (1 + args.prompt // 100))[:args.prompt]
            ptimes: dict[str, list[float]] = {k: [] for k in steps}
            for _ in range(args.reps + 1):  # the first round warms up
                for k, s in steps.items():
                    ptimes[k].append(prompt_ms(s, models[k], ids))
            ratio = statistics.median(a / b for a, b in zip(ptimes["stored"][1:], ptimes["int8"][1:]))
            print("\n| weights | prompt tokens | prompt ms | prompt tok/s | stored / int8 time |")
            print("|---|---|---|---|---|")
            for k in steps:
                ms = statistics.median(ptimes[k][1:])
                print(f"| {k} | {len(ids)} | {ms:.1f} | {1e3 * len(ids) / ms:.0f} "
                      f"| {ratio if k == 'stored' else 1.0:.2f} |", flush=True)


if __name__ == "__main__":
    main()
