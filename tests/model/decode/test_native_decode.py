"""The native (C++) decode step (model/decode/native.py) against the eager step it replaces:
same logits and same K/V written, for ragged batches over scattered slots, in float32 (to float
rounding) and int8 (same fbgemm kernels on the same weights), and the same greedy tokens
through the engine core. Needs a C++ compiler and ninja, which `make setup` and CI have."""

from __future__ import annotations

import os

import pytest
import torch

from model import build_model
from model.decode import DecodeOptions, PythonStep, prepare
from model.decode import native as native_decode
from model.decode.native import NativeStep, unsupported_reason, wants_native
from model.quant.int8 import DecodeInt8Linear, quantize_int8_
from tests.conftest import tiny_model
from tests.model.decode_steps import greedy_generations, greedy_steps, ragged_cache, random_prompts
from tests.model.nn.test_llama import llama_config


def _model(seed: int, **overrides):
    return build_model(llama_config(max_positions=160, **overrides)).init_weights(seed).eval()


def _int8(model, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    quantize_int8_(model, torch.randint(3, model.cfg.vocab_size, (1, 64), generator=g), decode_only=True)
    model.optimize_for_inference()
    assert isinstance(model.decoder_layers[0].ffn.down, DecodeInt8Linear)
    return model


_steps = greedy_steps


def _ragged(model, seed: int, lengths=(21, 5, 40, 1), slots=(4, 0, 2, 5), dtype=None):
    """A 7-slot cache holding prompts of different lengths in scattered slots."""
    return ragged_cache(model, seed, lengths, slots, 7, 120, dtype)


def _eager_then_native(model, seed: int, n: int):
    cache, first, slots, starts = _ragged(model, seed)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    eager = _steps(PythonStep(model), cache, first, slots, starts, n)
    eager_kv = cache.k.clone(), cache.v.clone()
    cache.k.copy_(before_k)
    cache.v.copy_(before_v)
    native = _steps(NativeStep(model, kv_dtype=torch.float32), cache, first, slots, starts, n)
    return eager, native, eager_kv, (cache.k, cache.v)


# GQA groups of 3, plain multi-head, multi-query at head size 8 (the portable loops); head sizes
# 64, 128 and 256 (the vectorised attention where the CPU has AVX-512).
@pytest.mark.parametrize("kv_heads,d_model,n_heads", [(2, 48, 6), (6, 48, 6), (1, 48, 6), (2, 256, 4), (1, 256, 2),
                                                     (1, 512, 2)])
def test_float32_steps_equal_eager_logits_and_cache(kv_heads, d_model, n_heads, fresh_seed):
    model = _model(fresh_seed, n_kv_heads=kv_heads, d_model=d_model, n_heads=n_heads)
    eager, native, (ek, ev), (nk, nv) = _eager_then_native(model, fresh_seed, 24)  # crosses span buckets
    for a, b in zip(native, eager):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(nk, ek, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nv, ev, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d_model,n_heads", [(48, 6), (256, 4)])  # head sizes 8 and 64
def test_a_bfloat16_cache_gives_the_eager_steps_over_the_same_cache(d_model, n_heads, fresh_seed):
    """K/V kept in bfloat16 (half the bytes a step reads) by a float32 model: the native step
    writes the very rows the Python step writes (torch's rounding) and attends over them."""
    model = _model(fresh_seed, d_model=d_model, n_heads=n_heads)
    cache, first, slots, starts = _ragged(model, fresh_seed, (21, 5, 40), (3, 0, 1), torch.bfloat16)
    before = cache.k.clone(), cache.v.clone()
    eager = _steps(PythonStep(model), cache, first, slots, starts, 20)
    eager_kv = cache.k.clone(), cache.v.clone()
    cache.k.copy_(before[0])
    cache.v.copy_(before[1])
    native = _steps(NativeStep(model), cache, first, slots, starts, 20)
    for a, b in zip(native, eager):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
    assert cache.k.dtype == torch.bfloat16
    torch.testing.assert_close(cache.k.float(), eager_kv[0].float(), atol=0.02, rtol=0.01)
    assert (cache.k == eager_kv[0]).float().mean() > 0.99  # the same rounding: (nearly) the same bits
    torch.testing.assert_close(cache.v.float(), eager_kv[1].float(), atol=0.02, rtol=0.01)


def _within_int8_rounding(ours, reference):
    for a, b in zip(ours, reference, strict=True):
        a, b = a.float(), b.float()
        assert (a - b).abs().max() <= 0.02 * (b.max() - b.min()), (a - b).abs().max()
        assert (a - b).abs().mean() <= 1e-3 * (b.max() - b.min()), (a - b).abs().mean()  # and rarely


def test_int8_steps_equal_eager_int8(fresh_seed):
    model = _int8(_model(fresh_seed), fresh_seed)
    eager, native, (ek, ev), (nk, nv) = _eager_then_native(model, fresh_seed, 8)
    # The same fbgemm kernels on the same weights; the activations they quantize differ only by
    # float rounding, which can move an int8 step rarely: a logit or a cached K/V entry moves by
    # a sliver of its range (a fixed 1e-3 failed once in CI on a K entry: 2.4e-3 of a range ~8).
    _within_int8_rounding(native + [nk, nv], eager + [ek, ev])


def test_greedy_generation_identical_with_and_without_native(fresh_seed):
    model = _model(fresh_seed)
    prompts = random_prompts(model, fresh_seed, (9, 1, 30, 14))
    eager = greedy_generations(model, prompts)
    native = NativeStep(model, kv_dtype=torch.float32)
    assert greedy_generations(model, prompts, step=native) == eager
    assert greedy_generations(model, prompts[2:3], step=native) == eager[2:3]
    # The same through the options the service reads (float32 weights: native only when asked).
    step = prepare(model, DecodeOptions(quantize="none", native="on", kv_dtype="float32"))
    assert step.name == "native" and greedy_generations(model, prompts, step=step) == eager


def test_the_service_default_options_choose_the_native_step_for_int8_llama(fresh_seed):
    """``prepare`` with the service's defaults quantizes a Llama-architecture model, picks the
    native step over a cache in the model's own dtype, and ``generate(options=...)`` runs that very step."""
    from model import SamplingParams, generate

    served, offline = _model(fresh_seed), _model(fresh_seed)
    prompts = random_prompts(served, fresh_seed, (9, 30))
    step = prepare(served, DecodeOptions())
    assert step.name == "native" and step.kv_dtype == served.dtype == torch.float32
    assert isinstance(served.decoder_layers[0].ffn.up, DecodeInt8Linear)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    by_options = [r.token_ids for r in generate(offline, prompts, params, options=DecodeOptions())]
    assert isinstance(offline.decoder_layers[0].ffn.up, DecodeInt8Linear)
    assert greedy_generations(served, prompts, step=step) == by_options


def test_which_models_run_native():
    gpt = tiny_model("decoder")
    assert unsupported_reason(gpt).startswith("config field 'positional' is 'learned'")
    assert "not a decoder-only model" in unsupported_reason(tiny_model("encoder-decoder"))
    assert unsupported_reason(_model(0, activation="gelu")) == (
        "config field 'activation' is 'gelu'; the native step implements ['silu', 'swish', 'gelu_new']")
    assert "'fused_qkv' is False" in unsupported_reason(_model(0, fused_qkv=False))
    with pytest.raises(ValueError, match="TSERVE_NATIVE_DECODE=on: config field 'positional'"):
        wants_native("on", gpt)
    with pytest.raises(ValueError, match="no native decode step for this model: config field 'positional'"):
        NativeStep(gpt)
    # The check and the construction read the same rules: where one says no, so does the other.
    separate = _model(0, fused_qkv=False)
    with pytest.raises(ValueError, match="fused_qkv"):
        wants_native("on", separate)
    with pytest.raises(ValueError, match="fused_qkv"):
        NativeStep(separate)
    llama = _model(0)
    assert wants_native("on", llama) and not wants_native("off", llama)
    assert not wants_native("auto", llama)  # float32 steps: the default leaves them alone
    _int8(llama, 0)
    assert wants_native("auto", llama)
    assert not wants_native("auto", gpt)


def test_a_machine_without_a_compiler_keeps_the_python_step(monkeypatch, caplog):
    llama = _int8(_model(0), 0)
    monkeypatch.setattr(native_decode, "_BUILD", {"error": "the native decode step could not be loaded: no c++"})
    assert not wants_native("auto", llama)
    assert "could not be loaded" in caplog.text
    with pytest.raises(RuntimeError, match="could not be loaded: no c\\+\\+"):
        wants_native("on", llama)


def test_bad_steps_are_refused(fresh_seed):
    model = _model(fresh_seed)
    cache, first, slots, starts = _ragged(model, fresh_seed)
    step = NativeStep(model, kv_dtype=torch.float32)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="exceeds the KV cache's max_len 120"):
            step(cache, first, slots, [120] * len(slots))
        with pytest.raises(IndexError, match=r"slots \[9\] out of range"):
            step(cache, first, [9, 0, 2, 5], starts)
        with pytest.raises(RuntimeError, match="block 999 out of range"):  # the C++ step checks its tables too
            step.plan.step(first[:1], cache.k, cache.v, torch.tensor([[999]]), [3])
        with pytest.raises(RuntimeError, match="token id .* out of range"):
            step(cache, torch.full_like(first, model.cfg.vocab_size), slots, starts)
        half = model.new_cache(2, 120, dtype=torch.float16)
        with pytest.raises(ValueError, match="float32 or bfloat16 KV cache"):
            step(half, first[:1], [0], [0])
    with pytest.raises(ValueError, match="float32 or bfloat16 KV cache"):
        NativeStep(model, kv_dtype=torch.float16)


def test_a_portable_prebuilt_library_loads_and_decodes_like_eager(tmp_path, monkeypatch):
    """What the container does: ``python -m model.decode.native --out DIR --portable`` at image
    build time, ``build(library)`` (``TSERVE_NATIVE_LIBRARY``) at start-up. Separate processes:
    one process can register the extension's operators only once."""
    import subprocess
    import sys

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", "model.decode.native", "--out", str(tmp_path / "lib"), "--portable"],
                         capture_output=True, text=True, timeout=600, check=True)
    library = out.stdout.strip().splitlines()[-1]
    assert library.endswith(".so") and (tmp_path / "lib").is_dir()
    check = f"""
import torch
from model import build_model
from model.decode.native import build, NativeStep
from tests.model.nn.test_llama import llama_config
build({library!r})
model = build_model(llama_config(max_positions=64)).init_weights(7).eval()
cache = model.new_cache(2, 32)
with torch.inference_mode():
    first = model.prefill(cache, [[5, 6, 7], [9]], [0, 1]).argmax(-1)
    k, v = cache.k.clone(), cache.v.clone()
    eager = model.decode_step(cache, first, [0, 1], [3, 1])
    cache.k.copy_(k); cache.v.copy_(v)
    native = NativeStep(model, {library!r}, torch.float32)(cache, first, [0, 1], [3, 1])
torch.testing.assert_close(native, eager, atol=2e-4, rtol=1e-4)
print("same logits")
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same logits" in done.stdout, done.stderr[-2000:]
    assert not (tmp_path / "cache").exists()  # loaded, not rebuilt
    # A caller that names no library (the GGUF import asks for the K-quant block kernels before any
    # decode step exists, and the first call in a process decides) loads the one the environment
    # names: the container's start-up compiled nothing, found no compiler, and fell back to Python.
    unnamed = """
from model.decode.native import build, default_library
build()
print("loaded", default_library())
"""
    env = {**os.environ, "TSERVE_NATIVE_LIBRARY": library, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", unnamed], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and f"loaded {library}" in done.stdout, done.stderr[-2000:]
    assert not (tmp_path / "cache").exists()
    # The K-quant kernels of the portable library (its vector loops and AMX tiles compiled through
    # target attributes, not -march=native) give this process's library's bits, through every
    # packed type and, where the CPU has usable AMX, the tiles (the image's library once faulted
    # on an aligned store there, which only a portable build could show)
    from model.quant import kquant
    from tests.model.quant.test_kquant import _here_and_in_a_child, _same_bits

    native_decode.build()
    if torch.ops.tserve_native.kquant_isa(kquant.PACKED) != kquant.PACKED:  # no AVX2 + FMA + F16C
        return
    for producer in ("packed_products", "amx_products"):
        a, b = _here_and_in_a_child(tmp_path, producer, TSERVE_NATIVE_LIBRARY=library,
                                    TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"))
        assert a.pop("units") == b.pop("units")  # the same vector units, chosen at run time
        _same_bits(a, b)


def test_a_missing_prebuilt_library_is_named(monkeypatch):
    monkeypatch.setattr(native_decode, "_BUILD", {})
    with pytest.raises(RuntimeError, match="could not be loaded from /nonexistent/lib.so"):
        native_decode.build("/nonexistent/lib.so")


# --- the lineages after Llama, described by data ------------------------------------------------

LINEAGES = {
    "qwen2": dict(qkv_bias=True, tie_word_embeddings=False),
    "qwen3": dict(qk_norm=True, head_dim_override=16),
    "mistral": dict(sliding_window=9),
    "phi3-longrope": dict(rope_scaling={"type": "longrope", "factors": [1.0, 1.5, 2.0, 4.0], "attention_factor": 1.2}),
    "gemma3": dict(d_model=64, n_heads=4, n_kv_heads=1, head_dim_override=64, qk_norm=True, post_sublayer_norm=True,
                   scale_embedding=True, activation="gelu_new", attention_scale=0.1, sliding_window=9,
                   sliding_window_layers=[0], local_rope_theta=50.0),
}


def _lineage(name: str, seed: int):
    model = _model(seed, **LINEAGES[name])
    with torch.no_grad():  # biases and norms away from their 0 / 1 init, so a mix-up shows
        g = torch.Generator().manual_seed(seed)
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.mark.parametrize("name", list(LINEAGES))
def test_each_lineage_float32_steps_equal_eager(name, fresh_seed):
    model = _lineage(name, fresh_seed)
    assert unsupported_reason(model) is None
    eager, native, (ek, ev), (nk, nv) = _eager_then_native(model, fresh_seed, 24)  # past every window
    for a, b in zip(native, eager):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(nk, ek, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nv, ev, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(LINEAGES))
def test_each_lineage_int8_steps_equal_eager_int8(name, fresh_seed):
    model = _int8(_lineage(name, fresh_seed), fresh_seed)
    eager, native, (ek, ev), (nk, nv) = _eager_then_native(model, fresh_seed, 16)
    _within_int8_rounding(native + [nk, nv], eager + [ek, ev])  # as test_int8_steps_equal_eager_int8 explains


@pytest.mark.parametrize("name", list(LINEAGES))
def test_each_lineage_greedy_generation_identical_with_and_without_native(name, fresh_seed):
    model = _lineage(name, fresh_seed)
    prompts = random_prompts(model, fresh_seed, (7, 30, 1))
    native = NativeStep(model, kv_dtype=torch.float32)
    assert greedy_generations(model, prompts, 20, native) == greedy_generations(model, prompts, 20)


@pytest.mark.parametrize("changed", ["llama_step.cpp", "common.h"])
def test_the_cached_build_is_named_by_its_sources(changed, tmp_path, monkeypatch):
    """Two versions of the service on one host (or an upgrade) never load each other's build,
    whichever file differs: a source or a header (which torch's own check of a build never reads)."""
    import shutil

    name = native_decode.library_name()
    assert name.startswith("tserve_native_llama_")
    copy = tmp_path / "csrc"
    shutil.copytree(native_decode.CSRC, copy)
    monkeypatch.setattr(native_decode, "CSRC", copy)
    assert native_decode.library_name() == name  # the same files, wherever they lie
    compiled = native_decode.sources()
    assert copy / "llama_step.cpp" in compiled and all(p.suffix == ".cpp" for p in compiled)
    (copy / changed).write_bytes((copy / changed).read_bytes() + b"\n// another version\n")
    assert native_decode.library_name() != name
    assert native_decode.library_name().rsplit("_", 1)[0] == name.rsplit("_", 1)[0]  # the same CPU


def test_the_cached_build_is_named_by_the_torch_it_was_built_against(monkeypatch):
    """Another torch (an upgrade, or a second venv sharing the cache) gets its own build instead
    of loading, or rebuilding over, this one's."""
    name = native_decode.library_name()
    monkeypatch.setattr(native_decode.torch, "__version__", native_decode.torch.__version__ + "+other")
    assert native_decode.library_name() != name
    assert native_decode.library_name().rsplit("_", 1)[0] == name.rsplit("_", 1)[0]


def test_a_native_step_that_cannot_be_set_up_falls_back_under_auto(monkeypatch, caplog, fresh_seed):
    """``auto``: a library that builds but does not fit (an older build, a missing method) costs
    a warning and the Python step, not the model; ``on`` says why."""
    import model.decode.step as step_module

    def broken(*_args, **_kwargs):
        raise AttributeError("LlamaDecoder does not have a field with name 'set_features'")

    monkeypatch.setattr(step_module, "NativeStep", broken)
    llama = _model(fresh_seed)
    with caplog.at_level("WARNING", logger=step_module.__name__):
        step = prepare(llama, DecodeOptions())
    assert step.name == "python" and step.kv_dtype == torch.float32
    assert "could not be set up (AttributeError" in caplog.text
    with pytest.raises(AttributeError, match="set_features"):
        prepare(_model(fresh_seed), DecodeOptions(native="on"))


def test_decoding_from_the_first_position_without_a_prefill(fresh_seed):
    """Every position through the step itself, blocks allocated as it goes (a bare cache):
    the blocks it writes are zeroed before the first write, never after."""
    model = _model(fresh_seed, d_model=256, n_heads=4, n_kv_heads=2)
    ids = random_prompts(model, fresh_seed, (40,))[0]

    def teacher_forced(step):
        cache = model.new_cache(2, len(ids) + 1, dtype=step.kv_dtype)
        with torch.inference_mode():
            return torch.cat([step(cache, torch.tensor([t]), [1], [i]) for i, t in enumerate(ids)])

    torch.testing.assert_close(teacher_forced(NativeStep(model, kv_dtype=torch.float32)),
                               teacher_forced(PythonStep(model)), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_one_sequence_at_consecutive_positions_equal_steps_one_by_one(dtype, fresh_seed):
    """Speculative decoding feeds a sequence's token and its drafts as rows of one step, at
    consecutive positions of one block table (across a block boundary here), next to another
    sequence's row: each row attends over the rows before it, so the logits and the K/V equal
    those of one step per token."""
    model = _model(fresh_seed)
    step = NativeStep(model, kv_dtype=dtype)
    cache, first, slots, starts = _ragged(model, fresh_seed, (13, 30), (1, 0), dtype)
    g = torch.Generator().manual_seed(fresh_seed)
    run = [int(first[0])] + torch.randint(3, model.cfg.vocab_size, (5,), generator=g).tolist()
    before = cache.k.clone(), cache.v.clone()
    with torch.inference_mode():
        one_by_one = [step(cache, torch.tensor([tok]), [1], [13 + i]) for i, tok in enumerate(run)]
        other = step(cache, first[1:], [0], [30])
        expected_kv = cache.k.clone(), cache.v.clone()
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        together = step(cache, torch.tensor(run + [int(first[1])]), [1] * 6 + [0], [13 + i for i in range(6)] + [30])
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(together, torch.cat(one_by_one + [other]), **tol)
    kv_tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.01)
    torch.testing.assert_close(cache.k.float(), expected_kv[0].float(), **kv_tol)
    torch.testing.assert_close(cache.v.float(), expected_kv[1].float(), **kv_tol)


def assert_rows_alone_equal_rows_in_a_batch(model, seed: int) -> None:
    """Each row's logits from the model's native step are bit-identical whatever shares its step."""
    step = NativeStep(model)
    cache, first, slots, starts = _ragged(model, seed, (21, 5, 40, 1), (4, 0, 2, 5), torch.bfloat16)
    before = cache.k.clone(), cache.v.clone()
    outs = []
    with torch.inference_mode():
        for n in (1, 2, 4):
            cache.k.copy_(before[0])
            cache.v.copy_(before[1])
            outs.append(step(cache, first[:n], slots[:n], starts[:n]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][0], outs[2][0])
    assert torch.equal(outs[1][:2], outs[2][:2])


def assert_the_partner_changes_no_bit(model, seed: int) -> tuple:
    """Decode rows, rows of one sequence, a short prompt and a long one through the step with
    and without its partner thread: the same logits and K/V, bit for bit. The long prompt (150
    rows from position 0) takes the paths of many rows: its row-wise passes split in pieces
    between the threads, its int8 projections split by rows through the whole pack, and its
    attention as blocks. Returns the two steps."""
    alone, shared = NativeStep(model, partner=False), NativeStep(model, partner=True)
    assert shared.partner and not alone.partner
    cache, first, slots, starts = _ragged(model, seed, (21, 5, 40, 1), (4, 0, 2, 5), torch.bfloat16)
    before = cache.k.clone(), cache.v.clone()
    prompt, long_prompt = random_prompts(model, seed + 1, (37, 150))
    threads = torch.get_num_threads()
    outs = []
    try:
        torch.set_num_threads(1)  # the partner works in steps of one intra-op thread only
        for step in (alone, shared):
            cache.k.copy_(before[0])
            cache.v.copy_(before[1])
            long_cache = model.new_cache(1, len(long_prompt) + 1, dtype=torch.bfloat16)
            long_cache.ensure(0, len(long_prompt))
            with torch.inference_mode():
                rows = [step(cache, first[:n], slots[:n], starts[:n]) for n in (1, 4)]
                rows.append(step.prefill(cache, [prompt], [6]))
                rows.append(step.prefill(long_cache, [long_prompt], [0]))
            outs.append((rows, cache.k.clone(), cache.v.clone(), long_cache.k.clone(), long_cache.v.clone()))
    finally:
        torch.set_num_threads(threads)
    (a, *a_kv), (b, *b_kv) = outs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(a_kv, b_kv, strict=True))
    return alone, shared


def test_an_int8_row_gives_the_same_logits_alone_or_in_any_batch(fresh_seed):
    """Activations are quantized row by row: a row's logits are bit-identical whatever shares
    its step (one scale per batch made them depend on the other rows)."""
    assert_rows_alone_equal_rows_in_a_batch(_int8(_model(fresh_seed), fresh_seed), fresh_seed)


def test_the_partner_thread_gives_the_same_bits(fresh_seed):
    """A step of one intra-op thread shares each int8 projection (two packs of its output
    features, the same int8 weights and scales) and its attention items with a second thread:
    decode rows, drafts-like rows of one sequence and a prompt give the logits and K/V of the
    step without it, bit for bit."""
    model = _int8(_model(fresh_seed, d_model=256, n_heads=4, n_kv_heads=2), fresh_seed)
    alone, shared = assert_the_partner_changes_no_bit(model, fresh_seed)
    # The halves are counted: int8 weights plus a scale and a zero point per output feature, for
    # the projections wide enough to split (128 features or more: not this model's 96-wide FFN).
    shapes = [m.quantized.weight().shape for m in model.modules() if isinstance(m, DecodeInt8Linear)]
    assert alone.extra_bytes == 0 and shared.extra_bytes == sum(o * (i + 16) for o, i in shapes if o >= 128) > 0


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    """torch's build lock names no owner: one left by a killed build would block every later
    start. Older than ``STALE_LOCK_S`` it is removed (with a warning); a live build's is kept."""
    import os
    import time

    lock = tmp_path / "lock"
    assert not native_decode.clear_stale_lock(tmp_path)  # no lock: nothing to do
    lock.touch()
    assert not native_decode.clear_stale_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - native_decode.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING"):
        assert native_decode.clear_stale_lock(tmp_path)
    assert not lock.exists() and "stale native build lock" in caplog.text
