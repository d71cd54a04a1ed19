"""ModelConfig: everything needed to build one of the three model families.

The config lives beside the weights as ``config.json`` and round-trips exactly
(``ModelConfig.from_dict(cfg.to_dict()) == cfg``). The options are the union of
what the 2017 Transformer, GPT-2, BERT and Marian need, so each of them can be
expressed without special cases in the model code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("encoder-decoder", "decoder", "encoder")
ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "swish")
POSITIONAL = ("sinusoidal", "learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("standard", "gated")
ROPE_SCALINGS = ("linear", "llama3", "longrope")
SINUSOIDAL_LAYOUTS = ("interleaved", "split")
NORM_PLACEMENTS = ("post", "pre")
POOLINGS = ("mean", "cls", "max")
LANGUAGE_CODE = re.compile(r"[a-z]{2,3}")  # ISO 639-1 (de) or 639-3 (deu), lower case


# The floating-point types weights can be stored or served in, by the names configs and flags use.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A config.json that does not describe a buildable model."""


@dataclass
class ModelConfig:
    family: str  # "encoder-decoder" (translation), "decoder" (LM), "encoder" (masked LM)
    vocab_size: int  # shared source/target vocabulary for the encoder-decoder
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int | None = None  # grouped-query attention: K/V heads shared by n_heads // n_kv_heads queries
    n_encoder_layers: int = 6  # ignored by the decoder family
    n_decoder_layers: int = 6  # ignored by the encoder family
    d_ff: int = 2048  # width of the position-wise feed-forward hidden layer
    activation: str = "relu"  # paper: relu; GPT-2: gelu_new; BERT: gelu; Marian: swish
    dropout: float = 0.1  # on embeddings and every residual branch (paper: 0.1)
    attention_dropout: float = 0.0  # on attention probabilities (BERT: 0.1)
    activation_dropout: float = 0.0  # inside the FFN, after the activation (Marian)
    max_positions: int = 512  # longest sequence the position table covers
    positional: str = "sinusoidal"  # paper/Marian: sinusoidal; GPT-2/BERT: learned; Llama: rope
    rope_theta: float = 10000.0  # base of the rotary frequencies (Llama 2: 1e4, SmolLM2: 1e5, Llama 3: 5e5)
    # None, {"type": "linear", "factor": f} (positions / f) or {"type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} (per-frequency blend)
    rope_scaling: dict[str, Any] | None = None
    # ... or {"type": "longrope", "factors": [one per frequency], "attention_factor": a}: each frequency
    # divided by its own factor, cos/sin multiplied by a (Phi-3's LongRoPE with one fixed factor list)
    # Paper: sin on even, cos on odd dims. Marian/HF: sin in the first half, cos in the second.
    sinusoidal_layout: str = "interleaved"
    norm: str = "layernorm"  # Llama: rmsnorm (scale only, no mean subtraction, no bias)
    mlp: str = "standard"  # standard: down(act(up x)); gated (SwiGLU): down(act(gate x) * up x)
    norm_placement: str = "post"  # paper/BERT/Marian: LayerNorm(x + f(x)); GPT-2: x + f(LN(x))
    final_norm: bool = False  # a LayerNorm after the last layer of each stack (pre-norm needs it)
    embedding_norm: bool = False  # LayerNorm right after summing embeddings (BERT)
    layer_norm_eps: float = 1e-5  # BERT uses 1e-12; also the RMSNorm epsilon
    bias: bool = True  # biases on attention and FFN projections
    fused_qkv: bool = True  # one (d, 3d) projection instead of three (same maths, one matmul)
    attention_scale: float | None = None  # None: 1/sqrt(head_dim) as in the paper
    scale_embedding: bool = False  # multiply token embeddings by sqrt(d_model) (paper, Marian)
    tie_word_embeddings: bool = True  # output projection shares the input embedding matrix
    # --- what the decoder lineages after Llama add (each read by the layers as data) ---------------------------
    head_dim_override: int | None = None  # width of one attention head when not d_model / n_heads (Qwen3, Gemma 3)
    qkv_bias: bool = False  # biases on the q/k/v projections even where 'bias' is False (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before the rotary positions (Qwen3, Gemma 3)
    post_sublayer_norm: bool = False  # a norm on each sublayer's output before the residual add (Gemma 3:
    # x + N2(attn(N1(x))), x + N4(ffn(N3(x))))
    sliding_window: int | None = None  # a position attends to itself and the window - 1 positions before it
    sliding_window_layers: list[int] | None = None  # the layers that use the window; None: every layer
    local_rope_theta: float | None = None  # rotary base of the window layers (unscaled); None: as the others
    type_vocab_size: int = 0  # >0 adds token-type (segment) embeddings (BERT: 2)
    lm_head_bias: bool = False  # bias on the output projection (BERT decoder bias, Marian final_logits_bias)
    mlm_transform: bool = False  # dense -> act -> LayerNorm before the MLM output projection (BERT)
    pooling: str = "mean"  # sentence embedding of the encoder: mean or max over real tokens, or the first ([CLS])
    normalize_embeddings: bool = True  # L2-normalise sentence embeddings (sentence-transformers' Normalize module)
    max_input_tokens: int | None = None  # sentence-transformers' max_seq_length: the longest input it was trained on
    mlm_head: bool = True  # encoder family: False for an embedding model (BertModel) that has no masked-LM head
    mask_placeholders: bool = False  # translation: trained on sources/targets with placeholders masked to
    # sentinels (model.text.placeholders); callers mask the input and unmask the output the same way
    pad_token_id: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None  # encoder-decoder: first decoder input (Marian: pad)
    mask_token_id: int | None = None  # encoder family: the [MASK] id
    # Translation: the language pair the checkpoint translates (ISO 639 codes, e.g. "en" -> "de"),
    # both or neither; None: unknown (the service then guesses it from the model's name)
    source_language: str | None = None
    target_language: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    # --- derived values -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_dim_override if self.head_dim_override is not None else self.d_model // self.n_heads

    def is_window_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` attends only inside ``sliding_window``."""
        if self.sliding_window is None:
            return False
        return self.sliding_window_layers is None or index in self.sliding_window_layers

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def has_encoder(self) -> bool:
        return self.family in ("encoder-decoder", "encoder")

    @property
    def has_decoder(self) -> bool:
        return self.family in ("encoder-decoder", "decoder")

    # --- validation and (de)serialisation ------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        choices = {
            "family": FAMILIES,
            "activation": ACTIVATIONS,
            "positional": POSITIONAL,
            "sinusoidal_layout": SINUSOIDAL_LAYOUTS,
            "norm_placement": NORM_PLACEMENTS,
            "pooling": POOLINGS,
            "norm": NORMS,
            "mlp": MLPS,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            need(value in allowed, f"config field '{name}' is {value!r}; expected one of {list(allowed)}")
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_positions"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                 f"config field '{name}' must be a positive integer, got {getattr(self, name)!r}")
        if self.head_dim_override is None:
            need(self.d_model % self.n_heads == 0,
                 f"config field 'd_model' ({self.d_model}) must be divisible by 'n_heads' ({self.n_heads})")
        else:
            need(isinstance(self.head_dim_override, int) and self.head_dim_override >= 1,
                 f"config field 'head_dim_override' must be a positive integer, got {self.head_dim_override!r}")
        if self.sliding_window is not None:
            need(isinstance(self.sliding_window, int) and self.sliding_window >= 1,
                 f"config field 'sliding_window' must be a positive integer or null, got {self.sliding_window!r}")
            need(self.family == "decoder", "config field 'sliding_window' is for the decoder family")
        if self.sliding_window_layers is not None:
            need(self.sliding_window is not None, "config field 'sliding_window_layers' needs 'sliding_window'")
            need(isinstance(self.sliding_window_layers, list)
                 and all(isinstance(i, int) and 0 <= i < self.n_decoder_layers for i in self.sliding_window_layers),
                 f"config field 'sliding_window_layers' must list layer indices in [0, {self.n_decoder_layers}), "
                 f"got {self.sliding_window_layers!r}")
        if self.local_rope_theta is not None:
            need(self.positional == "rope" and self.local_rope_theta > 0,
                 "config field 'local_rope_theta' needs rotary positions and must be > 0")
        if self.qk_norm:
            need(self.norm == "rmsnorm", "config field 'qk_norm' needs norm 'rmsnorm'")
        if self.post_sublayer_norm:
            need(self.norm_placement == "pre", "config field 'post_sublayer_norm' needs norm_placement 'pre'")
        if self.positional == "sinusoidal":
            need(self.d_model % 2 == 0, "sinusoidal positions need an even 'd_model'")
        if self.n_kv_heads is not None:
            need(isinstance(self.n_kv_heads, int) and self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
                 f"config field 'n_kv_heads' ({self.n_kv_heads}) must be a positive divisor of 'n_heads' "
                 f"({self.n_heads})")
        if self.positional == "rope":
            need(self.head_dim % 2 == 0, "rotary positions need an even head dimension")
            need(self.rope_theta > 0, "config field 'rope_theta' must be > 0")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type") if isinstance(self.rope_scaling, dict) else None
            need(kind in ROPE_SCALINGS,
                 f"config field 'rope_scaling' needs a 'type' in {list(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
            if kind == "longrope":
                factors = self.rope_scaling.get("factors")
                need(isinstance(factors, list) and len(factors) == self.head_dim // 2
                     and all(isinstance(f, (int, float)) and f > 0 for f in factors),
                     f"config field 'rope_scaling.factors' (longrope) must list {self.head_dim // 2} positive numbers")
                need(float(self.rope_scaling.get("attention_factor", 0)) > 0,
                     "config field 'rope_scaling.attention_factor' must be > 0")
            else:
                need(float(self.rope_scaling.get("factor", 0)) > 0, "config field 'rope_scaling.factor' must be > 0")
        if self.has_encoder:
            need(self.n_encoder_layers >= 1, "config field 'n_encoder_layers' must be >= 1")
        if self.has_decoder:
            need(self.n_decoder_layers >= 1, "config field 'n_decoder_layers' must be >= 1")
        if self.max_input_tokens is not None:
            need(isinstance(self.max_input_tokens, int) and 1 <= self.max_input_tokens <= self.max_positions,
                 f"config field 'max_input_tokens' ({self.max_input_tokens}) must be in [1, max_positions]")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            need(0.0 <= getattr(self, name) < 1.0, f"config field '{name}' must be in [0, 1)")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "mask_token_id"):
            value = getattr(self, name)
            need(value is None or 0 <= value < self.vocab_size,
                 f"config field '{name}' is {value}; must be in [0, vocab_size={self.vocab_size})")
        if self.family == "encoder-decoder":
            need(self.decoder_start_token_id is not None,
                 "config field 'decoder_start_token_id' is required for the encoder-decoder family")
        for name in ("source_language", "target_language"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, str) and LANGUAGE_CODE.fullmatch(value) is not None),
                 f"config field '{name}' is {value!r}; expected an ISO 639 language code such as 'en' or 'deu'")
        if self.source_language is not None or self.target_language is not None:
            need(self.family == "encoder-decoder", "config fields 'source_language'/'target_language' are for the "
                 "encoder-decoder (translation) family")
            need(self.source_language is not None and self.target_language is not None,
                 "config fields 'source_language' and 'target_language' go together: set both or neither")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known fields: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:  # a missing required field
            raise ConfigError(str(exc)) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
