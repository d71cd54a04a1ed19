"""Tokenizers: special tokens, and streaming detokenization that never breaks UTF-8."""

from __future__ import annotations

import pytest

from model.tokenization.tokenizer import BPE_SPECIALS, REPLACEMENT_CHAR, WORDPIECE_SPECIALS, train_bpe, train_wordpiece

TEXTS = [
    "Die Größe der Datei übersteigt das Limit.",
    "The file size exceeds the limit.",
    "Öffnen Sie das Menü »Datei« und wählen Sie Speichern.",
    "Open the File menu and choose Save.",
    "Straße, Maß, Fuß — naïve café 🙂 日本語のテキスト",
] * 20


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, vocab_size=300, template="$A </s>")


@pytest.fixture(scope="module")
def wordpiece():
    return train_wordpiece(TEXTS, vocab_size=200)


def test_bpe_special_ids_and_template(bpe):
    assert [bpe.token_to_id(t) for t in BPE_SPECIALS] == [0, 1, 2, 3]
    ids = bpe.encode("Open the menu")
    assert ids[-1] == bpe.token_to_id("</s>")
    assert bpe.decode(ids) == "Open the menu"  # specials skipped, bytes round-trip
    assert bpe.special_ids == {0, 1, 2, 3}


def test_byte_level_bpe_round_trips_any_text(bpe):
    text = "Unbekannt: ∑ ≠ ✓ 🚀 ñ — Zeichen, die nie im Training vorkamen"
    assert bpe.decode(bpe.encode(text, add_special_tokens=False)) == text


def test_wordpiece_specials_and_cls_sep(wordpiece):
    assert [wordpiece.token_to_id(t) for t in WORDPIECE_SPECIALS] == [0, 1, 2, 3, 4]
    ids = wordpiece.encode("open the menu")
    assert ids[0] == wordpiece.token_to_id("[CLS]") and ids[-1] == wordpiece.token_to_id("[SEP]")
    assert wordpiece.decode(ids) == "open the menu"


@pytest.mark.parametrize("text", [
    "Größe 🙂 日本語",
    "naïve café — Straße",
    "🙂🙂🙂 x 🚀",
])
def test_incremental_detokenization_never_emits_broken_characters(bpe, text):
    ids = bpe.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters really are split over tokens
    detok = bpe.detokenizer()
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # some tokens had to wait for the rest of a character


def test_incremental_detokenization_with_context_matches_full_decode(wordpiece):
    prompt = wordpiece.encode("open the", add_special_tokens=False)
    rest = wordpiece.encode("file menu and choose save", add_special_tokens=False)
    detok = wordpiece.detokenizer(prompt)
    streamed = "".join(detok.add(i) for i in rest) + detok.flush()
    full = wordpiece.decode(prompt + rest)
    assert wordpiece.decode(prompt) + streamed == full


def test_save_and_load(tmp_path, bpe):
    from model.tokenization.tokenizer import Tokenizer

    bpe.save(tmp_path / "tokenizer.json")
    again = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert again.encode(TEXTS[2]) == bpe.encode(TEXTS[2])
