"""``TSERVE_GGUF_WEIGHTS=stored`` (model/formats/gguf_stored.py): a tiny Llama GGUF whose
projections mix block types imports with each one a KQuantLinear over the file's own bytes, and
(weights dequantized per call: the reference path) computes the default import's logits; the
native step runs it."""

from __future__ import annotations

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


def test_stored_projections_compute_the_default_imports_logits(mixed_file, monkeypatch):
    plain = load_gguf(mixed_file).model.eval()
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")
    stored = load_gguf(mixed_file).model.eval()
    layers = {name: m for name, m in stored.named_modules() if isinstance(m, KQuantLinear)}
    assert len(layers) == 2 * 5  # every projection but blk.1's up (F16), and the head
    assert "decoder_layers.1.ffn.up" not in layers and "lm_head.proj" in layers
    assert [p.qtype.name for p in layers["decoder_layers.0.self_attn.qkv_proj"].parts] == ["Q5_0", "Q5_0", "Q4_1"]
    for name, layer in layers.items():  # the file's blocks, dequantized, are the default import's weights
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
