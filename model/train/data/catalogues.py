"""English -> German sentence pairs from gettext catalogues (.mo / .po).

A catalogue entry maps an English ``msgid`` to its German ``msgstr``. Turning entries
into training pairs needs care:
- plural entries give two pairs: (msgid, msgstr[0]) and (msgid_plural, msgstr[1]);
- fuzzy, obsolete, empty and untranslated (target == source) entries are dropped;
- mnemonic markers (``~File``, ``_File``, ``&File``) are stripped from both sides,
  since the model should learn words, not keyboard accelerators;
- format placeholders (``%s``, ``%(name)s``, ``{0}``, ``$1``, ``%PRODUCTNAME``) must
  match as multisets between source and target, else the pair is a mistranslation or
  an alignment we cannot trust, and is dropped;
- whitespace is collapsed and overly long or badly length-mismatched pairs are dropped.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import polib

from model.text.mnemonics import MNEMONIC_MARKERS, strip_marker
from model.text.placeholders import placeholders

MAX_SOURCE_CHARS = 200
MAX_TARGET_CHARS = 260
MAX_LENGTH_RATIO = 3.0  # target/source (or inverse) character ratio beyond which a pair is dropped


@dataclass(frozen=True)
class Pair:
    source: str
    target: str


@dataclass
class CatalogueStats:
    """Why entries were kept or dropped, per catalogue (goes into the manifest)."""

    entries: int = 0
    pairs: int = 0
    dropped: Counter = field(default_factory=Counter)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def to_dict(self) -> dict:
        return {"entries": self.entries, "pairs": self.pairs, "dropped": dict(sorted(self.dropped.items()))}


def strip_mnemonics(source: str, target: str) -> tuple[str, str]:
    """Strip accelerator markers from both sides of a pair, judging each side against the other."""
    for marker in MNEMONIC_MARKERS:
        source, target = strip_marker(source, target, marker), strip_marker(target, source, marker)
    return source, target


def clean_pair(source: str, target: str, stats: CatalogueStats) -> Pair | None:
    """Apply every filter to one (msgid, msgstr); None (with the reason counted) if dropped."""
    if not source.strip() or not target.strip():
        stats.drop("empty")
        return None
    source, target = strip_mnemonics(source, target)
    source, target = " ".join(source.split()), " ".join(target.split())
    if not re.search(r"[A-Za-z]{2}", source):
        stats.drop("no_words")
        return None
    if source == target:
        stats.drop("identical")
        return None
    if len(source) > MAX_SOURCE_CHARS or len(target) > MAX_TARGET_CHARS:
        stats.drop("too_long")
        return None
    ratio = (len(target) + 5) / (len(source) + 5)
    if ratio > MAX_LENGTH_RATIO or ratio < 1 / MAX_LENGTH_RATIO:
        stats.drop("length_ratio")
        return None
    if placeholders(source) != placeholders(target):
        stats.drop("placeholder_mismatch")
        return None
    return Pair(source, target)


def entry_pairs(entry: polib._BaseEntry, stats: CatalogueStats) -> Iterator[Pair]:
    """The pairs of one catalogue entry (two for a plural entry)."""
    stats.entries += 1
    if entry.obsolete or "fuzzy" in entry.flags:
        stats.drop("fuzzy_or_obsolete")
        return
    if entry.msgid_plural:
        forms = entry.msgstr_plural
        raw = [(entry.msgid, forms.get(0, "")), (entry.msgid_plural, forms.get(1, ""))]
    else:
        raw = [(entry.msgid, entry.msgstr)]
    for source, target in raw:
        pair = clean_pair(source, target, stats)
        if pair is not None:
            stats.pairs += 1
            yield pair


def read_catalogue(path: str | Path, stats: CatalogueStats | None = None) -> list[Pair]:
    """All usable pairs of a .mo or .po file (header entry skipped)."""
    path = Path(path)
    stats = stats if stats is not None else CatalogueStats()
    try:
        cat = polib.mofile(str(path)) if path.suffix == ".mo" else polib.pofile(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable gettext catalogue ({exc})") from None
    return [p for e in cat if e.msgid for p in entry_pairs(e, stats)]


def read_catalogues(paths: Iterable[Path]) -> tuple[list[Pair], CatalogueStats]:
    stats = CatalogueStats()
    pairs = [p for path in sorted(paths) for p in read_catalogue(path, stats)]
    return pairs, stats
