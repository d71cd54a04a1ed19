"""Machine translation of a gettext catalogue (.po): what /v1/translate/po does to a file.

- Untranslated entries (empty ``msgstr``, or empty plural forms) are filled and flagged
  ``fuzzy``: machine translation must be reviewed before it ships (msgfmt leaves fuzzy entries
  out of the .mo). Translated entries, obsolete entries (``#~``), the header entry, comments,
  flags, references and ``msgctxt`` are kept as they are. With ``include_fuzzy``, entries
  already flagged fuzzy are retranslated too (and stay fuzzy).
- Plural entries: the number of forms comes from the header's ``Plural-Forms`` (``nplurals``,
  2 when absent); form 0 is translated from ``msgid``, every other form from ``msgid_plural``
  (a language with a single form takes ``msgid_plural`` for it).
- Keyboard accelerators (``_Open``, ``&File``, ``~Save``) are taken off the source and one is
  put back into the translation (``model.text.mnemonics``); leading and trailing whitespace (a
  final ``\\n``, which msgfmt -c checks) is kept.
- An entry whose translation does not keep the source's placeholders (``%s``, ``{0}``, ...)
  is left empty and counted: a wrong placeholder crashes the program that formats it.
- Entries whose text is longer than the model accepts are left empty and counted.
All texts of a file go to the engine as one group (``engine.submit_all``), named
``entries[i].msgid`` / ``entries[i].msgid_plural``.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field

import polib

from model.text.mnemonics import add_mnemonic, find_mnemonic
from service.engines.errors import InvalidRequestError
from service.engines.generative import GenerativeEngine, SamplingParams, TokenUsage
from service.engines.waiting import ClientGone
from service.settings import Settings
from service.translation import translate as translation

FIELD = "file"
MO_MAGIC = (b"\xde\x12\x04\x95", b"\x95\x04\x12\xde")
CHARSET = re.compile(rb"charset=([A-Za-z0-9_.:-]+)")
NPLURALS = re.compile(r"nplurals\s*=\s*(\d+)")
MAX_NPLURALS = 6  # Arabic has the most forms any language uses


@dataclass
class Text:
    """One text to translate: form ``forms`` of entry ``entry`` get its translation."""

    entry: int  # index in the catalogue's entry list
    forms: list[int] | None  # plural forms it fills; None: the entry's msgstr
    source: str  # as the catalogue has it
    field: str  # entries[i].msgid or entries[i].msgid_plural
    core: str = ""  # what is translated: no accelerator, no surrounding whitespace
    mnemonic: tuple[str, str] | None = None  # (marker, key) to put back


@dataclass
class Summary:
    """What one request did to the file; the response headers report it."""

    entries: int = 0  # entries in the file (header and obsolete entries not counted)
    translated: int = 0  # filled (or retranslated) by this request, flagged fuzzy
    skipped_placeholders: int = 0  # left empty: the translation lost or changed a placeholder
    skipped_too_long: int = 0  # left empty: longer than the model accepts
    untranslated: int = 0  # entries still without a translation in the returned file
    fuzzy: int = 0  # entries flagged fuzzy in the returned file
    usage: TokenUsage = field(default_factory=lambda: TokenUsage(0))

    def headers(self) -> dict[str, str]:
        return {"X-Entries-Total": str(self.entries), "X-Entries-Translated": str(self.translated),
                "X-Entries-Skipped-Placeholders": str(self.skipped_placeholders),
                "X-Entries-Skipped-Too-Long": str(self.skipped_too_long),
                "X-Entries-Untranslated": str(self.untranslated), "X-Entries-Fuzzy": str(self.fuzzy)}


HEADERS_DOC = {
    "X-Entries-Total": "entries in the file (the header entry and obsolete entries not counted)",
    "X-Entries-Translated": "entries this request filled (or retranslated), all flagged fuzzy",
    "X-Entries-Skipped-Placeholders": "entries left empty: the translation did not keep the placeholders",
    "X-Entries-Skipped-Too-Long": "entries left empty: longer than the model accepts",
    "X-Entries-Untranslated": "entries still untranslated in the returned file (skipped, past max_entries, "
                              "or no letters to translate)",
    "X-Entries-Fuzzy": "entries flagged fuzzy in the returned file",
}


def parse(data: bytes, settings: Settings) -> polib.POFile:
    """The catalogue in ``data``; 400 naming ``file`` when it is not a .po file, 413 past the entry limit."""
    if not data.strip():
        raise InvalidRequestError("file is empty; send a gettext .po file", FIELD)
    if data[:4] in MO_MAGIC:
        raise InvalidRequestError("file is a compiled .mo catalogue; send the .po source (msgunfmt converts one)",
                                  FIELD)
    match = CHARSET.search(data[:4096])
    charset = match.group(1).decode() if match and match.group(1) != b"CHARSET" else "utf-8"
    try:
        text = data.decode(charset)
    except (LookupError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"file is not a gettext .po file: not {charset} text ({exc})", FIELD) from None
    if "\0" in text or "msgid" not in text:
        raise InvalidRequestError("file is not a gettext .po file: no msgid entries", FIELD)
    # polib reads a file when given a string that names one: parse our own temporary copy,
    # never a path a client could send.
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".po", delete=False) as tmp:
        tmp.write(text)
    try:
        po = polib.pofile(tmp.name, encoding="utf-8", wrapwidth=78)
    except (OSError, ValueError, UnicodeError, IndexError, KeyError) as exc:
        raise InvalidRequestError(f"file is not a gettext .po file: {exc}"[:300], FIELD) from None
    finally:
        os.unlink(tmp.name)
    if charset.lower().replace("_", "-") not in ("utf-8", "utf8") and "Content-Type" in po.metadata:
        po.metadata["Content-Type"] = re.sub(r"charset=[^;\s]+", "charset=UTF-8", po.metadata["Content-Type"])
    count = sum(1 for e in po if not e.obsolete)
    if count > settings.max_po_entries:
        raise InvalidRequestError(f"file has {count} entries; at most {settings.max_po_entries} are allowed "
                                  f"(TSERVE_MAX_PO_ENTRIES)", FIELD, code="body_too_large")
    if not count and not po.metadata:
        raise InvalidRequestError("file is not a gettext .po file: no entries", FIELD)
    return po


def nplurals(po: polib.POFile) -> int:
    match = NPLURALS.search(po.metadata.get("Plural-Forms", ""))
    return min(max(int(match.group(1)), 1), MAX_NPLURALS) if match else 2


def plan(po: polib.POFile, include_fuzzy: bool, max_entries: int | None) -> list[Text]:
    """The texts to translate, entry by entry in file order, at most ``max_entries`` entries."""
    n = nplurals(po)
    texts: list[Text] = []
    chosen = 0
    for i, entry in enumerate(po):
        if entry.obsolete or not re.search(r"[^\W\d_]", entry.msgid):
            continue
        fuzzy = "fuzzy" in entry.flags
        if fuzzy and not include_fuzzy:
            continue
        if entry.msgid_plural:
            forms = list(range(n)) if fuzzy else [k for k in range(n) if not entry.msgstr_plural.get(k)]
            if not forms:
                continue
            singular, plural = [k for k in forms if k == 0 and n > 1], [k for k in forms if k > 0 or n == 1]
            group = ([Text(i, singular, entry.msgid, f"entries[{i}].msgid")] if singular else []) + \
                ([Text(i, plural, entry.msgid_plural, f"entries[{i}].msgid_plural")] if plural else [])
        elif fuzzy or not entry.msgstr:
            group = [Text(i, None, entry.msgid, f"entries[{i}].msgid")]
        else:
            continue
        if max_entries is not None and chosen >= max_entries:
            break
        chosen += 1
        texts += group
    for t in texts:
        found = find_mnemonic(t.source)
        core = found[0] if found else t.source
        t.mnemonic = (found[1], found[2]) if found else None
        t.core = core.strip()
    return texts


def _dress(t: Text, translated: str) -> str:
    """The translation with the source's accelerator and surrounding whitespace put back."""
    if t.mnemonic is not None:
        translated = add_mnemonic(translated, *t.mnemonic)
    src = t.source
    return src[: len(src) - len(src.lstrip())] + translated + src[len(src.rstrip()):]


async def translate_catalogue(client_gone: ClientGone, engine: GenerativeEngine, po: polib.POFile,
                              texts: list[Text], params: SamplingParams, max_chars: int) -> Summary:
    """Fill ``po`` in place with the translations of ``texts``; what happened, counted."""
    summary = Summary(entries=sum(1 for e in po if not e.obsolete))
    sources = translation.sources(engine, [t.core for t in texts])
    ids = translation.source_ids(engine, sources, FIELD) if texts else []
    too_long = {t.entry for t, row in zip(texts, ids) if len(row) > engine.max_src_len or len(t.core) > max_chars}
    run = [k for k, t in enumerate(texts) if t.entry not in too_long]
    results, summary.usage = await translation.translate(
        client_gone, engine, [sources[k] for k in run], [ids[k] for k in run], params,
        [texts[k].field for k in run], FIELD) if run else ([], TokenUsage(0))
    by_entry: dict[int, list[tuple[Text, translation.Translated]]] = {}
    for k, result in zip(run, results):
        by_entry.setdefault(texts[k].entry, []).append((texts[k], result))
    entries = list(po)
    for index, done in by_entry.items():
        if not all(r.placeholders_ok and r.text for _, r in done):
            summary.skipped_placeholders += any(not r.placeholders_ok for _, r in done)
            continue
        entry = entries[index]
        for t, r in done:
            text = _dress(t, r.text)
            if t.forms is None:
                entry.msgstr = text
            else:
                for k in t.forms:
                    entry.msgstr_plural[k] = text
        if entry.msgid_plural:
            entry.msgstr_plural = {k: entry.msgstr_plural.get(k, "") for k in sorted({*entry.msgstr_plural,
                                                                                      *range(nplurals(po))})}
        if "fuzzy" not in entry.flags:
            entry.flags.insert(0, "fuzzy")
        summary.translated += 1
    summary.skipped_too_long = len(too_long)
    for entry in po:
        if entry.obsolete:
            continue
        filled = all(entry.msgstr_plural.values()) and entry.msgstr_plural if entry.msgid_plural else entry.msgstr
        summary.untranslated += not filled
        summary.fuzzy += "fuzzy" in entry.flags
    return summary


def render(po: polib.POFile) -> bytes:
    po.encoding = "utf-8"
    return (str(po).rstrip("\n") + "\n").encode("utf-8")
