"""Prepared corpora on disk: de-duplication, the hash split, files and their manifest.

A corpus directory holds ``train.jsonl.gz``, ``valid.jsonl.gz`` and ``test.jsonl.gz``
(one JSON object per line: ``{"text": ...}`` for prose, ``{"source", "target"}`` for
translation). Which split a record goes to depends only on a hash of its (source) text,
so adding data never moves an existing record from one split to another, and the same
source sentence can never sit in train and test at once.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPLITS = ("train", "valid", "test")
EXTRA_SPLITS = ("heldout",)  # translation-en-de-v2: whole packages kept out of training
TEST_PER_MILLE = 20  # 2% of the records
VALID_PER_MILLE = 10  # 1%


def split_of(key: str) -> str:
    """The split a record belongs to, from the sha256 of its key text."""
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 1000
    if bucket < TEST_PER_MILLE:
        return "test"
    if bucket < TEST_PER_MILLE + VALID_PER_MILLE:
        return "valid"
    return "train"


def dedup_key(text: str) -> str:
    return " ".join(text.split())


def dedup(records: Iterable[dict[str, str]], key_fields: tuple[str, ...]) -> tuple[list[dict[str, str]], int]:
    """Keep the first occurrence of each record (whitespace-normalised key fields); order kept."""
    seen: set[tuple[str, ...]] = set()
    kept, dropped = [], 0
    for rec in records:
        key = tuple(dedup_key(rec[f]) for f in key_fields)
        if key in seen:
            dropped += 1
            continue
        seen.add(key)
        kept.append(rec)
    return kept, dropped


def write_jsonl_gz(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """gzip without a timestamp or file name, so the same records give the same bytes."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        for rec in records:
            gz.write((json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8"))
    path.write_bytes(buf.getvalue())


def read_jsonl_gz(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: corpus file not found (run `python -m model.train.data prepare`)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_corpus(out_dir: Path, records: list[dict[str, str]], split_field: str,
                 key_fields: tuple[str, ...]) -> dict[str, Any]:
    """De-duplicate, split by hash of ``split_field`` and write the three files.

    Returns the manifest entry: counts and sha256 per split, and how many duplicates went.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    kept, duplicates = dedup(records, key_fields)
    by_split: dict[str, list[dict[str, str]]] = {s: [] for s in SPLITS}
    for rec in kept:
        by_split[split_of(dedup_key(rec[split_field]))].append(rec)
    entry: dict[str, Any] = {"records_in": len(records), "duplicates_removed": duplicates, "splits": {}}
    for split, recs in by_split.items():
        path = out_dir / f"{split}.jsonl.gz"
        write_jsonl_gz(path, recs)
        entry["splits"][split] = {"file": path.name, "records": len(recs), "sha256": sha256_file(path)}
    return entry


def load_split(corpus_dir: str | Path, split: str) -> list[dict[str, Any]]:
    if split not in SPLITS + EXTRA_SPLITS:
        raise ValueError(f"split must be one of {SPLITS + EXTRA_SPLITS}, got {split!r}")
    return read_jsonl_gz(Path(corpus_dir) / f"{split}.jsonl.gz")
