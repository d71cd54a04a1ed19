"""Tiny random Qwen2, Qwen3, Mistral, Phi-3 and Gemma 3 checkpoints written by transformers, for
parity tests of the lineages after Llama (HF directories here; GGUF files in gguf_lineages.py).

Each variant turns on what its lineage adds (q/k/v biases, q/k norms, a head width apart from
hidden / heads, sliding windows shorter than the test sequences, LongRoPE, Gemma's norms and
local rotary base) and is saved with the byte-level BPE tokenizer the Llama tests use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.model.gguf_tiny import CHATML, train_byte_bpe
from tests.model.hf_tiny import perturb, transformers

WINDOW = 8  # shorter than every test sequence, so the window boundary is crossed
BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1)

# name -> (config class, model class, overrides)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-untied-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
    "qwen3-tied-mha": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, num_key_value_heads=4,
                                                              tie_word_embeddings=True)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "mistral-head-dim": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16,
                                                                    tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    "phi3-longrope-window": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=False, sliding_window=WINDOW, max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.7],
                      "long_factor": [1.5, 2.5, 4.0, 9.0]})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=12, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
}


def tiny_lineage(name: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, overrides = VARIANTS[name]
    kwargs = {**BASE, "vocab_size": vocab_size, **overrides}
    if model_cls == "Gemma3ForCausalLM":
        kwargs["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    perturb(model)
    return model


def save_lineage(directory: Path, name: str, seed: int = 0) -> torch.nn.Module:
    bpe = train_byte_bpe()
    model = tiny_lineage(name, bpe.get_vocab_size(), seed)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    return model
