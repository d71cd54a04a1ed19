"""Qwen2ForCausalLM (Qwen2, Qwen2.5) -> DecoderLM: a Llama with biases on the q/k/v projections
(none on the output projection or the feed-forward block), a tied or untied head, and a
sliding window on the layers from ``max_window_layers`` on where ``use_sliding_window`` is set.
"""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import HFConfig, Importer, fast_tokenizer
from model.formats.hf.llama import decoder_tensors, hf_decoder_config, rope, sliding_window
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
    theta, scaling = rope(hf)
    window = qwen_window(hf, hf.require("max_position_embeddings"))
    return hf_decoder_config(hf, directory, rope_theta=theta, rope_scaling=scaling, **window, **lineage)


def qwen2_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    return qwen_config(hf, directory, qkv_bias=True)


QWEN2 = Importer(
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    tokenizer=fast_tokenizer,
    config=qwen2_config,
    tensors=decoder_tensors,
    ignored=(r"lm_head\.weight",),  # a copy of the tied head
)
