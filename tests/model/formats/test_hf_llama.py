"""LlamaForCausalLM directories saved by transformers: logits match on tiny random configs
(GQA, tied and untied heads, linear and llama3 RoPE scaling); unsupported settings fail by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model.formats.checkpoint import load
from model.formats.convert import main as convert_main
from model.formats.hf.importer import HFImportError, load_hf
from model.formats.sources import load_model
from tests.model.gguf_tiny import CHATML, tiny_llama, train_byte_bpe, transformers
from tests.model.hf_tiny import SENTENCES

VARIANTS = {
    "gqa-tied": dict(tie=True, n_kv_heads=2),
    "mha-untied": dict(tie=False, n_kv_heads=4),
    "mqa-linear-rope": dict(tie=False, n_kv_heads=1, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "gqa-llama3-rope": dict(tie=True, n_kv_heads=2, rope_theta=500000.0, max_position_embeddings=128, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
}


def save_llama(directory: Path, seed: int = 0, **variant) -> transformers.LlamaForCausalLM:
    bpe = train_byte_bpe()
    model = tiny_llama(seed=seed, vocab_size=bpe.get_vocab_size(), **variant)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, transformers.LlamaForCausalLM]]:
    out = {}
    for i, (name, variant) in enumerate(VARIANTS.items()):
        directory = tmp_path_factory.mktemp(name)
        out[name] = directory, save_llama(directory, seed=i, **variant)
    return out


def _copy(src: Path, dst: Path, change: dict) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data.update(change)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_with_padding(name, saved):
    directory, reference = saved[name]
    ours = load_hf(directory)
    torch.manual_seed(7)
    t = 40  # past llama3's original_max_position_embeddings, so the scaled frequencies matter
    ids = torch.randint(0, ours.config.vocab_size, (3, t))
    mask = torch.ones(3, t, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, :17] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = ours.model(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)


def test_config_mapping(saved):
    cfg = load_hf(saved["gqa-llama3-rope"][0]).config
    assert (cfg.n_heads, cfg.kv_heads, cfg.tie_word_embeddings, cfg.rope_theta) == (4, 2, True, 500000.0)
    assert cfg.rope_scaling == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}
    cfg = load_hf(saved["mqa-linear-rope"][0]).config
    assert (cfg.kv_heads, cfg.tie_word_embeddings, cfg.rope_scaling) == (1, False, {"type": "linear", "factor": 4.0})
    assert (cfg.norm, cfg.mlp, cfg.positional, cfg.bias, cfg.activation) == ("rmsnorm", "gated", "rope", False, "silu")


def test_older_config_layout_gives_the_same_config(saved, tmp_path):
    """rope_theta beside rope_scaling {"type": ...}, as transformers 4 wrote it."""
    src = saved["gqa-llama3-rope"][0]
    data = json.loads((src / "config.json").read_text())
    params = dict(data.pop("rope_parameters"))
    theta = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    old = _copy(src, tmp_path / "old", {})
    (old / "config.json").write_text(json.dumps({**data, "rope_theta": theta, "rope_scaling": params}))
    assert load_hf(old).config == load_hf(src).config


def test_tokenizer_template_and_stop_ids(saved, tmp_path):
    directory, _ = saved["gqa-tied"]
    ours = load_hf(directory)
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    for text in SENTENCES + ["<|im_start|>user\nHi<|im_end|>"]:
        assert ours.tokenizer.encode(text) == reference(text)["input_ids"], text
    assert ours.chat_template == CHATML
    multi = _copy(directory, tmp_path / "multi-eos", {})
    (multi / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_hf(multi).stop_token_ids == [0]


def test_template_in_tokenizer_config_is_read(saved, tmp_path):
    directory = _copy(saved["gqa-tied"][0], tmp_path / "legacy-template", {})
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ 1 }}"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_hf(directory).chat_template == "{{ 1 }}"


def test_convert_and_load_model(saved, tmp_path):
    directory, _ = saved["mha-untied"]
    assert convert_main([str(directory), str(tmp_path / "ckpt")]) == 0
    ckpt, direct = load(tmp_path / "ckpt"), load_model(directory)
    assert ckpt.config == direct.config and ckpt.chat_template == direct.chat_template == CHATML
    ids = torch.tensor([direct.tokenizer.encode(SENTENCES[0])])
    with torch.no_grad():
        assert torch.equal(ckpt.model(ids), direct.model(ids))


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 16}, "head_dim"),
    ({"hidden_act": "relu2"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, r"rope_parameters\.rope_type"),
])
def test_unsupported_settings_are_named(change, field, saved, tmp_path):
    bad = _copy(saved["gqa-tied"][0], tmp_path / "bad", change)
    with pytest.raises(HFImportError, match=rf"{field}=.*not supported"):
        load_hf(bad)
