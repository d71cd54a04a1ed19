"""``TSERVE_GGUF_WEIGHTS=stored`` (model/formats/gguf_import.py: stored=True): a tiny Llama GGUF whose
projections mix block types imports with each one a KQuantLinear over the file's own bytes, and
(weights dequantized per call: the reference path) computes the default import's logits; the
native step runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from model.decode import DecodeOptions, native, prepare
from model.formats.gguf_import import load_gguf
from model.quant import kquant
from model.quant.kquant import KQuantLinear
from tests.model.gguf_tiny import GGUFSpec, Q, tiny_llama, train_byte_bpe, write_llama_gguf


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    """Q8_0 throughout, q and k Q5_0 (llama.cpp permutes their rows), v Q4_1, an untied Q5_1 head
    and one float projection (F16: stays as imported)."""
    bpe = train_byte_bpe()
    reference = tiny_llama(seed=7, vocab_size=bpe.get_vocab_size(), tie=False)
    qtypes = {"output.weight": Q.Q5_1, "blk.1.ffn_up.weight": Q.F16}
    for i in range(2):
        qtypes.update({f"blk.{i}.attn_q.weight": Q.Q5_0, f"blk.{i}.attn_k.weight": Q.Q5_0,
                       f"blk.{i}.attn_v.weight": Q.Q4_1})
    return write_llama_gguf(tmp_path_factory.mktemp("stored") / "mixed.gguf", reference, bpe,
                            GGUFSpec(qtype=Q.Q8_0, qtypes=qtypes))


def test_stored_projections_compute_the_float_imports_logits(mixed_file, monkeypatch):
    plain = load_gguf_plain(mixed_file, monkeypatch)
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")
    stored = load_gguf(mixed_file).model.eval()
    layers = {name: m for name, m in stored.named_modules() if isinstance(m, KQuantLinear)}
    assert len(layers) == 2 * 5  # every projection but blk.1's up (F16), and the head
    assert "decoder_layers.1.ffn.up" not in layers and "lm_head.proj" in layers
    assert [p.qtype.name for p in layers["decoder_layers.0.self_attn.qkv_proj"].parts] == ["Q5_0", "Q5_0", "Q4_1"]
    for name, layer in layers.items():  # the file's blocks, dequantized, are the float import's weights
        assert torch.equal(layer.dequantized(), plain.get_submodule(name).weight), name
    ids = torch.randint(0, plain.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(kquant, "_NATIVE", [False])  # the reference path: float products
    with torch.no_grad():
        torch.testing.assert_close(stored(ids), plain(ids))


def test_the_native_step_reads_the_stored_blocks(mixed_file, monkeypatch):
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")
    g = load_gguf(mixed_file)
    native.build()
    step = prepare(g.model.eval(), DecodeOptions(native="on"), g.tokenizer)
    assert type(step).__name__ == "NativeStep"
    assert sum(isinstance(m, KQuantLinear) for m in g.model.modules()) == 10
    python_step = prepare(g.model, DecodeOptions(native="off"), g.tokenizer)
    cache_a, cache_b = g.model.new_cache(2, 8), g.model.new_cache(2, 8)
    ids = torch.tensor([5, 9])
    with torch.no_grad():
        for position in range(4):
            a = step(cache_a, ids, [0, 1], [position] * 2)
            b = python_step(cache_b, ids, [0, 1], [position] * 2)
            # both steps run the same block kernels; only the float work between them (norms,
            # attention, rotary) is rounded differently
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
            ids = a.argmax(-1)


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory):
    """A tied Llama, Q4_1 throughout (its token table and so its head too), one F16 projection."""
    bpe = train_byte_bpe()
    reference = tiny_llama(seed=11, vocab_size=bpe.get_vocab_size(), tie=True)
    return write_llama_gguf(tmp_path_factory.mktemp("stored") / "tied.gguf", reference, bpe,
                            GGUFSpec(qtype=Q.Q4_1, qtypes={"blk.0.ffn_down.weight": Q.F16}))


def _mapped(t: torch.Tensor, path: Path) -> bool:
    """Whether ``t``'s bytes lie inside a map of ``path`` (a view of the file, not a copy; Linux)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= t.data_ptr() and t.data_ptr() + t.numel() <= hi:
                return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux only)")
def test_a_stored_load_makes_no_float_weights(tied_file, monkeypatch):
    """Only the norms, biases and the one F16 projection are float; the token table and the tied
    head are the same mapped blocks, and every projection but llama's permuted q / k rows (copied
    once, as bytes) is a view of the map."""
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")
    g = load_gguf(tied_file)
    model = g.model
    tokens, head = model.embed.tokens, model.lm_head.proj
    assert isinstance(tokens, kquant.StoredEmbedding) and isinstance(head, KQuantLinear)
    assert head.parts[0].raw.data_ptr() == tokens.raw.data_ptr()
    assert _mapped(tokens.raw, tied_file)
    for name, m in model.named_modules():
        if isinstance(m, KQuantLinear):
            for i, part in enumerate(m.parts):
                assert _mapped(part.raw, tied_file) == (not (name.endswith("qkv_proj") and i < 2)), (name, i)
    floats = {n: p for n, p in model.named_parameters() if p.is_floating_point()}
    cfg = g.config
    down = cfg.d_ff * cfg.d_model  # blk.0.ffn_down, F16 in the file
    norms = (2 * cfg.n_decoder_layers + 1) * cfg.d_model
    assert sorted(n for n in floats if not n.endswith("norm.weight")) == ["decoder_layers.0.ffn.down.weight"]
    assert sum(p.numel() for p in floats.values()) == down + norms
    assert model.num_parameters() == load_gguf_plain(tied_file, monkeypatch).num_parameters()


def load_gguf_plain(path, monkeypatch):
    """The float import (``TSERVE_GGUF_WEIGHTS=float``), which the stored blocks must compute."""
    with monkeypatch.context() as m:
        m.setenv("TSERVE_GGUF_WEIGHTS", "float")
        return load_gguf(path).model.eval()


def test_a_stored_table_and_tied_head_compute_the_default_imports_logits(tied_file, monkeypatch):
    """Reference path (float products over the dequantized blocks): the same floats in the same
    operations as the default import, so the same bits."""
    plain = load_gguf_plain(tied_file, monkeypatch)
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")
    stored = load_gguf(tied_file).model.eval()
    ids = torch.randint(0, plain.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    assert torch.equal(stored.embed.tokens(ids), plain.embed.tokens(ids))
    monkeypatch.setattr(kquant, "_NATIVE", [False])
    with torch.no_grad():
        assert torch.equal(stored(ids), plain(ids))


def test_the_native_step_reads_the_token_table_as_stored(tied_file, monkeypatch):
    """The step's lookup dequantizes a row exactly as the float table holds it: logits equal, bit
    for bit, the same step given the dequantized table, for the tied head reads the blocks either way."""
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")
    g = load_gguf(tied_file)
    native.build()
    model = g.model.eval()
    blocks = prepare(model, DecodeOptions(native="on"), g.tokenizer)
    other = load_gguf(tied_file).model.eval()  # (a prepare drops the float copy of the F16 projection)
    tokens = other.embed.tokens
    table = kquant.dequantize(tokens.raw, tokens.qtype.code, (tokens.num_embeddings, tokens.embedding_dim))
    other.embed.tokens = torch.nn.Embedding.from_pretrained(table)
    floats = prepare(other, DecodeOptions(native="on", prefill="model"), g.tokenizer)  # (a float table kept float)
    cache_a, cache_b = model.new_cache(2, 8), model.new_cache(2, 8)
    ids = torch.tensor([5, 9])
    with torch.no_grad():
        for position in range(4):
            a = blocks(cache_a, ids, [0, 1], [position] * 2)
            assert torch.equal(a, floats(cache_b, ids, [0, 1], [position] * 2))
            ids = a.argmax(-1)
