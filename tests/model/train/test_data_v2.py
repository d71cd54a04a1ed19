"""translation-en-de-v2 corpus: the package-held-out split (``write_v2``), the filter report,
and reading unpacked packages into records (``translation_v2_records``)."""

from __future__ import annotations

import json

import polib

from model.train.data import prepare
from model.train.data.corpus import SPLITS, load_split, read_jsonl_gz
from model.train.data.debian_l10n import DebCatalogues
from model.train.data.prepare import filter_report, translation_v2_records, write_v2


def rec(source: str, target: str, package: str, heldout: bool = False) -> dict:
    r = {"source": source, "target": target, "origin": f"debian/{package}/d", "package": package}
    return r | ({"heldout": True} if heldout else {})


def test_write_v2_heldout_split(tmp_path):
    inside = [rec(f"Open file number {i}", f"Datei Nummer {i} öffnen", "pkg-a") for i in range(200)]
    inside.append(dict(inside[0]))  # an inside duplicate
    held = [
        rec("Start a new game", "Neues Spiel starten", "gnome-mines", True),
        rec("Start a new game", "Neues Spiel starten", "gnome-mines", True),  # duplicate
        rec("Start  a new\tgame", "Neues Spiel starten", "quadrapassel", True),  # the same, modulo whitespace
        rec("Start a new game", "Ein neues Spiel beginnen", "quadrapassel", True),  # same source, other target
        rec("Open file number 5", "Datei 5 öffnen", "gnome-mines", True),  # source seen in training packages
        rec(" Open   file number 7 ", "Datei 7 öffnen", "mousepad", True),  # seen, modulo whitespace
        rec("Flag a mine", "Eine Mine markieren", "gnome-mines", True),
    ]
    entry = write_v2(tmp_path, inside[:100] + held + inside[100:])

    assert set(entry["splits"]) == {*SPLITS, "heldout"}
    assert entry["duplicates_removed"] == 1
    assert sum(entry["splits"][s]["records"] for s in SPLITS) == 200
    training_sources = {r["source"] for s in SPLITS for r in load_split(tmp_path, s)}
    assert not training_sources & {r["source"] for r in held if r["source"].startswith(("Start", "Flag"))}

    h = entry["splits"]["heldout"]
    got = read_jsonl_gz(tmp_path / "heldout.jsonl.gz")
    assert load_split(tmp_path, "heldout") == got
    assert [(r["source"], r["target"]) for r in got] == [
        ("Start a new game", "Neues Spiel starten"),
        ("Start a new game", "Ein neues Spiel beginnen"),
        ("Flag a mine", "Eine Mine markieren"),
    ]
    assert h["records"] == 3 and h["duplicates_removed"] == 2 and h["removed_as_seen_in_training_packages"] == 2
    assert h["packages"] == ["gnome-mines", "quadrapassel"]  # mousepad's only record was seen in training
    assert h["file"] == "heldout.jsonl.gz" and len(h["sha256"]) == 64

    again = write_v2(tmp_path / "again", inside[:100] + held + inside[100:])
    assert json.dumps(again, sort_keys=True) == json.dumps(entry, sort_keys=True)  # reproducible bytes


def test_write_v2_without_heldout_records(tmp_path):
    entry = write_v2(tmp_path, [rec("Quit", "Beenden", "pkg-a")])
    assert entry["splits"]["heldout"]["records"] == 0 and entry["splits"]["heldout"]["packages"] == []
    assert read_jsonl_gz(tmp_path / "heldout.jsonl.gz") == []


def test_filter_report_sums_over_catalogues():
    sources = [
        {"name": "debian:a", "entries": 10, "pairs": 6, "dropped": {"empty": 3, "too_long": 1}},
        {"name": "debian:b", "entries": 5, "pairs": 2, "dropped": {"empty": 1, "fuzzy": 2}},
        {"name": "debian:c", "entries": 0, "pairs": 0, "dropped": {}},
        {"name": "skipped (no licence in the copyright file)", "packages": ["x"]},  # no counts at all
    ]
    assert filter_report(sources) == {"catalogue_entries": 15, "pairs": 8,
                                      "dropped_by_filter": {"empty": 4, "fuzzy": 2, "too_long": 1}}
    assert list(filter_report(sources)["dropped_by_filter"]) == ["empty", "fuzzy", "too_long"]
    assert filter_report([]) == {"catalogue_entries": 0, "dropped_by_filter": {}, "pairs": 0}


def _mo(path, pairs: dict[str, str]):
    po = polib.POFile()
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8"}
    for msgid, msgstr in pairs.items():
        po.append(polib.POEntry(msgid=msgid, msgstr=msgstr))
    po.save_as_mofile(str(path))
    return path


def test_translation_v2_records_marks_heldout_packages_and_skips_unlicensed(tmp_path, monkeypatch):
    mines = _mo(tmp_path / "gnome-mines.mo", {"Flag a mine": "Eine Mine markieren", "": ""})
    tool = _mo(tmp_path / "tool.mo", {"Open the file": "Die Datei öffnen"})
    debs = [DebCatalogues("some-tool", "1.0", "GPL-2+", {"tool": tool}),
            DebCatalogues("gnome-mines", "40.1", "GPL-3+", {"gnome-mines": mines}),
            DebCatalogues("secret", "2", None, {"tool": tool}),
            DebCatalogues("no-german", "3", "MIT", {})]
    v1 = [{"source": "Save", "target": "Speichern", "origin": "libreoffice/sw"}]
    monkeypatch.setattr(prepare, "translation_records", lambda cache, system_catalogues: (list(v1), [{"name": "lo"}]))
    monkeypatch.setattr(prepare, "read_package_list", lambda: [d.package for d in debs])
    monkeypatch.setattr(prepare, "unpack_all", lambda packages, cache: [d for d in debs if d.package in packages])

    records, sources = translation_v2_records(tmp_path)
    assert records == [
        {"source": "Save", "target": "Speichern", "origin": "libreoffice/sw", "package": "libreoffice"},
        {"source": "Open the file", "target": "Die Datei öffnen", "origin": "debian/some-tool/tool",
         "package": "some-tool"},
        {"source": "Flag a mine", "target": "Eine Mine markieren", "origin": "debian/gnome-mines/gnome-mines",
         "package": "gnome-mines", "heldout": True},
    ]
    by_name = {s["name"]: s for s in sources}
    assert by_name["debian:gnome-mines"]["heldout"] is True and by_name["debian:some-tool"]["heldout"] is False
    assert by_name["debian:some-tool"]["licence"] == "GPL-2+" and by_name["debian:some-tool"]["pairs"] == 1
    assert "debian:secret" not in by_name and "debian:no-german" not in by_name
    assert by_name["skipped (no licence in the copyright file)"]["packages"] == ["secret"]
