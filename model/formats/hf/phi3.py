"""Phi3ForCausalLM (Phi-3, Phi-3.5 mini) -> DecoderLM: a Llama whose q/k/v projections are stored
fused (``qkv_proj``: our layout already) and whose gate and up projections are one
``gate_up_proj`` (gate rows first: split here), with an optional sliding window on every layer.

LongRoPE ("longrope", older files "su"): transformers switches from ``short_factor`` to
``long_factor`` once a sequence is longer than ``original_max_position_embeddings``, which would
change the rotation of keys already in a cache. We serve the short factors (and the attention
factor, as transformers computes it) up to ``original_max_position_embeddings`` and cap the
context there, which matches transformers exactly over that range; ``partial_rotary_factor``
other than 1 is refused by name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from model.config import ModelConfig
from model.formats.hf.format import (
    HFConfig,
    HFImportError,
    HFWeights,
    Importer,
    TensorMap,
    fast_tokenizer,
)
from model.formats.hf.llama import decoder_tensors, hf_decoder_config, rope, rope_parameters, sliding_window
from model.tokenization.tokenizer import Tokenizer

LONGROPE = ("longrope", "su")


def longrope(hf: HFConfig, params: dict[str, Any], key: str, head_dim: int) -> tuple[float, dict[str, Any], int]:
    """rope_theta, our rope_scaling and the context we serve for a LongRoPE config."""
    max_positions = hf.require("max_position_embeddings")
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if not isinstance(original, int) or original < 1:
        raise HFImportError(f"{hf.path}: LongRoPE needs 'original_max_position_embeddings', got {original!r}")
    short = params.get("short_factor")
    if not isinstance(short, list) or len(short) != head_dim // 2:
        raise HFImportError(f"{hf.path}: field '{key}.short_factor' must list {head_dim // 2} numbers")
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # as transformers' _compute_longrope_parameters
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = {"type": "longrope", "factors": [float(f) for f in short], "attention_factor": float(attention_factor)}
    return theta, scaling, min(max_positions, original)


def phi3_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    hf.expect("attention_bias", False)
    d_model, n_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    hf.expect("head_dim", d_model // n_heads)
    params, key = rope_parameters(hf)
    if params.get("rope_type", params.get("type")) in LONGROPE:
        theta, scaling, max_positions = longrope(hf, params, key, d_model // n_heads)
    else:
        (theta, scaling), max_positions = rope(hf, params, key), hf.require("max_position_embeddings")
    return hf_decoder_config(hf, directory, rope_theta=theta, rope_scaling=scaling, max_positions=max_positions,
                             rms_eps=1e-5, **sliding_window(hf, hf.get("sliding_window"), max_positions))


def phi3_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    return decoder_tensors(weights, cfg, fused_qkv=True, fused_gate_up=True)


PHI3 = Importer(
    architecture="Phi3ForCausalLM",
    model_type="phi3",
    tokenizer=fast_tokenizer,
    config=phi3_config,
    tensors=phi3_tensors,
    ignored=(r"lm_head\.weight",),
)
