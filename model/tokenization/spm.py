"""SentencePiece unigram models rebuilt as ``tokenizers`` tokenizers (no sentencepiece needed).

A ``.spm`` / ``.model`` file is a protobuf ``ModelProto``: the pieces with their scores and
types, and the settings of the normalizer and trainer. A small wire-format reader takes
what a unigram tokenizer needs, and ``unigram_tokenizer`` rebuilds SentencePiece's
encoding with ``tokenizers`` parts:

- normalizer: the precompiled character map (e.g. nmt_nfkc), then SentencePiece's
  whitespace rules (drop leading/trailing spaces, collapse runs), the dummy-prefix ``▁``
  and spaces escaped as ``▁``;
- pre-tokenizer: split before each ``▁`` (pieces never cross a word boundary when the
  model was trained with split_by_whitespace, so Viterbi per word equals Viterbi overall);
- model: Unigram with the pieces' scores, so the segmentation is the same Viterbi path.

The ids come from a separate vocabulary (Marian's vocab.json), not from the model's
own piece order; see ``unigram_tokenizer`` for how entries outside the model are kept
unmatchable.

Known difference from MarianTokenizer: a run of two or more characters that the model
has no piece for becomes one ``<unk>`` there unless the whole run is a vocabulary entry;
here, vocabulary entries covering parts of such a run (e.g. target-language letters)
are used for those parts.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from model.tokenization.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece.Type
UNIGRAM = 1  # TrainerSpec.ModelType
WORD_BOUNDARY = "\u2581"  # ▁, SentencePiece's escaped space
# Prefixed to vocabulary entries that the source model cannot produce. Spaces are turned
# into ▁ before the model sees the text, so an entry containing one can never match, while
# the decoder removes it again so the entry still decodes to its text.
UNREACHABLE = " "


class SentencePieceError(ValueError):
    """A SentencePiece model that cannot be read or rebuilt exactly."""


@dataclass
class SentencePieceModel:
    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type)
    model_type: int = UNIGRAM
    split_by_whitespace: bool = True
    treat_whitespace_as_suffix: bool = False
    byte_fallback: bool = False
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True
    denormalizer_charsmap: bytes = b""


# --- protobuf wire format -------------------------------------------------------------

def _varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise SentencePieceError("truncated or malformed protobuf varint")
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs of one message: ints for varints, bytes otherwise."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire in (1, 5):  # fixed 64 / 32 bit
            size = 8 if wire == 1 else 4
            value, i = buf[i: i + size], i + size
        elif wire == 2:  # length-delimited: strings, bytes, sub-messages
            size, i = _varint(buf, i)
            value, i = buf[i: i + size], i + size
        else:
            raise SentencePieceError(f"unsupported protobuf wire type {wire} in field {number}")
        if i > len(buf):
            raise SentencePieceError(f"truncated protobuf field {number}")
        yield number, value


def _as(value: int | bytes, kind: type, what: str):
    if kind is bytes and isinstance(value, bytes):
        return value
    if kind is str and isinstance(value, bytes):
        return value.decode("utf-8")
    if kind is float and isinstance(value, bytes) and len(value) == 4:
        return struct.unpack("<f", value)[0]
    if kind in (int, bool) and isinstance(value, int):
        return kind(value)
    raise SentencePieceError(f"malformed SentencePiece field {what}")


def read_sentencepiece(data: bytes) -> SentencePieceModel:
    """Parse a serialized SentencePiece ``ModelProto`` (field numbers from sentencepiece_model.proto)."""
    spm = SentencePieceModel()
    trainer = {3: ("model_type", int), 22: ("split_by_whitespace", bool),
               24: ("treat_whitespace_as_suffix", bool), 35: ("byte_fallback", bool)}
    normalizer = {2: ("precompiled_charsmap", bytes), 3: ("add_dummy_prefix", bool),
                  4: ("remove_extra_whitespaces", bool), 5: ("escape_whitespaces", bool)}
    for number, value in _fields(data):
        if number == 1:  # repeated SentencePiece
            piece, score, kind = "", 0.0, NORMAL
            for sub, v in _fields(_as(value, bytes, "pieces")):
                if sub == 1:
                    piece = _as(v, str, "piece")
                elif sub == 2:
                    score = _as(v, float, "score")
                elif sub == 3:
                    kind = _as(v, int, "type")
            spm.pieces.append((piece, score, kind))
        elif number in (2, 3):  # TrainerSpec, NormalizerSpec
            known = trainer if number == 2 else normalizer
            for sub, v in _fields(_as(value, bytes, "spec")):
                if sub in known:
                    name, kind = known[sub]
                    setattr(spm, name, _as(v, kind, name))
        elif number == 5:  # denormalizer NormalizerSpec
            for sub, v in _fields(_as(value, bytes, "denormalizer_spec")):
                if sub == 2:
                    spm.denormalizer_charsmap = _as(v, bytes, "denormalizer precompiled_charsmap")
    if not spm.pieces:
        raise SentencePieceError("no pieces: not a SentencePiece model")
    return spm


# --- rebuilding the tokenizer ---------------------------------------------------------

def _check_supported(spm: SentencePieceModel) -> None:
    problems = []
    if spm.model_type != UNIGRAM:
        problems.append(f"model_type {spm.model_type} (only unigram = {UNIGRAM})")
    if spm.byte_fallback:
        problems.append("byte_fallback")
    if spm.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix")
    if not spm.escape_whitespaces:
        problems.append("escape_whitespaces = false")
    if spm.denormalizer_charsmap:
        problems.append("a denormalizer")
    user = [p for p, _, kind in spm.pieces if kind == USER_DEFINED]
    if user:
        problems.append(f"user-defined pieces {user[:5]}")
    if problems:
        raise SentencePieceError(f"unsupported SentencePiece settings: {'; '.join(problems)}")


def _normalizer(spm: SentencePieceModel) -> normalizers.Normalizer:
    steps: list[normalizers.Normalizer] = []
    if spm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spm.precompiled_charsmap))
    if spm.remove_extra_whitespaces:  # SentencePiece only treats U+0020 (after the map) as whitespace
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    if spm.add_dummy_prefix:
        steps.append(normalizers.Prepend(WORD_BOUNDARY))  # not applied to an empty string
    steps.append(normalizers.Replace(" ", WORD_BOUNDARY))
    return normalizers.Sequence(steps)


def unigram_tokenizer(spm: SentencePieceModel, vocab: dict[str, int], unk_token: str,
                      special_tokens: list[str], append_token: str | None = None) -> Tokenizer:
    """A tokenizer that segments like ``spm`` and numbers pieces by ``vocab``.

    Every piece the model can produce must be in ``vocab`` (else the ids could not match).
    ``special_tokens`` (all in ``vocab``) are matched in the raw text first, as HF slow
    tokenizers do. Vocabulary entries the model cannot produce (e.g. target-language
    pieces of a shared vocabulary) keep their ids but can never be matched.
    ``append_token`` is added after every encoded text (Marian's ``</s>``).
    """
    _check_supported(spm)
    size = len(vocab)
    if sorted(vocab.values()) != list(range(size)):
        raise SentencePieceError(f"vocabulary ids are not exactly 0..{size - 1}")
    missing = [t for t in (unk_token, *special_tokens, *([append_token] if append_token else [])) if t not in vocab]
    if missing:
        raise SentencePieceError(f"special token(s) {missing} not in the vocabulary")
    scores = {piece: score for piece, score, kind in spm.pieces if kind == NORMAL}
    absent = [piece for piece in scores if piece not in vocab]
    if absent:
        raise SentencePieceError(f"{len(absent)} piece(s) of the SentencePiece model are not in the vocabulary, "
                                 f"e.g. {absent[:5]}; their ids would differ")
    specials = {unk_token, *special_tokens}
    # Characters the model has no piece for come out of SentencePiece as one "unknown" piece
    # per run, whose text MarianTokenizer then looks up in the vocabulary; entries made only of
    # such characters (e.g. target-language letters) are therefore reachable.
    known_chars = {piece for piece in scores if len(piece) == 1}
    lowest = min(scores.values(), default=0.0)  # keeps spm's unknown penalty (min score - 10)
    entries: list[tuple[str, float]] = [("", 0.0)] * size
    for piece, i in vocab.items():
        if piece in scores:
            entries[i] = (piece, scores[piece])
        elif piece in specials:
            entries[i] = (piece, 0.0)  # matched as an added token before the model runs
        elif piece and not known_chars.intersection(piece):
            entries[i] = (piece, lowest)  # fewer, longer pieces win over a split of the same run
        else:
            entries[i] = (UNREACHABLE + piece, 0.0)

    tk = HFTokenizer(models.Unigram(entries, unk_id=vocab[unk_token], byte_fallback=False))
    tk.normalizer = _normalizer(spm)
    if spm.split_by_whitespace:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement=WORD_BOUNDARY, prepend_scheme="never", split=True)
    tk.decoder = decoders.Sequence([
        decoders.Replace(UNREACHABLE, ""),
        decoders.Metaspace(replacement=WORD_BOUNDARY, prepend_scheme="always" if spm.add_dummy_prefix else "never"),
    ])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys([unk_token,
                                                                                                  *special_tokens])])
    if append_token:
        tk.post_processor = processors.TemplateProcessing(
            single=f"$A {append_token}", pair=f"$A $B {append_token}",
            special_tokens=[(append_token, vocab[append_token])],
        )
    return Tokenizer(tk)
