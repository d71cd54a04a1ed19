"""LlamaForCausalLM -> DecoderLM (also what the GGUF import builds for llama.cpp's "llama").

A Llama is a pre-norm decoder with RMSNorm, rotary positions (Hugging Face's rotate-half
layout of the q/k rows), a SwiGLU feed-forward block, grouped-query attention and no
biases. The separate q/k/v projections are concatenated into our fused ``qkv_proj``
(rows: all q heads, then the k heads, then the v heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from model.formats.hf.format import (
    HFConfig,
    HFImportError,
    HFWeights,
    Importer,
    TensorMap,
    activation,
    eos_token_ids,
    fast_tokenizer,
)
from model.tokenization.tokenizer import Tokenizer

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama_model_config(*, vocab_size: int, d_model: int, n_heads: int, n_kv_heads: int, n_layers: int, d_ff: int,
                       max_positions: int, rope_theta: float, rope_scaling: dict[str, Any] | None, rms_eps: float,
                       tie_word_embeddings: bool, bos: int | None, eos: int | None, pad: int | None,
                       activation: str = "silu") -> ModelConfig:
    """The ModelConfig of a Llama-architecture decoder, whichever file format described it."""
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
        n_decoder_layers=n_layers, d_ff=d_ff, activation=activation, dropout=0.0, max_positions=max_positions,
        positional="rope", rope_theta=float(rope_theta), rope_scaling=rope_scaling, norm="rmsnorm", mlp="gated",
        norm_placement="pre", final_norm=True, layer_norm_eps=float(rms_eps), bias=False, fused_qkv=True,
        tie_word_embeddings=tie_word_embeddings,
        # Padded positions are masked, so without a pad token any valid id will do.
        pad_token_id=pad if pad is not None else (eos if eos is not None else 0),
        bos_token_id=bos, eos_token_id=eos,
    )


def _rope(hf: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and our rope_scaling from either layout: transformers 5 writes one
    ``rope_parameters`` dict, older files ``rope_theta`` beside ``rope_scaling``."""
    params, key = hf.get("rope_parameters"), "rope_parameters"
    if params is None:
        params, key = hf.get("rope_scaling", {}), "rope_scaling"
    if not isinstance(params, dict):
        raise HFImportError(f"{hf.path}: field '{key}' is {params!r}; expected an object")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))  # older files: "type"
    if kind == "default":
        return theta, None
    if kind == "linear":
        if not isinstance(params.get("factor"), (int, float)):
            raise HFImportError(f"{hf.path}: field '{key}' of type linear needs a numeric 'factor'")
        return theta, {"type": "linear", "factor": float(params["factor"])}
    if kind == "llama3":
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
        if missing:
            raise HFImportError(f"{hf.path}: field '{key}' of type llama3 lacks {missing}")
        scaling: dict[str, Any] = {"type": "llama3"}
        scaling.update({k: float(params[k]) for k in LLAMA3_ROPE_KEYS[:3]})
        scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return theta, scaling
    raise hf.unsupported(f"{key}.rope_type", kind, "'default', 'linear' or 'llama3'")


def llama_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    hf.expect("attention_bias", False)
    hf.expect("mlp_bias", False)
    d_model, n_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    if n_heads and d_model % n_heads == 0:
        hf.expect("head_dim", d_model // n_heads)  # our attention derives head_dim = d_model / n_heads
    theta, scaling = _rope(hf)
    eos = eos_token_ids(hf.data, directory)
    return llama_model_config(
        vocab_size=hf.require("vocab_size"), d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads), n_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), max_positions=hf.require("max_position_embeddings"),
        rope_theta=theta, rope_scaling=scaling, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos=hf.token_id("bos_token_id"), eos=eos[0] if eos else None, pad=hf.token_id("pad_token_id"),
        activation=activation(hf, "hidden_act"),
    )


def llama_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    p = weights.prefix("embed_tokens.weight", ("model.", ""))  # LlamaModel-saved files have no prefix
    out = TensorMap()
    out.put("embed.tokens.weight", weights.take(f"{p}embed_tokens.weight"), f"{p}embed_tokens.weight")
    for i in range(cfg.n_decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"{p}layers.{i}"
        out.put(f"{ours}.self_attn_norm.weight", weights.take(f"{theirs}.input_layernorm.weight"),
                f"{theirs}.input_layernorm.weight")
        names = [f"{theirs}.self_attn.{x}_proj.weight" for x in "qkv"]
        qkv = torch.cat([weights.take(n) for n in names], dim=0)  # (n_heads + 2 n_kv) * head_dim, d
        out.put(f"{ours}.self_attn.qkv_proj.weight", qkv, " + ".join(names))
        out.put(f"{ours}.self_attn.out_proj.weight", weights.take(f"{theirs}.self_attn.o_proj.weight"),
                f"{theirs}.self_attn.o_proj.weight")
        out.put(f"{ours}.ffn_norm.weight", weights.take(f"{theirs}.post_attention_layernorm.weight"),
                f"{theirs}.post_attention_layernorm.weight")
        for ours_name, theirs_name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            name = f"{theirs}.mlp.{theirs_name}.weight"
            out.put(f"{ours}.ffn.{ours_name}.weight", weights.take(name), name)
    out.put("decoder_norm.weight", weights.take(f"{p}norm.weight"), f"{p}norm.weight")
    if not cfg.tie_word_embeddings:
        out.put("lm_head.proj.weight", weights.take("lm_head.weight"), "lm_head.weight")
    return out


LLAMA = Importer(
    architecture="LlamaForCausalLM",
    model_type="llama",
    tokenizer=fast_tokenizer,
    config=llama_config,
    tensors=llama_tensors,
    # Rotary tables some old checkpoints stored, and a copy of the tied head.
    ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight"),
)
