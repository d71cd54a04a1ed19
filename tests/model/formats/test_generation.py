"""A model's recommended sampling, read from each place a publisher states it: a GGUF's
``general.sampling.*`` keys (a tiny file written with the gguf package), a Hugging Face
``generation_config.json``, a manifest's ``generation`` block; and the shipped manifests' own."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from model import CheckpointError
from model.formats.manifest import ManifestError, read_manifest
from model.formats.sources import recommended_sampling
from tests.model.gguf_tiny import GGUFSpec, tiny_llama, train_byte_bpe, write_llama_gguf

WEIGHTS = Path(__file__).resolve().parents[3] / "weights"
K = gguf.Keys.General
SHA = "0" * 64


def _gguf(path: Path, keys: dict) -> Path:
    bpe = train_byte_bpe()
    return write_llama_gguf(path, tiny_llama(vocab_size=bpe.get_vocab_size()), bpe, GGUFSpec(extra_kv=keys))


def test_a_gguf_files_sampling_keys(tmp_path):
    file = _gguf(tmp_path / "s.gguf", {K.SAMPLING_TEMP: 0.3, K.SAMPLING_TOP_K: 20, K.SAMPLING_TOP_P: 0.8,
                                       K.SAMPLING_PENALTY_REPEAT: 1.1, K.SAMPLING_MIN_P: 0.05})
    found = recommended_sampling(file)
    # stored as float32 (0.3 -> 0.30000001192...): read back as the decimal that was meant
    assert found.values == {"temperature": 0.3, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.1}
    assert found.source == "GGUF general.sampling"
    assert found.unused == (K.SAMPLING_MIN_P,)  # stated, but the sampler has no min-p: reported, not applied
    plain = recommended_sampling(_gguf(tmp_path / "plain.gguf", {}))
    assert plain.values == {} and plain.source is None


def test_a_gguf_value_out_of_bounds_names_the_key(tmp_path):
    file = _gguf(tmp_path / "bad.gguf", {K.SAMPLING_TOP_P: 1.5})
    with pytest.raises(CheckpointError, match=r"top_p must be in \(0, 1\], got 1.5"):
        recommended_sampling(file)


def test_a_generation_config_json(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 40.0, "eos_token_id": [2, 3],
         "repetition_penalty": None}))
    found = recommended_sampling(tmp_path)
    assert found.values == {"temperature": 0.6, "top_p": 0.9, "top_k": 40} and isinstance(found.values["top_k"], int)
    assert found.source == "generation_config.json"
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert recommended_sampling(tmp_path).values == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(CheckpointError, match=r"generation_config.json.temperature must be in \[0, 100\]"):
        recommended_sampling(tmp_path)


def _manifest(tmp_path: Path, generation) -> Path:
    directory = tmp_path / "m"
    directory.mkdir(exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps(
        {"format": "gguf", "package": "nothing-installed", "version": "1", "file": "x.gguf", "sha256": SHA,
         "licence": "MIT", "generation": generation}))
    return directory


def test_a_manifests_generation_block(tmp_path):
    directory = _manifest(tmp_path, {"temperature": 0.2, "top_p": 0.9, "source": "the model card"})
    manifest = read_manifest(directory)
    assert manifest.generation == {"temperature": 0.2, "top_p": 0.9}
    assert manifest.generation_source == "the model card"
    # the block is the whole recommendation: the package need not be installed to read it
    found = recommended_sampling(directory)
    assert found.values == {"temperature": 0.2, "top_p": 0.9} and found.source == "manifest.json: the model card"


@pytest.mark.parametrize("block,error", [
    ({"temperature": 0.2}, r"'generation.source' must say where"),
    ({"temp": 0.2, "source": "x"}, r"unknown field\(s\) \['temp'\]"),
    ({"top_k": 1.5, "source": "x"}, r"generation'.top_k must be an integer"),
    ({"top_p": 0, "source": "x"}, r"top_p must be in \(0, 1\]"),
    ({"temperature": True, "source": "x"}, r"temperature must be in \[0, 100\], got True"),
    ([0.2], r"'generation' must be an object"),
])
def test_a_bad_generation_block_is_refused(tmp_path, block, error):
    with pytest.raises(ManifestError, match=error):
        read_manifest(_manifest(tmp_path, block))


@pytest.mark.parametrize("name,values", [
    ("smollm2-135m-instruct", {"temperature": 0.2, "top_p": 0.9}),  # its model card's example
    ("gemma3-270m", {"temperature": 1.0, "top_k": 64, "top_p": 0.95}),  # its generation_config.json
])
def test_the_shipped_models_recommendations(name, values):
    found = recommended_sampling(WEIGHTS / name)
    assert found.values == values
    assert found.source.startswith("manifest.json: ") and "huggingface.co" in found.source
