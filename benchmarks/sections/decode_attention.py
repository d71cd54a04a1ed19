"""9. Decode attention on the GPU: the Triton kernel vs SDPA as the engine calls it.

SmolLM2-135M's attention shapes (9 query heads, 3 K/V heads, head_dim 64) in ``gpu_dtype``,
one layer of a paged block pool (16 positions a block) sized for the longest history. Per
(batch, history): each row's history length is drawn between half and all of ``history``;
SDPA gets what the Python step gives it (the power-of-two span covering the longest row,
gathered from the rows' blocks, and the mask that hides each row's positions beyond its own;
the gather is timed with it), the kernel reads each row's blocks in place up to its own
length. A sample times ``decode_attention_calls`` back-to-back calls (one call is a few
microseconds, below what one host-side timer read resolves); rows report microseconds per call
and the kernel/SDPA ratio (below 1: the kernel is faster). The two
outputs are compared on every workload.

Without a CUDA device nothing is measured: the section says so in one line (the Triton
interpreter that the tests use on the CPU is far too slow to say anything about speed).
"""

from __future__ import annotations

import torch

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.report import Row, RunReport, SectionSkipped, say
from benchmarks.harness.timing import time_interleaved
from benchmarks.harness.workspace import Workspace

SECTION = "9. decode attention (GPU)"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
TOLERANCE = 2e-2  # bf16 outputs: a few units of the last place


def repeated(calls: int, fn, *args):
    """One timed sample: ``calls`` back-to-back calls of fn(*args); returns the last result."""
    def sample():
        for _ in range(calls):
            out = fn(*args)
        return out
    return sample


def measure_decode_attention(cfg: BenchConfig, report: RunReport, device: str, dtype: torch.dtype) -> None:
    from model.decode.triton_attention import decode_attention_triton, triton_available
    from model.nn.kv_cache import span_bucket
    from model.nn.layers import attention

    if not triton_available():
        raise SectionSkipped("not measured: triton is not installed")
    gen = torch.Generator().manual_seed(0)
    max_len, calls = max(cfg.decode_attention_histories), cfg.decode_attention_calls
    scale = HEAD_DIM ** -0.5
    block = 16  # the paged cache's positions per block
    blocks = -(-(max_len + 1) // block)
    for batch in cfg.decode_attention_batches:
        # a block pool (block 0 the null block) and each row's table of its own blocks, as the paged cache holds them
        k_pool = torch.randn(batch * blocks + 1, KV_HEADS, block, HEAD_DIM, generator=gen).to(device, dtype)
        v_pool = torch.randn(batch * blocks + 1, KV_HEADS, block, HEAD_DIM, generator=gen).to(device, dtype)
        tables = (torch.arange(batch * blocks).view(batch, blocks) + 1).to(device)
        key_positions = torch.arange(max_len + 1, device=device)
        for history in cfg.decode_attention_histories:
            lengths = torch.randint(history // 2, history + 1, (batch,), generator=gen).to(device)
            span = span_bucket(int(lengths.max()), max_len + 1)
            mask = (key_positions[:span][None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, span)
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
            n = -(-span // block)

            def sdpa(q=q, mask=mask, span=span, n=n, batch=batch, tables=tables, k_pool=k_pool, v_pool=v_pool):
                # what the Python step does: gather the span from the blocks, then SDPA
                ids = tables[:, :n].reshape(-1)
                k_span = k_pool.index_select(0, ids).view(batch, n, KV_HEADS, block, HEAD_DIM).transpose(1, 2)
                v_span = v_pool.index_select(0, ids).view(batch, n, KV_HEADS, block, HEAD_DIM).transpose(1, 2)
                k_span = k_span.reshape(batch, KV_HEADS, n * block, HEAD_DIM)[:, :, :span]
                v_span = v_span.reshape(batch, KV_HEADS, n * block, HEAD_DIM)[:, :, :span]
                return attention(q[:, :, None], k_span, v_span, mask, scale)  # (B, H, 1, D)

            sides = {
                "kernel": repeated(calls, decode_attention_triton, q, k_pool, v_pool, tables, lengths, scale),
                "sdpa": repeated(calls, sdpa),
            }
            stats, outs = time_interleaved(sides, cfg.repetitions, device)
            diff = (outs["kernel"].float() - outs["sdpa"][:, :, 0].float()).abs().max().item()
            check = f"outputs agree (max |Δ| {diff:.1e})" if diff <= TOLERANCE else \
                f"MISMATCH: max |Δ| {diff:.1e} > {TOLERANCE}"
            per_call = {name: s.map(lambda x: x * 1e6 / calls) for name, s in stats.items()}
            row = Row(SECTION, f"B={batch}, history {history} (span {span})", "µs per call", per_call["kernel"],
                      higher_is_better=False, peer="SDPA over the engine's span + mask", peer_value=per_call["sdpa"],
                      check=check)
            report.rows.append(row)
            say(f"{SECTION}: B={batch} history={history}: kernel {per_call['kernel'].median:.1f} µs, "
                f"SDPA {per_call['sdpa'].median:.1f} µs, ratio {row.ratio:.2f}; {check}")


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:  # noqa: ARG001 - the sections' signature
    if not torch.cuda.is_available():
        raise SectionSkipped("not measured: no GPU present (torch.cuda.is_available() is False)")
    measure_decode_attention(cfg, report, "cuda", getattr(torch, cfg.gpu_dtype))

