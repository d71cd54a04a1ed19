"""GGUF blocks read as stored (model/quant/kquant.py, csrc/kquant.cpp), on tiny random GGUF files
written with the ``gguf`` package: the reference dequantizer is gguf's bit for bit, the native
scalar and AVX2 loops give the same bits, the native product stays within the bound the 14-bit
activations allow of the float product (exactly, at the weights and activations that make its
integers largest), and a row's result does not depend on the rows beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model.decode import native
from model.quant import kquant
from model.quant.kquant import KQuantLinear, kquant_projection

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1"]
# bytes of a block that hold its quantized values (after them or before them: its scales)
Q_BYTES = {"Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192), "Q8_0": (2, 34), "Q5_0": (2, 22),
           "Q5_1": (4, 24), "Q4_0": (2, 18), "Q4_1": (4, 20)}
# where each block's float16 scales are (d, and dmin or m)
HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2),
          "Q4_0": (0,), "Q4_1": (0, 2)}
EPS = float(torch.finfo(torch.float32).eps)


def _random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) uint8. gguf's Python quantizer covers the 32-value types; the K-quants are
    random bytes (every pattern of their quantized values and 6-bit scales is a valid block) with
    float16 scales set to sizes a trained model has."""
    t = kquant.BY_NAME[name]
    qt = gguf.GGMLQuantizationType[name]
    try:
        return gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qt)
    except NotImplementedError:
        blocks = rng.integers(0, 256, size=(n * k // t.values, t.size), dtype=np.uint8)
        for at in HALVES[name]:
            blocks[:, at:at + 2] = (rng.uniform(2e-4, 4e-3, size=(blocks.shape[0], 1)).astype(np.float16)
                                    .view(np.uint8))
        return blocks.reshape(n, -1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A GGUF file with one (5, k) tensor of each type (k: two blocks and a half for the 32-value
    types, two blocks for the K-quants), read back through gguf's memory-mapped reader."""
    rng = np.random.default_rng(41)
    path = tmp_path_factory.mktemp("kquant") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in TYPES:
        k = 512 if kquant.BY_NAME[name].values == 256 else 96
        writer.add_tensor(name, _random_blocks(name, 5, k, rng), raw_dtype=gguf.GGMLQuantizationType[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    return {t.name: t for t in reader.tensors}


def _stored(tiny_gguf, name: str) -> tuple[torch.Tensor, int, int]:
    info = tiny_gguf[name]
    k, n = (int(s) for s in info.shape.tolist())  # GGUF lists the fastest dimension first
    return torch.from_numpy(np.array(info.data)).reshape(n, -1), n, k


@pytest.fixture(scope="module")
def kernel():
    native.build()
    return torch.ops.tserve_native.kquant_linear


def _activations(seed: int, rows: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2
    x[0, :32] = 0.0  # a block of zeros: scale 0
    x[-1, 5] = 40.0  # an outlier: one block's scale is set by it
    return x


@pytest.mark.parametrize("name", TYPES)
def test_the_reference_dequantizer_is_ggufs_bit_for_bit(tiny_gguf, name):
    raw, n, k = _stored(tiny_gguf, name)
    want = gguf.quants.dequantize(np.array(tiny_gguf[name].data), gguf.GGMLQuantizationType[name])
    got = kquant.dequantize(raw, name, (n, k))
    assert got.shape == (n, k)
    assert np.array_equal(got.numpy().view(np.uint32), np.asarray(want, dtype=np.float32).reshape(n, k).view(np.uint32))


@pytest.mark.parametrize("name", TYPES)
def test_scalar_and_avx2_loops_give_the_same_bits(tiny_gguf, kernel, name, fresh_seed):
    if torch.ops.tserve_native.kquant_isa(kquant.AVX2) != kquant.AVX2:
        pytest.skip("this CPU has no AVX2")
    raw, n, k = _stored(tiny_gguf, name)
    x = _activations(fresh_seed, 7, k)
    code = kquant.BY_NAME[name].code
    scalar = kernel(x, raw, code, n, k, None, kquant.SCALAR)
    vector = kernel(x, raw, code, n, k, None, kquant.AVX2)
    assert torch.equal(scalar.view(torch.int32), vector.view(torch.int32))


def _bound(x: torch.Tensor, raw: torch.Tensor, name: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the kernel may be from x W^T (W dequantized), per output: (quantization, rounding).

    Activations: a block of `v` inputs (256 for the K-quants, 32 else) goes in as s r with
    s = max|x| / L and r = round(x / s) (L = kquant.ACTIVATION_LEVELS), so |x_i - s r_i| <= s / 2
    and the product moves by at most sum_blocks (s / 2) sum_i |w_i|: the quantization term.
    Float: each block adds up to five terms t = (d s) i into a float32 sum (Q6_K: four partial
    sums; Q5_K: two and the minima), each rounded at most three times (d s, i to float, the fused
    add), so the sum is off by at most (3 + 2 terms) eps sum |t|. A term is at most
    s sum_i (|w_i| + 2 |w0_i|) |r_i| with w0 the weights of the same block with every quantized
    value zeroed (the minimum or offset part, which a term may carry without the other cancelling
    it), and s |r_i| <= |x_i| + s / 2: the rounding term."""
    v = kquant.BY_NAME[name].values
    w = kquant.dequantize(raw, name, (n, k)).double()
    zeroed = raw.reshape(-1, kquant.BY_NAME[name].size).clone()
    lo, hi = Q_BYTES[name]
    zeroed[:, lo:hi] = 0
    w0 = kquant.dequantize(zeroed, name, (n, k)).double()
    xb = x.double().reshape(x.shape[0], k // v, v)
    s = xb.abs().amax(-1, keepdim=True) / kquant.ACTIVATION_LEVELS  # (rows, blocks, 1)
    half_step = (s / 2).expand_as(xb).reshape(x.shape[0], k)
    terms = (x.double().abs() + half_step) @ (w.abs() + 2 * w0.abs()).T
    return half_step @ w.abs().T, (3 + 2 * 5 * (k // v)) * EPS * terms


def _kernel_maths(x: torch.Tensor, raw: torch.Tensor, name: str, n: int, k: int) -> torch.Tensor:
    """What the kernel computes before float rounding: the activations quantized as it does
    (float32 s = max|x| / L, r = round half to even of x * (L / max|x|)), then
    sum_blocks s (w . r) in float64 (exact: float32 weights times 14-bit integers)."""
    v, levels = kquant.BY_NAME[name].values, kquant.ACTIVATION_LEVELS
    xb = x.reshape(x.shape[0], k // v, v)
    top = xb.abs().amax(-1, keepdim=True)
    # a true float32 division, as the kernel's L / max (torch's `number / tensor` multiplies by
    # a rounded reciprocal, which moves products that sit near a half step)
    inv = torch.where(top > 0, torch.full_like(top, levels) / torch.where(top > 0, top, torch.ones_like(top)),
                      torch.zeros_like(top))
    r = (xb * inv).round().clamp(-levels, levels).double()
    w = kquant.dequantize(raw, name, (n, k)).double().reshape(n, k // v, v)
    return torch.einsum("bgv,ngv,bg->bn", r, w, (top / levels).squeeze(-1).double())


@pytest.mark.parametrize("rows", [1, 6, 33])
@pytest.mark.parametrize("name", TYPES)
def test_the_native_product_is_the_float_product_within_the_activation_rounding(tiny_gguf, kernel, name, rows,
                                                                                 fresh_seed):
    raw, n, k = _stored(tiny_gguf, name)
    x = _activations(fresh_seed, rows, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(fresh_seed))
    exact = x.double() @ kquant.dequantize(raw, name, (n, k)).double().T + bias.double()
    maths = _kernel_maths(x, raw, name, n, k) + bias.double()
    quantization, rounding = _bound(x, raw, name, n, k)
    rounding = rounding + 2 * EPS * exact.abs()  # the bias added in float32
    for isa in (kquant.SCALAR, kquant.AUTO):
        got = kernel(x, raw, kquant.BY_NAME[name].code, n, k, bias, isa).double()
        assert ((got - exact).abs() <= quantization + rounding).all(), (got - exact).abs().max()
        # and tightly: apart from float rounding it is exactly the documented maths
        assert ((got - maths).abs() <= rounding).all(), (got - maths).abs().max()
    assert not torch.equal(got, exact)  # the 14-bit activations do move the product


@pytest.mark.parametrize("name", TYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(tiny_gguf, kernel, name, fresh_seed):
    raw, n, k = _stored(tiny_gguf, name)
    x = _activations(fresh_seed, 9, k)
    code = kquant.BY_NAME[name].code
    for isa in (kquant.SCALAR, kquant.AUTO):
        together = kernel(x, raw, code, n, k, None, isa)
        for b in (0, 4, 8):
            alone = kernel(x[b:b + 1], raw, code, n, k, None, isa)
            assert torch.equal(alone[0], together[b])


@pytest.mark.parametrize("name", TYPES)
def test_the_avx2_row_loops_keep_every_rows_bits_at_any_batch(kernel, name, fresh_seed):
    """The AVX2 loops a row at a time (what a KQuantLinear's forward takes): over 21 outputs and
    several blocks, at 1, 3, 8 and 33 rows, they give the scalar loops' bits, and every row equals
    itself computed alone."""
    rng = np.random.default_rng(fresh_seed)
    n, k = 21, 3 * kquant.BY_NAME[name].values if kquant.BY_NAME[name].values == 256 else 7 * 32
    raw = torch.from_numpy(np.ascontiguousarray(_random_blocks(name, n, k, rng)))
    code = kquant.BY_NAME[name].code
    bias = torch.randn(n, generator=torch.Generator().manual_seed(fresh_seed))
    for rows in (1, 3, 8, 33):
        x = _activations(fresh_seed + rows, rows, k)
        scalar = kernel(x, raw, code, n, k, bias, kquant.SCALAR)
        vector = kernel(x, raw, code, n, k, bias, kquant.AUTO)
        assert torch.equal(scalar.view(torch.int32), vector.view(torch.int32)), rows
        for b in range(rows):
            alone = kernel(x[b:b + 1], raw, code, n, k, bias, kquant.AUTO)
            assert torch.equal(alone[0].view(torch.int32), vector[b].view(torch.int32)), (rows, b)


def _largest_blocks(name: str, n: int, k: int) -> torch.Tensor:
    """(n, row bytes) blocks whose integers against activations all at +L are as large as the
    type allows (kquant.h's bounds, each just under 2^31 for Q4_K, Q5_K and Q6_K): every
    quantized value and 6-bit scale at its top (Q6_K: q - 32 = -32 under scales of -128; Q8_0:
    -128), the float16 scales small."""
    t = kquant.BY_NAME[name]
    lo, hi = Q_BYTES[name]
    block = np.zeros(t.size, dtype=np.uint8)
    if name == "Q6_K":
        block[192:208] = 0x80  # scales -128, values 0 (q - 32 = -32)
    elif name == "Q8_0":
        block[lo:hi] = 0x80
    else:
        block[lo:hi] = 0xFF  # values (and fifth bits) at their top
        if name in ("Q4_K", "Q5_K"):
            block[4:16] = 0xFF  # eight scales and minima of 63
    for at in HALVES[name]:
        block[at:at + 2] = np.array([1e-3], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(np.tile(block, (n, k // t.values)))


@pytest.mark.parametrize("name", TYPES)
def test_the_largest_integers_a_block_can_give_are_exact(kernel, name):
    """At the weights and activations that make a block's integers largest (each of Q4_K's, Q5_K's
    and Q6_K's within 0.2 % of 2^31), every loop gives the documented maths within float rounding:
    an integer past int32 would wrap and be off by orders of magnitude."""
    n, k = 9, 2 * kquant.BY_NAME[name].values
    raw = _largest_blocks(name, n, k)
    code = kquant.BY_NAME[name].code
    for sign in (1.0, -1.0):
        x = torch.full((9, k), sign)  # 9 rows: the packed loops widen each block once from 4 rows on
        maths = _kernel_maths(x, raw, name, n, k)
        _, rounding = _bound(x, raw, name, n, k)
        for isa in (kquant.SCALAR, kquant.AUTO, kquant.PACKED):
            if torch.ops.tserve_native.kquant_isa(isa) != isa:
                continue
            got = kernel(x, raw, code, n, k, None, isa).double()
            assert ((got - maths).abs() <= rounding).all(), (isa, sign, (got - maths).abs().max())


PACKED_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.mark.parametrize("n", [21, 8, 40])
@pytest.mark.parametrize("name", PACKED_TYPES)
def test_repacked_once_gives_the_scalar_bits_at_any_batch(kernel, name, n, fresh_seed):
    """The native step's projections are repacked once (kquant_packed.cpp: 8 outputs a tile, values
    as stored, Q4_K's and Q5_K's scales a byte each) and every step, one row or many,
    runs against that: over n outputs (whole and short tiles) and 3 blocks of 256 (24 of 32), at
    1, 2, 3, 4, 5, 33 and 130 rows (from 4 on, each block widened to int16 once per group of rows), with and
    without a bias, the packed loops give the scalar loops' bits, and each row equals itself
    computed alone."""
    if torch.ops.tserve_native.kquant_isa(kquant.PACKED) != kquant.PACKED:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    rng = np.random.default_rng(fresh_seed)
    k = 3 * 256
    raw = torch.from_numpy(np.ascontiguousarray(_random_blocks(name, n, k, rng)))
    code = kquant.BY_NAME[name].code
    for bias in (None, torch.randn(n, generator=torch.Generator().manual_seed(fresh_seed))):
        for rows in (1, 2, 3, 4, 5, 33, 130):  # widened from 4 rows on (kw_run), 128 rows a group here
            x = _activations(fresh_seed + rows, rows, k)
            scalar = kernel(x, raw, code, n, k, bias, kquant.SCALAR)
            packed = kernel(x, raw, code, n, k, bias, kquant.PACKED)
            assert torch.equal(scalar.view(torch.int32), packed.view(torch.int32)), rows
            for b in (0, rows - 1):
                alone = kernel(x[b:b + 1], raw, code, n, k, bias, kquant.PACKED)
                assert torch.equal(alone[0].view(torch.int32), packed[b].view(torch.int32)), (rows, b)


SEED_ISA = 4141


def _products(out: str, names, row_counts, n: int) -> None:
    """The packed products of `names` at each row count over n outputs and 2 blocks of 256, and
    the vector units that computed them, saved to ``out`` (run here and in a child with some
    vector units turned off)."""
    native.build()
    rng = np.random.default_rng(SEED_ISA)
    k = 2 * 256
    results = {"units": torch.ops.tserve_native.vector_units()}
    for name in names:
        raw = torch.from_numpy(np.ascontiguousarray(_random_blocks(name, n, k, rng)))
        for rows in row_counts:
            x = _activations(SEED_ISA + rows, rows, k)
            results[f"{name} {rows}"] = torch.ops.tserve_native.kquant_linear(
                x, raw, kquant.BY_NAME[name].code, n, k, None, kquant.PACKED)
    torch.save(results, out)


def packed_products(out: str) -> None:
    """Every packed type at 1, 4, 13, 33 and 70 rows over 24 outputs."""
    _products(out, PACKED_TYPES, (1, 4, 13, 33, 70), 24)


def amx_products(out: str) -> None:
    """The types the AMX tiles take (Q4_K, Q6_K, Q8_0, Q5_0, Q4_0) at the row counts they take
    them (the 32-value types from 3 rows; Q4_K from 9 and Q6_K from 10, so 8 rows is the edge
    below, 9 and 11 a short tile alone, then whole tiles of 16, a short last one, two row groups
    at 600 rows), over 40 outputs (two pairs of tiles and one alone)."""
    _products(out, ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"), (3, 8, 9, 11, 16, 17, 33, 600), 40)


def _here_and_in_a_child(tmp_path, producer: str, **env: str) -> tuple[dict, dict]:
    """`producer`'s results in this process and in a child whose environment adds `env` (some
    vector units turned off, or another library)."""
    here, there = tmp_path / f"{producer}-here.pt", tmp_path / f"{producer}-child.pt"
    globals()[producer](str(here))
    root = Path(__file__).resolve().parents[3]
    code = f"from tests.model.quant.test_kquant import {producer}; {producer}({str(there)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{producer} in the child: exit {done.returncode}, {done.stderr[-3000:]}"
    return torch.load(here), torch.load(there)


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), key


def test_the_avx512_vnni_loops_give_the_avx2_loops_bits(tmp_path):
    """Where the CPU has AVX512-VNNI, its loops run (kquant_packed.cpp): one row at a time through
    vpdpbusd (kp_row_k4_vnni, kp_row6_vnni: 1 row, and the rows left over), Q4_K's byte loops from
    4 rows below KB_MAX (kb_run_k4: 4 and 13 rows; with AMX, 13 go through Q4_K's tiles and the
    AMX test's child runs these loops at 8, 9 and 11), the widened blocks through vpdpwssd for the
    other types and from KB_MAX rows, eight rows against two tiles a pass (33 and 70), and the
    AMX tiles where they run; a child with ``TSERVE_NATIVE_ISA=avx2`` runs the AVX2 loops on the
    same inputs, and every product has the same bits (on a CPU without VNNI both sides run the
    AVX2 loops, and this checks only that the switch is harmless)."""
    native.build()
    if torch.ops.tserve_native.kquant_isa(kquant.PACKED) != kquant.PACKED:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    a, b = _here_and_in_a_child(tmp_path, "packed_products", TSERVE_NATIVE_ISA="avx2")
    assert "avx512" not in b.pop("units")
    a.pop("units")
    _same_bits(a, b)


def test_the_amx_tiles_give_the_avx512_loops_bits(tmp_path):
    """Where the CPU has AMX and the kernel grants it (common.h probes both), Q4_K takes the
    tiles from 9 rows, Q6_K from 10, Q8_0, Q5_0 and Q4_0 from 3 (ka_run, ka_run32: the same exact integers,
    the same float combination); a child with ``TSERVE_NATIVE_ISA=avx512`` runs the VNNI loops on
    the same inputs, and every product has the same bits."""
    native.build()
    if "amx_int8" not in torch.ops.tserve_native.vector_units():
        pytest.skip("no usable AMX on this CPU")
    a, b = _here_and_in_a_child(tmp_path, "amx_products", TSERVE_NATIVE_ISA="avx512")
    assert "amx_int8" in a.pop("units") and "amx_int8" not in b.pop("units")
    _same_bits(a, b)


def test_kquant_linear_fuses_parts_of_several_types_native_or_reference(tiny_gguf, monkeypatch, fresh_seed):
    """A fused q/k/v whose parts differ in type (Gemma 3's Q4_K_M file: Q5_0 and Q8_0): the
    native forward and the reference one (the weights dequantized per call) agree within the
    activation bound of each part, for inputs of any leading shape."""
    q50, n1, k = _stored(tiny_gguf, "Q5_0")
    q80, n2, _ = _stored(tiny_gguf, "Q8_0")
    bias = torch.randn(n1 + n2, generator=torch.Generator().manual_seed(fresh_seed))
    layer = KQuantLinear([(q50, "Q5_0"), (q80, 8)], k, bias)
    assert (layer.in_features, layer.out_features, layer.weight_bytes) == (k, n1 + n2, q50.numel() + q80.numel())
    x = _activations(fresh_seed, 6, k).reshape(2, 3, k)
    native.build()
    got = layer(x)
    monkeypatch.setattr(kquant, "_NATIVE", [False])
    reference = layer(x)
    assert got.shape == reference.shape == (2, 3, n1 + n2)
    torch.testing.assert_close(reference, torch.nn.functional.linear(x, layer.dequantized(), bias))
    rows = x.reshape(6, k)
    bound = torch.cat([sum(_bound(rows, q50, "Q5_0", n1, k)), sum(_bound(rows, q80, "Q8_0", n2, k))], 1)
    diff = (got.reshape(6, -1) - reference.reshape(6, -1)).double().abs()
    assert (diff <= bound + 8 * EPS * reference.reshape(6, -1).double().abs() + 1e-6).all()


def test_bad_shapes_and_types_are_refused(tiny_gguf):
    raw, n, k = _stored(tiny_gguf, "Q4_K")
    assert kquant_projection(raw, "Q4_K", (n, k)).out_features == n
    with pytest.raises(ValueError, match="do not hold"):
        kquant_projection(raw, "Q4_K", (n + 1, k))
    with pytest.raises(ValueError, match="multiples of 256"):
        KQuantLinear([(raw, "Q4_K")], 320)
    with pytest.raises(ValueError, match="not read as stored"):
        kquant_projection(raw, "IQ2_XS", (n, k))
    native.build()
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.tserve_native.kquant_linear(torch.zeros(1, 320), raw, 12, n, 320, None, -1)


def test_the_scalar_switch_is_read_from_the_environment():
    native.build()  # built (or cached) here first, so the child only loads it
    code = ("import torch; from model.decode import native; native.build(); "
            "print(torch.ops.tserve_native.kquant_isa(-1))")
    env = {**os.environ, "TSERVE_NATIVE_ISA": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == str(kquant.SCALAR)


@pytest.mark.parametrize("name", TYPES)
def test_native_rows_are_the_reference_dequantization_bit_for_bit(tiny_gguf, name):
    """``kquant_rows`` (the step's embedding lookup, csrc kquant_dequantize_row) gives exactly the
    reference's floats, for rows picked in any order and repeated; StoredEmbedding agrees either way."""
    native.build()
    raw, n, k = _stored(tiny_gguf, name)
    code = kquant.BY_NAME[name].code
    want = kquant.dequantize(raw, code, (n, k))
    ids = torch.tensor([4, 0, 2, 2, 1, 3])
    assert torch.equal(torch.ops.tserve_native.kquant_rows(raw, code, k, ids), want[ids])
    table = kquant.StoredEmbedding(raw, name, k)
    assert torch.equal(table(ids.view(2, 3)), want[ids].view(2, 3, k))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tserve_native.kquant_rows(raw, code, k, torch.tensor([5]))
