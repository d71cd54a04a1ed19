"""4-bit weights in runs of 32 for the native decode step (``attach_q4``; the kernels in
``model/decode/csrc/q4.cpp``, the byte layout ``pack_q4`` writes documented in ``csrc/q4.h``).

Each run of 32 inputs of an output row has a scale d and an offset m (float16) and 4-bit values
q: w = d q + m, q in [0, 15], as GGUF's Q4_1 stores it (Q4_0 is the case m = -8 d). A model
imported from such a file holds the dequantized floats; ``q4_runs`` finds the runs again
(offset = the run's minimum, scale = its span / 15, as llama.cpp's quantizer sets them) and
``exact`` says whether they give back every weight bit for bit. Where they do, the step reads
the file's own 4-bit weights (0.625 bytes a weight, against int8's 1), not a re-quantization of
them; where they do not (float checkpoints, 6- or 8-bit files), the projection stays int8.

Activations are quantized per run of 32 too (8 bits, symmetric): ``reference_linear`` is the
kernel's maths in PyTorch, for tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

RUN = 32  # inputs per run (one scale and offset)
TILE = 16  # outputs per kernel tile
RUN_BYTES = 320  # per (tile, run): 256 bytes of nibbles, 16 float16 scales, 16 float16 offsets


def q4_runs(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight (N, K) float, K a multiple of 32 -> q (N, K) uint8 in [0, 15], d and m (N, K / 32)
    float16, with w ~ d q + m."""
    n, k = weight.shape
    if k % RUN:
        raise ValueError(f"4-bit runs need inputs in multiples of {RUN}, got {k}")
    runs = weight.detach().float().reshape(n, k // RUN, RUN)
    lo, hi = runs.amin(-1), runs.amax(-1)
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    df = d.float().unsqueeze(-1)
    q = torch.where(df > 0, ((runs - m.float().unsqueeze(-1)) / torch.where(df > 0, df, torch.ones_like(df))).round(),
                    torch.zeros_like(runs))
    return q.clamp(0, 15).to(torch.uint8).reshape(n, k), d, m


def dequantize(q: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """The float32 weights the runs stand for (d q + m, as GGUF's dequantization computes them)."""
    n, k = q.shape
    runs = q.reshape(n, k // RUN, RUN).float()
    return (d.float().unsqueeze(-1) * runs + m.float().unsqueeze(-1)).reshape(n, k)


def exact(weight: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """The runs of ``weight`` where they give it back bit for bit (a model read from a Q4_0 /
    Q4_1 file), else None."""
    n, k = weight.shape
    if k % RUN or n % TILE:
        return None
    if n > TILE and exact(weight[:TILE]) is None:  # most weights that are not runs fail in the first tile
        return None
    q, d, m = q4_runs(weight)
    if not torch.equal(dequantize(q, d, m), weight.detach().float()):
        return None
    return q, d, m


def pack_q4(q: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """The kernel's layout (csrc: Q4_RUN_BYTES): per tile of 16 outputs and run of 32 inputs,
    four 64-byte chunks whose byte 4j + t holds inputs 8c + t (low nibble) and 8c + 4 + t (high
    nibble) of output j, then the 16 scales, then the 16 offsets."""
    n, k = q.shape
    if n % TILE or k % RUN:
        raise ValueError(f"4-bit runs need outputs in multiples of {TILE} and inputs in multiples of {RUN}")
    t, u = n // TILE, k // RUN
    # (tiles, outputs j, runs, chunks c, halves h, t) -> (tiles, runs, c, j, h, t)
    six = q.reshape(t, TILE, u, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
    nibbles = (six[..., 0, :] | (six[..., 1, :] << 4)).reshape(t, u, 256)
    scales = d.reshape(t, TILE, u).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(t, u, 2 * TILE)
    offsets = m.reshape(t, TILE, u).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(t, u, 2 * TILE)
    return torch.cat([nibbles, scales, offsets], dim=-1).reshape(-1).contiguous()


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (B, K) float32 -> r (B, K) in [-127, 127] (as float) and each run's scale (B, K / 32),
    as the kernel quantizes them (round half to even)."""
    b, k = x.shape
    runs = x.float().reshape(b, k // RUN, RUN)
    top = runs.abs().amax(-1)
    scale = top / 127.0
    # a true division, as the kernel's 127.0f / top (torch's `number / tensor` multiplies by a
    # rounded reciprocal, which moves a product sitting near half a step to the other integer)
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / torch.where(top > 0, top, torch.ones_like(top)),
                      torch.zeros_like(top))
    r = (runs * inv.unsqueeze(-1)).round().clamp(-127, 127)
    return r.reshape(b, k), scale


def reference_linear(x: Tensor, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None = None) -> Tensor:
    """The 4-bit projection's maths in float64: per run, s_a (d q.r + m sum r), summed over runs."""
    r, scale = quantize_activations(x)
    b, k = r.shape
    n = q.shape[0]
    rr = r.double().reshape(b, k // RUN, RUN)
    qq = q.double().reshape(n, k // RUN, RUN)
    dots = torch.einsum("bur,nur->bnu", rr, qq)  # exact integers
    sums = rr.sum(-1)  # (b, u)
    s = scale.double()
    scaled = (dots * d.double().unsqueeze(0) * s.unsqueeze(1)).sum(-1)
    y = scaled + (m.double().unsqueeze(0) * (s * sums).unsqueeze(1)).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.float()
