"""Where our decode and translation time goes: ``python -m benchmarks.studies.profile``.

Runs ``model.generate`` (GPT-2, section 1's shape) and greedy / beam translation (Marian,
section 2's shape) under ``torch.profiler`` twice, for N new tokens and for 1, and prints
the difference divided by N - 1: what one decode step costs, operator by operator, with
the prefill taken out. The line above the table gives the step's wall time and the share
spent outside any torch operator (Python and host bookkeeping between kernels). Sizes
come from the benchmark's config (``--quick`` and ``--set`` work the same way).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.generation import ours_generate, ours_translate
from benchmarks.harness.synthetic import sentences
from benchmarks.harness.workspace import Workspace


def op_times(fn: Callable[[], object]) -> tuple[float, dict[str, list[float]]]:
    """(wall seconds, {op: [self CPU seconds, calls]}) of one profiled call."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall = time.perf_counter() - start
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        ops[e.key][0] += e.self_cpu_time_total / 1e6
        ops[e.key][1] += e.count
    return wall, ops


def per_step(run: Callable[[int], object], n: int, label: str, rows: int) -> None:
    run(n)  # warm-up
    wall_n, ops_n = op_times(lambda: run(n))
    wall_1, ops_1 = op_times(lambda: run(1))
    steps = n - 1
    step_wall = (wall_n - wall_1) / steps
    diff = {k: ((v[0] - ops_1.get(k, [0.0, 0])[0]) / steps, (v[1] - ops_1.get(k, [0.0, 0])[1]) / steps)
            for k, v in ops_n.items()}
    in_ops = sum(t for t, _ in diff.values())
    print(f"\n### {label}: {step_wall * 1e3:.2f} ms per decode step (profiled); torch ops' self time "
          f"{in_ops * 1e3:.2f} ms ({in_ops / step_wall:.0%}); the rest is Python / host work between ops\n")
    print("| op | ms per step | share of step | calls per step |\n|---|---|---|---|")
    for name, (t, calls) in sorted(diff.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"| {name} | {t * 1e3:.3f} | {t / step_wall:.1%} | {calls:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", choices=["decode", "translate"], default=["decode", "translate"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=1, help="decode: prompts; translate: sentences")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    cfg = (BenchConfig.quick_preset() if args.quick else BenchConfig()).with_overrides(
        args.set + ([f"threads={args.threads}"] if args.threads else []))
    torch.set_num_threads(cfg.threads)
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, {args.new_tokens} new tokens")
    with Workspace(cfg) as ws:
        if "decode" in args.what:
            model = ws.gpt2_ours()
            prompts = torch.randint(8, model.cfg.vocab_size, (args.batch, cfg.decode_prompt_len))
            per_step(lambda n: ours_generate(model, prompts, n), args.new_tokens,
                     f"decode: generate(), GPT-2 {cfg.gpt2_layers}L d{cfg.gpt2_d_model}, batch {args.batch}, "
                     f"prompt {cfg.decode_prompt_len}", args.rows)
        if "translate" in args.what:
            imported = ws.marian_ours()
            sources = [imported.tokenizer.encode(t) for t in sentences(args.batch, cfg.seed + 7)]
            mode = "greedy" if args.beam == 1 else f"beam {args.beam}"
            per_step(lambda n: ours_translate(imported.model, [sources], args.beam, n), args.new_tokens,
                     f"translate: {mode}, Marian {cfg.marian_layers}+{cfg.marian_layers}L d{cfg.marian_d_model}, "
                     f"{args.batch} sentences", args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
