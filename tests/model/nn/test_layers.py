"""Attention maths against the course's worked examples, SDPA against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from model.nn.layers import attention, reference_attention, sinusoidal_table

Q = torch.tensor([[-1.0, -2.5], [4.0, 3.0]])
KV = torch.tensor([[-2.0, -4.0], [-2.5, -0.5], [4.5, 2.5]])
CAUSAL_X = torch.tensor([[1.0, 1.0], [-1.0, -2.5], [4.0, 3.0], [2.0, -3.0]])

BOTH = pytest.mark.parametrize("impl", ["reference", "sdpa"])


def run(impl, q, k, v, **kw):
    if impl == "reference":
        return reference_attention(q, k, v, **kw)[0]
    return attention(q, k, v, **kw)


def test_worked_example_scores():
    assert torch.allclose(Q @ KV.T, torch.tensor([[12.0, 3.75, -10.75], [-20.0, -11.5, 25.5]]))


@BOTH
def test_worked_example_default_scale(impl):
    out = run(impl, Q, KV, KV)  # scale defaults to 1/sqrt(d_k) = 1/sqrt(2)
    assert torch.allclose(out, torch.tensor([[-2.0015, -3.9898], [4.5000, 2.5000]]), atol=1e-4)


@BOTH
def test_worked_example_course_scale_one_third(impl):
    out = run(impl, Q, KV, KV, scale=1 / 3)
    assert torch.allclose(out, torch.tensor([[-2.0269, -3.7867], [4.5000, 2.5000]]), atol=1e-4)
    # the course's printed (rounded) numbers
    assert torch.allclose(out, torch.tensor([[-2.02, -3.78], [4.49, 2.49]]), atol=0.011)
    weights = reference_attention(Q, KV, KV, scale=1 / 3)[1]
    assert torch.allclose(weights, torch.tensor([[0.94, 0.06, 0.00], [0.00, 0.00, 0.99]]), atol=0.011)


@BOTH
def test_worked_example_causal_unscaled(impl):
    x = CAUSAL_X
    out = run(impl, x, x, x, scale=1.0, causal=True)
    expected = torch.tensor([[1, 1], [-0.99996, -2.4999], [4, 3], [1.9983, -2.9997]])
    assert torch.allclose(out, expected, atol=1e-4)


@BOTH
def test_worked_example_causal_default_scale(impl):
    out = run(impl, CAUSAL_X, CAUSAL_X, CAUSAL_X, causal=True)
    assert torch.allclose(out[-1], torch.tensor([1.9852, -2.9970]), atol=1e-4)
    assert torch.allclose(out[0], CAUSAL_X[0])  # the first token sees only itself


def test_masked_positions_get_exactly_zero_weight():
    _, w = reference_attention(CAUSAL_X, CAUSAL_X, CAUSAL_X, scale=1.0, causal=True)
    assert torch.equal(w.triu(diagonal=1), torch.zeros(4, 4))
    assert torch.allclose(w.sum(-1), torch.ones(4))
    pad = torch.tensor([True, True, False])
    _, w = reference_attention(Q, KV, KV, mask=pad)
    assert torch.equal(w[:, 2], torch.zeros(2))


def test_masked_keys_cannot_influence_sdpa_output(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    mask = torch.tensor([True, True, True, False, False])[None, None, None, :]
    out = attention(q, k, v, mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[..., 3:, :], v2[..., 3:, :] = 1e4, -1e4  # garbage in masked keys
    assert torch.equal(attention(q, k2, v2, mask=mask), out), f"seed {fresh_seed}"


CASES = {
    "self": dict(tq=7, tk=7),
    "causal": dict(tq=7, tk=7, causal=True),
    "cross": dict(tq=5, tk=9),
    "padded": dict(tq=6, tk=6, pad=True),
    "padded_causal": dict(tq=6, tk=6, pad=True, causal=True),
    "cross_padded": dict(tq=4, tk=8, pad=True),
}


@pytest.mark.parametrize("case", CASES)
def test_sdpa_matches_reference(case, fresh_seed):
    spec = CASES[case]
    g = torch.Generator().manual_seed(fresh_seed)
    b, h, d = 3, 4, 16
    q = torch.randn(b, h, spec["tq"], d, generator=g)
    k = torch.randn(b, h, spec["tk"], d, generator=g)
    v = torch.randn(b, h, spec["tk"], d, generator=g)
    mask = None
    if spec.get("pad"):
        lengths = torch.randint(1, spec["tk"] + 1, (b,), generator=g)
        mask = (torch.arange(spec["tk"])[None, :] < lengths[:, None])[:, None, None, :]
    causal = spec.get("causal", False)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), mask=mask, causal=causal)
    fast = attention(q, k, v, mask=mask, causal=causal)
    assert (fast.double() - ref).abs().max() < 1e-5, f"seed {fresh_seed}"


def test_sinusoidal_table_matches_paper_formula():
    table = sinusoidal_table(50, 16, "interleaved")
    pos, i = 37, 3
    angle = pos / 10000 ** (2 * i / 16)
    assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
    assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)
    split = sinusoidal_table(50, 16, "split")
    assert torch.equal(split[:, :8], table[:, 0::2]) and torch.equal(split[:, 8:], table[:, 1::2])
