"""Qwen2, Qwen3, Mistral, Phi-3 and Gemma 3 directories saved by transformers: through
model.load_model the logits match transformers within 1e-4 (left padding included) and greedy
generation gives the same tokens; settings we do not implement are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model import SamplingParams, generate
from model.formats.hf.importer import HFImportError, load_hf
from model.formats.sources import load_model
from tests.model.lineages_tiny import VARIANTS, WINDOW, save_lineage


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    out = {}
    for i, name in enumerate(VARIANTS):
        directory = tmp_path_factory.mktemp(name)
        out[name] = directory, save_lineage(directory, name, seed=i)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_with_padding(name, saved):
    directory, reference = saved[name]
    ours = load_model(directory)
    torch.manual_seed(7)
    t = 40  # several windows long
    ids = torch.randint(3, ours.config.vocab_size, (3, t))
    mask = torch.ones(3, t, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, :17] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = ours.model(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_transformers(name, saved):
    directory, reference = saved[name]
    ours = load_model(directory)
    prompts = [ours.tokenizer.encode(text) for text in ("The quick brown fox", "Hello world, how are you today?")]
    results = generate(ours.model, prompts, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.token_ids == out[0, len(prompt):].tolist()


def test_config_mapping(saved):
    cfg = load_hf(saved["qwen2-untied-window"][0]).config
    assert (cfg.qkv_bias, cfg.bias, cfg.tie_word_embeddings) == (True, False, False)
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (WINDOW, [1])
    cfg = load_hf(saved["qwen3"][0]).config
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.head_dim_override) == (True, False, 16, 16)
    assert load_hf(saved["qwen3-tied-mha"][0]).config.head_dim_override is None  # 32 / 4 already
    cfg = load_hf(saved["mistral-window"][0]).config
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (WINDOW, None)
    cfg = load_hf(saved["phi3-longrope-window"][0]).config
    assert cfg.max_positions == 64 and cfg.rope_scaling["type"] == "longrope"
    assert cfg.rope_scaling["factors"] == [1.0, 1.3, 2.1, 3.7]
    cfg = load_hf(saved["gemma3"][0]).config
    assert (cfg.qk_norm, cfg.post_sublayer_norm, cfg.scale_embedding, cfg.activation) == (True, True, True, "gelu_new")
    assert (cfg.sliding_window, cfg.sliding_window_layers, cfg.local_rope_theta, cfg.rope_theta) == (
        WINDOW, [0, 1, 3], 10_000.0, 1_000_000.0)
    assert cfg.attention_scale == pytest.approx(12 ** -0.5)


def _copy(src: Path, dst: Path, change: dict) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data.update(change)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("name, change, field", [
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("phi3", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_parameters\.rope_type"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("mistral-window", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
])
def test_unsupported_settings_are_named(name, change, field, saved, tmp_path):
    bad = _copy(saved[name][0], tmp_path / "bad", change)
    with pytest.raises(HFImportError, match=rf"{field}=.*not supported"):
        load_hf(bad)


def test_an_unknown_architecture_is_refused_with_the_supported_list(saved, tmp_path):
    bad = _copy(saved["qwen2-tied"][0], tmp_path / "bad", {"architectures": ["Gemma2ForCausalLM"]})
    with pytest.raises(HFImportError, match=r"Gemma2ForCausalLM.*not supported.*Gemma3ForCausalLM.*Qwen3ForCausalLM"):
        load_hf(bad)


@pytest.mark.parametrize("name", ["qwen2-untied-window", "qwen3", "mistral-window", "phi3-longrope-window", "gemma3"])
def test_served_as_the_service_prepares_them(name, saved):
    """prepare(): int8 decode projections (biases included) and the native step, which reads every
    lineage's features as data."""
    step = "native"
    from model.decode import DecodeOptions, prepare
    from model.decode.native import unsupported_reason

    ours = load_model(saved[name][0])
    ids = [ours.tokenizer.encode("The quick brown fox jumps over the lazy dog.")]
    plain = generate(ours.model, ids, SamplingParams(max_new_tokens=1, temperature=0.0))[0]
    chosen = prepare(ours.model, DecodeOptions(), ours.tokenizer)
    assert chosen.name == step, unsupported_reason(ours.model)
    served = generate(ours.model, ids, SamplingParams(max_new_tokens=8, temperature=0.0), step=chosen)[0]
    assert len(served.token_ids) == 8
    # With float prompts (TSERVE_PREFILL=model) the first token is the float model's. By default the
    # native step writes the prompt in int8 too, which may flip a near-tie of these random weights.
    floats = load_model(saved[name][0])
    kept = prepare(floats.model, DecodeOptions(prefill="model"), floats.tokenizer)
    assert kept.name == step
    first = generate(floats.model, ids, SamplingParams(max_new_tokens=1, temperature=0.0), step=kept)[0]
    assert first.token_ids[0] == plain.token_ids[0]


@pytest.mark.parametrize("name", ["gemma3", "qwen2-untied-window", "phi3-longrope-window"])
def test_convert_to_our_checkpoint_keeps_every_lineage_field(name, saved, tmp_path):
    from model.formats.checkpoint import load
    from model.formats.convert import main as convert_main

    directory, _ = saved[name]
    assert convert_main([str(directory), str(tmp_path / "ckpt")]) == 0
    ckpt, direct = load(tmp_path / "ckpt"), load_model(directory)
    assert ckpt.config == direct.config
    ids = torch.randint(3, direct.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ckpt.model(ids), direct.model(ids))
