"""MistralForCausalLM -> DecoderLM: a Llama whose every layer attends inside ``sliding_window``
(where the config sets one, and it is shorter than the context), with an optional ``head_dim``.
"""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import (
    HFConfig,
    Importer,
    fast_tokenizer,
)
from model.formats.hf.llama import decoder_tensors, hf_decoder_config, rope, sliding_window
from model.formats.hf.qwen3 import head_dim_override
from model.tokenization.tokenizer import Tokenizer


def mistral_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    if hf.get("layer_types") is not None:  # transformers points such files at its Ministral classes
        raise hf.unsupported("layer_types", hf.get("layer_types"), "absent (every layer alike)")
    theta, scaling = rope(hf)
    window = sliding_window(hf, hf.get("sliding_window"), hf.require("max_position_embeddings"))
    return hf_decoder_config(hf, directory, rope_theta=theta, rope_scaling=scaling,
                             head_dim_override=head_dim_override(hf), **window)


MISTRAL = Importer(
    architecture="MistralForCausalLM",
    model_type="mistral",
    tokenizer=fast_tokenizer,
    config=mistral_config,
    tensors=decoder_tensors,
    ignored=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight"),
)
