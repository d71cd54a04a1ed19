"""The int8 kernel with activations quantized per run of 32 (csrc/int8_blocks.cpp): the portable
loop and the vector one give the same bits, a row's result does not depend on the rows beside it,
and both compute model.quant.int8.blockwise_int8_linear's maths to float rounding."""

from __future__ import annotations

import pytest
import torch

from model.decode import native
from model.quant.int8 import blockwise_int8_linear
from model.quant.q4 import RUN, quantize_activations

EPS = 2.0 ** -24  # float32's unit roundoff


@pytest.fixture(scope="module")
def op():
    native.build()
    return torch.ops.tserve_native.int8_block_linear


def _case(seed: int, rows: int, n: int, k: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, 3] *= 60  # a large channel, as a norm's output has
    ints = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.02 + 1e-3
    bias = torch.randn(n, generator=g)
    return x, ints, scales, bias


def _exact(x, ints, scales):
    """The kernel's maths in float64, and the size of what it sums (for the rounding bound)."""
    r, s = quantize_activations(x)
    b, k = x.shape
    dots = torch.einsum("bur,nur->bnu", r.double().reshape(b, k // RUN, RUN), ints.double().reshape(-1, k // RUN, RUN))
    terms = dots * s.double().unsqueeze(1)
    return terms.sum(-1) * scales.double(), terms.abs().sum(-1) * scales.double()


# widths: a tail of outputs past the vector loop's groups of 8, rows past its groups of 4
@pytest.mark.parametrize("rows,n,k", [(1, 64, 96), (3, 45, 64), (9, 130, 576)])
def test_the_vector_loop_gives_the_portable_bits(op, rows, n, k, fresh_seed):
    x, ints, scales, bias = _case(fresh_seed, rows, n, k)
    for b in (None, bias):
        assert torch.equal(op(x, ints, scales, b, False), op(x, ints, scales, b, True))


def test_a_row_gives_the_same_bits_alone_or_in_a_batch(op, fresh_seed):
    x, ints, scales, bias = _case(fresh_seed, 7, 80, 128)
    batch = op(x, ints, scales, bias, False)
    for i in range(len(x)):
        assert torch.equal(op(x[i:i + 1], ints, scales, bias, False)[0], batch[i])


def test_kernel_and_python_compute_the_blockwise_maths(op, fresh_seed):
    """Each output is a sum over k / 32 runs: the kernel rounds once per run (a fused multiply-add)
    and once for the weight scale, so it lies within (runs + 1) roundings of the sum of the
    terms' magnitudes from the exact value; the Python form (a product, a sum of runs, a
    product) within (runs + 2)."""
    x, ints, scales, bias = _case(fresh_seed, 5, 48, 256)
    exact, size = _exact(x, ints, scales)
    runs = x.shape[1] // RUN
    kernel = op(x, ints, scales, None, False).double()
    python = blockwise_int8_linear(x, ints.float(), scales, None).double()
    assert ((kernel - exact).abs() <= (runs + 1) * EPS * size + 1e-30).all()
    assert ((python - exact).abs() <= (runs + 2) * EPS * size + 1e-30).all()
    with_bias = op(x, ints, scales, bias, False)
    assert torch.equal(with_bias, op(x, ints, scales, None, False) + bias)


def test_runs_keep_small_channels_a_row_wide_grid_loses(fresh_seed):
    """Why per run: a row with one large channel. Per row (7 bits over the row's range) the rest of
    the row falls into a few levels; per run of 32 only the large channel's run does."""
    x, ints, scales, _ = _case(fresh_seed, 4, 64, 256)
    w = ints.float() * scales[:, None]
    truth = x.double() @ w.double().T
    blocks = blockwise_int8_linear(x, ints.float(), scales, None).double()
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    step = (hi - lo) / 127
    zero = (-lo / step).round()
    per_row = (((x / step + zero).round().clamp(0, 127) - zero) * step).double() @ w.double().T
    assert (blocks - truth).abs().mean() < 0.5 * (per_row - truth).abs().mean()
