"""Repeated timing with medians: the machine is shared and noisy, so one run means little.

Competing implementations are timed interleaved (ours, peer, ours, peer, ...) so a burst of
load from another process lands on both sides instead of on whichever ran second.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Stat:
    """Median / min / max of n samples, in the unit of the row that holds it."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stat:
        if not samples:
            raise ValueError("no samples")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def map(self, fn: Callable[[float], float]) -> Stat:
        """The same statistics of fn(sample); fn must be monotonic (it may be decreasing)."""
        lo, hi = sorted((fn(self.min), fn(self.max)))
        return Stat(fn(self.median), lo, hi, self.n)

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device | str = "cpu") -> tuple[float, object]:
    """(seconds, result) of one call, with the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def time_interleaved(
    fns: dict[str, Callable[[], object]], repetitions: int, device: torch.device | str = "cpu",
    warmups: dict[str, Callable[[], object]] | None = None,
) -> tuple[dict[str, Stat], dict[str, object]]:
    """Time each function ``repetitions`` times, round-robin; returns the stats (seconds)
    and each function's last result (for correctness checks).

    First calls pay for lazy init, allocator growth and kernel selection, so ``warmups``
    run untimed first: by default each function itself; pass cheaper stand-ins (the same
    call with fewer tokens) where a full extra call would cost minutes.
    """
    for fn in (fns if warmups is None else warmups).values():
        fn()
    results: dict[str, object] = {}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repetitions):
        for name, fn in fns.items():
            seconds, results[name] = timed(fn, device)
            samples[name].append(seconds)
    return {name: Stat.of(s) for name, s in samples.items()}, results
