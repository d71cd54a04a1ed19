"""The Triton decode-attention kernel (model/decode/triton_attention.py) against its SDPA
reference, run on the CPU in Triton's interpreter.

Triton 3.9 decides between compiling and interpreting when ``triton.jit`` wraps a function,
from TRITON_INTERPRET in the environment at that moment; its own library functions
(``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) are wrapped when triton is imported. So the variable
must be set before triton is first imported, and must not leak into the rest of the suite
(on a GPU machine it would turn every later Triton kernel, torch.compile's included, into
interpreted Python). Hence: run as part of the suite, this module re-runs itself in a child
pytest with TRITON_INTERPRET=1 (``test_kernel_under_the_triton_interpreter``); run with the
variable already set (``TRITON_INTERPRET=1 python -m pytest this_file``), its tests run
in-process. The interpreter is slow: shapes stay small.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.decode import DecodeOptions, PythonStep, prepare
from model.decode.triton_attention import (
    attention_kernel,
    decode_attention,
    decode_attention_reference,
    decode_attention_triton,
    interpreting,
    triton_available,
)
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed (the dev extra has it)")
ROOT = Path(__file__).resolve().parents[3]
INTERPRETED = interpreting()  # set before this process imported triton: the child run
# Where the kernel tests run, one parameter per process: "interpreter" (CPU tensors) in the
# child that sets TRITON_INTERPRET=1, "cuda" (compiled) everywhere else, skipped where there is
# no CUDA device. Both compare with the same float32 reference, within the same tolerances.
KERNEL_MODES = ["interpreter"] if INTERPRETED else ["cuda"]
NO_CUDA = "no CUDA device (compiled on CUDA only; Triton's interpreter runs these tests on the CPU)"


def collected_if(condition: bool):
    """Collect the test only where ``condition`` holds (``__test__`` = False: not a test elsewhere)."""
    def mark(test):
        test.__test__ = condition
        return test
    return mark


in_interpreter = collected_if(INTERPRETED)


@pytest.fixture(params=[pytest.param(mode, marks=pytest.mark.gpu) if mode == "cuda" else mode
                        for mode in KERNEL_MODES])
def device(request) -> str:
    """The device the kernel runs on in this mode: the CPU (interpreted) or CUDA (compiled)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return "cpu" if request.param == "interpreter" else "cuda"


@collected_if(not INTERPRETED and not torch.cuda.is_available())
def test_kernel_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = child.stdout[-6000:] + child.stderr[-2000:]
    assert child.returncode == 0, report
    summary = child.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


SCALE = 0.125
BLOCK = 16  # the paged cache's positions per block
N_BLOCKS = 23
LENGTHS = [1, 37, 64, 23]  # ragged: 1, two lengths that are not a multiple of the 16-key tile, a whole one


def inputs(device: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A block pool and each row's table: its blocks in a shuffled order, none shared, the
    null block 0 past its length (as the cache leaves it)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(N_BLOCKS, kv_heads, BLOCK, head_dim, generator=gen).to(dtype)
    v = torch.randn(N_BLOCKS, kv_heads, BLOCK, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(LENGTHS), heads, head_dim, generator=gen).to(dtype)
    order = (torch.randperm(N_BLOCKS - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(LENGTHS), 5, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        for i in range(-(-n // BLOCK)):
            tables[row, i] = order.pop()
    return q.to(device), k.to(device), v.to(device), tables.to(device), torch.tensor(LENGTHS, device=device)


U32 = 2.0**-24  # float32's unit roundoff
UBF16 = 2.0**-8  # bfloat16's (8 significant bits)


def tolerance(q, k, v, dtype: torch.dtype) -> dict:
    """assert_close's atol and rtol for the kernel against ``reference_fp32``, from how the two
    round rather than from any run. Both read the same values (the reference widens bf16 inputs)
    and accumulate in float32, in different orders (tiles of 16 keys, splits, the combine's
    rescaling; exp2 against exp). The error of an n-term float32 sum grows like sqrt(n)·u
    (rounding errors of random sign), n <= 64 here on either side; a score's error scales with
    its largest sum of |q_d k_d| terms and shifts the weights by that much relative, hence the
    output by that much times the values' spread; the weights' and the weighted values' sums add
    about one such term each (the + 2). Twice that, for margin. bfloat16 adds, on a GPU, the
    weights rounded to bfloat16 before P·V (at most UBF16 · max|v|: the weighted mean of values
    each off by UBF16 of itself), and in either mode the output rounded to bfloat16 (UBF16 relative)."""
    d = q.size(-1)
    qf, kf = q.float().reshape(-1, d), k.float().reshape(-1, d)
    magnitude = float((qf.abs() @ kf.abs().T).max()) * SCALE
    drift = 2 * math.sqrt(max(d, *LENGTHS)) * U32 * (magnitude + 2)
    atol, rtol = drift * float(v.float().pow(2).mean().sqrt()), drift
    if dtype == torch.bfloat16:
        atol, rtol = atol + UBF16 * float(v.float().abs().max()), rtol + UBF16
    return {"atol": atol, "rtol": rtol}


def reference_fp32(q, k, v, tables, lengths, window=0):
    return decode_attention_reference(q.float(), k.float(), v.float(), tables, lengths, SCALE, window)


def gathered(pool, tables, row: int, n: int):
    """Row ``row``'s first ``n`` positions of ``pool``, in order: (kv heads, n, D)."""
    blocks = tables[row, : -(-n // BLOCK)]
    return pool[blocks].transpose(0, 1).reshape(pool.size(1), -1, pool.size(3))[:, :n]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (9, 3, 64), (8, 2, 32)],
                         ids=["mha", "gqa3-smollm2", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(device, heads, kv_heads, head_dim, dtype):
    q, k, v, tables, lengths = inputs(device, heads, kv_heads, head_dim, dtype)
    out = decode_attention_triton(q, k, v, tables, lengths, SCALE, num_splits=3, block_n=16)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference_fp32(q, k, v, tables, lengths)
    torch.testing.assert_close(out.float(), expected, **tolerance(q, k, v, dtype))
    # Length 1 sees only its first key: the output is that value row, whatever the query.
    torch.testing.assert_close(out[0].float(), v[tables[0, 0], :, 0].float().repeat_interleave(heads // kv_heads, 0),
                               atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)
    # And the reference is plain attention over the row's positions, gathered in order.
    keys, values = gathered(k, tables, 2, 64).float(), gathered(v, tables, 2, 64).float()
    scores = torch.einsum("hd,hnd->hn", q[2].float(), keys.repeat_interleave(heads // kv_heads, 0)) * SCALE
    plain = torch.einsum("hn,hnd->hd", scores.softmax(-1), values.repeat_interleave(heads // kv_heads, 0))
    torch.testing.assert_close(expected[2], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 9, 16, 40])
def test_a_sliding_window_reads_only_its_last_positions(device, window):
    q, k, v, tables, lengths = inputs(device, 9, 3, 64, torch.float32, seed=4)
    out = decode_attention_triton(q, k, v, tables, lengths, SCALE, window, num_splits=3, block_n=16)
    torch.testing.assert_close(out, reference_fp32(q, k, v, tables, lengths, window),
                               **tolerance(q, k, v, torch.float32))
    if window < 64:  # the window really narrows what row 2 (64 positions) sees
        assert (out[2] - reference_fp32(q, k, v, tables, lengths)[2]).abs().max() > 1e-3


@pytest.mark.parametrize("splits", [1, 2, 5, 16])  # 16: more pieces than blocks, most of them empty
def test_any_number_of_splits_gives_the_same_result(device, splits):
    q, k, v, tables, lengths = inputs(device, 9, 3, 64, torch.float32, seed=1)
    out = decode_attention_triton(q, k, v, tables, lengths, SCALE, num_splits=splits, block_n=16)
    torch.testing.assert_close(out, reference_fp32(q, k, v, tables, lengths), **tolerance(q, k, v, torch.float32))


def test_non_contiguous_query_and_stale_blocks(device):
    # q as the decode path passes it: heads split out of the fused q|k|v projection (B, 1, 3 * H * D).
    q, k, v, tables, lengths = inputs(device, 8, 2, 32, torch.float32, seed=2)
    b = len(LENGTHS)
    qkv = torch.cat([q.reshape(b, 1, -1), torch.randn(b, 1, 2 * 8 * 32, device=device)], dim=-1)
    q = qkv[..., :8 * 32].view(b, 1, 8, 32).transpose(1, 2)[:, :, 0]  # (B, H, D), row stride 3 * H * D
    assert not q.is_contiguous()
    expected, tol = reference_fp32(q, k, v, tables, lengths), tolerance(q, k, v, torch.float32)
    owned = {(int(tables[r, p // BLOCK]), p % BLOCK) for r, n in enumerate(LENGTHS) for p in range(n)}
    for block in range(N_BLOCKS):  # stale K in every position no row owns (block tails, other blocks) must not count
        for offset in range(BLOCK):
            if (block, offset) not in owned:
                k[block, :, offset] = 1e4
    out = decode_attention_triton(q, k, v, tables, lengths, SCALE, num_splits=2, block_n=16)
    torch.testing.assert_close(out, expected, **tol)


@in_interpreter
def test_dispatcher_uses_the_kernel_only_where_it_can_run(monkeypatch):
    q, k, v, tables, lengths = inputs("cpu", 4, 2, 32, torch.float32, seed=3)
    calls = []
    monkeypatch.setattr("model.decode.triton_attention.decode_attention_triton",
                        lambda *a: calls.append(1) or decode_attention_reference(*a))
    decode_attention(q, k, v, tables, lengths, SCALE)
    assert calls == [1]  # interpreter on
    monkeypatch.delenv("TRITON_INTERPRET")
    out = decode_attention(q, k, v, tables, lengths, SCALE)  # CPU tensors, no interpreter: the reference
    assert calls == [1]
    torch.testing.assert_close(out, reference_fp32(q, k, v, tables, lengths))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        decode_attention_triton(q, k, v, tables, lengths, SCALE)


@pytest.mark.parametrize("window", [None, 6])
def test_decode_steps_through_the_kernel_match_sdpa(device, window):
    """The wiring: the Python decode step with TSERVE_DECODE_ATTENTION=triton (interpreted, or
    compiled on CUDA, where the SDPA side is CUDA's) gives SDPA's logits, for ragged rows in rows
    out of order, with and without a sliding window."""
    model = tiny_model("decoder", n_heads=6, n_kv_heads=2, d_model=48, positional="rope", norm="rmsnorm",
                       mlp="gated", activation="silu", bias=False, sliding_window=window,
                       sliding_window_layers=[0] if window else None).to(device)
    prompts, slots = [[5, 6, 7], [8] * 19, [9, 10]], [3, 0, 5]
    logits = {}
    for mode in ("sdpa", "triton"):
        step = prepare(model, DecodeOptions.reference().with_attention(mode))
        cache = model.new_cache(n_slots=6, max_len=32)
        model.prefill(cache, prompts, slots)
        positions, tokens, steps = [len(p) for p in prompts], torch.tensor([11, 12, 13], device=device), []
        for _ in range(3):
            steps.append(step(cache, tokens, slots, positions))
            tokens, positions = steps[-1].argmax(-1), [p + 1 for p in positions]
        logits[mode] = torch.stack(steps)
    torch.testing.assert_close(logits["triton"], logits["sdpa"], atol=1e-4, rtol=1e-4)


def test_triton_mode_is_refused_where_the_kernel_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("decoder")
    with pytest.raises(ValueError, match="cuda|CUDA"):
        prepare(model, DecodeOptions.reference().with_attention("triton"))
    with pytest.raises(ValueError, match="one of"):
        attention_kernel("flash", model.device)
    with pytest.raises(ValueError, match="attention='flash'; expected one of"):
        DecodeOptions(attention="flash")


@collected_if(not INTERPRETED)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernels_compile_for_an_h100(dtype):
    """No GPU here, but Triton compiles without one: both kernels down to an sm_90 cubin
    (type and shape errors, the tl.dot tile limits and shared memory all surface here)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from model.decode.triton_attention import _kernels

    def source(fn, pointers: dict[str, str], constants: dict[str, object]) -> ASTSource:
        signature = {name: pointers.get(name, "i64") for name in fn.arg_names}
        signature.update(dict.fromkeys(constants, "constexpr"))
        return ASTSource(fn=fn, signature=signature,
                         constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()})

    split, combine = _kernels(False)
    target = GPUTarget("cuda", 90, 32)
    pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Tables": "*i64", "Lengths": "*i64",
                "PartO": "*fp32", "PartM": "*fp32", "PartL": "*fp32", "qk_scale": "fp32", "num_splits": "i32",
                "Out": f"*{dtype}"}
    compiled = [
        triton_compile(source(split, pointers, dict(BLOCK_LEN=16, GROUP=3, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=64,
                                                    BLOCK_D=64, UPCAST=False)), target=target),
        triton_compile(source(combine, pointers, dict(BLOCK_S=8, HEAD_DIM=64, BLOCK_D=64)), target=target),
    ]
    for kernel in compiled:
        assert kernel.asm["cubin"] and kernel.metadata.shared < 200 * 1024


@collected_if(not INTERPRETED)
def test_auto_goes_back_to_sdpa_for_good_when_the_kernel_fails(monkeypatch, caplog):
    """Under ``auto`` a kernel that cannot build or launch (say, no C compiler in a slim
    container) costs one warning, not the request: that step and every later one use SDPA."""
    import model.decode.triton_attention as kernels

    model = tiny_model("decoder", n_kv_heads=2)
    cache = model.new_cache(n_slots=3, max_len=32)
    model.prefill(cache, [[5, 6, 7], [8, 9]], [2, 0])
    expected = model.decode_step(cache, torch.tensor([11, 12]), [2, 0], [3, 2])  # SDPA (CPU, auto)

    def broken(*_):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.setattr(kernels, "decode_attention_triton", broken)
    auto = kernels.attention_kernel("auto", model.device)
    monkeypatch.setattr(auto, "applies", lambda q: kernels.kernel_runs_on(torch.device("cuda")))  # as if on a GPU
    assert kernels.kernel_runs_on(torch.device("cuda")) == kernels.c_compiler_found()
    monkeypatch.setattr(kernels, "c_compiler_found", lambda: True)
    step = PythonStep(model, attention=auto)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        got = step(cache, torch.tensor([11, 12]), [2, 0], [3, 2])  # rewrites the same positions
    assert torch.equal(got, expected)
    assert not kernels.kernel_runs_on(torch.device("cuda"))
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        "the Triton decode-attention kernel failed, using SDPA from now on: RuntimeError: Failed to find C compiler"]
