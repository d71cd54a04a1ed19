"""MarianMTModel -> EncoderDecoder, and Marian's SentencePiece tokenizer -> tokenizer.json.

Marian is the 2017 post-norm encoder-decoder with one embedding matrix shared by encoder,
decoder and output projection, token embeddings scaled by sqrt(d_model), sinusoidal
positions with all sines before all cosines (our ``split`` layout), swish FFNs, an output
bias ``final_logits_bias``, and the pad token as the decoder's start token.

Its tokenizer encodes with ``source.spm`` and numbers pieces by ``vocab.json``; we rebuild
that as a ``tokenizers`` Unigram model (model.tokenization.spm), appending ``</s>`` as
MarianTokenizer does, so serving needs neither sentencepiece nor transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.config import LANGUAGE_CODE, ModelConfig
from model.formats.hf.format import HFConfig, HFImportError, HFWeights, Importer, TensorMap, activation, read_json
from model.nn.layers import sinusoidal_table
from model.tokenization.spm import SentencePieceError, read_sentencepiece, unigram_tokenizer
from model.tokenization.tokenizer import Tokenizer


def _token_text(value: object, default: str) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else default


def marian_tokenizer(directory: Path) -> Tokenizer:
    settings_path = directory / "tokenizer_config.json"
    settings = read_json(settings_path) if settings_path.is_file() else {}
    if settings.get("separate_vocabs") or (directory / "target_vocab.json").exists():
        raise HFImportError(f"{settings_path}: Marian tokenizers with separate source/target vocabularies "
                            "are not supported (our encoder-decoder shares one vocabulary)")
    vocab = read_json(directory / "vocab.json")
    if not all(isinstance(i, int) for i in vocab.values()):
        raise HFImportError(f"{directory / 'vocab.json'}: expected an object mapping pieces to integer ids")
    unk = _token_text(settings.get("unk_token"), "<unk>")
    eos = _token_text(settings.get("eos_token"), "</s>")
    pad = _token_text(settings.get("pad_token"), "<pad>")
    extra = settings.get("additional_special_tokens") or settings.get("extra_special_tokens") or []
    extra = [_token_text(t, "") for t in extra] if isinstance(extra, list) else []
    # Target-language codes (">>de<<") of multilingual models: MarianTokenizer keeps one at the
    # start of the text as a single token; as special tokens they are recognised anywhere.
    codes = [t for t in vocab if t.startswith(">>") and t.endswith("<<")]
    spm_path = directory / "source.spm"
    try:
        spm = read_sentencepiece(spm_path.read_bytes())
        return unigram_tokenizer(spm, vocab, unk, [eos, pad, *[t for t in extra if t], *codes], append_token=eos)
    except FileNotFoundError:
        raise HFImportError(f"{spm_path}: file not found (Marian's source SentencePiece model)") from None
    except SentencePieceError as exc:
        raise HFImportError(f"{spm_path} + vocab.json: {exc}") from None


def marian_languages(directory: Path) -> tuple[str | None, str | None]:
    """(source, target) language codes where the HF directory says them: ``source_lang`` and
    ``target_lang`` of tokenizer_config.json (what transformers' Marian conversion writes, e.g.
    ``en``/``de`` for opus-mt-en-de); (None, None) when absent or when either is not an ISO 639
    code (``ROMANCE`` of opus-mt-en-ROMANCE)."""
    path = directory / "tokenizer_config.json"
    settings = read_json(path) if path.is_file() else {}
    pair = [settings.get("source_lang"), settings.get("target_lang")]
    codes = [p.lower() for p in pair if isinstance(p, str) and LANGUAGE_CODE.fullmatch(p.lower())]
    return (codes[0], codes[1]) if len(codes) == 2 else (None, None)


def marian_config(hf: HFConfig, tokenizer: Tokenizer, directory: Path) -> ModelConfig:
    hf.expect("share_encoder_decoder_embeddings", True)
    vocab_size = hf.require("vocab_size")
    hf.expect("decoder_vocab_size", vocab_size)
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.require(enc) != hf.require(dec):
            raise hf.unsupported(dec, hf.get(dec), f"equal to {enc} ({hf.get(enc)}); our stacks share these sizes")
    pad = hf.token_id("pad_token_id")
    for key, text in (("pad_token_id", "<pad>"), ("eos_token_id", "</s>")):
        value, in_vocab = hf.token_id(key), tokenizer.token_to_id(text)
        if value is not None and in_vocab is not None and value != in_vocab:
            raise HFImportError(f"{hf.path}: {key} is {value} but vocab.json maps {text!r} to {in_vocab}")
    start = hf.token_id("decoder_start_token_id")
    source_language, target_language = marian_languages(directory)
    return ModelConfig(
        family="encoder-decoder",
        vocab_size=vocab_size,
        d_model=hf.require("d_model"),
        n_heads=hf.require("encoder_attention_heads"),
        n_encoder_layers=hf.require("encoder_layers"),
        n_decoder_layers=hf.require("decoder_layers"),
        d_ff=hf.require("encoder_ffn_dim"),
        activation=activation(hf, "activation_function"),
        dropout=float(hf.get("dropout", 0.0)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        activation_dropout=float(hf.get("activation_dropout", 0.0)),
        max_positions=hf.require("max_position_embeddings"),
        positional="sinusoidal",
        sinusoidal_layout="split",
        norm_placement="post",
        layer_norm_eps=1e-5,  # Marian's LayerNorms use the PyTorch default
        fused_qkv=True,  # q/k/v stacked at import (see _attention)
        scale_embedding=bool(hf.get("scale_embedding", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        lm_head_bias=True,
        pad_token_id=pad if pad is not None else 0,
        bos_token_id=hf.token_id("bos_token_id"),
        eos_token_id=hf.token_id("eos_token_id"),
        decoder_start_token_id=start if start is not None else pad,
        source_language=source_language,
        target_language=target_language,
    )


def _check_positions(weights: HFWeights, cfg: ModelConfig) -> None:
    """Stored sinusoid tables (older files keep them) must be the layout we compute."""
    expected = sinusoidal_table(cfg.max_positions, cfg.d_model, cfg.sinusoidal_layout)
    for stack in ("encoder", "decoder"):
        name = f"model.{stack}.embed_positions.weight"
        if weights.has(name):
            table = weights.take(name)
            stored, tol = table.float(), 4 * torch.finfo(table.dtype).eps
            if stored.shape != expected.shape or not torch.allclose(stored, expected, atol=tol):
                raise HFImportError(f"{weights.directory}: tensor '{name}' is not the sinusoid table Marian "
                                    "computes (sin in the first half, cos in the second); unsupported positions")


def _attention(out: TensorMap, weights: HFWeights, ours: str, theirs: str, cross: bool = False) -> None:
    # Our fused layout: one q|k|v projection for self-attention; q apart and k|v together for
    # cross-attention, whose k/v come from the encoder memory once per request.
    if cross:
        out.linear(f"{ours}.q_proj", weights, f"{theirs}.q_proj")
        out.fused_linear(f"{ours}.kv_proj", weights, f"{theirs}.k_proj", f"{theirs}.v_proj")
    else:
        out.fused_linear(f"{ours}.qkv_proj", weights, f"{theirs}.q_proj", f"{theirs}.k_proj", f"{theirs}.v_proj")
    out.linear(f"{ours}.out_proj", weights, f"{theirs}.out_proj")


def marian_tensors(weights: HFWeights, cfg: ModelConfig) -> TensorMap:
    out = TensorMap()
    shared, name = weights.take_first("model.shared.weight", "model.encoder.embed_tokens.weight",
                                      "model.decoder.embed_tokens.weight")
    out.put("embed.tokens.weight", shared, name)
    _check_positions(weights, cfg)
    for stack, n_layers in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n_layers):
            ours, theirs = f"{stack}_layers.{i}", f"model.{stack}.layers.{i}"
            _attention(out, weights, f"{ours}.self_attn", f"{theirs}.self_attn")
            out.layer_norm(f"{ours}.self_attn_norm", weights, f"{theirs}.self_attn_layer_norm")
            if stack == "decoder":
                _attention(out, weights, f"{ours}.cross_attn", f"{theirs}.encoder_attn", cross=True)
                out.layer_norm(f"{ours}.cross_attn_norm", weights, f"{theirs}.encoder_attn_layer_norm")
            out.linear(f"{ours}.ffn.up", weights, f"{theirs}.fc1")
            out.linear(f"{ours}.ffn.down", weights, f"{theirs}.fc2")
            out.layer_norm(f"{ours}.ffn_norm", weights, f"{theirs}.final_layer_norm")
    if weights.has("final_logits_bias"):  # (1, V); transformers too starts from zeros when it is absent
        out.put("lm_head.proj.bias", weights.take("final_logits_bias").reshape(-1), "final_logits_bias")
    else:
        out.put("lm_head.proj.bias", torch.zeros(cfg.vocab_size, dtype=shared.dtype), "final_logits_bias (zeros)")
    if not cfg.tie_word_embeddings:
        out.put("lm_head.proj.weight", weights.take("lm_head.weight"), "lm_head.weight")
    return out


MARIAN = Importer(
    architecture="MarianMTModel",
    model_type="marian",
    tokenizer=marian_tokenizer,
    config=marian_config,
    tensors=marian_tensors,
    # Tied copies of the shared embedding and of the output projection.
    ignored=(r"model\.(encoder|decoder)\.embed_tokens\.weight", r"lm_head\.weight"),
)
