"""English -> German prose pairs (translate-en-de v3): Debian's translated manuals and
package descriptions.

``apt-get source`` cannot be used here (the archive mirror reachable from this machine
serves ``.dsc`` files but answers 404 for source tarballs), so the po4a ``.po`` files of
the manuals are out of reach. Two sources that binary packages and the archive's index
files do carry:

- **Translated manuals** (``MANUALS``): the English and the German HTML build of the same
  manual, from the binary ``.deb`` packages. The German build is made with po4a from the
  English DocBook, so both files of a chapter have the same block structure; the paragraphs
  (``<p>``, DocBook's ``<div class="para">``, headings, ``<dt>``) are paired in order when the
  two sequences of block tags are identical, else by ``difflib`` over the tag sequence (only
  runs that match). A paragraph po4a left untranslated (German == English) is dropped.
- **Package descriptions** (``DDTP``): ``i18n/Translation-en`` and ``i18n/Translation-de``
  of bookworm/main (Debian Description Translation Project), paired by package and
  ``Description-md5``; the short description is one pair, the long description's
  paragraphs (separated by `` .`` lines) are paired when both sides have as many.

A pair longer than ``MAX_SOURCE_CHARS``/``MAX_TARGET_CHARS`` is split into sentences and the
sentences are paired only when both sides have as many; otherwise it is dropped.

Held out by document: the whole ``HELDOUT_MANUALS`` (every chapter), and the descriptions
of the packages that ``debian_l10n.is_heldout`` holds out from the software strings (so a
held-out package is held out in both corpora). None of their pairs is trained on.
"""

from __future__ import annotations

import bz2
import difflib
import hashlib
import lzma
import re
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from model.train.data.debian_l10n import is_heldout, is_reserved
from model.train.data.sources import SourceError, debian_licence, debian_package

MAX_SOURCE_CHARS = 280
MAX_TARGET_CHARS = 360
MIN_SOURCE_CHARS = 12
MIN_LETTER_SHARE = 0.6  # of the non-space characters: below this a "paragraph" is mostly code or paths
MAX_LENGTH_RATIO = 2.2

DDTP_BASE = "http://deb.debian.org/debian/dists/bookworm/main/i18n/"
DDTP_FILES = {"en": "Translation-en.xz", "de": "Translation-de.bz2"}


@dataclass(frozen=True)
class Manual:
    name: str
    en_package: str
    de_package: str
    en_glob: str  # chapter files in the English package
    de_path: str  # the German file of a chapter, from the English file's stem ({stem})
    licence_package: str  # whose copyright file states the licence
    licence_note: str = ""  # when that file has no License: field


MANUALS = (
    Manual("debian-handbook", "debian-handbook", "debian-handbook",
           "usr/share/doc/debian-handbook/html/en-US/*.html",
           "usr/share/doc/debian-handbook/html/de-DE/{stem}.html", "debian-handbook"),
    Manual("debian-reference", "debian-reference-en", "debian-reference-de",
           "usr/share/debian-reference/*.en.html", "usr/share/debian-reference/{stem}.de.html",
           "debian-reference-en"),
    Manual("developers-reference", "developers-reference", "developers-reference-de",
           "usr/share/developers-reference/*.html", "usr/share/developers-reference/de/{stem}.html",
           "developers-reference"),
    Manual("debian-faq", "debian-faq", "debian-faq-de", "usr/share/doc/debian/FAQ/*.en.html",
           "usr/share/doc/debian/FAQ/de/{stem}.de.html", "debian-faq",
           "SPI permission notice: verbatim and modified copies and translations may be distributed "
           "(usr/share/doc/debian-faq/copyright)"),
    Manual("maint-guide", "maint-guide", "maint-guide-de", "usr/share/doc/maint-guide/html/*.en.html",
           "usr/share/doc/maint-guide-de/html/{stem}.de.html", "maint-guide"),
)
HELDOUT_MANUALS = frozenset({"maint-guide", "debian-faq"})

BLOCK_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "title"}
SKIP_TAGS = {"pre", "script", "style"}


class _BlockParser(HTMLParser):
    """(tag, text) of each innermost text block, in document order; code blocks skipped."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple[str, str]] = []
        self._stack: list[tuple[str, list[str] | None]] = []  # (tag, text parts or None when not a block)
        self._skip = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in SKIP_TAGS:
            self._skip += 1
        elif tag in BLOCK_TAGS or (tag == "div" and ("class", "para") in attrs):
            self._stack.append((tag if tag != "div" else "para", []))
        elif tag == "div":
            self._stack.append(("div", None))

    def handle_endtag(self, tag: str) -> None:
        if tag in SKIP_TAGS:
            self._skip = max(0, self._skip - 1)
            return
        if tag not in BLOCK_TAGS and tag != "div":
            return
        while self._stack:  # tolerate unclosed <p>
            name, parts = self._stack.pop()
            if parts is not None:
                text = " ".join("".join(parts).replace("\u00b6", "").split())
                if text:
                    self.blocks.append((name, text))
            if name == tag or (tag == "div" and name in ("div", "para")):
                break

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        for _, parts in reversed(self._stack):
            if parts is not None:
                parts.append(data)
                return


def html_blocks(html: str) -> list[tuple[str, str]]:
    parser = _BlockParser()
    parser.feed(html)
    parser.close()
    return parser.blocks


def align_blocks(en: list[tuple[str, str]], de: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(English, German) texts of blocks that correspond: all of them when the tag sequences
    are the same, else those in runs that difflib finds equal in the tag sequence."""
    en_tags, de_tags = [t for t, _ in en], [t for t, _ in de]
    if en_tags == de_tags:
        return [(a, b) for (_, a), (_, b) in zip(en, de)]
    out = []
    for block in difflib.SequenceMatcher(None, en_tags, de_tags, autojunk=False).get_matching_blocks():
        if block.size >= 3:  # a short run of equal tags is no evidence of correspondence
            out += [(en[block.a + k][1], de[block.b + k][1]) for k in range(block.size)]
    return out


_ABBREV = re.compile(r"\b(?:e\.g|i\.e|etc|vs|cf|z\.\s?B|d\.\s?h|u\.\s?a|bzw|ggf|usw|vgl|ca|Nr|Dr|Mr|Mrs|St)\.$",
                     re.IGNORECASE)


def sentences(text: str) -> list[str]:
    """Split at . ! ? followed by a space and an upper-case letter (or a quote), except after
    common abbreviations."""
    out, start = [], 0
    for m in re.finditer(r"[.!?][\"'»«“”)]*\s+(?=[A-ZÄÖÜ\"'»«„“(])", text):
        head = text[start: m.end()].strip()
        if _ABBREV.search(text[start: m.start() + 1]):
            continue
        out.append(head)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


def _letter_share(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) / max(1, len(chars))


def clean_pairs(en: str, de: str, dropped: Counter) -> list[tuple[str, str]]:
    """The pair itself, its sentences, or nothing (with the reason counted)."""
    en, de = " ".join(en.split()), " ".join(de.split())
    if not en or not de:
        dropped["empty"] += 1
        return []
    if en == de:
        dropped["untranslated"] += 1
        return []
    if len(en) > MAX_SOURCE_CHARS or len(de) > MAX_TARGET_CHARS:
        en_s, de_s = sentences(en), sentences(de)
        if len(en_s) < 2 or len(en_s) != len(de_s):
            dropped["too_long"] += 1
            return []
        out = []
        for a, b in zip(en_s, de_s):
            out += clean_pairs(a, b, dropped)
        return out
    if len(en) < MIN_SOURCE_CHARS:
        dropped["too_short"] += 1
        return []
    if _letter_share(en) < MIN_LETTER_SHARE or _letter_share(de) < MIN_LETTER_SHARE:
        dropped["markup_or_code"] += 1
        return []
    if re.search(r"</?[a-zA-Z][^>]*>|&[a-z]+;|\\f[BIRP]|^\.[A-Z]{1,2}\s", en + " " + de):
        dropped["markup_or_code"] += 1
        return []
    ratio = len(de) / len(en)
    if not 1 / MAX_LENGTH_RATIO <= ratio <= MAX_LENGTH_RATIO:
        dropped["length_ratio"] += 1
        return []
    return [(en, de)]


def manual_records(cache: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records, sources = [], []
    for man in MANUALS:
        en_pkg = debian_package(man.en_package, cache)
        de_pkg = debian_package(man.de_package, cache) if man.de_package != man.en_package else en_pkg
        heldout = man.name in HELDOUT_MANUALS
        dropped: Counter = Counter()
        files, pairs, unmatched = 0, 0, 0
        for en_file in sorted(en_pkg.root.glob(man.en_glob)):
            stem = en_file.name.removesuffix(".html").removesuffix(".en")
            de_file = de_pkg.root / man.de_path.format(stem=stem)
            if not de_file.is_file():
                continue
            files += 1
            en_blocks = html_blocks(en_file.read_text(encoding="utf-8", errors="replace"))
            de_blocks = html_blocks(de_file.read_text(encoding="utf-8", errors="replace"))
            aligned = align_blocks(en_blocks, de_blocks)
            unmatched += len(en_blocks) - len(aligned)
            for en, de in aligned:
                for a, b in clean_pairs(en, de, dropped):
                    rec = {"source": a, "target": b, "origin": f"{man.name}/{stem}", "document": f"{man.name}"}
                    if heldout:
                        rec["heldout"] = True
                    records.append(rec)
                    pairs += 1
        licence = debian_licence(man.licence_package, (en_pkg.root / "usr/share/doc"))
        sources.append({"name": f"debian:{man.en_package}" + (f"+{man.de_package}" if de_pkg is not en_pkg else ""),
                        "version": f"{en_pkg.version}" + (f"/{de_pkg.version}" if de_pkg is not en_pkg else ""),
                        "licence": licence or man.licence_note or "unknown", "kind": "manual (HTML, en+de)",
                        "heldout": heldout, "files": files, "pairs": pairs, "blocks_not_aligned": unmatched,
                        "dropped": dict(sorted(dropped.items()))})
    return records, sources


def _fetch(name: str, cache: Path) -> bytes:
    path = cache / "ddtp" / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = urllib.request.urlopen(DDTP_BASE + name, timeout=120).read()
        except OSError as exc:
            raise SourceError(f"cannot fetch {DDTP_BASE + name}: {exc}") from None
        path.with_suffix(".tmp").write_bytes(data)
        path.with_suffix(".tmp").replace(path)
    return path.read_bytes()


def parse_translation(text: str, lang: str) -> Iterator[tuple[str, str, str]]:
    """(package, Description-md5, description) of each stanza of a Translation-<lang> file."""
    for stanza in text.split("\n\n"):
        package = re.search(r"^Package: (\S+)", stanza, re.MULTILINE)
        md5 = re.search(r"^Description-md5: (\S+)", stanza, re.MULTILINE)
        desc = re.search(rf"^Description-{lang}: (.*(?:\n .*)*)", stanza, re.MULTILINE)
        if package and md5 and desc:
            yield package.group(1), md5.group(1), desc.group(1)


def description_parts(desc: str) -> list[str]:
    """Short description, then each long-description paragraph (lines joined); a paragraph
    that is a list gives one part per item."""
    lines = desc.split("\n")
    parts = [lines[0].strip()]
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            parts.append(" ".join(paragraph))
            paragraph.clear()

    for line in lines[1:]:
        body = line[1:] if line.startswith(" ") else line
        if body.strip() == ".":
            flush()
        elif re.match(r"\s*[*+\-o•]\s+", body):  # a list item starts a part of its own
            flush()
            paragraph.append(re.sub(r"^\s*[*+\-o•]\s+", "", body).strip())
        else:
            paragraph.append(body.strip())
    flush()
    return parts


def ddtp_records(cache: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    en_raw = lzma.decompress(_fetch(DDTP_FILES["en"], cache)).decode("utf-8", "replace")
    de_raw = bz2.decompress(_fetch(DDTP_FILES["de"], cache)).decode("utf-8", "replace")
    english = {(p, m): d for p, m, d in parse_translation(en_raw, "en")}
    records: list[dict[str, Any]] = []
    dropped: Counter = Counter()
    described, part_mismatch, held_packages = 0, 0, set()
    for package, md5, de_desc in parse_translation(de_raw, "de"):
        en_desc = english.get((package, md5))
        if en_desc is None or is_reserved(package):
            continue
        described += 1
        en_parts, de_parts = description_parts(en_desc), description_parts(de_desc)
        if len(en_parts) != len(de_parts):
            part_mismatch += 1
            en_parts, de_parts = en_parts[:1], de_parts[:1]  # the short descriptions still pair
        heldout = is_heldout(package)
        for en, de in zip(en_parts, de_parts):
            for a, b in clean_pairs(en, de, dropped):
                rec = {"source": a, "target": b, "origin": f"ddtp/{package}", "document": f"ddtp/{package}"}
                if heldout:
                    rec["heldout"] = True
                    held_packages.add(package)
                records.append(rec)
    sha = {lang: hashlib.sha256((cache / "ddtp" / f).read_bytes()).hexdigest() for lang, f in DDTP_FILES.items()}
    source = {"name": "debian:ddtp bookworm/main i18n Translation-en + Translation-de",
              "version": f"sha256 en {sha['en'][:16]}…, de {sha['de'][:16]}…",
              "licence": "package descriptions: each package's own licence (Debian main, DFSG-free); German "
                         "translations contributed to the Debian Description Translation Project for Debian",
              "kind": "package descriptions", "descriptions": described,
              "descriptions_paragraph_count_mismatch": part_mismatch, "pairs": len(records),
              "heldout_packages": len(held_packages), "dropped": dict(sorted(dropped.items()))}
    return records, [source]


def prose_records(cache: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records, sources = manual_records(cache)
    more, more_sources = ddtp_records(cache)
    return records + more, sources + more_sources
