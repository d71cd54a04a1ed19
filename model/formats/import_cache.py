"""Converted weights, kept between starts: a GGUF file imported once, then read back as one of
our checkpoints.

Importing a GGUF file costs most of a start (Gemma 3 270M: ~18 s parsing its 262k-token
vocabulary out of the metadata, ~5 s dequantizing; SmolLM2: ~4 s; Qwen2.5-Coder 1.5B: ~40 s
with its int8 copies). The result of the import is written with
``model.formats.checkpoint.save`` (config.json, float32 model.safetensors, tokenizer.json,
chat template, stop ids) under

    <TSERVE_WEIGHTS_CACHE>/converted/<source, 16 hex>-<key, 16 hex>/

(default ``~/.cache/transformer-serve/converted/``; 4 bytes a parameter: Gemma 3 270M ~1.1 GB,
Qwen2.5-Coder 1.5B ~6.2 GB, plus the int8 copies model.quant.int8 keeps beside them), and later
starts map that directory instead (safetensors: pages are read as they are touched, and a
native step that keeps only the int8 copies touches few of them). The key hashes what the
conversion depends on: the source's identity, the source of the converter and of the model
code (model/formats, model/tokenization, model/nn, model/config.py), the versions of gguf and
torch, and ``CACHE_FORMAT``. Any change there gives a new directory; the older ones of the same
source are removed when it is written, unless read or written within the last hour
(``IN_USE_S``): two code versions served side by side share the cache without pulling entries
from under each other's loads.

The source's identity: a manifest's file by its pinned sha256 (verified by ``locate``); a GGUF
path given directly by its resolved path, size, modification time and inode (``file_identity``:
hashing a 1 GB file on every start would cost seconds), so a file rewritten in place is
converted again. ``TSERVE_CONVERTED_CACHE=off`` turns the cache off.

Safety: an entry is written into a temporary directory beside it and renamed into place, so
a reader sees no entry or a whole one. An entry that cannot be read (truncated, edited, from
an incompatible version) is logged as a warning, removed and converted again; a cache that
cannot be written is a warning, and the model is served from the import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from model.formats.checkpoint import (
    CHAT_TEMPLATE_FILE,
    CONFIG_FILE,
    GENERATION_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    Checkpoint,
    CheckpointError,
    check_safetensors_complete,
    load,
    save,
)
from model.formats.gguf_import import chat_and_stops, check_all_used, float_tensors, open_gguf
from model.formats.manifest import Manifest, cache_dir

log = logging.getLogger("tserve.weights")

CACHE_FORMAT = 1  # bump when the layout of an entry changes
# An older entry of the same source read or written this recently may be another process's (a
# server of another code version starting beside this one, mid-read): it is kept until it ages.
IN_USE_S = 3600.0
SWITCH_ENV = "TSERVE_CONVERTED_CACHE"
SUBDIR = "converted"
MODEL_ROOT = Path(__file__).resolve().parents[1]  # model/
# The code a converted checkpoint depends on: the importers, the tokenizers, the layers whose
# state-dict keys and stored conventions (e.g. Gemma's 1 + w norms) the entry is written in.
CODE = ("formats", "tokenization", "nn", "config.py")


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def code_version() -> str:
    """sha256 over the source files the conversion depends on (``CODE``), in path order."""
    digest = hashlib.sha256()
    for part in CODE:
        root = MODEL_ROOT / part
        for file in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            digest.update(str(file.relative_to(MODEL_ROOT)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def file_identity(file: Path) -> dict[str, object]:
    """What says a GGUF file given by path is the one converted before: where it is, its size,
    modification time and inode (a rewrite or a replacement changes one of them)."""
    st = file.stat()
    return {"path": str(file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _source(source: Manifest | Path) -> tuple[str, dict[str, object]]:
    """(the entry name's first part, the source's part of the key)."""
    if isinstance(source, Manifest):
        return source.sha256[:16], {"source_sha256": source.sha256, "source_format": source.format}
    identity = file_identity(source)
    return "f" + hashlib.sha256(str(identity["path"]).encode()).hexdigest()[:15], {
        "source_file": identity, "source_format": "gguf"}


def cache_key(source: Manifest | Path) -> dict[str, object]:
    """Everything an entry depends on, as stored in its ``source.json``."""
    return {"cache_format": CACHE_FORMAT, **_source(source)[1], "code": code_version(), "gguf": _version("gguf"),
            "torch": torch.__version__}


def entry_dir(source: Manifest | Path, key: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / SUBDIR / f"{_source(source)[0]}-{digest[:16]}"


def load_converted(source: Manifest | Path, convert: Callable[[], Checkpoint], device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None, gguf: Path | None = None) -> Checkpoint:
    """The checkpoint of ``source`` (a manifest, or a GGUF file's path) on ``device`` (floats
    cast to ``dtype``): read from the cache entry for the current key, or ``convert()`` (the
    import, float32 on the CPU), written as that entry and read back from it, so a first and a
    later start serve the same tensors. Without the cache (off, or not writable) the import
    itself is returned, placed. ``gguf``: the file ``convert`` imports, written into the entry
    tensor by tensor instead (``write_gguf_entry``: the float model never exists whole in
    memory; the entry is then mapped)."""
    if not enabled():
        return _placed(convert(), device, dtype)
    key = cache_key(source)
    entry = entry_dir(source, key)
    path = source.path.parent if isinstance(source, Manifest) else source
    if entry.is_dir():
        try:
            ckpt = _read(entry, path, device, dtype)
            log.info("converted weights read from the cache", extra={"entry": str(entry)})
            return ckpt
        except Exception as exc:  # noqa: BLE001 - an unreadable entry is rebuilt, never served
            log.warning("converted weights in %s cannot be read (%s: %s); converting again", entry,
                        type(exc).__name__, exc)
            shutil.rmtree(entry, ignore_errors=True)
    if gguf is not None and _write(entry, lambda tmp: write_gguf_entry(gguf, tmp), key, path):
        return _read(entry, path, device, dtype)
    ckpt = convert()
    if not _write(entry, _saver(ckpt), key, ckpt.path):
        return _placed(ckpt, device, dtype)
    del ckpt
    return _read(entry, path, device, dtype)


def _saver(ckpt: Checkpoint) -> Callable[[Path], None]:
    return lambda tmp: save(tmp, ckpt.model, ckpt.tokenizer, chat_template=ckpt.chat_template,
                            stop_token_ids=ckpt.stop_token_ids)


def write_gguf_entry(file: Path, directory: Path) -> None:
    """The import of ``file`` as our checkpoint in ``directory``, what ``save`` writes of
    ``load_gguf(file)``, with the weights streamed into model.safetensors one tensor at a time."""
    f, cfg, tokenizer = open_gguf(file)
    shapes, tensors = float_tensors(f, cfg)
    _write_safetensors(directory / WEIGHTS_FILE, shapes, tensors, {"format": "pt", "family": cfg.family})
    check_all_used(f)
    cfg.save(directory / CONFIG_FILE)
    tokenizer.save(directory / TOKENIZER_FILE)
    template, stops = chat_and_stops(f, cfg)
    if template is not None:
        (directory / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    if stops:
        (directory / GENERATION_FILE).write_text(json.dumps({"stop_token_ids": stops}, indent=2) + "\n")


def _write_safetensors(file: Path, shapes: dict[str, tuple[int, ...]], tensors, metadata: dict[str, str]) -> None:
    """A safetensors file of float32 tensors named and shaped by ``shapes``, whose data
    ``tensors`` yields in that order, each written and let go before the next."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with file.open("wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for (name, t), expected in zip(tensors, shapes, strict=True):
            if name != expected or tuple(t.shape) != shapes[name] or t.dtype != torch.float32:
                raise CheckpointError(f"{file}: tensor '{name}' {list(t.shape)} {t.dtype} does not match the header")
            out.write(t.contiguous().numpy().data)
            del t


def _read(entry: Path, path: Path, device: str | torch.device, dtype: torch.dtype | None) -> Checkpoint:
    problem = check_safetensors_complete(entry / WEIGHTS_FILE)
    if problem:
        raise CheckpointError(problem)
    ckpt = dataclasses.replace(load(entry, device, dtype), path=path)
    try:
        os.utime(entry)  # last use: an entry in use is not pruned (IN_USE_S)
    except OSError:
        pass  # a read-only cache
    ckpt.model.weights_cache_dir = entry  # model.quant.int8 keeps the model's int8 copies beside it
    return ckpt


def _placed(ckpt: Checkpoint, device: str | torch.device, dtype: torch.dtype | None) -> Checkpoint:
    ckpt.model.to(device=device, dtype=dtype)
    return ckpt


def _write(entry: Path, fill: Callable[[Path], None], key: dict[str, object], served_as: Path) -> bool:
    """Write ``entry`` atomically (``fill`` writes the checkpoint into a temporary sibling, renamed
    into place); older entries of the same source go. Failing to write is a warning (returns
    False)."""
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the entry from other users of a shared cache
        fill(tmp)
        (tmp / "source.json").write_text(json.dumps({**key, "manifest": str(served_as)}, indent=2) + "\n")
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():  # another process won the race with the same entry: keep theirs
                raise
        else:
            tmp = None
        for old in entry.parent.glob(entry.name.split("-")[0] + "-*"):
            if old != entry and old.is_dir() and _unused(old):
                shutil.rmtree(old, ignore_errors=True)
        _remove_orphans(entry.parent)
        log.info("converted weights cached", extra={"entry": str(entry)})
        return True
    except OSError as exc:
        log.warning("cannot cache converted weights in %s (%s); set TSERVE_WEIGHTS_CACHE to a writable directory "
                    "or TSERVE_CONVERTED_CACHE=off", entry.parent, exc)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _unused(entry: Path) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > IN_USE_S
    except OSError:
        return False  # gone already, or not ours to judge


def _remove_orphans(root: Path) -> None:
    """Removes the entries of GGUF files given by path that no longer exist (a test's temporary
    file, a download since deleted): nothing would ever read them again."""
    for entry in root.glob("f*-*"):
        try:
            source = json.loads((entry / "source.json").read_text())["source_file"]["path"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours to judge
        if not Path(source).exists():
            shutil.rmtree(entry, ignore_errors=True)
