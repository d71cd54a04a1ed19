"""A model's card read from its files (``model.formats.card``) says what loading it gives: the same
config, parameter count, chat template and manifest tool format, for tiny random models of every
source and lineage (GGUF as llama.cpp lays it out, Hugging Face directories, sentence-transformers,
our checkpoints) and the shipped models whose packages are installed. And it reads no weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest

from model import ModelConfig, build_model, load_model, save
from model.formats import card as card_module
from model.formats.card import read_card
from model.formats.gguf_import import load_gguf
from model.formats.hf.importer import banned_tokens
from model.formats.manifest import ManifestError, is_manifest_dir, locate, read_manifest
from model.formats.sources import as_checkpoint
from model.quant.kquant import KQuantLinear
from model.tokenization.tokenizer import train_bpe
from tests.model.gguf_lineages import PHI3_LONGROPE, VARIANTS, write_lineage_gguf
from tests.model.gguf_tiny import GGUFSpec, tiny_llama, train_byte_bpe, write_llama_gguf
from tests.model.hf_tiny import save_bert, save_gpt2, save_marian, save_sentence_transformer
from tests.model.lineages_tiny import VARIANTS as HF_LINEAGES
from tests.model.lineages_tiny import save_lineage

REPO = Path(__file__).resolve().parents[3]
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def weights_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TSERVE_WEIGHTS_CACHE", str(tmp_path / "cache"))  # GGUF conversions land here


def assert_card_is_the_load(path: Path) -> None:
    card = read_card(path)
    ckpt = load_model(path)
    assert card.config == ckpt.config
    assert card.parameters == ckpt.model.num_parameters()
    assert card.chat_template == (ckpt.chat_template if ckpt.config.has_decoder else None)
    assert card.tool_format == getattr(ckpt, "tool_format", None)
    assert card.metrics == ckpt.metrics
    assert card.source_bytes > 0


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_gguf_lineages(tmp_path, key):
    path, _ = write_lineage_gguf(tmp_path / f"{key}.gguf", key)
    assert_card_is_the_load(path)
    assert read_card(path).architecture == VARIANTS[key].arch
    assert read_card(path).source_bytes == path.stat().st_size


def test_gguf_phi3_longrope_reads_its_factors_as_config(tmp_path):
    path, _ = write_lineage_gguf(tmp_path / "phi3-longrope.gguf", PHI3_LONGROPE)
    assert_card_is_the_load(path)
    assert read_card(path).config.rope_scaling["type"] == "longrope"


@pytest.mark.parametrize("tie,qtype,template", [(True, Q.F32, True), (False, Q.Q8_0, False), (True, Q.Q4_0, True)])
def test_gguf_llama(tmp_path, tie, qtype, template):
    bpe = train_byte_bpe()
    spec = GGUFSpec(qtype=qtype) if template else GGUFSpec(qtype=qtype, chat_template=None)
    model = tiny_llama(vocab_size=bpe.get_vocab_size(), tie=tie, intermediate_size=256, hidden_size=256)
    path = write_llama_gguf(tmp_path / "tiny.gguf", model, bpe, spec)
    assert_card_is_the_load(path)
    assert (read_card(path).chat_template is not None) is template


def test_stored_gguf_projections_count_as_the_float_layers_they_stand_for(tmp_path, monkeypatch):
    bpe = train_byte_bpe()
    model = tiny_llama(vocab_size=bpe.get_vocab_size(), tie=False, intermediate_size=256, hidden_size=256)
    path = write_llama_gguf(tmp_path / "tiny.gguf", model, bpe, GGUFSpec(qtype=Q.Q8_0))
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")
    ckpt = as_checkpoint(load_gguf(path))
    assert any(isinstance(m, KQuantLinear) for m in ckpt.model.modules())  # the case this is about
    assert read_card(path).parameters == ckpt.model.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(HF_LINEAGES))
def test_hf_lineages(tmp_path, name):
    save_lineage(tmp_path / name, name)
    assert_card_is_the_load(tmp_path / name)


@pytest.mark.parametrize("save_hf", [save_gpt2, save_bert, save_marian], ids=["gpt2", "bert", "marian"])
def test_hf_directories(tmp_path, save_hf):
    save_hf(tmp_path / "m")
    assert_card_is_the_load(tmp_path / "m")
    data = json.loads((tmp_path / "m" / "config.json").read_text())
    assert read_card(tmp_path / "m").architecture == data["model_type"]


def test_a_marian_ban_becomes_an_output_bias_in_the_card_too(tmp_path):
    save_marian(tmp_path / "m")
    data = json.loads((tmp_path / "m" / "config.json").read_text())
    assert banned_tokens(tmp_path / "m", data)  # what makes load_hf fold the ban into an output bias
    assert read_card(tmp_path / "m").config.lm_head_bias


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False)])
def test_sentence_transformers(tmp_path, pooling, normalize):
    assert_card_is_the_load(save_sentence_transformer(tmp_path / "st", pooling, normalize, max_seq_length=12))
    assert read_card(tmp_path / "st").config.max_input_tokens == 12


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder", "encoder"])
def test_our_checkpoints(tmp_path, family):
    tok = train_bpe(["to be or not to be", "that is the question"] * 4, vocab_size=120, template="$A")
    extra = {"encoder": dict(mlm_head=True, mask_token_id=3), "decoder": {},
             "encoder-decoder": dict(decoder_start_token_id=1, source_language="en", target_language="de")}[family]
    cfg = ModelConfig(family=family, vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_decoder_layers=1,
                      n_encoder_layers=1, d_ff=64, max_positions=64, positional="learned", **extra)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" if family == "decoder" else None
    save(tmp_path / "m", build_model(cfg).init_weights(3).eval(), tok, metrics={"loss": 1.5}, chat_template=template)
    assert_card_is_the_load(tmp_path / "m")
    assert read_card(tmp_path / "m").metrics == {"loss": 1.5}


def _installed(name: str) -> bool:
    path = REPO / "weights" / name
    if not is_manifest_dir(path):
        return True
    try:
        locate(read_manifest(path))
    except ManifestError:
        return False
    return True


# The shipped checkpoints and sentence-transformers packages; the shipped GGUFs (SmolLM2, Gemma 3:
# ~2 min of conversion) are held to their loads by tests/service/test_model_cards.py, over /v1/models.
SHIPPED = ["generate-en", "translate-en-de", "all-minilm-l6-v2", "fill-mask-en"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_models(name, monkeypatch):
    if not _installed(name):
        pytest.skip(f"weights/{name}: its weight package is not installed (make setup)")
    monkeypatch.delenv("TSERVE_WEIGHTS_CACHE")  # the conversion a server start keeps, when there is one
    assert_card_is_the_load(REPO / "weights" / name)


def test_a_card_reads_no_weights(tmp_path, monkeypatch):
    """A card is read from files whose weights are garbage (safetensors) or cut off after the header
    (GGUF): it never reads them, and gguf's reader (which maps every tensor) is never made."""
    save_gpt2(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    expected = read_card(tmp_path / "hf")
    weights.write_bytes(b"\xff" * weights.stat().st_size)
    assert read_card(tmp_path / "hf") == expected
    with pytest.raises(Exception):  # noqa: B017 - whatever the safetensors reader says: the file is not weights
        load_model(tmp_path / "hf")

    bpe = train_byte_bpe()
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(vocab_size=bpe.get_vocab_size()), bpe)
    expected = read_card(path)
    cut = gguf.GGUFReader(str(path)).data_offset  # where the tensors' data starts: the header alone is kept
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:cut])
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("gguf's reader was made"))
    cut_card = read_card(tmp_path / "cut.gguf")
    assert cut_card == dataclasses.replace(expected, source_bytes=cut)


def test_a_split_gguf_is_read_from_its_first_chunk(tmp_path, monkeypatch):
    """A manifest whose GGUF is split over packages: the header comes from the first chunk (not
    joined, not hashed), the size from all of them."""
    bpe = train_byte_bpe()
    whole = write_llama_gguf(tmp_path / "whole.gguf", tiny_llama(vocab_size=bpe.get_vocab_size()), bpe)
    data = whole.read_bytes()
    chunks = [tmp_path / "part0", tmp_path / "part1"]
    chunks[0].write_bytes(data[:len(data) // 2])
    chunks[1].write_bytes(data[len(data) // 2:])
    calls = iter(chunks)
    monkeypatch.setattr(card_module, "_package_file", lambda *a: next(calls))
    monkeypatch.setattr("model.formats.manifest.sha256_of", lambda f: pytest.fail(f"hashed {f}"))
    manifest = tmp_path / "split"
    manifest.mkdir()
    parts = [{"package": f"p{i}", "version": "1", "file": f"part{i}", "sha256": "0" * 64} for i in range(2)]
    (manifest / "manifest.json").write_text(json.dumps({
        "format": "gguf", "package": "p0", "version": "1", "file": "tiny.gguf", "sha256": "1" * 64,
        "licence": "test", "parts": parts, "tool_format": "hermes"}))
    card = read_card(manifest)
    assert card == dataclasses.replace(read_card(whole), tool_format="hermes")  # the size: both chunks
    assert not (tmp_path / "cache").exists()  # nothing joined
