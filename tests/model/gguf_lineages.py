"""Tiny GGUF files of the lineages after Llama, laid out as llama.cpp's converter writes them
(its tensor names per architecture, Gemma's norms stored as 1 + w, q/k rows permuted for the
"llama" architecture only, Phi-3's fused qkv and gate+up), with the weights of a tiny random
transformers model, and either a byte-level BPE vocabulary (Qwen) or a SentencePiece BPE one
(Mistral, Phi-3, Gemma 3: tokens, scores, token types, byte fallback pieces).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import sentencepiece
import torch

from tests.model.gguf_tiny import CHATML, llama_cpp_permute, train_byte_bpe, vocabulary
from tests.model.hf_tiny import ENGLISH, GERMAN, perturb, transformers

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1)


@dataclass(frozen=True)
class Variant:
    arch: str  # general.architecture
    config: str  # transformers config class
    model: str  # transformers model class
    vocab: str  # "bpe" (byte-level) or "spm" / "gemma-spm" (SentencePiece, Gemma's special ids)
    overrides: dict[str, Any]
    name: str = "tiny"  # general.name ("mistral" in it makes transformers read a llama file as Mistral)


# transformers reads only some keys of each architecture (Qwen3's head_dim stays its default 128,
# Gemma 3's query_pre_attn_scalar 256, Mistral's window 4096): the variants keep to those values.
VARIANTS = {
    "qwen2": Variant("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "bpe", dict(tie_word_embeddings=False)),
    "qwen2-tied": Variant("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "bpe", dict(tie_word_embeddings=True)),
    "qwen3": Variant("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "bpe", dict(head_dim=128, tie_word_embeddings=True)),
    "mistral": Variant("llama", "MistralConfig", "MistralForCausalLM", "spm",
                       dict(head_dim=16, sliding_window=None, tie_word_embeddings=False), name="tiny-mistral"),
    "phi3": Variant("phi3", "Phi3Config", "Phi3ForCausalLM", "spm", dict(tie_word_embeddings=False)),
    "gemma3": Variant("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", "gemma-spm", dict(
        num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        tie_word_embeddings=True)),
}

# Phi-3 with LongRoPE and a window, as llama.cpp writes it (rope_factors_* tensors, rope.scaling.*
# keys). transformers ignores those when it reads a GGUF, so this one is compared with the
# transformers model it was written from.
PHI3_LONGROPE = Variant("phi3", "Phi3Config", "Phi3ForCausalLM", "spm", dict(
    tie_word_embeddings=False, sliding_window=8, max_position_embeddings=256, original_max_position_embeddings=64,
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 2.5, 4.0, 9.0]}))

# SentencePiece token types, as llama.cpp stores them
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


@dataclass
class Vocab:
    tokens: list[str]
    scores: list[float] | None
    types: list[int]
    merges: list[str] | None
    bos: int
    eos: int
    pad: int
    unk: int
    pre: str | None = None
    model: str = "llama"
    add_space_prefix: bool = True


def spm_vocab(gemma: bool = False) -> Vocab:
    """A SentencePiece BPE model with byte fallback trained on a few sentences, as llama.cpp's
    converter stores one: pieces, scores and types, in the model's order."""
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter((ENGLISH + GERMAN) * 4), model_writer=out, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, minloglevel=2, hard_vocab_limit=False,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"] if gemma else [],
        add_dummy_prefix=not gemma, **ids)
    sp = sentencepiece.SentencePieceProcessor(model_proto=out.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i)
                     else USER_DEFINED if tokens[-1].startswith("<") and tokens[-1].endswith("_turn>") else NORMAL)
    return Vocab(tokens, scores, types, None, bos=sp.bos_id(), eos=sp.eos_id(),
                 pad=sp.pad_id() if sp.pad_id() >= 0 else 0, unk=sp.unk_id(), add_space_prefix=not gemma)


def bpe_vocab() -> Vocab:
    tokens, merges, types = vocabulary(train_byte_bpe())
    return Vocab(tokens, None, types, merges, bos=1, eos=2, pad=0, unk=0, pre="qwen2", model="gpt2")


def tiny_model(variant: Variant, vocab_size: int, bos: int, eos: int, pad: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    kwargs = {**BASE, "vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
              **variant.overrides}
    model = getattr(transformers, variant.model)(getattr(transformers, variant.config)(**kwargs)).eval()
    perturb(model)
    return model


def _tensors(variant: Variant, model: torch.nn.Module) -> dict[str, np.ndarray]:
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    gemma = variant.arch == "gemma3"
    norm = (lambda w: w + 1.0) if gemma else (lambda w: w)  # llama.cpp stores Gemma's 1 + w
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": norm(sd["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[b + "ffn_down.weight"] = sd[p + "mlp.down_proj.weight"]
        out[b + "attn_norm.weight"] = norm(sd[p + "input_layernorm.weight"])
        if gemma:
            out[b + "post_attention_norm.weight"] = norm(sd[p + "post_attention_layernorm.weight"])
            out[b + "ffn_norm.weight"] = norm(sd[p + "pre_feedforward_layernorm.weight"])
            out[b + "post_ffw_norm.weight"] = norm(sd[p + "post_feedforward_layernorm.weight"])
        else:
            out[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        if variant.arch == "phi3":
            out[b + "attn_qkv.weight"] = sd[p + "self_attn.qkv_proj.weight"]
            out[b + "ffn_up.weight"] = sd[p + "mlp.gate_up_proj.weight"]
            continue
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if variant.arch == "llama":
            q, k = llama_cpp_permute(q, cfg.num_attention_heads), llama_cpp_permute(k, cfg.num_key_value_heads)
        out.update({b + "attn_q.weight": q, b + "attn_k.weight": k,
                    b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
                    b + "ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
                    b + "ffn_up.weight": sd[p + "mlp.up_proj.weight"]})
        for x in "qkv":
            if p + f"self_attn.{x}_proj.bias" in sd:
                out[b + f"attn_{x}.bias"] = sd[p + f"self_attn.{x}_proj.bias"]
        for x in "qk":
            if p + f"self_attn.{x}_norm.weight" in sd:
                out[b + f"attn_{x}_norm.weight"] = norm(sd[p + f"self_attn.{x}_norm.weight"])
    return out


def write_lineage_gguf(path: Path, key: str | Variant, seed: int = 0, extra_kv: dict[str, Any] | None = None,
                       chat_template: str | None = CHATML) -> tuple[Path, torch.nn.Module]:
    """Write the tiny model of VARIANTS[key] (or the variant ``key``) to ``path``; returns the path
    and the transformers model."""
    variant = VARIANTS[key] if isinstance(key, str) else key
    vocab = bpe_vocab() if variant.vocab == "bpe" else spm_vocab(gemma=variant.vocab == "gemma-spm")
    model = tiny_model(variant, len(vocab.tokens), vocab.bos, vocab.eos, vocab.pad, seed)
    cfg, arch = model.config, variant.arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = float((cfg.rope_parameters.get("full_attention") or cfg.rope_parameters)["rope_theta"])
    w = gguf.GGUFWriter(str(path), arch)
    kv: dict[str, Any] = {
        f"{arch}.context_length": cfg.max_position_embeddings, f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.dimension_count": head_dim, f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": theta,
        "general.name": variant.name, "general.license": "apache-2.0",
        "tokenizer.ggml.model": vocab.model, "tokenizer.ggml.bos_token_id": vocab.bos,
        "tokenizer.ggml.eos_token_id": vocab.eos, "tokenizer.ggml.padding_token_id": vocab.pad,
        "tokenizer.ggml.unknown_token_id": vocab.unk,
    }
    if arch in ("gemma3", "phi3") and cfg.sliding_window:
        kv[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    rope = cfg.rope_parameters
    tensors = _tensors(variant, model)
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter writes it
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        kv[f"{arch}.rope.scaling.original_context_length"] = original
        kv[f"{arch}.rope.scaling.attn_factor"] = float(np.sqrt(1 + np.log(scale) / np.log(original)))
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    if vocab.model == "llama":
        kv["tokenizer.ggml.add_space_prefix"] = vocab.add_space_prefix
        kv["tokenizer.ggml.add_bos_token"] = True
    else:
        kv["tokenizer.ggml.pre"] = vocab.pre
        kv["tokenizer.ggml.add_bos_token"] = False
    kv.update(extra_kv or {})
    for k, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(k, value)
        elif isinstance(value, int):
            w.add_uint32(k, value)
        elif isinstance(value, float):
            w.add_float32(k, value)
        else:
            w.add_string(k, value)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for name, values in tensors.items():
        w.add_tensor(name, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model
