"""4-bit runs (model/quant/q4.py) and the native step's 4-bit kernel (``tserve_native::q4_linear``):
the runs of a Q4_1-style tensor are found again bit for bit, float weights are not taken for
runs, and the kernel computes the documented maths (reference_linear), the same bits with the
vector and the portable loops, and the same bits for a row alone or in any batch."""

from __future__ import annotations

import pytest
import torch

from model.decode import native
from model.quant import q4


@pytest.fixture(scope="module")
def kernel():
    native.build()
    return torch.ops.tserve_native.q4_linear


def _runs(seed: int, n: int, k: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] = 0.125  # a constant run: scale 0
    return q4.q4_runs(w)


def test_the_runs_of_dequantized_weights_are_found_again_bit_for_bit(fresh_seed):
    q, d, m = _runs(fresh_seed, 48, 96)
    weights = q4.dequantize(q, d, m)
    found = q4.exact(weights)
    assert found is not None
    assert all(torch.equal(a, b) for a, b in zip(found, (q, d, m)))
    assert torch.equal(q4.dequantize(*found), weights)
    assert int(q.max()) <= 15 and d.dtype == m.dtype == torch.float16


def test_float_weights_and_odd_shapes_are_not_taken_for_runs(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    assert q4.exact(torch.randn(32, 64, generator=g)) is None  # float weights: not on a 16-level grid
    q, d, m = _runs(fresh_seed, 48, 96)
    assert q4.exact(q4.dequantize(q, d, m)[:40]) is None  # 40 outputs: not whole tiles of 16
    with pytest.raises(ValueError, match="multiples of 32"):
        q4.q4_runs(torch.zeros(16, 48))


@pytest.mark.parametrize("n,k,rows", [(16, 32, 1), (48, 96, 3), (960, 576, 8), (576, 1536, 13)])
def test_the_kernel_computes_the_documented_maths(kernel, n, k, rows, fresh_seed):
    q, d, m = _runs(fresh_seed, n, k)
    g = torch.Generator().manual_seed(fresh_seed + 1)
    x = torch.randn(rows, k, generator=g) * 3
    x[0, 32:64] = 0.0  # a zero run of activations: scale 0
    bias = torch.randn(n, generator=g)
    packed = q4.pack_q4(q, d, m)
    got = kernel(x, packed, n, k, bias, False)
    want = q4.reference_linear(x, q, d, m, bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and close to the float product: the activations' 8-bit rounding is all that differs
    exact = x @ q4.dequantize(q, d, m).T + bias
    assert (got - exact).norm() / exact.norm() < 0.02


def test_the_vector_and_portable_loops_give_the_same_bits(kernel, fresh_seed):
    q, d, m = _runs(fresh_seed, 80, 192)  # an odd number of tiles: the vector loop's last tile alone
    x = torch.randn(11, 192, generator=torch.Generator().manual_seed(fresh_seed))
    packed = q4.pack_q4(q, d, m)
    assert torch.equal(kernel(x, packed, 80, 192, None, False), kernel(x, packed, 80, 192, None, True))


def test_a_row_gives_the_same_bits_alone_or_in_any_batch(kernel, fresh_seed):
    q, d, m = _runs(fresh_seed, 96, 128)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(fresh_seed))
    packed = q4.pack_q4(q, d, m)
    together = kernel(x, packed, 96, 128, None, False)
    for i in range(9):
        assert torch.equal(kernel(x[i:i + 1], packed, 96, 128, None, False)[0], together[i])


def test_runs_that_do_not_match_the_shape_are_refused(kernel):
    q, d, m = _runs(0, 32, 64)
    with pytest.raises(RuntimeError, match=r"runs must be a contiguous uint8 CPU tensor of \(n / 16\)"):
        kernel(torch.zeros(1, 64), q4.pack_q4(q, d, m), 48, 64, None, False)
    with pytest.raises(RuntimeError, match="4-bit projection of 64 inputs"):
        kernel(torch.zeros(1, 32), q4.pack_q4(q, d, m), 32, 64, None, False)
