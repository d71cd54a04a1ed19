"""What there is to serve: each model as a ``ModelEntry``, found by ``discover``, shown by ``card``.

A ``ModelEntry`` is the registry's record of one model, loaded or not. The registry
(``service.models.registry``) creates one per discovered model at start-up and keeps them in its
``entries`` dict; the other parts (loading, budget, leases) read and update the entries it hands
them. Entries are only ever touched on the event loop: the worker threads a load uses get paths
and engines, never an entry to write.

Threads: ``discover`` reads the weights directory synchronously; the registry calls it on the
event loop at start-up (once, before any model is loaded), benchmarks and tests call it outside
any loop. ``read_cards`` runs in a worker thread at start-up; ``card`` runs on the event loop
(``GET /v1/models``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model import CheckpointError, is_model_dir
from model.formats.manifest import ManifestError, RescoreSpec, is_manifest_dir, locate, read_manifest
from service.engines.generative import BaseEngine
from service.models.facts import file_card
from service.settings import Settings

log = logging.getLogger("tserve.registry")

NO_MEMORY = {"weights_bytes": 0, "kv_cache_bytes": 0, "total_bytes": 0}


@dataclass(eq=False)
class ModelEntry:
    """One model the registry can serve, loaded or not."""

    name: str
    path: Path
    state: str = "available"  # available | loading | loaded | failed
    error: str | None = None  # why the last load failed
    engine: BaseEngine | None = None
    loading: asyncio.Task | None = None  # the one load every request for this model waits on
    last_used: float = 0.0  # monotonic: when its last request ended (or it was seen in flight)
    leases: int = 0  # HTTP requests holding it now
    users: int = 0  # loaded fill-mask models whose rescorer shares this decoder: it stays loaded for them
    rescorer_source: ModelEntry | None = None  # the served decoder this model's rescorer shares while loaded
    keep_alive: float | None = None  # the last request's keep_alive (seconds, -1 forever); None: the setting
    measured_bytes: int | None = None  # weights + KV caches at its last load
    card: dict[str, Any] | None = None  # its /v1/models entry while it was last loaded
    facts: dict[str, Any] | None = None  # its card read from its files, before any load (``facts.file_card``)
    card_error: str | None = None  # why its files could not say what it is

    @property
    def described(self) -> dict[str, Any] | None:
        """What is known of it without loading it: its files' card, else its last load's."""
        return self.facts or self.card

    def in_use(self) -> bool:
        return self.engine is not None and (self.leases > 0 or self.users > 0 or self.engine.in_flight)

    def keep_alive_s(self, default: float) -> float:
        """How long it stays loaded once idle: its last request's ``keep_alive``, else ``default``
        (``TSERVE_KEEP_ALIVE``); -1 is forever."""
        return default if self.keep_alive is None else self.keep_alive


def discover(settings: Settings) -> list[tuple[str, Path]]:
    """(name, path) of each model to serve. ``TSERVE_MODELS`` entries are names in the weights
    directory or paths (a model directory or a ``.gguf`` file); without it, every model
    directory there, skipping (with a warning) manifests whose weight package is missing."""
    root = settings.weights_dir
    found = {p.name: p for p in sorted(root.iterdir()) if is_model_dir(p)} if root.is_dir() else {}
    wanted = settings.model_names()
    if not wanted:
        found = {name: p for name, p in found.items() if _installed(p)}
        if not found:
            raise CheckpointError(f"no model directories (config.json + model.safetensors, or manifest.json) "
                                  f"in {root.resolve()}")
        return list(found.items())
    chosen, missing = [], []
    for entry in wanted:
        path = Path(entry)
        if entry in found:
            chosen.append((entry, found[entry]))
        elif ("/" in entry or entry.endswith(".gguf")) and path.exists():
            chosen.append((path.name.removesuffix(".gguf"), path))
        else:
            missing.append(entry)
    if missing:
        raise CheckpointError(f"TSERVE_MODELS names {missing}: neither a model in {root} (found: {sorted(found)}) "
                              "nor an existing path")
    return chosen


def preloads_by_default(path: Path) -> bool:
    """Whether start-up loads ``path`` when it loads every model found: all but manifests that
    say ``"preload": false`` (listed, loaded on their first request)."""
    try:
        return not is_manifest_dir(path) or read_manifest(path).preload
    except ManifestError:
        return True  # the load itself will say what is wrong


def _installed(path: Path) -> bool:
    """False (with a warning) for a manifest whose weight package is not installed."""
    if not is_manifest_dir(path):
        return True
    try:
        locate(read_manifest(path))
    except ManifestError as exc:
        log.warning("skipping %s: %s", path.name, exc)
        return False
    return True


def read_cards(models: list[tuple[str, Path]], settings: Settings) -> dict[str, tuple[dict | None, str | None]]:
    """(card, None) for each model whose files say what it is (``facts.file_card``: no weights
    read), else (None, why): its load will say more. Runs in a worker thread; the registry writes
    the results into the entries on the event loop."""
    cards: dict[str, tuple[dict | None, str | None]] = {}
    for name, path in models:
        try:
            cards[name] = file_card(name, path, settings), None
        except Exception as exc:  # noqa: BLE001 - any reader's error: the card says it, the load decides
            cards[name] = None, f"{type(exc).__name__}: {exc}"
            log.warning("cannot read what model %s is before loading it: %s", name, cards[name][1])
    return cards


def card(entry: ModelEntry, default_keep_alive: float) -> dict[str, Any]:
    """One model's /v1/models entry: what it is and where it stands (state, why it failed, the
    memory it holds now). A loaded model's fields come from its engine (over its file card, for
    ``source_bytes``); a model that is not loaded shows its file card, whose load-only fields are
    null and named in ``until_loaded``."""
    if entry.engine is not None:
        shown = {**(entry.facts or {}), **entry.engine.info(), "until_loaded": []}
    elif entry.facts is not None:
        shown = {**entry.facts, "memory": dict(NO_MEMORY)}
    else:
        created = int(entry.path.stat().st_mtime) if entry.path.exists() else 0
        shown = {**(entry.card or {"id": entry.name, "object": "model", "created": created,
                                   "owned_by": "transformer-serve"}),
                 "memory": dict(NO_MEMORY), "card_error": entry.card_error}
    return {**shown, "state": entry.state, "state_reason": entry.error,
            "keep_alive": entry.keep_alive_s(default_keep_alive)}


def rescore_spec(path: Path) -> RescoreSpec | None:
    """The fill-mask rescorer a model's manifest names (``rescore``), read without loading it."""
    if not is_manifest_dir(path):
        return None
    try:
        return read_manifest(path).rescore
    except ManifestError:
        return None
