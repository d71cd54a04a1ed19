"""Decode attention over the paged KV cache: one query token per sequence, fused in Triton.

A decode step asks, for every running sequence b, softmax(q_b Kᵀ · scale) V over the first
``lengths[b]`` positions of its history (the last ``window`` of them in a sliding-window
layer), which lie in the pool's blocks that its block table ``tables[b]`` names. SDPA does
this over a padded span gathered from the blocks (a power of two, ``CacheView.update``) with a
mask, reading every masked position too; the kernel reads each block in place, only the
positions the row sees (paged flash-decoding):

1. ``split`` kernel, grid (B, kv heads, splits): each program takes one sequence, one K/V
   head and one contiguous piece of that sequence's history; each key's block comes from the
   table, its offset from the position. It loads the query heads that
   share the K/V head (grouped-query attention: K/V is read once per group, not once per
   query head), walks its piece ``BLOCK_N`` keys at a time keeping the running max, the sum
   of exponentials and the unnormalised output in float32 (online softmax), and writes
   those three partial results.
2. ``combine`` kernel, grid (B, query heads): rescales each split's partial results to the
   common max and sums them: the exact softmax over the whole history.

Splitting the history keeps the GPU busy at small batches (B x kv heads programs alone
would leave most SMs idle: SmolLM2 has 3 K/V heads). Every row gets the same number of
splits, sized to its own length, so the grid does not depend on host-side lengths (no
device->host sync; a CUDA graph can capture it).

``decode_attention`` dispatches: the kernel on CUDA tensors (or on CPU under the Triton
interpreter, ``TRITON_INTERPRET=1``, which is how the tests run it), else the SDPA reference.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil

import torch
import torch.nn.functional as F
from torch import Tensor

_LOG2E = 1.4426950408889634  # the kernels use exp2: exp(x) = exp2(x * log2(e))
log = logging.getLogger(__name__)


# --- the reference -------------------------------------------------------------------

def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                               scale: float, window: int = 0) -> Tensor:
    """SDPA over each row's blocks with a length (and window) mask: q (B, H, D) -> (B, H, D) in q's dtype.

    k_cache, v_cache: one layer of the block pool, (blocks, kv heads, block_len, D); row b
    attends to positions ``0 .. lengths[b] - 1`` (the last ``window`` of them when > 0), held in
    blocks ``tables[b, p // block_len]``.
    """
    block_len = k_cache.size(2)
    span = int(lengths.max())  # host sync: fine for a reference
    n = -(-span // block_len)
    b, nkv, d = q.size(0), k_cache.size(1), k_cache.size(3)
    ids = tables[:, :n].to(k_cache.device)
    k = k_cache[ids].transpose(1, 2).reshape(b, nkv, n * block_len, d)[:, :, :span].to(q.dtype)
    v = v_cache[ids].transpose(1, 2).reshape(b, nkv, n * block_len, d)[:, :, :span].to(q.dtype)
    keys = torch.arange(span, device=q.device)[None, :]
    ends = lengths[:, None].to(q.device)
    mask = keys < ends  # (B, span)
    if window:
        mask &= keys >= ends - window
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=k.size(1) != q.size(1))  # (B, H, 1, D)
    return out[:, :, 0]


# --- when the kernel can run -------------------------------------------------------------

def interpreting() -> bool:
    """True when Triton runs kernels on the CPU, in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def c_compiler_found() -> bool:
    """Triton builds its CUDA launcher from C source on first use (``CC``, else gcc or clang);
    slim container images have no compiler."""
    return bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang"))


_failed: str | None = None  # why the kernel failed in this process, if it did (then: never again)


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernel can run on tensors of ``device``."""
    if not triton_available() or _failed is not None:
        return False
    if device.type == "cuda":
        return c_compiler_found()
    return interpreting()


def kernel_failed(exc: BaseException) -> None:
    """Record that the kernel raised (it failed to build or launch here): ``kernel_runs_on``
    says False from now on, so ``auto`` callers go back to SDPA. Logged once."""
    global _failed
    if _failed is None:
        _failed = f"{type(exc).__name__}: {exc}"
        log.warning("the Triton decode-attention kernel failed, using SDPA from now on: %s", _failed)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                     scale: float, window: int = 0) -> Tensor:
    """The Triton kernel where it can run (CUDA, or the interpreter), else the SDPA reference."""
    if kernel_runs_on(q.device):
        return decode_attention_triton(q, k_cache, v_cache, tables, lengths, scale, window)
    return decode_attention_reference(q, k_cache, v_cache, tables, lengths, scale, window)


DECODE_ATTENTION_MODES = ("auto", "sdpa", "triton", "native")  # native: model.decode.native


class TritonDecodeAttention:
    """The kernel as an attention layer's decode path (``AttentionContext.decode_kernel``):
    ``auto`` uses it on CUDA where it runs and falls back to SDPA for good if it fails;
    ``triton`` always uses it and lets a failure raise."""

    def __init__(self, mode: str):
        self.mode = mode

    def applies(self, q: Tensor) -> bool:
        return self.mode == "triton" or (q.device.type == "cuda" and kernel_runs_on(q.device))

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                 scale: float, window: int = 0) -> Tensor | None:
        try:
            return decode_attention_triton(q, k_cache, v_cache, tables, lengths, scale, window)
        except Exception as exc:
            if self.mode == "triton":
                raise
            kernel_failed(exc)
            return None


def attention_kernel(mode: str, device: torch.device) -> TritonDecodeAttention | None:
    """The Triton side of how a decode step attends (``TSERVE_DECODE_ATTENTION``): ``auto`` (the
    Triton kernel on CUDA when triton is installed, else SDPA), ``sdpa`` (None), ``triton`` (the
    kernel, or an error now naming why it cannot run here: it needs triton and CUDA, or
    TRITON_INTERPRET=1), ``native`` (None here: ``model.decode.step.prepare`` asks
    ``model.decode.native.native_attention``, as it does for ``auto`` on the CPU)."""
    if mode not in DECODE_ATTENTION_MODES:
        raise ValueError(f"decode attention must be one of {DECODE_ATTENTION_MODES}, got {mode!r}")
    if mode in ("sdpa", "native"):
        return None  # native: model.decode.native's kernel, chosen by model.decode.step.prepare
    if mode == "triton" and not kernel_runs_on(device):
        if not triton_available():
            why = "triton is not installed"
        elif device.type != "cuda":
            why = f"the model is on {device} (the kernel needs CUDA, or TRITON_INTERPRET=1 on the CPU)"
        elif not c_compiler_found():
            why = "Triton finds no C compiler to build its CUDA launcher with (install gcc or set CC)"
        else:
            why = "the kernel failed earlier in this process"
        raise ValueError(f"decode attention 'triton' cannot run here: {why}")
    return TritonDecodeAttention(mode)


# --- the kernel's launcher -------------------------------------------------------------

def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_splits(batch: int, kv_heads: int, positions: int, block_n: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice over, never more splits than key blocks."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4 * batch * kv_heads  # the interpreter: a few splits, to exercise the combine
    splits = math.ceil(target / (batch * kv_heads))
    return max(1, min(splits, math.ceil(positions / block_n), 64))


def decode_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                            scale: float, window: int = 0, num_splits: int | None = None,
                            block_n: int | None = None) -> Tensor:
    """The fused kernel: q (B, H, D), k_cache/v_cache (blocks, nkv, block_len, D), block tables
    (B, n) and lengths (B,) integer tensors -> (B, H, D) in q's dtype. ``lengths[b]`` must be in
    ``1 .. n * block_len`` (a row of length 0 comes out as zeros); ``window`` > 0 reads only the
    last ``window`` positions of each row. ``num_splits`` pieces of history per row and
    ``block_n`` keys per step default to sizes for the device."""
    if not kernel_runs_on(q.device):
        raise RuntimeError("the Triton decode-attention kernel needs triton and a CUDA tensor "
                           "(or TRITON_INTERPRET=1 to run it on the CPU in Triton's interpreter)")
    b, h, d = q.shape
    _, kv_heads, block_len, d_cache = k_cache.shape
    positions = tables.size(1) * block_len if window <= 0 else min(window, tables.size(1) * block_len)
    if v_cache.shape != k_cache.shape or d_cache != d:
        raise ValueError(f"k/v cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} "
                         f"do not fit q {tuple(q.shape)}")
    if h % kv_heads:
        raise ValueError(f"{h} query heads are not a multiple of {kv_heads} kv heads")
    if tables.dim() != 2 or tables.size(0) != b or lengths.shape != (b,):
        raise ValueError(f"tables {tuple(tables.shape)} and lengths {tuple(lengths.shape)} must be ({b}, n) and ({b},)")
    block_n = block_n or (64 if q.device.type == "cuda" else 16)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot's smallest tile), got {block_n}")
    splits = num_splits or default_splits(b, kv_heads, positions, block_n, q.device)
    group = h // kv_heads
    split_kernel, combine_kernel = _kernels(interpreting())

    qc = q if q.dtype == k_cache.dtype else q.to(k_cache.dtype)  # the dot products run in the cache's dtype
    part_o = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)  # unnormalised outputs
    part_m = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)  # running max (log2 units)
    part_l = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)  # sum of exponentials
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    block_d = max(16, _next_power_of_2(d))
    split_kernel[(b, kv_heads, splits)](
        qc, k_cache, v_cache, tables, lengths, part_o, part_m, part_l, scale * _LOG2E, splits,
        window if window > 0 else 2**30, tables.stride(0), *qc.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_LEN=block_len,
        GROUP=group, BLOCK_G=max(16, _next_power_of_2(group)),  # tl.dot wants >= 16 rows
        BLOCK_N=block_n, HEAD_DIM=d, BLOCK_D=block_d,
        # The interpreter computes bfloat16 arithmetic on the raw bits (it only converts them
        # correctly), so there the dot products take float32 operands; a GPU multiplies the
        # cache's own dtype on its tensor cores, accumulating in float32 either way.
        UPCAST=interpreting(),
    )
    combine_kernel[(b, h)](
        part_o, part_m, part_l, out, splits, *out.stride(),
        BLOCK_S=_next_power_of_2(splits), HEAD_DIM=d, BLOCK_D=block_d,
    )
    return out


# --- the kernels -----------------------------------------------------------------------------
# Built on first use, once per mode: ``triton.jit`` reads TRITON_INTERPRET when it wraps a
# function (compiled JITFunction or interpreted InterpretedFunction), so the choice is made
# here rather than at import time, and importing this module never imports triton.

@functools.cache
def _kernels(interpret: bool):  # noqa: ARG001 - the cache key: one pair of kernels per mode
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        Q, K, V, Tables, Lengths, PartO, PartM, PartL, qk_scale, num_splits, window, stride_tb,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        BLOCK_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        n_heads = tl.num_programs(1) * GROUP
        length = tl.load(Lengths + row).to(tl.int32)
        first = tl.maximum(length - window, 0)  # the window's first position (no window: a huge one)
        # This split's piece of the row's history: equal pieces, whole tiles of keys.
        piece = (((length - first + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        start = first + split * piece
        end = tl.minimum(start + piece, length)

        g = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = dims < HEAD_DIM
        heads = kv_head * GROUP + g  # the query heads that share this K/V head
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (G, D)
        if UPCAST:
            q = q.to(tl.float32)
        table = Tables + row * stride_tb

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max of the scores (log2)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # running sum of exp2(...) * v
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            n_ok = keys < end
            kv_mask = n_ok[:, None] & d_ok[None, :]
            blocks = tl.load(table + keys // BLOCK_LEN, mask=n_ok, other=0).to(tl.int64)  # each key's block
            offsets = keys % BLOCK_LEN
            k = tl.load(K + blocks[:, None] * stride_kb + kv_head * stride_kh + offsets[:, None] * stride_kn
                        + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (G, N), log2 units
            scores = tl.where(n_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every block has a real key
            alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
            p = tl.exp2(scores - m_new[:, None])
            v = tl.load(V + blocks[:, None] * stride_vb + kv_head * stride_vh + offsets[:, None] * stride_vn
                        + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

        # (B, H, splits[, D]) partial results; an empty piece leaves m=-inf, l=0, acc=0.
        at = (row * n_heads + heads) * num_splits + split  # (G,)
        tl.store(PartM + at, m_i, mask=g_ok)
        tl.store(PartL + at, l_i, mask=g_ok)
        tl.store(PartO + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def combine_kernel(
        PartO, PartM, PartL, Out, num_splits, stride_ob, stride_oh, stride_od,
        BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        dims = tl.arange(0, BLOCK_D)
        s_ok = splits < num_splits
        d_ok = dims < HEAD_DIM
        at = (row * tl.num_programs(1) + head) * num_splits + splits  # (S,)
        m = tl.load(PartM + at, mask=s_ok, other=float("-inf"))
        l_part = tl.load(PartL + at, mask=s_ok, other=0.0)
        o = tl.load(PartO + at[:, None] * HEAD_DIM + dims[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every piece empty: weights all 0
        w = tl.exp2(m - m_max)  # (S,): 0 for an empty piece
        denom = tl.sum(w * l_part, axis=0)
        numer = tl.sum(o * w[:, None], axis=0)  # (D,)
        result = tl.where(denom > 0.0, numer / tl.maximum(denom, 1e-30), 0.0)
        tl.store(Out + row * stride_ob + head * stride_oh + dims * stride_od,
                 result.to(Out.dtype.element_ty), mask=d_ok)

    return split_kernel, combine_kernel
