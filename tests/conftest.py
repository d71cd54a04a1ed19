"""Shared fixtures: tiny configs and randomly initialised models of each family."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from model import ModelConfig, build_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def checkpoint_variant(src: Path, dst: Path, **config) -> Path:
    """``dst``: the checkpoint ``src`` (weights and tokenizer linked, not copied) with
    ``config.json`` fields overridden, e.g. ``mask_placeholders=True``."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json"):
        (dst / name).symlink_to(src / name)
    (dst / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | config))
    return dst


def tiny_config(family: str, **overrides) -> ModelConfig:
    base = dict(
        family=family, vocab_size=61, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
        d_ff=64, dropout=0.0, max_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if family == "decoder":
        base.update(norm_placement="pre", final_norm=True, positional="learned", activation="gelu_new")
    elif family == "encoder-decoder":
        base.update(decoder_start_token_id=1, scale_embedding=True, activation="relu")
    else:
        base.update(positional="learned", embedding_norm=True, type_vocab_size=2, mlm_transform=True,
                    lm_head_bias=True, activation="gelu", mask_token_id=3, eos_token_id=None, bos_token_id=None)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(family: str, seed: int = 0, **overrides):
    return build_model(tiny_config(family, **overrides)).init_weights(seed).eval()


@pytest.fixture
def fresh_seed() -> int:
    """A new seed each run (printed in failures), for tests that must hold on any input."""
    return random.SystemRandom().randrange(2**31)


@pytest.fixture(scope="session")
def decoder_lm():
    return tiny_model("decoder", seed=1)


@pytest.fixture(scope="session")
def encoder_decoder():
    return tiny_model("encoder-decoder", seed=2)


@pytest.fixture(scope="session")
def masked_lm():
    return tiny_model("encoder", seed=3)
