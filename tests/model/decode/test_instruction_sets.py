"""The native step's numbers do not depend on the CPU's vector units: the same computation in
this process (whatever vector kernels this CPU takes: AVX2 attention, AVX-512 int8 row passes,
VNNI 4-bit products) and in a child process with ``TSERVE_NATIVE_ISA=scalar`` (the plain loops
only) gives the same bits. Under ``make test-scalar`` this process is scalar too, and the other
numerics tests run against the plain loops."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.decode.native import NativeStep, build
from tests.model.decode.test_native_decode import _int8
from tests.model.decode.test_native_q4 import _q4_float
from tests.model.decode_steps import random_prompts

ROOT = Path(__file__).resolve().parents[3]
SEED = 11


def compute(out: str) -> None:
    """Everything compared, saved to ``out``: a 4-bit model's prompt (300 rows, one call, past
    several blocks), its cache, decode steps with drafts beside another row, a replay; and the
    paged decode attention at head sizes 64 and 128 over float32 and bfloat16 pools, with a window."""
    build()
    torch.manual_seed(SEED)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _int8(_q4_float(SEED), SEED)
        step = NativeStep(model, kv_dtype=dtype)
        long, short = random_prompts(model, SEED, (150, 9))
        cache = model.new_cache(3, 160, dtype=dtype)
        cache.k.zero_(), cache.v.zero_()  # allocated empty: what no row writes stays zero in both processes
        with torch.inference_mode():
            first = step.prefill(cache, [long, short], [0, 2])
            decoded = step(cache, torch.tensor([5, 6, 7, 8]), [0, 0, 0, 2], [150, 151, 152, 9])
            replayed = step.replay(cache, [[9, 10, 11]], [1], [0])
        name = str(dtype).split(".")[-1]
        results[f"step {name}"] = torch.cat([first, decoded, replayed])
        results[f"cache {name}"] = torch.stack([cache.k.float(), cache.v.float()])
    g = torch.Generator().manual_seed(SEED)
    for hs in (64, 128):
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(3, 6, hs, generator=g)
            k, v = (torch.randn(2, 20, 16, hs, generator=g).to(dtype) for _ in range(2))
            tables = torch.randperm(19, generator=g)[:18].add(1).view(3, 6)
            lengths = torch.tensor([1, 37, 96])
            for window in (0, 20):
                results[f"attention {hs} {dtype} {window}"] = torch.ops.tserve_native.paged_decode_attention(
                    q, k, v, tables, lengths, hs ** -0.5, window)
    torch.save(results, out)


def test_the_plain_loops_give_the_vector_kernels_bits(tmp_path):
    here, scalar = tmp_path / "here.pt", tmp_path / "scalar.pt"
    compute(str(here))
    env = {**os.environ, "TSERVE_NATIVE_ISA": "scalar"}
    code = f"from tests.model.decode.test_instruction_sets import compute; compute({str(scalar)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = torch.load(here), torch.load(scalar)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: vector and plain loops differ by {(a[key] - b[key]).abs().max()}"


@pytest.mark.parametrize("hs", [64, 96])
def test_attention_does_not_depend_on_the_rows_beside_a_query(hs):
    """A row's decode attention alone equals the same row among others (a head size the vector
    kernels take, and one only the plain loops take)."""
    build()
    g = torch.Generator().manual_seed(SEED)
    q = torch.randn(4, 4, hs, generator=g)
    k, v = (torch.randn(2, 13, 16, hs, generator=g) for _ in range(2))
    tables = torch.arange(1, 13).view(4, 3)
    lengths = torch.tensor([5, 48, 17, 33])
    together = torch.ops.tserve_native.paged_decode_attention(q, k, v, tables, lengths, 0.125, 0)
    for b in range(4):
        alone = torch.ops.tserve_native.paged_decode_attention(q[b:b + 1], k, v, tables[b:b + 1], lengths[b:b + 1],
                                                               0.125, 0)
        assert torch.equal(alone[0], together[b])
