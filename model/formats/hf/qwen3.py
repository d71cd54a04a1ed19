"""Qwen3ForCausalLM -> DecoderLM: a Llama with an RMSNorm over each head of q and of k before the
rotary positions, no q/k/v biases, and a head width (``head_dim``) apart from hidden / heads.
"""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import HFConfig, Importer, fast_tokenizer
from model.formats.hf.llama import decoder_tensors
from model.formats.hf.qwen2 import qwen_config
from model.tokenization.tokenizer import Tokenizer


def head_dim_override(hf: HFConfig) -> int | None:
    """``head_dim`` where the file sets one other than hidden_size / num_attention_heads."""
    d_model, n_heads = hf.require("hidden_size"), hf.require("num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is None or (d_model % n_heads == 0 and head_dim == d_model // n_heads):
        return None
    return hf.require("head_dim")


def qwen3_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    hf.expect("attention_bias", False)
    return qwen_config(hf, directory, qk_norm=True, head_dim_override=head_dim_override(hf))


QWEN3 = Importer(
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    tokenizer=fast_tokenizer,
    config=qwen3_config,
    tensors=decoder_tensors,
    ignored=(r"lm_head\.weight",),
)
