"""BertForMaskedLM -> MaskedLM, and BertModel (no head: sentence embeddings) -> MaskedLM(mlm_head=False).

BERT is a post-norm encoder: word + position + token-type embeddings summed and
LayerNorm-ed, separate query/key/value projections (stacked into our fused one here), and
an MLM head that transforms the hidden state (dense -> activation -> LayerNorm) before the
tied decoder with its own bias.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from model.config import ModelConfig
from model.formats.hf.format import (
    HFConfig,
    HFImportError,
    HFWeights,
    Importer,
    TensorMap,
    activation,
    fast_tokenizer,
    special_token,
)
from model.tokenization.tokenizer import Tokenizer


def bert_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    # Relative position embeddings (older configs) and decoder use are not BERT-as-MLM.
    hf.expect("position_embedding_type", "absolute")
    hf.expect("is_decoder", False)
    hf.expect("add_cross_attention", False)
    d_model = hf.require("hidden_size")
    if hf.get("embedding_size", d_model) != d_model:  # ALBERT-style factorised embeddings
        raise hf.unsupported("embedding_size", hf.get("embedding_size"), f"equal to hidden_size ({d_model})")
    mask_text = special_token(directory, "mask_token") or "[MASK]"
    mask_id = tokenizer.token_to_id(mask_text)
    if mask_id is None and hf.architecture == "BertForMaskedLM":
        raise HFImportError(f"{directory / 'tokenizer.json'}: no mask token {mask_text!r} (fill-mask needs one)")
    return ModelConfig(
        family="encoder",
        vocab_size=hf.require("vocab_size"),
        d_model=d_model,
        n_heads=hf.require("num_attention_heads"),
        n_encoder_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"),
        activation=activation(hf, "hidden_act"),
        dropout=float(hf.get("hidden_dropout_prob", 0.0)),
        attention_dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
        max_positions=hf.require("max_position_embeddings"),
        positional="learned",
        norm_placement="post",
        embedding_norm=True,
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        fused_qkv=True,  # query/key/value stacked into one projection at import
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        type_vocab_size=hf.require("type_vocab_size"),
        lm_head_bias=True,
        mlm_transform=True,
        pad_token_id=hf.token_id("pad_token_id") or 0,
        mask_token_id=mask_id,
    )


def bert_model_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    """BertModel: the encoder alone (what sentence-transformers wraps), no masked-LM head."""
    cfg = bert_config(hf, tokenizer, directory)
    return dataclasses.replace(cfg, mlm_head=False, mlm_transform=False, lm_head_bias=False)


def bert_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    p = weights.prefix("embeddings.word_embeddings.weight", ("bert.", ""))
    out = TensorMap()
    for ours, theirs in (("tokens", "word"), ("positions", "position"), ("token_types", "token_type")):
        name = f"{p}embeddings.{theirs}_embeddings.weight"
        out.put(f"embed.{ours}.weight", weights.take(name), name)
    out.layer_norm("embed.norm", weights, f"{p}embeddings.LayerNorm")
    for i in range(cfg.n_encoder_layers):
        ours, theirs = f"encoder_layers.{i}", f"{p}encoder.layer.{i}"
        attn = f"{theirs}.attention.self"
        out.fused_linear(f"{ours}.self_attn.qkv_proj", weights, f"{attn}.query", f"{attn}.key", f"{attn}.value")
        out.linear(f"{ours}.self_attn.out_proj", weights, f"{theirs}.attention.output.dense")
        out.layer_norm(f"{ours}.self_attn_norm", weights, f"{theirs}.attention.output.LayerNorm")
        out.linear(f"{ours}.ffn.up", weights, f"{theirs}.intermediate.dense")
        out.linear(f"{ours}.ffn.down", weights, f"{theirs}.output.dense")
        out.layer_norm(f"{ours}.ffn_norm", weights, f"{theirs}.output.LayerNorm")
    if not cfg.mlm_head:
        return out
    out.linear("lm_head.dense", weights, "cls.predictions.transform.dense")
    out.layer_norm("lm_head.norm", weights, "cls.predictions.transform.LayerNorm")
    # The decoder bias is tied to cls.predictions.bias; newer files store only the latter.
    bias, name = weights.take_first("cls.predictions.bias", "cls.predictions.decoder.bias")
    out.put("lm_head.proj.bias", bias, name)
    if not cfg.tie_word_embeddings:
        out.put("lm_head.proj.weight", weights.take("cls.predictions.decoder.weight"), "cls.predictions.decoder.weight")
    return out


BERT = Importer(
    architecture="BertForMaskedLM",
    model_type="bert",
    tokenizer=fast_tokenizer,
    config=bert_config,
    tensors=bert_tensors,
    # The pooler and next-sentence head of pre-training checkpoints; position-id buffers; tied copies.
    ignored=(r"(bert\.)?pooler\..*", r"cls\.seq_relationship\..*", r"(bert\.)?embeddings\.position_ids",
             r"cls\.predictions\.decoder\.(weight|bias)"),
)

BERT_MODEL = Importer(
    architecture="BertModel",
    model_type="bert",
    tokenizer=fast_tokenizer,
    config=bert_model_config,
    tensors=bert_tensors,
    # The pooler (dense + tanh on [CLS]): sentence-transformers does not use it.
    ignored=(r"(bert\.)?pooler\..*", r"(bert\.)?embeddings\.position_ids"),
)
