"""Tiny GGUF files written here with gguf.GGUFWriter, laid out the way llama.cpp's converter
lays out a Llama: its tensor names, its q/k row order, its metadata keys and a byte-level
BPE vocabulary (tokens, merges, token types) trained on a few sentences.

The weights come from a tiny random transformers ``LlamaForCausalLM``, so a file can be
compared with the model it was written from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.model.hf_tiny import ENGLISH, GERMAN, perturb, transformers

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_byte_bpe(vocab_size: int = 400) -> Tokenizer:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(ENGLISH + GERMAN, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tk


def vocabulary(tk: Tokenizer) -> tuple[list[str], list[str], list[int]]:
    """tokens (by id), merges ("a b"), llama.cpp token types (3 control, 1 normal)."""
    vocab = tk.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = json.loads(tk.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, merges, types


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes: within each head, the two rotate-half
    blocks are interleaved row by row (as its ``permute`` describes it)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(seed: int = 0, vocab_size: int = 400, tie: bool = True, n_kv_heads: int = 2,
               **overrides: Any) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=n_kv_heads, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, initializer_range=0.1)
    kwargs.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    perturb(model)
    return model


def encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


@dataclass
class GGUFSpec:
    """What to write; the defaults describe a well-formed tiny Llama."""

    qtype: Q = Q.F32  # for 2-D weights; norms stay F32 as llama.cpp keeps them
    qtypes: Mapping[str, Q] | None = None  # per-tensor overrides
    architecture: str = "llama"
    pre: str = "smollm"
    chat_template: str | None = CHATML
    drop_keys: tuple[str, ...] = ()
    extra_kv: Mapping[str, Any] | None = None  # key -> int / float / str / bool
    extra_tensors: Mapping[str, tuple[np.ndarray, Q]] | None = None
    tokenizer_model: str = "gpt2"


def write_llama_gguf(path: Path, model: transformers.LlamaForCausalLM, tk: Tokenizer,
                     spec: GGUFSpec | None = None) -> Path:
    spec = spec or GGUFSpec()
    cfg = model.config
    arch = spec.architecture
    w = gguf.GGUFWriter(str(path), arch)
    kv: dict[str, Any] = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        f"{arch}.vocab_size": cfg.vocab_size,
        "general.name": "tiny-llama",
        "general.license": "apache-2.0",
        "tokenizer.ggml.model": spec.tokenizer_model,
        "tokenizer.ggml.pre": spec.pre,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }
    kv.update(spec.extra_kv or {})
    for key, value in kv.items():
        if key in spec.drop_keys:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    tokens, merges, types = vocabulary(tk)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    if spec.chat_template is not None:
        w.add_chat_template(spec.chat_template)

    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads),
            f"blk.{i}.attn_k.weight": llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        })
    for name, values in tensors.items():
        qtype = (spec.qtypes or {}).get(name, spec.qtype if values.ndim == 2 else Q.F32)
        w.add_tensor(name, encode(values, qtype), raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    for name, (values, qtype) in (spec.extra_tensors or {}).items():
        w.add_tensor(name, values, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_raw_tensor_gguf(path: Path, name: str, data: np.ndarray, qtype: Q) -> Path:
    """A file holding one tensor of already encoded ``data`` (for dequantization tests)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
