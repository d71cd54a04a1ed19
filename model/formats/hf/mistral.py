"""MistralForCausalLM -> DecoderLM: a Llama whose every layer attends inside ``sliding_window``
(where the config sets one, and it is shorter than the context), with an optional ``head_dim``.
"""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import (
    HFConfig,
    HFWeights,
    Importer,
    TensorMap,
    activation,
    eos_token_ids,
    fast_tokenizer,
)
from model.formats.hf.llama import decoder_tensors, llama_model_config, rope, sliding_window
from model.formats.hf.qwen3 import head_dim_override
from model.tokenization.tokenizer import Tokenizer


def mistral_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    if hf.get("layer_types") is not None:  # transformers points such files at its Ministral classes
        raise hf.unsupported("layer_types", hf.get("layer_types"), "absent (every layer alike)")
    d_model, n_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    theta, scaling = rope(hf)
    eos = eos_token_ids(hf.data, directory)
    max_positions = hf.require("max_position_embeddings")
    window = sliding_window(hf, hf.get("sliding_window"), max_positions)
    return llama_model_config(
        vocab_size=hf.require("vocab_size"), d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads), n_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), max_positions=max_positions,
        rope_theta=theta, rope_scaling=scaling, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos=hf.token_id("bos_token_id"), eos=eos[0] if eos else None, pad=hf.token_id("pad_token_id"),
        activation=activation(hf, "hidden_act"), head_dim_override=head_dim_override(hf), **window,
    )


def mistral_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    return decoder_tensors(weights, cfg)


MISTRAL = Importer(
    architecture="MistralForCausalLM",
    model_type="mistral",
    tokenizer=fast_tokenizer,
    config=mistral_config,
    tensors=mistral_tensors,
    ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight"),
)
