"""Gemma3ForCausalLM (Gemma 3 text: 270M, 1B) -> DecoderLM.

What differs from a Llama, each as ModelConfig data:
- GeGLU feed-forward with tanh-approximated GELU (``activation="gelu_new"``, ``mlp="gated"``);
- four RMSNorms per block (``post_sublayer_norm``: a norm on each sublayer's output before the
  residual add); every RMSNorm scales by ``1 + w``: the 1 is added to the weights here;
- token embeddings times sqrt(hidden_size) (``scale_embedding``);
- RMSNorm over each head of q and k before the rotary positions (``qk_norm``), ``head_dim``
  apart from hidden / heads (``head_dim_override``), scores scaled by
  ``query_pre_attn_scalar ** -0.5`` (``attention_scale``);
- sliding-window layers (``sliding_window``, ``sliding_window_layers`` from ``layer_types``)
  with their own rotary base (``local_rope_theta``) between global layers.

Refused by name: attention or final logit soft-capping (Gemma 2 has them; Gemma 3 sets neither),
bidirectional attention, a scaled rotary table on the local layers.
"""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import HFConfig, HFWeights, Importer, TensorMap, fast_tokenizer
from model.formats.hf.llama import decoder_tensors, hf_decoder_config, rope, sliding_window
from model.formats.hf.qwen3 import head_dim_override
from model.tokenization.tokenizer import Tokenizer

GEMMA_NORMS = {
    "input_layernorm": "self_attn_norm",
    "post_attention_layernorm": "self_attn_post_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "ffn_post_norm",
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults for Gemma 3


def gemma3_rope(hf: HFConfig) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta) from transformers 5's per-layer-type
    ``rope_parameters`` or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        theta, scaling = rope(hf, params.get("full_attention") or {}, "rope_parameters.full_attention", GLOBAL_THETA)
        local = params.get("sliding_attention") or {}
        local_theta, local_scaling = rope(hf, local, "rope_parameters.sliding_attention", LOCAL_THETA)
        if local_scaling is not None:
            raise hf.unsupported("rope_parameters.sliding_attention.rope_type", local.get("rope_type"), "'default'")
        return theta, scaling, local_theta
    theta, scaling = rope(hf, params or hf.get("rope_scaling") or {}, "rope_scaling", GLOBAL_THETA)
    return theta, scaling, float(hf.get("rope_local_base_freq", LOCAL_THETA))


def gemma3_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        hf.expect(key, None)  # any value is refused by name: we do not soft-cap
    hf.expect("use_bidirectional_attention", False)
    hf.expect("attention_bias", False)
    n_layers = hf.require("num_hidden_layers")
    theta, scaling, local_theta = gemma3_rope(hf)
    max_positions = hf.require("max_position_embeddings")
    pattern = hf.get("sliding_window_pattern", 6)
    window = sliding_window(hf, hf.get("sliding_window", 4096), max_positions,
                            [i for i in range(n_layers) if (i + 1) % pattern], drop_if_longer=False)
    return hf_decoder_config(
        hf, directory, rope_theta=theta, rope_scaling=scaling, max_positions=max_positions, tied=True,
        activation_key="hidden_activation",
        head_dim_override=head_dim_override(hf), qk_norm=True, post_sublayer_norm=True, scale_embedding=True,
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=local_theta if window else None, **window,
    )


def gemma3_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    return decoder_tensors(weights, cfg, norms=GEMMA_NORMS, norm_offset=1.0)


GEMMA3 = Importer(
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    tokenizer=fast_tokenizer,
    config=gemma3_config,
    tensors=gemma3_tensors,
    ignored=(r"lm_head\.weight",),
)
