"""Gettext catalogues -> training pairs: plurals, placeholders, mnemonics, filters."""

from __future__ import annotations

import polib
import pytest

from model.train.data.catalogues import CatalogueStats, placeholders, read_catalogue, strip_mnemonics


def _catalogue(entries: list[polib.POEntry]) -> polib.POFile:
    po = polib.POFile()
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8", "Plural-Forms": "nplurals=2; plural=(n != 1);"}
    for e in entries:
        po.append(e)
    return po


ENTRIES = [
    polib.POEntry(msgid="Open the file", msgstr="Die Datei öffnen"),
    polib.POEntry(msgid="~Save Document", msgstr="Dokument ~speichern"),
    polib.POEntry(msgid="_Close", msgstr="Schl_ießen"),
    polib.POEntry(msgid="%(count)d file deleted", msgid_plural="%(count)d files deleted",
                  msgstr_plural={0: "%(count)d Datei gelöscht", 1: "%(count)d Dateien gelöscht"}),
    polib.POEntry(msgid="Cannot open %s: %s", msgstr="%s kann nicht geöffnet werden"),  # lost a placeholder
    polib.POEntry(msgid="Value {0} is too large", msgstr="Der Wert {0} ist zu groß"),
    polib.POEntry(msgid="Rename $1 to $2", msgstr="$2 umbenennen"),  # lost $1
    polib.POEntry(msgid="Fuzzy guess", msgstr="Unscharfe Vermutung", flags=["fuzzy"]),
    polib.POEntry(msgid="Not yet translated", msgstr=""),
    polib.POEntry(msgid="Fax", msgstr="Fax"),  # identical
    polib.POEntry(msgid="Start %PRODUCTNAME now", msgstr="%PRODUCTNAME jetzt starten"),
    polib.POEntry(msgid="word " * 80, msgstr="Wort " * 80),  # too long
]
EXPECTED = {
    ("Open the file", "Die Datei öffnen"),
    ("Save Document", "Dokument speichern"),
    ("Close", "Schließen"),
    ("%(count)d file deleted", "%(count)d Datei gelöscht"),
    ("%(count)d files deleted", "%(count)d Dateien gelöscht"),
    ("Value {0} is too large", "Der Wert {0} ist zu groß"),
    ("Start %PRODUCTNAME now", "%PRODUCTNAME jetzt starten"),
}


@pytest.mark.parametrize("fmt", ["po", "mo"])
def test_catalogue_pairs(tmp_path, fmt):
    path = tmp_path / f"de.{fmt}"
    po = _catalogue(ENTRIES)
    po.save(str(path)) if fmt == "po" else po.save_as_mofile(str(path))
    stats = CatalogueStats()
    pairs = read_catalogue(path, stats)
    assert {(p.source, p.target) for p in pairs} == EXPECTED
    assert stats.dropped["placeholder_mismatch"] == 2
    assert stats.dropped["identical"] == 1
    assert stats.dropped["too_long"] == 1
    # msgfmt leaves fuzzy and untranslated entries out of a .mo; a .po still has them.
    if fmt == "po":
        assert stats.dropped["fuzzy_or_obsolete"] == 1 and stats.dropped["empty"] == 1


def test_placeholders_are_compared_as_multisets():
    assert placeholders("%1$s of %2$s") == placeholders("%2$s von %1$s")
    assert placeholders("%d%% done") == ["%d"]  # %% is a literal percent sign
    assert placeholders("Load $(ARG1) in {name}") == ["$(ARG1)", "{name}"]
    assert placeholders("%PRODUCTNAME %s") == ["%PRODUCTNAME", "%s"]


def test_mnemonics_stripped_but_identifiers_kept():
    assert strip_mnemonics("&File", "&Datei") == ("File", "Datei")
    assert strip_mnemonics("E~xport", "E~xportieren") == ("Export", "Exportieren")
    # an identifier spelled the same on both sides is no accelerator
    assert strip_mnemonics("set debug_dump", "debug_dump setzen") == ("set debug_dump", "debug_dump setzen")
    assert strip_mnemonics("Tom & Jerry", "Tom & Jerry") == ("Tom & Jerry", "Tom & Jerry")
    assert strip_mnemonics("&amp;File", "&amp;Datei") == ("&amp;File", "&amp;Datei")
