"""Save -> load round trips exactly; broken checkpoints fail with a clear message."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import CheckpointError, is_checkpoint, load, save
from model.tokenization.tokenizer import train_bpe
from tests.conftest import tiny_model


@pytest.fixture
def saved(tmp_path):
    tok = train_bpe(["a tiny corpus for a tiny tokenizer"] * 5, vocab_size=300)
    model = tiny_model("decoder", vocab_size=tok.vocab_size)
    return save(tmp_path / "ckpt", model, tok, metrics={"perplexity": 1.5})


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder", "encoder"])
def test_round_trip_gives_identical_logits(tmp_path, family):
    model = tiny_model(family, seed=9)
    path = save(tmp_path / family, model)
    assert is_checkpoint(path)
    loaded = load(path).model
    ids = torch.randint(3, 61, (2, 7))
    with torch.inference_mode():
        if family == "encoder-decoder":
            a, b = model(ids, ids[:, :4]), loaded(ids, ids[:, :4])
        else:
            a, b = model(ids), loaded(ids)
    assert torch.equal(a, b)
    assert not loaded.training
    assert all(p.device.type == "cpu" for p in loaded.parameters())


def test_tied_weights_stored_once_and_retied(saved):
    names = load_file(str(saved / "model.safetensors")).keys()
    assert "lm_head.proj.weight" not in names and "embed.tokens.weight" in names
    ckpt = load(saved)
    assert ckpt.model.lm_head.proj.weight is ckpt.model.embed.tokens.weight
    assert ckpt.metrics == {"perplexity": 1.5}
    assert ckpt.tokenizer is not None and ckpt.tokenizer.vocab_size <= ckpt.config.vocab_size


def test_dtype_cast_on_load(saved):
    model = load(saved, dtype=torch.bfloat16).model
    assert model.embed.tokens.weight.dtype == torch.bfloat16


def test_truncated_weights_name_the_file_and_the_tensor(saved):
    weights = saved / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: tensor '[\w.]+' ends at data byte"):
        load(saved)
    weights.write_bytes(data[:20])  # cut inside the header
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: the header needs \d+ bytes"):
        load(saved)


def test_shape_mismatch_names_the_tensor(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["d_ff"] = 48
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'decoder_layers.0.ffn.up.weight' "
                                              r"has shape \[64, 32\] but config.json implies \[48, 32\]"):
        load(saved)


def test_missing_and_unexpected_tensors(saved):
    weights = saved / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["decoder_layers.1.ffn_norm.bias"]
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match="missing tensor.*decoder_layers.1.ffn_norm.bias"):
        load(saved)
    tensors["decoder_layers.1.ffn_norm.bias"] = torch.zeros(32)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match="unexpected tensor.*extra.weight"):
        load(saved)


def test_bad_config_and_missing_files(tmp_path, saved):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load(tmp_path / "nope")
    (saved / "config.json").write_text(json.dumps({"family": "decoder"}))
    with pytest.raises(CheckpointError, match="config.json"):
        load(saved)
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load(saved)


def test_tokenizer_larger_than_the_embedding_is_refused(saved):
    vocab = load(saved).config.vocab_size
    bigger = train_bpe(["a different and somewhat larger corpus, with more words in it"] * 9, vocab_size=vocab + 30)
    assert bigger.vocab_size > vocab
    bigger.save(saved / "tokenizer.json")
    with pytest.raises(CheckpointError, match=f"tokenizer.json: {bigger.vocab_size} tokens but config.json "
                                              f"has vocab_size {vocab}"):
        load(saved)


def test_pickle_is_never_used(saved, monkeypatch):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load(saved)
