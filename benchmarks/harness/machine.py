"""What the numbers were measured on, and the memory bandwidth that bounds decoding."""

from __future__ import annotations

import datetime
import os
import platform
import time
from importlib import metadata
from pathlib import Path

import torch

from benchmarks.harness.timing import Stat, synchronize


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "transformers": _version("transformers"),
        "ctranslate2": _version("ctranslate2"),
        "cuda": torch.cuda.is_available(),
        "load_average_at_start": load_average(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    return info


def memory_bandwidth(nbytes: int = 512 * 2**20, repetitions: int = 5,
                     device: torch.device | str = "cpu") -> dict:
    """Bytes per second moved by streaming through a buffer far larger than the caches.

    ``read``: sum() of the buffer (reads nbytes; what a decode step does with its weights);
    ``copy``: copy_ into a second buffer (reads + writes 2 * nbytes). The floor uses the
    larger of the two, so it is the most optimistic (lowest) floor.
    """
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    results = {}
    for name, fn, moved in (("read", src.sum, nbytes), ("copy", lambda: dst.copy_(src), 2 * nbytes)):
        fn()  # first touch of the pages
        samples = []
        for _ in range(repetitions):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            samples.append(moved / (time.perf_counter() - start))
        results[name] = Stat.of(samples)
    best = max(results.values(), key=lambda s: s.median)
    return {"bytes_per_s": best.median, "read": results["read"].to_dict(), "copy": results["copy"].to_dict(),
            "buffer_bytes": nbytes, "threads": torch.get_num_threads()}


def read_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Bytes per second torch reads at ``threads`` threads (a float32 sum: one load per value)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mib * 2**20 // 4)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(before)
