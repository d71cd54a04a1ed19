"""11. Linear kernels at SmolLM2's shapes: which low-bit weight format is actually fast here.

Each candidate computes ``x @ W.T`` for SmolLM2-135M's projections (qkv 960x576, output
576x576, gate/up 1536x576, down 576x1536, head 49152x576) at batch 1 and 8, against the
prepacked float32 kernel the engine uses (oneDNN), in the same run:

- ``int8 dynamic``: fbgemm's dynamic linear (weights int8 per output channel, activations
  int8 per call): what ``quantize_int8_`` installs;
- ``int8 weight-only``: ``torch._weight_int8pack_mm`` (activations stay float);
- ``int4 weight-only``: ``torch._weight_int4pack_mm_for_cpu`` (groups of 32, scale and zero);
- ``int8 weight-only, compiled``: ``torch.compile`` (inductor) of dequantize-then-matmul, for
  the gate/up shape at batch 1 only (a compile per shape costs tens of seconds here).

Rows report microseconds per call (lower is better) and the ratio to float32; each
candidate's result is checked against float32 on the dequantized weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.report import Row, RunReport, say
from benchmarks.harness.timing import time_interleaved
from benchmarks.harness.workspace import Workspace

SECTION = "11. linear kernels"
SHAPES = {"qkv": (960, 576), "attn out": (576, 576), "gate/up": (1536, 576), "down": (576, 1536),
          "head": (49152, 576)}
GROUP = 32
CALLS = 20  # calls per timed sample: one call is tens of microseconds


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return (w / scale[:, None]).round().to(torch.int8), scale


def _int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, scales_and_zeros, dequantized) in the layout the CPU int4 kernel takes."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 15
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1)
    sz = torch.stack([scale.squeeze(-1).t(), (lo + 8 * scale).squeeze(-1).t()], -1).contiguous()
    return packed, sz, (q.float() * scale + lo).view(n, k)


def _dequantize_matmul(w8: torch.Tensor, s8: torch.Tensor):
    return lambda x: F.linear(x, w8.to(x.dtype)) * s8


def _candidates(w: torch.Tensor, dyn: torch.nn.Module) -> tuple[dict, dict]:
    """The kernels for one weight, and the (dequantized) weight each one should reproduce."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    w8, s8 = _int8(w)
    w4, sz4, deq4 = _int4(w)
    fns = {
        "float32": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "int8 dynamic": dyn,
        "int8 weight-only": lambda x: torch._weight_int8pack_mm(x, w8, s8),
        "int4 weight-only": lambda x: torch._weight_int4pack_mm_for_cpu(x, w4, GROUP, sz4),
    }
    return fns, {"int8 dynamic": w, "int8 weight-only": w8.float() * s8[:, None], "int4 weight-only": deq4}


def _repeat(fn, x):
    def run():
        for _ in range(CALLS):
            y = fn(x)
        return y
    return run


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:  # noqa: ARG001 - the sections' signature
    import torch.ao.nn.quantized.dynamic as nnqd
    from torch.ao.quantization import per_channel_dynamic_qconfig

    g = torch.Generator().manual_seed(cfg.seed)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.02
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = w
        lin.qconfig = per_channel_dynamic_qconfig
        fns, refs = _candidates(w, nnqd.Linear.from_float(lin))
        for batch in (1, 8):
            x = torch.randn(batch, k, generator=g)
            wanted = dict(fns)
            if name == "gate/up" and batch == 1:
                wanted["int8 weight-only, compiled"] = torch.compile(_dequantize_matmul(*_int8(w)))
                refs["int8 weight-only, compiled"] = refs["int8 weight-only"]
            with torch.inference_mode():
                stats, outs = time_interleaved({k_: _repeat(f, x) for k_, f in wanted.items()}, cfg.repetitions,
                                               warmups={k_: _repeat(f, x) for k_, f in wanted.items()})
                per_call = {k_: v.map(lambda t: t / CALLS * 1e6) for k_, v in stats.items()}
                for cand in [c for c in wanted if c != "float32"]:
                    err = float((outs[cand] - F.linear(x, refs[cand])).abs().max() / F.linear(x, w).abs().max())
                    report.rows.append(Row(SECTION, f"{name} {n}x{k}, batch {batch}", "µs per call", per_call[cand],
                                           higher_is_better=False, peer="float32 (oneDNN prepacked)",
                                           peer_value=per_call["float32"], check=f"max error {err:.1%} of max |y|",
                                           note=cand))
            say(f"{SECTION}: {name} batch {batch}: " + ", ".join(f"{k_} {v.median:.0f} µs"
                                                                 for k_, v in per_call.items()))
