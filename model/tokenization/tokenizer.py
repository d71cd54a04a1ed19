"""Tokenizers (Hugging Face ``tokenizers``): training, loading, incremental detokenization.

- byte-level BPE for the decoder and the encoder-decoder (one shared en/de vocabulary),
  special tokens ``<pad> <s> </s> <unk>`` at ids 0-3;
- WordPiece for the encoder, special tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` at ids 0-4.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

BPE_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with the ids the model needs."""

    def __init__(self, tk: HFTokenizer):
        self.tk = tk

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self.tk.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tk.id_to_token(token_id)

    @property
    def special_ids(self) -> set[int]:
        return {i for i, tok in self.tk.get_added_tokens_decoder().items() if tok.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, context: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, context)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a character.

    A byte-level token can end in the middle of a multi-byte UTF-8 character; decoding
    then ends in U+FFFD. Such text is held back until the following tokens complete it.
    Decoding restarts from a few tokens back (``prefix_offset``) so decoders that depend
    on context (WordPiece's ``##``, leading spaces) give the same text as a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context)[-6:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix_offset: self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            delta = after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of a sequence)."""
        before = self._decode(self.ids[self.prefix_offset: self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


# --- training -------------------------------------------------------------------------

def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              template: str | None = None) -> Tokenizer:
    """Byte-level BPE. ``template`` adds special tokens on encode, e.g. ``"$A </s>"``
    (translation sources) or ``"<s> $A"`` (LM prompts)."""
    tk = HFTokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer)
    if template:
        tk.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, tk.token_to_id(t)) for t in BPE_SPECIALS if t in template]
        )
    return Tokenizer(tk)


def train_wordpiece(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    lowercase: bool = True) -> Tokenizer:
    """BERT-style WordPiece with ``[CLS] text [SEP]`` added on encode."""
    tk = HFTokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tk.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=WORDPIECE_SPECIALS,
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = tk.token_to_id("[CLS]"), tk.token_to_id("[SEP]")
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return Tokenizer(tk)
