"""4. Fused vs explicit attention: ``model.nn.layers.attention`` (SDPA) vs ``reference_attention``.

One causal self-attention call on (1, heads, T, head_dim) inputs, per sequence length:
forward time and peak memory. On the CPU each (implementation, length) runs in a fresh
subprocess (``python -m benchmarks.sections.attention --probe ...``) whose peak RSS belongs to that
one call: the kernel's high-water mark (VmHWM) is reset to the current RSS right before the
call (``/proc/self/clear_refs``), so peak memory = VmHWM after - RSS before, with the inputs
already allocated and the code paths warmed on a tiny input. (getrusage's ru_maxrss would
not do: after fork + exec it still carries the parent's RSS.) On CUDA it is
``torch.cuda.max_memory_allocated`` above the allocation before the call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.config import BenchConfig
from benchmarks.harness.report import Row, RunReport, say
from benchmarks.harness.timing import Stat, synchronize

IMPLEMENTATIONS = {"sdpa": "attention (SDPA)", "reference": "reference_attention (explicit)"}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    """Set the peak-RSS mark to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def probe(impl: str, length: int, heads: int, head_dim: int, repetitions: int, device: str,
          dtype: torch.dtype) -> dict:
    """Peak memory of the first call, then the time of ``repetitions`` more."""
    from model.nn.layers import attention, reference_attention

    def call(q, k, v):
        if impl == "sdpa":
            return attention(q, k, v, causal=True)
        return reference_attention(q, k, v, causal=True)[0]

    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        tiny = torch.randn(1, heads, 16, head_dim, generator=gen).to(device, dtype)
        call(tiny, tiny, tiny)  # load kernels and start the thread pool before measuring
        q, k, v = (torch.randn(1, heads, length, head_dim, generator=gen).to(device, dtype) for _ in range(3))
        synchronize(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            reset = _reset_peak_rss()
            before, peak_before = _status_bytes("VmRSS"), _status_bytes("VmHWM")
        out = call(q, k, v)
        synchronize(device)
        if device == "cuda":
            peak, exact = torch.cuda.max_memory_allocated() - before, True
        else:
            after = _status_bytes("VmHWM")
            # Without the reset, a call that stayed below an earlier high-water mark has an unknown peak.
            peak, exact = after - before, reset or after > peak_before
        del out
        samples = []
        for _ in range(repetitions):
            synchronize(device)
            start = time.perf_counter()
            call(q, k, v)
            synchronize(device)
            samples.append(time.perf_counter() - start)
    return {"impl": impl, "length": length, "peak_bytes": peak, "peak_exact": exact, "seconds": samples,
            "threads": torch.get_num_threads()}


def run_probe_subprocess(impl: str, length: int, cfg: BenchConfig, device: str, dtype: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.sections.attention", "--probe", impl, "--length", str(length),
           "--heads", str(cfg.attention_heads), "--head-dim", str(cfg.attention_head_dim),
           "--repetitions", str(cfg.repetitions), "--threads", str(cfg.threads), "--device", device,
           "--dtype", dtype]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          timeout=cfg.attention_probe_timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"attention probe {impl} T={length} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_attention(cfg: BenchConfig, report: RunReport, section: str, device: str = "cpu",
                      dtype: str = "float32") -> None:
    h, d = cfg.attention_heads, cfg.attention_head_dim
    for length in cfg.attention_lengths:
        say(f"{section}: T={length}")
        if device == "cuda":  # one process is fine: the CUDA allocator's peak counter is exact
            res = {impl: probe(impl, length, h, d, cfg.repetitions, device, getattr(torch, dtype))
                   for impl in IMPLEMENTATIONS}
        else:
            res = {impl: run_probe_subprocess(impl, length, cfg, device, dtype) for impl in IMPLEMENTATIONS}
        workload = f"causal self-attention (1, {h}, {length}, {d}) {dtype}"
        sdpa, ref = res["sdpa"], res["reference"]
        report.rows.append(Row(section, workload, "forward ms", Stat.of([s * 1e3 for s in sdpa["seconds"]]),
                               higher_is_better=False, peer=IMPLEMENTATIONS["reference"],
                               peer_value=Stat.of([s * 1e3 for s in ref["seconds"]]),
                               note=f"ours = {IMPLEMENTATIONS['sdpa']}"))
        exact = sdpa["peak_exact"] and ref["peak_exact"]
        report.rows.append(Row(
            section, workload, "peak MiB", _mib(sdpa["peak_bytes"]), higher_is_better=False,
            peer=IMPLEMENTATIONS["reference"], peer_value=_mib(ref["peak_bytes"]),
            check="" if exact else "peak below an earlier high-water mark: upper bound",
            note=f"scores matrix alone: {h * length * length * torch.finfo(getattr(torch, dtype)).bits / 8 / 2**20:.0f}"
                 " MiB; " + ("max_memory_allocated" if device == "cuda" else "fresh process, ru_maxrss delta")))
        say(f"{section}: T={length}: sdpa {min(sdpa['seconds']) * 1e3:.1f} ms {sdpa['peak_bytes'] / 2**20:.1f} MiB, "
            f"reference {min(ref['seconds']) * 1e3:.1f} ms {ref['peak_bytes'] / 2**20:.1f} MiB")


def _mib(nbytes: int) -> Stat:
    v = max(nbytes, 0) / 2**20
    return Stat(v, v, v, 1)


def run(ws, cfg: BenchConfig, report: RunReport) -> None:
    measure_attention(cfg, report, "4. attention")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One attention measurement (used by the benchmark).")
    parser.add_argument("--probe", choices=sorted(IMPLEMENTATIONS), required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = probe(args.probe, args.length, args.heads, args.head_dim, max(args.repetitions, 1), args.device,
                   getattr(torch, args.dtype))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
