"""Keyboard accelerators (mnemonics) in UI strings: ``_Open``, ``&File``, ``~Save``.

GTK marks the accelerator letter with ``_``, Qt/KDE and Windows with ``&``, LibreOffice with
``~``. The translator should see words, not markers (the training pairs are stripped the same
way, ``model.train.data.catalogues``); a translated UI string still needs an accelerator, so
one is put back before a letter of the translation.
"""

from __future__ import annotations

import re

from model.text.placeholders import PLACEHOLDER

MNEMONIC_MARKERS = "~_&"


def _hide_placeholders(text: str) -> str:
    """``text`` with every placeholder blanked out, same length: a ``_`` or ``&`` inside one is no marker."""
    return PLACEHOLDER.sub(lambda m: "\0" * len(m.group()), text)


def strip_marker(text: str, other: str, marker: str) -> str:
    """Remove ``marker`` where it is a mnemonic: the only such marker in the text, directly
    before a letter or digit, and not part of an identifier shared verbatim with ``other``
    (the other side of a pair: ``debug_dump``) or an HTML entity (``&amp;``)."""
    masked = _hide_placeholders(text)
    spots = [i for i, ch in enumerate(masked) if ch == marker]
    if len(spots) != 1:
        return text
    i = spots[0]
    if i + 1 >= len(text) or not text[i + 1].isalnum():
        return text
    if marker == "&" and re.match(r"&#?\w+;", text[i:]):
        return text
    start = max(text.rfind(" ", 0, i), text.rfind("\n", 0, i)) + 1
    end_match = re.search(r"\s", text[i:])
    word = text[start: i + end_match.start() if end_match else len(text)]
    if word in other.split():  # an identifier both sides spell the same way
        return text
    return text[:i] + text[i + 1:]


def find_mnemonic(text: str) -> tuple[str, str, str] | None:
    """(text without its accelerator marker, the marker, the accelerator character), or None
    when ``text`` has no mnemonic. Without another side to compare with, a marker inside a word
    counts in a phrase (``Print Pre_view``) or a capitalised word (``A_ppearance``), not in a lone
    lowercase word (``file_name``, an identifier)."""
    for marker in MNEMONIC_MARKERS:
        stripped = strip_marker(text, "", marker)
        if stripped == text:
            continue
        i = next((i for i, (a, b) in enumerate(zip(text, stripped)) if a != b), len(stripped))
        lone_word = not re.search(r"\s", text.strip())
        if i > 0 and text[i - 1].isalnum() and lone_word and text == text.lower():
            continue
        return stripped, marker, stripped[i]
    return None


def add_mnemonic(text: str, marker: str, key: str) -> str:
    """``text`` with ``marker`` before the accelerator: before the first word-initial ``key``
    (case-insensitive) if the translation has one, else before its first letter or digit outside
    a placeholder. Unchanged when it has none."""
    hidden = _hide_placeholders(text)
    starts = [m.start() for m in re.finditer(r"(?<!\w)\w", hidden) if hidden[m.start()] != "\0"]
    same = [i for i in starts if text[i].casefold() == key.casefold()]
    spots = same or [i for i, ch in enumerate(hidden) if ch.isalnum()]
    if not spots:
        return text
    return text[:spots[0]] + marker + text[spots[0]:]
