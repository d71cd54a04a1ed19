"""Tiny randomly initialised Hugging Face models saved in the HF layout, for parity tests.

Each is built offline from a config with transformers (a test-only dependency) and saved
with ``save_pretrained`` next to a tokenizer trained here on a few sentences and saved the
way transformers saves it: tokenizer.json for GPT-2 and BERT, SentencePiece models +
vocab.json for Marian.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sentencepiece
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from model.formats.hf.importer import HFModel, load_hf
from model.tokenization.tokenizer import train_wordpiece

transformers.logging.set_verbosity_error()

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today?",
    "I like green apples and red cherries.",
    "Where is the train station, please?",
    "We will meet again next week in Berlin or in Zürich.",
    "She reads a long book about the history of science.",
    "My brother works at the hospital near the river.",
    "It is raining, so we stay at home and play cards.",
    "The café in Köln serves a naïve but lovely crème brûlée.",
    "Numbers like 42, 1999 and 3.14 appear in the text.",
]
GERMAN = [
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Hallo Welt, wie geht es dir heute?",
    "Ich mag grüne Äpfel und rote Kirschen.",
    "Wo ist bitte der Bahnhof?",
    "Wir treffen uns nächste Woche wieder in Berlin oder in Zürich.",
    "Sie liest ein langes Buch über die Geschichte der Wissenschaft.",
    "Mein Bruder arbeitet im Krankenhaus am Fluss.",
    "Es regnet, also bleiben wir zu Hause und spielen Karten.",
    "Viele Grüße aus der großen Straße in Köln.",
    "Zahlen wie 42, 1999 und 3,14 stehen im Text.",
]
# Tokenizer equivalence inputs: accents, a letter only the target side knows (ß), unknown
# scripts and emoji, odd whitespace, literal special tokens, the empty string.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln!",
    "naïve café — 東京 🙂",
    "  multiple   spaces and\ttabs\nnewlines  ",
    "Straße und Größe",
    "",
    "Hello </s> world",
]


def perturb(model: torch.nn.Module, scale: float = 0.1) -> None:
    """Add noise to every trainable tensor: LayerNorms and biases start at 1/0 after init, and a
    mapping that swapped two of them would otherwise go unnoticed."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


def save_gpt2(directory: Path, seed: int = 0) -> tuple[transformers.GPT2LMHeadModel, object]:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.train_from_iterator(ENGLISH + GERMAN, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    eos = tk.token_to_id("<|endoftext|>")
    tokenizer = transformers.GPT2TokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>",
                                               eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=tk.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=eos, eos_token_id=eos, initializer_range=0.1)
    model = transformers.GPT2LMHeadModel(config).eval()
    perturb(model)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def save_bert(directory: Path, seed: int = 0) -> tuple[transformers.BertForMaskedLM, object]:
    wordpiece = train_wordpiece(ENGLISH + GERMAN, vocab_size=300, min_frequency=1)
    vocab = sorted(wordpiece.tk.get_vocab().items(), key=lambda item: item[1])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(token for token, _ in vocab) + "\n", encoding="utf-8")
    tokenizer = transformers.BertTokenizer(vocab=str(directory / "vocab.txt"))
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                     pad_token_id=tokenizer.pad_token_id)
    model = transformers.BertForMaskedLM(config).eval()
    perturb(model)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def save_sentence_transformer(directory: Path, pooling: str = "mean", normalize: bool = True,
                              max_seq_length: int = 16, seed: int = 0) -> Path:
    """A tiny random BertModel saved as sentence-transformers saves a model."""
    save_bert(directory, seed)  # vocabulary + tokenizer files
    for f in ("model.safetensors", "config.json"):
        (directory / f).unlink()
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=len((directory / "vocab.txt").read_text().splitlines()),
                                     hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    perturb(model)
    model.save_pretrained(directory)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                      "do_lower_case": False}))
    (directory / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m.startswith(pooling) for m in ("cls_token", "mean_tokens", "max_tokens")}
    flags["pooling_mode_mean_sqrt_len_tokens"] = False
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))
    return directory


def _train_spm(lines: list[str], vocab_size: int) -> bytes:
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 4), model_writer=out, vocab_size=vocab_size, model_type="unigram",
        hard_vocab_limit=False, character_coverage=1.0, minloglevel=2,
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, unk_piece="<unk>", eos_piece="</s>",
    )
    return out.getvalue()


def save_marian(directory: Path, seed: int = 0) -> tuple[transformers.MarianMTModel, object]:
    """Separate en/de SentencePiece models and one shared vocab.json laid out as Marian's:
    </s> = 0, <unk> = 1, a language code, the pieces of both models, <pad> last."""
    directory.mkdir(parents=True, exist_ok=True)
    models_ = {"source": _train_spm(ENGLISH, 160), "target": _train_spm(GERMAN, 160)}
    vocab = {"</s>": 0, "<unk>": 1, ">>de<<": 2}
    for name, proto in models_.items():
        (directory / f"{name}.spm").write_bytes(proto)
        sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        for i in range(sp.get_piece_size()):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(source_spm=str(directory / "source.spm"),
                                             target_spm=str(directory / "target.spm"),
                                             vocab=str(directory / "vocab.json"))
    pad = vocab["<pad>"]
    torch.manual_seed(seed)
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        activation_function="swish", scale_embedding=True, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=None, init_std=0.1,
    )
    model = transformers.MarianMTModel(config).eval()
    perturb(model)
    with torch.no_grad():
        model.final_logits_bias.normal_(std=0.1)
    model.generation_config.bad_words_ids = [[pad]]  # as in the published opus-mt models
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


@dataclass
class Imported:
    """One tiny HF model: where it was saved, the transformers side, and our import of it."""

    directory: Path
    reference: torch.nn.Module  # the transformers model
    reference_tokenizer: Any  # the transformers tokenizer, loaded back from the directory
    ours: HFModel


def build_and_import(directory: Path, build: Callable[[Path], tuple[torch.nn.Module, Any]]) -> Imported:
    reference, _ = build(directory)
    return Imported(directory, reference, transformers.AutoTokenizer.from_pretrained(directory), load_hf(directory))
