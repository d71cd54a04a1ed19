"""Corpus writing: de-duplication, the hash split and its stability, prose readers."""

from __future__ import annotations

import json

import polib

from model.train.data.catalogues import read_catalogues
from model.train.data.corpus import SPLITS, load_split, split_of, write_corpus
from model.train.data.prose import html_paragraphs, text_paragraphs
from model.train.data.sources import debian_licence


def _pairs(n: int, offset: int = 0) -> list[dict[str, str]]:
    return [{"source": f"Delete item number {i}", "target": f"Eintrag Nummer {i} löschen", "origin": "t"}
            for i in range(offset, offset + n)]


def _where(out_dir) -> dict[str, str]:
    return {r["source"]: split for split in SPLITS for r in load_split(out_dir, split)}


def test_split_is_stable_when_data_is_added(tmp_path):
    first = write_corpus(tmp_path / "a", _pairs(600), "source", ("source", "target"))
    second = write_corpus(tmp_path / "b", _pairs(600) + _pairs(900, offset=600), "source", ("source", "target"))
    before, after = _where(tmp_path / "a"), _where(tmp_path / "b")
    assert all(after[s] == split for s, split in before.items())
    assert sum(v["records"] for v in first["splits"].values()) == 600
    assert sum(v["records"] for v in second["splits"].values()) == 1500
    # every split gets some records at these rates (2% test, 1% valid)
    assert all(second["splits"][s]["records"] > 0 for s in SPLITS)


def test_dedup_and_same_source_stays_in_one_split(tmp_path):
    pairs = _pairs(300)
    pairs += [dict(p) for p in pairs[:50]]  # exact duplicates
    pairs += [{"source": "Delete item number 7", "target": "Element 7 entfernen", "origin": "u"}]  # 2nd translation
    entry = write_corpus(tmp_path, pairs, "source", ("source", "target"))
    assert entry["duplicates_removed"] == 50
    kept = [r for s in SPLITS for r in load_split(tmp_path, s)]
    assert len(kept) == 301
    homes = {s for s in SPLITS for r in load_split(tmp_path, s) if r["source"] == "Delete item number 7"}
    assert homes == {split_of("Delete item number 7")}


def test_written_files_are_reproducible(tmp_path):
    a = write_corpus(tmp_path / "a", _pairs(200), "source", ("source", "target"))
    b = write_corpus(tmp_path / "b", _pairs(200), "source", ("source", "target"))
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # same sha256 per split


def test_catalogues_to_corpus(tmp_path):
    """A .po and a .mo written here, read together, de-duplicated across files."""
    for i, fmt in enumerate(("po", "mo")):
        po = polib.POFile()
        po.metadata = {"Content-Type": "text/plain; charset=UTF-8"}
        po.append(polib.POEntry(msgid="_Print", msgstr="_Drucken"))  # in both files
        po.append(polib.POEntry(msgid=f"Page {i}", msgstr=f"Seite {i}"))
        path = tmp_path / f"c{i}.{fmt}"
        po.save(str(path)) if fmt == "po" else po.save_as_mofile(str(path))
    pairs, stats = read_catalogues(tmp_path.glob("c*"))
    assert stats.pairs == 4
    records = [{"source": p.source, "target": p.target} for p in pairs]
    entry = write_corpus(tmp_path / "out", records, "source", ("source", "target"))
    assert entry["duplicates_removed"] == 1
    kept = {(r["source"], r["target"]) for s in SPLITS for r in load_split(tmp_path / "out", s)}
    assert kept == {("Print", "Drucken"), ("Page 0", "Seite 0"), ("Page 1", "Seite 1")}


def test_prose_paragraphs():
    book = "HAMLET.\nTo be, or not to be,--that is the question:--\n\n\n\nOPHELIA.\nGood my lord,\n\nx\n"
    assert text_paragraphs(book) == ["HAMLET.\nTo be, or not to be,--that is the question:--",
                                     "OPHELIA.\nGood my lord,"]  # "x" is too short to be a paragraph
    html = ("<h1>Intro¶</h1><p>Python is an <em>easy</em> to learn,\n powerful language.</p>"
            "<pre>print('code is skipped')</pre><p>It has efficient data structures.</p>")
    assert html_paragraphs(html) == ["Python is an easy to learn, powerful language.",
                                     "It has efficient data structures."]


def test_debian_licence_from_copyright_files(tmp_path):
    files = {
        "dep5": "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
                "Files: debian/*\nCopyright: 2020 Someone\nLicense: MIT\n\n"
                "Files: *\nCopyright: 2020 Upstream\nLicense: GPL-3+\n",
        "freetext": "Copyright (C) 2002 Someone.\n\nLicense:\n\n   This package is free software; you can "
                    "redistribute it under the terms of the GNU General Public License as published by the Free "
                    "Software Foundation; either version 2 of the License, or (at your option) any later version.\n",
        "nolicence": "Copyright (C) 2002 Someone. All rights reserved.\n",
    }
    for package, text in files.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "copyright").write_text(text)
    assert debian_licence("dep5", tmp_path) == "GPL-3+"  # the Files: * stanza, not the first one
    assert debian_licence("freetext", tmp_path) == "GPL-2+ (from a free-text copyright file)"
    assert debian_licence("nolicence", tmp_path) is None  # not used
    assert debian_licence("missing", tmp_path) is None
