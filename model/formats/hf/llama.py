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
                       activation: str = "silu", **lineage: Any) -> ModelConfig:
    """The ModelConfig of a Llama-architecture decoder, whichever file format described it. ``lineage``:
    the fields by which a later architecture differs (qkv_bias, qk_norm, sliding_window, ...)."""
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
        n_decoder_layers=n_layers, d_ff=d_ff, activation=activation, dropout=0.0, max_positions=max_positions,
        positional="rope", rope_theta=float(rope_theta), rope_scaling=rope_scaling, norm="rmsnorm", mlp="gated",
        norm_placement="pre", final_norm=True, layer_norm_eps=float(rms_eps), bias=False, fused_qkv=True,
        tie_word_embeddings=tie_word_embeddings,
        # Padded positions are masked, so without a pad token any valid id will do.
        pad_token_id=pad if pad is not None else (eos if eos is not None else 0),
        bos_token_id=bos, eos_token_id=eos, **lineage,
    )


def rope_parameters(hf: HFConfig) -> tuple[dict[str, Any], str]:
    """The rotary settings from either layout: transformers 5 writes one ``rope_parameters``
    dict, older files ``rope_theta`` beside ``rope_scaling``. Returns them and the key read."""
    params, key = hf.get("rope_parameters"), "rope_parameters"
    if params is None:
        params, key = hf.get("rope_scaling", {}), "rope_scaling"
    if not isinstance(params, dict):
        raise HFImportError(f"{hf.path}: field '{key}' is {params!r}; expected an object")
    for partial in (params.get("partial_rotary_factor"), hf.get("partial_rotary_factor")):
        if partial not in (None, 1.0):  # rotary positions on only part of each head (Phi-4-mini)
            raise hf.unsupported("partial_rotary_factor", partial, "1.0")
    return params, key


def rope(hf: HFConfig, params: dict[str, Any] | None = None, key: str = "rope_parameters",
         default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and our rope_scaling (``params``: one layer type's settings; default: the file's)."""
    if params is None:
        params, key = rope_parameters(hf)
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
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


def hf_decoder_config(hf: HFConfig, directory: Path, *, rope_theta: float, rope_scaling: dict[str, Any] | None,
                      max_positions: int | None = None, rms_eps: float = 1e-6, tied: bool = False,
                      activation_key: str = "hidden_act", **lineage: Any) -> ModelConfig:
    """``llama_model_config`` from the keys every Llama-style config.json shares (Llama, Qwen2/3,
    Mistral, Phi-3, Gemma 3); ``rms_eps`` and ``tied`` are the lineage's defaults where the file is
    silent; ``lineage``: the fields by which it differs."""
    d_model, n_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    eos = eos_token_ids(hf.data, directory)
    return llama_model_config(
        vocab_size=hf.require("vocab_size"), d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads), n_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"),
        max_positions=max_positions if max_positions is not None else hf.require("max_position_embeddings"),
        rope_theta=rope_theta, rope_scaling=rope_scaling, rms_eps=float(hf.get("rms_norm_eps", rms_eps)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tied)),
        bos=hf.token_id("bos_token_id"), eos=eos[0] if eos else None, pad=hf.token_id("pad_token_id"),
        activation=activation(hf, activation_key), **lineage,
    )


def llama_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    hf.expect("attention_bias", False)
    hf.expect("mlp_bias", False)
    d_model, n_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    if n_heads and d_model % n_heads == 0:
        hf.expect("head_dim", d_model // n_heads)  # our attention derives head_dim = d_model / n_heads
    theta, scaling = rope(hf)
    return hf_decoder_config(hf, directory, rope_theta=theta, rope_scaling=scaling)


# Their per-layer norm names -> ours, for Llama and the lineages that kept its two norms.
LLAMA_NORMS = {"input_layernorm": "self_attn_norm", "post_attention_layernorm": "ffn_norm"}


def decoder_tensors(weights: HFWeights, cfg: ModelConfig, *, norms: dict[str, str] | None = None,
                    norm_offset: float = 0.0, fused_qkv: bool = False, fused_gate_up: bool = False) -> TensorMap:
    """The tensors of a Llama-shaped decoder in transformers' names, for every lineage built on it.

    ``norms``: their per-layer norm names -> ours; ``norm_offset``: added to every RMSNorm weight
    (Gemma's norms scale by ``1 + w``; folded here, so the layers keep one RMSNorm);
    ``fused_qkv`` / ``fused_gate_up``: Phi-3's ``qkv_proj`` (our layout already) and ``gate_up_proj``
    (gate rows, then up rows: split here). q/k/v biases and q/k norms are read where ``cfg`` has them."""
    p = weights.prefix("embed_tokens.weight", ("model.", ""))  # LlamaModel-saved files have no prefix
    out = TensorMap()

    def norm(ours: str, theirs: str) -> None:
        w = weights.take(theirs)
        out.put(ours, (w.float() + norm_offset).to(w.dtype) if norm_offset else w, theirs)

    out.put("embed.tokens.weight", weights.take(f"{p}embed_tokens.weight"), f"{p}embed_tokens.weight")
    for i in range(cfg.n_decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"{p}layers.{i}"
        for their_norm, our_norm in (norms or LLAMA_NORMS).items():
            norm(f"{ours}.{our_norm}.weight", f"{theirs}.{their_norm}.weight")
        attn = f"{theirs}.self_attn"
        if fused_qkv:
            out.put(f"{ours}.self_attn.qkv_proj.weight", weights.take(f"{attn}.qkv_proj.weight"),
                    f"{attn}.qkv_proj.weight")
        else:
            names = [f"{attn}.{x}_proj.weight" for x in "qkv"]
            qkv = torch.cat([weights.take(n) for n in names], dim=0)  # (n_heads + 2 n_kv) * head_dim, d
            out.put(f"{ours}.self_attn.qkv_proj.weight", qkv, " + ".join(names))
        if cfg.qkv_bias:
            names = [f"{attn}.{x}_proj.bias" for x in "qkv"]
            out.put(f"{ours}.self_attn.qkv_proj.bias", torch.cat([weights.take(n) for n in names]), " + ".join(names))
        if cfg.qk_norm:
            for x in "qk":
                norm(f"{ours}.self_attn.{x}_norm.weight", f"{attn}.{x}_norm.weight")
        out.put(f"{ours}.self_attn.out_proj.weight", weights.take(f"{attn}.o_proj.weight"), f"{attn}.o_proj.weight")
        mlp = f"{theirs}.mlp"
        if fused_gate_up:
            gate, up = weights.take(f"{mlp}.gate_up_proj.weight").chunk(2, dim=0)
            out.put(f"{ours}.ffn.gate.weight", gate.contiguous(), f"{mlp}.gate_up_proj.weight (first half)")
            out.put(f"{ours}.ffn.up.weight", up.contiguous(), f"{mlp}.gate_up_proj.weight (second half)")
        else:
            for ours_name, theirs_name in (("gate", "gate_proj"), ("up", "up_proj")):
                out.put(f"{ours}.ffn.{ours_name}.weight", weights.take(f"{mlp}.{theirs_name}.weight"),
                        f"{mlp}.{theirs_name}.weight")
        out.put(f"{ours}.ffn.down.weight", weights.take(f"{mlp}.down_proj.weight"), f"{mlp}.down_proj.weight")
    norm("decoder_norm.weight", f"{p}norm.weight")
    if not cfg.tie_word_embeddings:
        out.put("lm_head.proj.weight", weights.take("lm_head.weight"), "lm_head.weight")
    return out


def sliding_window(hf: HFConfig, window: int | None, max_positions: int,
                   default_layers: list[int] | None = None, drop_if_longer: bool = True) -> dict[str, Any]:
    """Our ``sliding_window`` / ``sliding_window_layers`` from a window (None: none) and the file's
    ``layer_types`` ("sliding_attention" / "full_attention" per layer; absent: ``default_layers``,
    None meaning every layer). A window no shorter than the context changes nothing and is dropped
    (unless ``drop_if_longer`` is False: Gemma's window layers also have their own rotary base),
    so such a model keeps the fast decode paths."""
    if window is None:
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise HFImportError(f"{hf.path}: field 'sliding_window' is {window!r}; expected a positive integer")
    n = hf.require("num_hidden_layers")
    types = hf.get("layer_types")
    layers = default_layers
    if types is not None:
        unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
        if not isinstance(types, list) or len(types) != n or unknown:
            raise hf.unsupported("layer_types", types, f"{n} entries of 'sliding_attention' or 'full_attention'")
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if layers is not None and len(layers) == n:
        layers = None
    if (drop_if_longer and window >= max_positions) or layers == []:
        return {}
    return {"sliding_window": window, "sliding_window_layers": layers}


LLAMA = Importer(
    architecture="LlamaForCausalLM",
    model_type="llama",
    tokenizer=fast_tokenizer,
    config=llama_config,
    tensors=decoder_tensors,
    # Rotary tables some old checkpoints stored, and a copy of the tied head.
    ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight"),
)
