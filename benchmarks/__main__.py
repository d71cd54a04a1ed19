"""``python -m benchmarks [--quick] [--only SECTION ...] [--out DIR]`` (also ``make bench``).

Runs the sections side by side in one process on the same weights and inputs, prints a
markdown table (stdout; progress goes to stderr) and writes the JSON report to
``DIR/bench-<UTC time>.json`` and ``DIR/latest.json``. Exit status 1 when a section failed
or a correctness check (token-for-token equality with the peer) did not hold.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.machine import load_average, machine_info
from benchmarks.harness.report import RunReport, SectionSkipped, loud, markdown_table, say
from benchmarks.harness.workspace import Workspace
from benchmarks.sections import (
    attention,
    chat_model,
    chat_service,
    decode,
    decode_attention,
    embeddings,
    gpu,
    kv_cache,
    linear_kernels,
    prefix_cache,
    service_load,
    translation,
)

# OpenMP's wait policy is left as the environment has it (the OpenMP default: threads spin
# briefly while they wait). Every side of a comparison runs under the same policy (the service
# and probes inherit it; llama.cpp's ggml uses OpenMP too) and the report records it. On a quiet
# machine spinning is what each peer is built for: OMP_WAIT_POLICY=PASSIVE there measured
# llama.cpp at 37 tok/s instead of ~110 and our int8 step at 20 instead of 44 (batch 1, 2
# threads). On a shared machine, where a spinning thread burns its partner's time slice, set
# OMP_WAIT_POLICY=PASSIVE in the environment before running this.

SECTIONS = {  # name on the command line -> (label in the report, runner)
    "decode": ("1. decode", decode.run),
    "translation": ("2. translation", translation.run),
    "kv-cache": ("3. KV cache", kv_cache.run),
    "attention": ("4. attention", attention.run),
    "service": ("5. service", service_load.run),
    "gpu": ("6. GPU", gpu.run),
    "chat": ("7. chat model", chat_model.run),
    "embeddings": ("8. embeddings", embeddings.run),
    "decode-attention": (decode_attention.SECTION, decode_attention.run),
    "prefix-cache": ("10. prefix cache", prefix_cache.run),
    "kernels": (linear_kernels.SECTION, linear_kernels.run),
    "chat-service": (chat_service.SECTION, chat_service.run),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition (about 1-2 minutes)")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), metavar="SECTION",
                        help=f"run only these sections: {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON goes")
    parser.add_argument("--threads", type=int, help="torch / CTranslate2 / service threads (default: all cores)")
    parser.add_argument("--repetitions", type=int, help="timed runs per measurement (median reported)")
    parser.add_argument("--service-weights", type=Path,
                        help="checkpoint dir served in section 5 (default weights/generate-en; synthetic if absent)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override any size in benchmarks/harness/config.py, e.g. --set gpt2_layers=12")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig.quick_preset() if args.quick else BenchConfig()
    overrides = list(args.set)
    for name, value in (("threads", args.threads), ("repetitions", args.repetitions),
                        ("service_weights", args.service_weights)):
        if value is not None:
            overrides.append(f"{name}={value}")
    cfg = cfg.with_overrides(overrides)
    if cfg.threads < 1 or cfg.repetitions < 1:
        raise ValueError(f"threads and repetitions must be >= 1, got {cfg.threads} and {cfg.repetitions}")
    return cfg


def run_sections(names: list[str], cfg: BenchConfig, report: RunReport) -> None:
    with Workspace(cfg) as ws:
        for name in names:
            label, runner = SECTIONS[name]
            info = report.sections.setdefault(label, {})
            info["load_average_before"] = load_average()
            start = time.monotonic()
            say(f"=== {label} ===")
            try:
                runner(ws, cfg, report)
                info["status"] = "ok"
            except SectionSkipped as exc:
                info["status"] = f"skipped: {exc}"
                say(f"{label}: skipped: {exc}")
            except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
                info["status"] = f"failed: {type(exc).__name__}: {exc}"
                loud(f"{label} failed: {exc}\n{traceback.format_exc()}")
            info["seconds"] = round(time.monotonic() - start, 1)
            info["load_average_after"] = load_average()


def summary(report: RunReport) -> str:
    m = report.machine
    lines = [
        "## Benchmark results", "",
        f"{m['date']} · {m['cpu_model']} · {m['cpu_cores']} cores · {m['memory_gib']} GiB · torch {m['torch']} "
        f"({m['torch_threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy']}) · transformers {m['transformers']}"
        f" · ctranslate2 {m['ctranslate2']}" + (f" · {m['cuda_device']}" if m.get("cuda") else "")
        + f" · load average at start {m['load_average_at_start']}",
        "", markdown_table(report.rows), "",
    ]
    for label, info in report.sections.items():
        extra = f", {info['checkpoint_label']}" if "checkpoint_label" in info else ""
        lines.append(f"- {label}: {info.get('status', 'not run')} in {info.get('seconds', 0)} s, load average "
                     f"{info.get('load_average_before')} -> {info.get('load_average_after')}{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.threads)  # everything in this process, peers included, uses these threads
    busy = load_average()[:1]
    cores = os.cpu_count() or 1
    if busy and cfg.threads > 1 and busy[0] + cfg.threads > cores + 0.5:
        say(f"WARNING: load average {busy[0]} on {cores} cores: other processes compete for the CPUs, and "
            f"{cfg.threads} threads per op wait on each other (OpenMP barriers; OMP_WAIT_POLICY="
            f"{os.environ.get('OMP_WAIT_POLICY')}); timings will be noisy. --threads 1 gives steadier numbers.")
    names = args.only or list(SECTIONS)
    report = RunReport(machine_info(), cfg.to_dict())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_sections(names, cfg, report)
    report.machine["load_average_at_end"] = load_average()
    print(summary(report))
    path = report.write_json(args.out, stamp)
    say(f"JSON written to {path}")
    failed = [label for label, info in report.sections.items() if info.get("status", "").startswith("failed")]
    mismatches = [r for r in report.rows if r.check.startswith("MISMATCH")]
    if mismatches:
        loud(f"{len(mismatches)} row(s) failed the token-for-token check: "
             + "; ".join(f"{r.section} {r.workload} vs {r.peer}" for r in mismatches))
    return 1 if failed or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
