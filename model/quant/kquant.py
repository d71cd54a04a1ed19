"""GGUF projections read as stored: ``KQuantLinear`` holds a projection's raw GGUF blocks (a
uint8 tensor, one row of blocks per output, byte for byte the file's, so it can be a view of the
mapped file) and multiplies by them without ever making a float or int8 copy of the weights.

Types: the K-quants of a Q4_K_M file (Q4_K, Q5_K, Q6_K) and Q8_0, plus the 32-value types such a
file falls back to for rows whose width is not a multiple of 256 (Q5_0 in Gemma 3 270M's file;
Q4_0, Q4_1, Q5_1 cost nothing more). ``dequantize`` is this module's own reading of ggml's block
formats (tested equal, bit for bit, to ``gguf.quants.dequantize``).

``forward`` runs the native kernel (``model/decode/csrc/kquant.cpp``: activations quantized per
block to 14 bits, exact integer dot products per block, then float) where the native library is
built, else the float product with the weights dequantized on each call. ``kquant_projection``
wraps one tensor's bytes; the GGUF import (``TSERVE_GGUF_WEIGHTS=stored``) builds ``KQuantLinear``
and ``StoredEmbedding`` (token embeddings as blocks) over views of the mapped file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class BlockType:
    name: str
    code: int  # ggml's type number (gguf.GGMLQuantizationType), also the kernel's
    values: int  # weights per block
    size: int  # bytes per block


TYPES = {t.code: t for t in (
    BlockType("Q4_0", 2, 32, 18), BlockType("Q4_1", 3, 32, 20), BlockType("Q5_0", 6, 32, 22),
    BlockType("Q5_1", 7, 32, 24), BlockType("Q8_0", 8, 32, 34), BlockType("Q4_K", 12, 256, 144),
    BlockType("Q5_K", 13, 256, 176), BlockType("Q6_K", 14, 256, 210),
)}
BY_NAME = {t.name: t for t in TYPES.values()}

# The native kernel's loops (csrc/kquant.h): the library's default, scalar, AVX2 a row at a time, and
# AVX2 over every type repacked once (what the native step's projections take where AVX2 is the default).
AUTO, SCALAR, AVX2, PACKED = -1, 0, 1, 3
# The native kernels' activations: per block of the weight type's size, r = round(x * L / max|x|)
# in [-L, L] (csrc/kquant_blocks.h KqActs): 14-bit integers.
ACTIVATION_LEVELS = 8191


def block_type(qtype: int | str) -> BlockType:
    found = BY_NAME.get(qtype) if isinstance(qtype, str) else TYPES.get(int(qtype))
    if found is None:
        raise ValueError(f"GGUF type {qtype!r} is not read as stored (supported: {', '.join(BY_NAME)})")
    return found


# --- the reference dequantizers: (blocks, size) uint8 -> (blocks, values) float32 ------------------

def _half(b: Tensor, at: int) -> Tensor:
    """The float16 at byte ``at`` of each block, as float32 (blocks, 1)."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """(blocks, 16) bytes -> (blocks, 32): the low nibbles are values 0-15, the high ones 16-31."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _bits32(qh: Tensor) -> Tensor:
    """(blocks, 4) bytes of a little-endian 32-bit word -> its 32 bits (blocks, 32), bit j at j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit minima. Bytes 0-3 hold scales
    0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the minima; bytes
    8-11 the low 4 bits of scales 4-7 (low nibble) and of minima 4-7 (high nibble)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc, mn


def _dequantize_blocks(b: Tensor, t: BlockType) -> Tensor:
    n = b.shape[0]
    if t.name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * _half(b, 0)
    if t.name in ("Q4_0", "Q4_1"):
        q = _nibbles(b[:, 2 if t.name == "Q4_0" else 4:])
        if t.name == "Q4_0":
            return _half(b, 0) * (q.to(torch.int8) - 8).float()
        return _half(b, 0) * q.float() + _half(b, 2)
    if t.name in ("Q5_0", "Q5_1"):
        at = 2 if t.name == "Q5_0" else 4
        q = _nibbles(b[:, at + 4:]) | (_bits32(b[:, at:at + 4]) << 4)
        if t.name == "Q5_0":
            return _half(b, 0) * (q.to(torch.int8) - 16).float()
        return _half(b, 0) * q.float() + _half(b, 2)
    if t.name in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(b[:, 4:16])
        d = (_half(b, 0) * sc.float()).unsqueeze(-1)  # (n, 8, 1): each sub-block of 32
        dm = (_half(b, 2) * mn.float()).unsqueeze(-1)
        qs = b[:, 16:144] if t.name == "Q4_K" else b[:, 48:176]
        # each 32 bytes: low nibbles are sub-block 2j, high nibbles sub-block 2j + 1
        q = torch.stack([qs.reshape(n, 4, 32) & 15, qs.reshape(n, 4, 32) >> 4], dim=2).reshape(n, 8, 32)
        if t.name == "Q5_K":  # bit s of high byte l is the fifth bit of value l of sub-block s
            q = q | (((b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1) << 4)
        return (d * q.float() - dm).reshape(n, 256)
    if t.name == "Q6_K":
        ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 1, 32)
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        # per half of 128: values 0-31 / 32-63 are the low nibbles of ql[0:32] / ql[32:64], values
        # 64-95 / 96-127 their high nibbles; bits 2c, 2c + 1 of qh[l] top up value 32c + l
        low = torch.stack([ql & 15, ql >> 4], dim=2).reshape(n, 2, 4, 32)
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        return ((_half(b, 208) * sc).unsqueeze(-1) * q).reshape(n, 256)
    raise AssertionError(t.name)


def dequantize(raw: Tensor, qtype: int | str, shape: tuple[int, int]) -> Tensor:
    """Raw GGUF bytes of an (n, k) tensor -> float32 (n, k), as ggml dequantizes them."""
    t = block_type(qtype)
    n, k = shape
    if k % t.values or raw.numel() != n * (k // t.values) * t.size:
        raise ValueError(f"{t.name}: {raw.numel()} bytes do not hold a ({n}, {k}) tensor")
    return _dequantize_blocks(raw.reshape(-1, t.size), t).reshape(n, k)


# --- the module ----------------------------------------------------------------------------------

@dataclass
class Part:
    """Rows [.., .. + n) of a projection: raw (n, row bytes) uint8 of one type."""
    raw: Tensor
    qtype: BlockType
    n: int


_NATIVE: list[bool] = []  # [False]: never the native kernel (tests of the reference path)


def native_kernel() -> bool:
    """Whether the native library with ``kquant_linear`` is loaded in this process (the import
    loads it: ``model.formats.gguf_import.load_gguf``; the decode step's preparation does too)."""
    if _NATIVE:
        return _NATIVE[0]
    return hasattr(torch.ops.tserve_native, "kquant_linear")


class KQuantLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks. A projection may be several tensors of the file
    stacked by rows, each of its own type (a fused q/k/v whose v is Q8_0 and q, k Q5_0): ``parts``
    in output order. ``isa``: -1 the native library's choice, 0 its scalar loops (tests)."""

    def __init__(self, parts: list[tuple[Tensor, int | str]], in_features: int, bias: Tensor | None = None):
        super().__init__()
        self.in_features = in_features
        self.parts: list[Part] = []
        for raw, qtype in parts:
            t = block_type(qtype)
            if in_features % t.values:
                raise ValueError(f"{t.name} needs inputs in multiples of {t.values}, got {in_features}")
            row = in_features // t.values * t.size
            if raw.dtype != torch.uint8 or raw.numel() % row:
                raise ValueError(f"{t.name}: expected uint8 rows of {row} bytes, got {raw.dtype} x {raw.numel()}")
            self.parts.append(Part(raw.reshape(-1, row), t, raw.numel() // row))
        self.out_features = sum(p.n for p in self.parts)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.isa = AUTO

    @property
    def weight_bytes(self) -> int:
        return sum(p.raw.numel() for p in self.parts)

    def float_weights(self) -> tuple[int, int, bool]:
        """(out, in, has bias) of the float layer these blocks stand for (``num_parameters``)."""
        return self.out_features, self.in_features, self.bias is not None

    def dequantized(self) -> Tensor:
        """The float32 weights (out, in): for tests and the reference path."""
        return torch.cat([dequantize(p.raw, p.qtype.code, (p.n, self.in_features)) for p in self.parts])

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float().contiguous()
        if native_kernel() and x.device.type == "cpu":
            outs = [torch.ops.tserve_native.kquant_linear(rows, p.raw, p.qtype.code, p.n, self.in_features, None,
                                                          self.isa) for p in self.parts]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(rows, self.dequantized().to(rows.device), self.bias)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        types = "+".join(p.qtype.name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}"


class StoredEmbedding(nn.Module):
    """Token embeddings kept as a GGUF tensor's blocks (``raw``: (V, row bytes) uint8, a view of the
    mapped file): a lookup dequantizes only the rows it gathers (``torch.ops.tserve_native.kquant_rows``
    where the native library is loaded, else ``dequantize``: the same bits). The native step reads
    the same blocks (``LlamaDecoder.set_embedding_blocks``), and a tied output head is a
    ``KQuantLinear`` over them, so the table never exists in float."""

    dtype = torch.float32  # what a lookup returns

    def __init__(self, raw: Tensor, qtype: int | str, dim: int):
        super().__init__()
        self.qtype = block_type(qtype)
        if dim % self.qtype.values:
            raise ValueError(f"{self.qtype.name} needs rows in multiples of {self.qtype.values}, got {dim}")
        row = dim // self.qtype.values * self.qtype.size
        if raw.dtype != torch.uint8 or raw.numel() % row:
            raise ValueError(f"{self.qtype.name}: expected uint8 rows of {row} bytes, got {raw.dtype} x {raw.numel()}")
        self.raw = raw.reshape(-1, row)
        self.num_embeddings, self.embedding_dim = self.raw.shape[0], dim

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def float_weights(self) -> tuple[int, int, bool]:
        return self.num_embeddings, self.embedding_dim, False

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        if native_kernel():
            rows = torch.ops.tserve_native.kquant_rows(self.raw, self.qtype.code, self.embedding_dim, flat)
        else:
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
                raise IndexError(f"token id out of range [0, {self.num_embeddings})")
            rows = dequantize(self.raw[flat].reshape(-1), self.qtype.code, (flat.numel(), self.embedding_dim))
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name}"


def kquant_projection(raw: Tensor, qtype: int | str, shape: tuple[int, int], bias: Tensor | None = None
                      ) -> KQuantLinear:
    """A projection of ``shape`` (out, in) over one GGUF tensor's raw bytes (uint8, as stored)."""
    n, k = shape
    t = block_type(qtype)
    if k % t.values or raw.numel() != n * (k // t.values) * t.size:
        raise ValueError(f"{t.name}: {raw.numel()} bytes do not hold a ({n}, {k}) tensor")
    return KQuantLinear([(raw, t.code)], k, bias)


GGUF_WEIGHT_MODES = ("stored", "float")


def stored_weights() -> bool:
    """``TSERVE_GGUF_WEIGHTS``: ``stored`` (the default) keeps GGUF projections of these types as
    their blocks; ``float`` imports them as float weights (then int8 decode copies), the path
    before 2026-11-28, kept to compare with."""
    mode = os.environ.get("TSERVE_GGUF_WEIGHTS", "").strip().lower() or "stored"
    if mode not in GGUF_WEIGHT_MODES:
        raise ValueError(f"TSERVE_GGUF_WEIGHTS must be one of {', '.join(GGUF_WEIGHT_MODES)}, got {mode!r}")
    return mode == "stored"
