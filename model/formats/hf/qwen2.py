"""Qwen2ForCausalLM (Qwen2, Qwen2.5) -> DecoderLM: a Llama with biases on the q/k/v projections
(none on the output projection or the feed-forward block), a tied or untied head, and a
sliding window on the layers from ``max_window_layers`` on where ``use_sliding_window`` is set.
"""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import HFConfig, HFWeights, Importer, TensorMap, activation, eos_token_ids, fast_tokenizer
from model.formats.hf.llama import decoder_tensors, llama_model_config, rope, sliding_window
from model.tokenization.tokenizer import Tokenizer


def qwen_window(hf: HFConfig, max_positions: int) -> dict:
    """Qwen2 / Qwen3: a window only where ``use_sliding_window``; on the layers ``layer_types`` names,
    or (older files) on layers ``max_window_layers`` and up, as transformers reads it."""
    if not hf.get("use_sliding_window", False):
        return {}
    n = hf.require("num_hidden_layers")
    first = hf.get("max_window_layers", n)
    return sliding_window(hf, hf.get("sliding_window"), max_positions, [i for i in range(n) if i >= first])


def qwen_config(hf: HFConfig, directory: Path, **lineage) -> ModelConfig:
    d_model, n_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    theta, scaling = rope(hf)
    eos = eos_token_ids(hf.data, directory)
    max_positions = hf.require("max_position_embeddings")
    return llama_model_config(
        vocab_size=hf.require("vocab_size"), d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads", n_heads), n_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), max_positions=max_positions,
        rope_theta=theta, rope_scaling=scaling, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos=hf.token_id("bos_token_id"), eos=eos[0] if eos else None, pad=hf.token_id("pad_token_id"),
        activation=activation(hf, "hidden_act"), **qwen_window(hf, max_positions), **lineage,
    )


def qwen2_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    return qwen_config(hf, directory, qkv_bias=True)


def qwen2_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    return decoder_tensors(weights, cfg)


QWEN2 = Importer(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    tokenizer=fast_tokenizer,
    config=qwen2_config,
    tensors=qwen2_tensors,
    ignored=(r"lm_head\.weight",),  # a copy of the tied head
)
