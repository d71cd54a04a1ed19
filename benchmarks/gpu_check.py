"""``python -m benchmarks.gpu_check`` (``make gpu-check``): everything that needs a GPU, in one
command and one report; the first thing to run on a lent device.

1. The CUDA tests, in a pytest subprocess with a junit-xml result: the Triton decode-attention
   kernel compiled on CUDA tensors, in float32 and bfloat16, and the Python decode step through
   it against SDPA on CUDA. Without a CUDA device they are reported "skipped: no CUDA device".
2. The same kernel tests under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), in a
   second subprocess: the variable must be set before triton is imported and must not leak into
   the compiled run. On every machine, GPU or not, so this check cannot rot where there is none.
3. The GPU benchmark sections in this process, at the quick sizes: "6. GPU" (decode,
   translation, KV cache, attention in bfloat16) and
   "9. decode attention (GPU)" (the kernel vs SDPA); their rows, failures and each section's
   peak CUDA memory (``torch.cuda.max_memory_allocated``). Without CUDA they report themselves
   skipped.

Writes ``OUT/report.json`` and ``OUT/report.md`` (default ``build/gpu-check``); exits 0 only if
everything that could run here passed. 38 s on a lent H200 (2026-11-30), about 2 minutes on 2
CPU cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRITON_TESTS = "tests/model/decode/test_triton_attention.py"
# The CUDA tests: the modules whose tests run on CUDA tensors where a device is present (the
# others that mention CUDA only pass the name as a string, e.g. wants_int8(..., "cuda")).
CUDA_TESTS = (TRITON_TESTS,)
# In the compiled run, the test that re-runs the module under the interpreter is left out: run 2 does that.
INTERPRETER_CHILD = f"{TRITON_TESTS}::test_kernel_under_the_triton_interpreter"
PYTEST_TIMEOUT_S = 240  # per pytest run (1-2 minutes on 2 busy cores): a hung run is reported, not waited on
SECTIONS = ("gpu", "decode-attention")  # names in python -m benchmarks

# What passing under the interpreter does not show (also in docs/benchmarks.md, "GPU check").
INTERPRETER_GAPS = (
    "bfloat16 dot products: the interpreter computes bfloat16 arithmetic on the raw bits, so "
    "interpreted the kernel widens q, K and V to float32 before tl.dot (UPCAST); the bfloat16 "
    "tensor-core products and the weights rounded to bfloat16 before P·V run only on a GPU",
    "code generation and launch: PTX/cubin, shared memory and register limits, num_warps, and the "
    "launcher Triton builds with a C compiler (the cubin is also checked offline for sm_90 by "
    "test_kernels_compile_for_an_h100)",
    "concurrency: the interpreter runs the programs of a grid one after another, so no race "
    "between programs can show",
    "speed: nothing interpreted is timed",
)


@dataclass
class PytestRun:
    """One pytest subprocess: what it runs and in which mode."""

    name: str
    paths: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    extra: tuple[str, ...] = ()


def default_runs() -> list[PytestRun]:
    return [
        PytestRun("cuda", CUDA_TESTS, {"TRITON_INTERPRET": "0"}, ("--deselect", INTERPRETER_CHILD)),
        PytestRun("interpreter", (TRITON_TESTS,), {"TRITON_INTERPRET": "1"}),
    ]


# --- the environment -------------------------------------------------------------------------

def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0], "torch": torch.__version__, "triton": _version("triton"),
        "cuda_available": torch.cuda.is_available(), "cpu_cores": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    compute_capability=f"{props.major}.{props.minor}",
                    device_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, torch_cuda=torch.version.cuda,
                    bf16_supported=torch.cuda.is_bf16_supported())
    else:
        info["device"] = "none: no CUDA device (torch.cuda.is_available() is False)"
    return info


# --- the tests -------------------------------------------------------------------------------

def _outcome(case: ET.Element) -> tuple[str, str]:
    """(outcome, message) of one junit testcase."""
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            detail = (found.text or "").strip()
            return ("failed" if tag == "failure" else "error"), (detail or found.get("message", ""))[-4000:]
    skipped = case.find("skipped")
    if skipped is not None:
        return "skipped", skipped.get("message", "")
    return "passed", ""


def parse_junit(path: Path) -> list[dict]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = _outcome(case)
        where = case.get("file") or case.get("classname", "")  # file: junit_family=xunit1
        tests.append({"id": f"{where}::{case.get('name')}",
                      "outcome": outcome, "seconds": round(float(case.get("time") or 0), 2), "message": message})
    return tests


def run_tests(run: PytestRun, out: Path) -> dict:
    """One pytest subprocess; its tests from the junit file, or why there are none."""
    junit = out / f"junit-{run.name}.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "junit_family=xunit1", *run.extra, *run.paths]  # xunit1: each test names its file
    env = {**os.environ, **run.env}
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = None, f"timed out after {PYTEST_TIMEOUT_S} s\n" + str(exc.stdout or "")[-3000:]
    result = {"name": run.name, "command": " ".join(f"{k}={v}" for k, v in run.env.items()) + " " + " ".join(cmd[1:]),
              "returncode": rc, "seconds": round(time.monotonic() - start, 1), "tests": []}
    if junit.is_file():
        result["tests"] = parse_junit(junit)
    # rc 0: passed; 1: some test failed (listed); 5: nothing collected. Anything else, or no
    # junit file, is a run that broke before reporting its tests.
    if rc not in (0, 1) or not result["tests"]:
        result["error"] = f"pytest exited with {rc}:\n{tail}"
    return result


# --- the benchmark sections --------------------------------------------------------------------

def bench_config(overrides: list[str]):
    from benchmarks.harness.config import BenchConfig

    # The quick sizes, but medians of 3.
    return BenchConfig.quick_preset().with_overrides(["repetitions=3", *overrides])


def section_peak(allocated_bytes: int, parts: dict[str, float]) -> float:
    """A section's peak CUDA MiB: the allocator's peak since the section began, or its largest
    part's where larger (section 6 resets the peak before each of its parts). A section that
    records no parts (section 9) has the allocator's peak alone."""
    return max([round(allocated_bytes / 2**20, 1), *parts.values()])


def run_benchmarks(names: tuple[str, ...], overrides: list[str]) -> dict:
    """The sections in this process, one at a time, each with its CUDA memory peak."""
    import torch

    from benchmarks.__main__ import SECTIONS as ALL_SECTIONS
    from benchmarks.__main__ import run_sections
    from benchmarks.harness.machine import machine_info
    from benchmarks.harness.report import RunReport, markdown_table

    cfg = bench_config(overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    report = RunReport(machine_info(), cfg.to_dict())
    peaks = {}
    try:
        for name in names:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            run_sections([name], cfg, report)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                label = ALL_SECTIONS[name][0]
                parts = report.sections[label].get("peak_cuda_mib", {})
                peaks[label] = section_peak(torch.cuda.max_memory_allocated(), parts)
    finally:
        torch.set_num_threads(threads)
    sections = {}
    for label, info in report.sections.items():
        sections[label] = {"status": info.get("status", "not run"), "seconds": info.get("seconds"),
                           "failures": info.get("failures", {}), "peak_cuda_mib": peaks.get(label),
                           "parts_peak_cuda_mib": info.get("peak_cuda_mib", {})}
    return {"config": cfg.to_dict(), "sections": sections, "rows": [r.to_dict() for r in report.rows],
            "table": markdown_table(report.rows) if report.rows else ""}


# --- the verdict and the report ----------------------------------------------------------------

def problems(report: dict) -> list[str]:
    """Everything that ran and did not pass; empty when the check passed."""
    found = []
    for run in report["test_runs"]:
        if "error" in run:
            found.append(f"tests ({run['name']}): {run['error'].splitlines()[0]}")
        found += [f"test ({run['name']}) {t['outcome']}: {t['id']}" for t in run["tests"]
                  if t["outcome"] in ("failed", "error")]
    bench = report["benchmarks"]
    for label, info in bench["sections"].items():
        if info["status"].startswith("failed"):
            found.append(f"benchmark {label}: {info['status']}")
        found += [f"benchmark {label} {part}: {why}" for part, why in info["failures"].items()]
    found += [f"benchmark row {r['section']} {r['workload']}: {r['check']}" for r in bench["rows"]
              if r["check"].startswith("MISMATCH")]
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# GPU check", "", f"**{'PASSED' if report['passed'] else 'FAILED'}** in {report['seconds']} s, "
             f"{env['date']}", "", "## Environment", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += ["", "## Tests", ""]
    for run in report["test_runs"]:
        counts = {}
        for t in run["tests"]:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"
        lines += [f"### {run['name']}: {summary} in {run['seconds']} s", "", f"`{run['command'].strip()}`", ""]
        if "error" in run:
            lines += ["```", run["error"], "```", ""]
        lines += ["| test | outcome | s | message |", "|---|---|---|---|"]
        lines += [f"| {_cell(t['id'])} | {t['outcome']} | {t['seconds']} | {_cell(t['message'][:200])} |"
                  for t in run["tests"]]
        lines.append("")
    lines += ["## Benchmark sections", "", "| section | status | s | peak CUDA MiB (parts) | failures |",
              "|---|---|---|---|---|"]
    for label, info in report["benchmarks"]["sections"].items():
        failures = "; ".join(f"{part}: {why}" for part, why in info["failures"].items())
        peak = info["peak_cuda_mib"] or ""
        if info["parts_peak_cuda_mib"]:
            peak = f"{peak} ({', '.join(f'{part} {mib}' for part, mib in info['parts_peak_cuda_mib'].items())})"
        lines.append(f"| {label} | {_cell(info['status'])} | {info['seconds']} | {peak} | {_cell(failures)} |")
    if report["benchmarks"]["table"]:
        lines += ["", report["benchmarks"]["table"]]
    lines += ["", "## What failed", ""]
    lines += [f"- {p}" for p in report["problems"]] or ["- nothing"]
    failed = [t for run in report["test_runs"] for t in run["tests"] if t["outcome"] in ("failed", "error")]
    for t in failed:
        lines += ["", f"### {t['id']}", "", "```", t["message"], "```"]
    lines += ["", "## What the interpreter run does not show", ""]
    lines += [f"- {gap}" for gap in report["interpreter_gaps"]]
    return "\n".join(lines) + "\n"


def run_check(out: Path, runs: list[PytestRun] | None = None, sections: tuple[str, ...] = SECTIONS,
              overrides: list[str] | None = None) -> dict:
    """Run everything, write ``out/report.json`` and ``out/report.md``; returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report = {"environment": environment(), "interpreter_gaps": list(INTERPRETER_GAPS)}
    report["test_runs"] = [run_tests(run, out) for run in (default_runs() if runs is None else runs)]
    report["benchmarks"] = run_benchmarks(sections, overrides or [])
    report["problems"] = problems(report)
    report["passed"] = not report["problems"]
    report["seconds"] = round(time.monotonic() - start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check", help="where the report goes")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a benchmark size (benchmarks/config.py), as python -m benchmarks --set")
    args = parser.parse_args(argv)
    report = run_check(args.out, overrides=args.set)
    print(markdown(report))
    print(f"report: {args.out / 'report.md'} and report.json", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
