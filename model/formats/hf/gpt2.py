"""GPT2LMHeadModel -> DecoderLM.

GPT-2 is a pre-norm decoder with learned positions, a final LayerNorm and a tied LM
head. Its projections are ``Conv1D`` modules that store weights as (in, out), the
transpose of ``nn.Linear``; the attention input projection ``c_attn`` is already fused
(q | k | v along the output dimension), which is exactly our ``qkv_proj``.
"""

from __future__ import annotations

from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import HFConfig, HFWeights, Importer, TensorMap, activation, fast_tokenizer
from model.tokenization.tokenizer import Tokenizer


def gpt2_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    # A per-layer attention scale and cross-attention blocks have no counterpart in our layers.
    hf.expect("scale_attn_by_inverse_layer_idx", False)
    hf.expect("add_cross_attention", False)
    # reorder_and_upcast_attn only changes the precision of the attention scores (fp32), not the maths.
    d_model = hf.require("n_embd")
    eos = hf.token_id("eos_token_id")
    pad = hf.token_id("pad_token_id")
    return ModelConfig(
        family="decoder",
        vocab_size=hf.require("vocab_size"),
        d_model=d_model,
        n_heads=hf.require("n_head"),
        n_decoder_layers=hf.require("n_layer"),
        d_ff=hf.get("n_inner", 4 * d_model),
        activation=activation(hf, "activation_function"),
        dropout=float(hf.get("resid_pdrop", 0.0)),
        attention_dropout=float(hf.get("attn_pdrop", 0.0)),
        max_positions=hf.require("n_positions"),
        positional="learned",
        norm_placement="pre",
        final_norm=True,
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        fused_qkv=True,
        attention_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        # GPT-2 has no pad token; padded positions are masked, so any valid id will do.
        pad_token_id=pad if pad is not None else (eos if eos is not None else 0),
        bos_token_id=hf.token_id("bos_token_id"),
        eos_token_id=eos,
    )


def gpt2_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    p = weights.prefix("wte.weight", ("transformer.", ""))  # GPT2Model-saved files have no prefix
    out = TensorMap()
    out.put("embed.tokens.weight", weights.take(f"{p}wte.weight"), f"{p}wte.weight")
    out.put("embed.positions.weight", weights.take(f"{p}wpe.weight"), f"{p}wpe.weight")
    for i in range(cfg.n_decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"{p}h.{i}"
        out.layer_norm(f"{ours}.self_attn_norm", weights, f"{theirs}.ln_1")
        out.linear(f"{ours}.self_attn.qkv_proj", weights, f"{theirs}.attn.c_attn", transpose=True)
        out.linear(f"{ours}.self_attn.out_proj", weights, f"{theirs}.attn.c_proj", transpose=True)
        out.layer_norm(f"{ours}.ffn_norm", weights, f"{theirs}.ln_2")
        out.linear(f"{ours}.ffn.up", weights, f"{theirs}.mlp.c_fc", transpose=True)
        out.linear(f"{ours}.ffn.down", weights, f"{theirs}.mlp.c_proj", transpose=True)
    out.layer_norm("decoder_norm", weights, f"{p}ln_f")
    if not cfg.tie_word_embeddings:
        out.put("lm_head.proj.weight", weights.take("lm_head.weight"), "lm_head.weight")
    return out


GPT2 = Importer(
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    tokenizer=fast_tokenizer,
    config=gpt2_config,
    tensors=gpt2_tensors,
    # Causal-mask buffers of old checkpoints, and a copy of the tied head.
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", r"lm_head\.weight"),
)
