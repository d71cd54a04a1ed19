"""6. The GPU rows: sections 1-4 again on CUDA in bf16, plus the compiled decode step.

Runs only where ``torch.cuda.is_available()``; elsewhere the section reports itself as
skipped (a missing device, not a failure). Each part runs on its own so one failing
(say, a CTranslate2 wheel without CUDA) does not hide the others.
"""

from __future__ import annotations

import traceback

import torch

from benchmarks.attention import measure_attention
from benchmarks.compiled import measure_compiled_decode
from benchmarks.config import BenchConfig
from benchmarks.decode import measure_decode
from benchmarks.kv_cache import measure_kv_cache
from benchmarks.report import RunReport, SectionSkipped, loud
from benchmarks.translation import measure_translation
from benchmarks.workspace import Workspace

SECTION = "6. GPU"


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    if not torch.cuda.is_available():
        raise SectionSkipped("no CUDA device present (torch.cuda.is_available() is False)")
    dtype = getattr(torch, cfg.gpu_dtype)
    parts = {
        "decode": lambda: measure_decode(ws, cfg, report, SECTION, "cuda", dtype),
        "translation": lambda: measure_translation(ws, cfg, report, SECTION, "cuda", dtype),
        "kv-cache": lambda: measure_kv_cache(ws, cfg, report, SECTION, "cuda", dtype),
        "attention": lambda: measure_attention(cfg, report, SECTION, "cuda", cfg.gpu_dtype),
    }
    if cfg.gpu_compile:
        parts["compile"] = lambda: measure_compiled_decode(ws, cfg, report, SECTION, "cuda", dtype,
                                                           "reduce-overhead")
    failures = report.sections[SECTION].setdefault("failures", {})
    peaks = report.sections[SECTION].setdefault("peak_cuda_mib", {})  # each part's high-water mark
    for name, part in parts.items():
        torch.cuda.reset_peak_memory_stats()
        try:
            part()
            torch.cuda.synchronize()
            peaks[name] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        except Exception as exc:  # noqa: BLE001 - record and go on with the other parts
            failures[name] = f"{type(exc).__name__}: {exc}"
            loud(f"{SECTION} {name} failed: {exc}\n{traceback.format_exc()}")
        finally:
            torch.cuda.empty_cache()
