"""Which models each fast decode path can run, decided in one place.

Every field of ``ModelConfig`` is classified here for every fast path (the native C++ step,
the Triton decode-attention kernel); ``tests/model/decode/test_support.py`` fails when a field
is added to the config without a line below. So a new architecture's feature (q/k norms,
biases, sliding windows, soft-capping) cannot flow silently into a fast path that ignores it:
whoever adds the field says here whether each path reads it, ignores it, or needs one value.

A rule is one of:
- ``READ``: the path takes the value from the model (a shape, an epsilon, a table built from it);
- ``IGNORED``: the value cannot change what a decode step computes (training-only, encoder-only,
  token ids, metadata);
- a tuple of the values the path implements; any other value makes ``unsupported_reason``
  name the field.

The checks and the construction of a step read the same function, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from model.config import ModelConfig

READ = "read"
IGNORED = "ignored"
Rule = Any  # READ, IGNORED, or a tuple of the values implemented

FAST_PATHS = ("native", "triton", "native_encdec")


@dataclass(frozen=True)
class FieldRule:
    native: Rule  # model/decode/native.py + csrc/llama_step.cpp: the whole decode step in C++
    triton: Rule = READ  # model/decode/triton_attention.py: attention over q, k, v the layer computed
    # model/decode/native.py NativeEncDecStep + csrc EncDecDecoder: an encoder-decoder's decoder step
    native_encdec: Rule = None  # every entry sets it (a test checks)


# The Triton kernel replaces only the attention core of a decode step (softmax(q k^T * scale) v
# over each row's own positions); everything around it stays the layer's own Python code, so it
# reads most fields through the layer. A field that changes *which positions* a row attends to or
# how scores are formed (a window, soft-capping, alibi) must say so in its triton rule.
FIELDS: dict[str, FieldRule] = {
    "family": FieldRule(native=("decoder",), triton=("decoder", "encoder-decoder"),
                        native_encdec=("encoder-decoder",)),
    "vocab_size": FieldRule(native=READ, native_encdec=READ),
    "d_model": FieldRule(native=READ, native_encdec=READ),
    "n_heads": FieldRule(native=READ, native_encdec=READ),
    # the encoder-decoder step: the cross-attention memory keeps every head (no grouped K/V)
    "n_kv_heads": FieldRule(native=READ, native_encdec=(None,)),
    "n_encoder_layers": FieldRule(native=IGNORED, native_encdec=IGNORED),  # the decoder family has none
    "n_decoder_layers": FieldRule(native=READ, native_encdec=READ),
    "d_ff": FieldRule(native=READ, native_encdec=READ),
    # the C++ gate: SiLU or tanh GELU; the encoder-decoder step calls torch's activations
    "activation": FieldRule(native=("silu", "swish", "gelu_new"),
                            native_encdec=("relu", "gelu", "gelu_new", "silu", "swish")),
    "dropout": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),  # training only
    "attention_dropout": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "activation_dropout": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "max_positions": FieldRule(native=READ, native_encdec=READ),  # the length of the rotary table it is given
    "positional": FieldRule(native=("rope",), native_encdec=("sinusoidal", "learned")),
    "rope_theta": FieldRule(native=READ, native_encdec=IGNORED),  # through the rotary table the model built
    # likewise (LongRoPE's attention factor is in the table too)
    "rope_scaling": FieldRule(native=READ, native_encdec=IGNORED),
    "sinusoidal_layout": FieldRule(native=IGNORED, native_encdec=READ),  # only for sinusoidal positions, refused above
    "norm": FieldRule(native=("rmsnorm",), native_encdec=("layernorm",)),
    "mlp": FieldRule(native=("gated",), native_encdec=("standard",)),
    "norm_placement": FieldRule(native=("pre",), native_encdec=READ),
    "final_norm": FieldRule(native=(True,), native_encdec=READ),
    "embedding_norm": FieldRule(native=(False,), native_encdec=READ),
    "layer_norm_eps": FieldRule(native=READ, native_encdec=READ),
    "bias": FieldRule(native=(False,), native_encdec=READ),  # the int8 projections carry no bias in the C++ step
    "fused_qkv": FieldRule(native=(True,), native_encdec=READ),  # it reads one qkv projection per layer
    "attention_scale": FieldRule(native=READ, native_encdec=READ),
    "scale_embedding": FieldRule(native=READ, native_encdec=READ),  # the embedding scale it is given
    "tie_word_embeddings": FieldRule(native=READ, native_encdec=READ),  # the head is read from lm_head either way
    # The lineages after Llama (Qwen2, Qwen3, Gemma 3, Phi-3, Mistral), as data the C++ step reads.
    # its widths are n_heads * head_dim, d from the embeddings
    "head_dim_override": FieldRule(native=READ, native_encdec=READ),
    # the bias rides in the qkv projection (float or fbgemm int8)
    "qkv_bias": FieldRule(native=READ, native_encdec=READ),
    "qk_norm": FieldRule(native=READ, native_encdec=(False,)),  # per-layer q/k norm weights
    "post_sublayer_norm": FieldRule(native=READ, native_encdec=(False,)),  # per-layer post-norm weights
    # A window changes which positions a row attends to: the C++ step and the Triton kernel start
    # each row's attention at position - window + 1 in the layers that have one.
    "sliding_window": FieldRule(native=READ, triton=READ, native_encdec=(None,)),
    "sliding_window_layers": FieldRule(native=READ, triton=READ, native_encdec=IGNORED),
    "local_rope_theta": FieldRule(native=READ, native_encdec=IGNORED),  # the second rotary table the model built
    "type_vocab_size": FieldRule(native=(0,), native_encdec=(0,)),
    "lm_head_bias": FieldRule(native=(False,), native_encdec=READ),
    "mlm_transform": FieldRule(native=(False,), native_encdec=(False,)),
    "pooling": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),  # encoder family only
    "normalize_embeddings": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "max_input_tokens": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "mlm_head": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "mask_placeholders": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),  # how callers prepare text
    # metadata: which engine serves a pair
    "source_language": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "target_language": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "pad_token_id": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "bos_token_id": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "eos_token_id": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "decoder_start_token_id": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
    "mask_token_id": FieldRule(native=IGNORED, triton=IGNORED, native_encdec=IGNORED),
}


def config_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]


def unclassified_fields() -> list[str]:
    """Config fields with no rule here (a test keeps this empty)."""
    return [name for name in config_fields() if name not in FIELDS]


def unsupported_reason(cfg: ModelConfig, path: str) -> str | None:
    """Why ``path`` (one of FAST_PATHS) cannot run a model of ``cfg``; None where it can."""
    if path not in FAST_PATHS:
        raise ValueError(f"unknown fast path {path!r}; one of {FAST_PATHS}")
    missing = unclassified_fields()
    if missing:  # never guess about a field nobody classified
        return f"config field(s) {missing} are not classified for the fast paths (model/decode/support.py)"
    for name, rule in FIELDS.items():
        allowed = getattr(rule, path)
        if isinstance(allowed, tuple):
            value = getattr(cfg, name)
            if value not in allowed:
                return f"config field '{name}' is {value!r}; the {path} step implements {list(allowed)}"
    return None
