"""The models: what is served, loaded on demand, evicted, looked up. ``EngineRegistry`` composes the parts.

Every model ``discover()`` finds is *available*; the registry *loads* one (in a worker thread,
while the others keep serving) at start-up when ``TSERVE_PRELOAD`` names it, when a request
or ``POST /models/load`` asks for it, and unloads one when ``POST /models/unload`` asks, when it
has been idle for its keep-alive, or when loading another would pass ``TSERVE_MEMORY_BUDGET``
(least recently used idle model first; a model with requests in flight is never unloaded).
States: ``available`` -> ``loading`` -> ``loaded`` -> ``available``; a load that fails leaves
``failed`` with the reason (the next request tries again).

The parts, each in its own module of ``service.models``:

- ``catalogue``: ``ModelEntry`` (one model's record), ``discover``, ``card`` (/v1/models);
- ``loading``: ``ModelLoader``, loads and unloads, holds the lock that serialises them;
- ``budget``: whether a model fits and which one to evict (pure);
- ``leases``: requests' leases on models, and ``KeepAlive`` (unload after idle);
- ``lookup``: which loaded model answers a request (family, placeholders, defaults).

Shared state is owned here: ``entries`` (every available model) and ``engines`` (the loaded
ones) are created once and never rebound; ``start`` fills ``entries``, the loader alone writes
``engines``. The one lock (``loader.lock``) belongs to the loader; keep-alive and ``unload``
take it too.

``start()`` runs in the background of the app's lifespan, so /health answers at once and
/ready turns true once the preloaded models are loaded and warmed up.

Threads: every method runs on the event loop (the loads' heavy parts go to worker threads
inside ``ModelLoader``), except ``discover``, which benchmarks and tests also call outside one.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from model import CheckpointError
from service.engines.base import TASKS, EngineLoad
from service.engines.errors import EngineStoppedError, InvalidRequestError, ModelNotFoundError
from service.engines.generative import BaseEngine, GenerativeEngine
from service.metrics import Metrics
from service.models import catalogue, leases
from service.models.catalogue import ModelEntry
from service.models.leases import KeepAlive
from service.models.loading import ModelLoader
from service.models.lookup import DEFAULT_SETTINGS, FAMILY_NAMES, check_family, is_placeholder, pick_default
from service.schemas.common import printable
from service.settings import Settings

log = logging.getLogger("tserve.registry")

# What /ready reports per model (the loaded ones keep the word they always had).
READY_WORDS = {"loaded": "ready", "loading": "loading", "available": "available", "failed": "failed"}


class EngineRegistry:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.engines: dict[str, BaseEngine] = {}  # the loaded (serving) models; written by the loader
        self.entries: dict[str, ModelEntry] = {}  # every available model; filled by start()
        self.preloaded: list[str] = []
        self.error: str | None = None
        self.started = False
        self.stopping = False
        self.loader = ModelLoader(settings, metrics, self.entries, self.engines, self._preloading)
        self.keep_alive = KeepAlive(self.entries, settings, self.loader.lock, self.loader.unload)

    def _preloading(self) -> list[str] | None:
        """The models start-up is preloading, until it is done (the budget keeps them)."""
        return None if self.started else self.preloaded

    # --- lifecycle ----------------------------------------------------------------------------
    def discover(self) -> list[tuple[str, Path]]:
        """(name, path) of each model to serve (``catalogue.discover``)."""
        return catalogue.discover(self.settings)

    async def start(self) -> None:
        """Find the models, load the preloaded ones in order; a failure is ``self.error``."""
        try:
            self.entries.update((name, ModelEntry(name, path)) for name, path in self.discover())
            cards = await asyncio.to_thread(catalogue.read_cards, [(n, e.path) for n, e in self.entries.items()],
                                            self.settings)
            for name, (facts, why) in cards.items():
                self.entries[name].facts, self.entries[name].card_error = facts, why
            wanted = self.settings.preload_names()
            if wanted is None:  # every model TSERVE_MODELS names; without it, all found but the on-demand ones
                named = bool(self.settings.model_names())
                wanted = [n for n, e in self.entries.items() if named or catalogue.preloads_by_default(e.path)]
            self.preloaded = wanted
            unknown = [n for n in self.preloaded if n not in self.entries]
            if unknown:
                raise CheckpointError(f"TSERVE_PRELOAD names {unknown}, which are not served (available: "
                                      f"{sorted(self.entries)})")
            for name in self.preloaded:
                await self.load(name)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("model loading failed: %s", self.error)
        finally:
            self.started = True
            self.keep_alive.start()

    async def stop(self, grace_s: float) -> None:
        self.stopping = True
        self.keep_alive.cancel()
        await asyncio.gather(*(e.stop(grace_s) for e in self.engines.values()))

    @property
    def ready(self) -> bool:
        """Ready for Kubernetes: the preloaded models loaded and warmed up, no start-up error, not
        shutting down. A model unloaded later (idle, evicted) does not make it unready: a request
        for it loads it again."""
        return self.started and self.error is None and not self.stopping and bool(self.entries)

    def status(self) -> dict:
        return {"ready": self.ready, "error": self.error,
                "models": {name: READY_WORDS[e.state] for name, e in self.entries.items()}}

    # --- loading and unloading (``ModelLoader``) ------------------------------------------------
    async def load(self, name: str) -> BaseEngine:
        """The engine of ``name``, loading it first if needed; concurrent callers share one load.
        A caller that gives up (deadline, client gone) does not cancel it for the others."""
        return await self.loader.load(self._entry(name))

    async def load_within_deadline(self, name: str) -> BaseEngine:
        """``load``, waiting at most TSERVE_REQUEST_TIMEOUT_S (504 after; the load goes on). A load
        that fails for another reason than the budget is a 503 naming the cause."""
        entry = self._entry(name)
        if self.stopping:
            raise EngineStoppedError("the server is shutting down")
        return await self.loader.load_within_deadline(entry)

    async def unload(self, name: str) -> None:
        """Unload ``name`` now (``POST /models/unload``); in-flight requests get the shutdown grace."""
        entry = self._entry(name)
        async with self.loader.lock:
            if entry.engine is None:
                raise InvalidRequestError(f"model '{printable(name)}' is not loaded (state: {entry.state})", "model",
                                          code="model_not_loaded")
            users = sorted(e.name for e in self.entries.values() if e.rescorer_source is entry)
            if users:
                raise InvalidRequestError(f"model '{printable(name)}' is the fill-mask rescorer of {users}, which "
                                          "share its weights; unload those first", "model")
            await self.loader.unload(entry, "request")

    # --- lookup --------------------------------------------------------------------------------
    def _entry(self, name: str) -> ModelEntry:
        entry = self.entries.get(name)
        if entry is None:
            if not self.started and not self.entries:
                raise EngineStoppedError("models are still being discovered")
            raise ModelNotFoundError(f"model '{printable(name)}' not found; available: {sorted(self.entries)}",
                                     "model")
        return entry

    def check_named(self, name: str, family: str, endpoint: str) -> None:
        """Raise as ``acquire`` would for a name that is not served (404) or is of another family
        (400), without loading it."""
        entry = self._entry(name)
        known = entry.engine.info() if entry.engine is not None else entry.described
        if known is not None:
            check_family(name, known["family"], family, endpoint)

    async def acquire(self, name: str | None, family: str, endpoint: str, task: str | None = None,
                      only_one: bool = False, keep_alive: float | None = None) -> BaseEngine:
        """``get``, loading first (within the request's deadline, TSERVE_REQUEST_TIMEOUT_S) a named
        model that is available but not loaded, or, without a name, the default model that
        ``default_to_load`` says is needed. ``keep_alive``: how long the model stays loaded after
        this request (seconds, -1 forever; None: TSERVE_KEEP_ALIVE)."""
        if only_one and is_placeholder(name):
            name = None
        wanted = self.default_to_load(family, task, only_one) if name is None and not self.stopping else None
        if wanted is not None:  # no loaded model answers a request without one: its default loads, like a named one
            await self.load_within_deadline(wanted)
        entry = self.entries.get(name) if name is not None else None
        if entry is not None and entry.engine is None and not self.stopping:
            known = entry.described  # its files' card (or its last load's): its family is known before loading
            if known is not None:
                check_family(name, known["family"], family, endpoint)
            await self.load_within_deadline(name)
        engine = self.get(name, family, endpoint, task, only_one)
        self.entries[engine.name].keep_alive = keep_alive
        return engine

    def request_leases(self) -> AbstractContextManager[None]:
        """The scope of one HTTP request (a context manager): the models it is handed stay in use
        until it ends (``leases.request_leases``)."""
        return leases.request_leases()

    def default(self, task: str) -> BaseEngine | None:
        """The model a drop-in request of ``task`` (``TASKS``' values, or ``feature-extraction``)
        without a model goes to (``lookup.pick_default``); None when no model of it is loaded."""
        candidates = [e for e in self.engines.values() if e.task == task]
        return pick_default(candidates, task, self.settings) if candidates else None

    def default_to_load(self, family: str, task: str | None = None, only_one: bool = False) -> str | None:
        """The model a request of ``family`` (and ``task``) without a model needs loaded first; None
        when a loaded model answers it (``get``) or no model's card says it serves it. A drop-in
        request (``only_one``) needs its task's ``TSERVE_DEFAULT_*_MODEL`` where set; otherwise one
        is needed only when no model of the family is loaded: the task's default among every
        model's card, chosen as ``lookup.pick_default`` chooses among loaded ones."""
        task = task or TASKS[family]
        setting = DEFAULT_SETTINGS.get(task)
        named = getattr(self.settings, setting) if setting else ""
        if only_one and named:
            entry = self.entries.get(named)  # of another family or not served: ``pick_default`` says so
            fits = entry is not None and (entry.described or {}).get("family", family) == family
            return named if fits and entry.engine is None else None
        if any(e.family == family for e in self.engines.values()):
            return None
        cards = [e for e in self.entries.values() if e.described and e.described["family"] == family]
        of_task = [e for e in cards if e.described["task"] == task] or cards
        if not of_task:
            return None
        if named and any(e.name == named for e in of_task):
            return named
        if task == "text-generation":
            return next((e.name for e in of_task if e.described.get("chat")), of_task[0].name)
        return of_task[0].name

    def get(self, name: str | None, family: str, endpoint: str, task: str | None = None,
            only_one: bool = False) -> BaseEngine:
        """The loaded engine for ``name``; without a name, the first loaded model of ``family`` (of
        ``task`` where models of other tasks could answer too). With ``only_one`` (the drop-in APIs,
        whose clients send no model or a placeholder such as ``"tgi"``) the task's default model
        answers (``default``), and a placeholder counts as no name. The model is leased to the
        current request."""
        if only_one and is_placeholder(name):
            name = None
        if name is None:
            candidates = [e for e in self.engines.values() if e.family == family]
            if task is not None and any(e.task == task for e in candidates):
                candidates = [e for e in candidates if e.task == task]
            if not candidates:
                if not self.started:
                    raise EngineStoppedError("models are still loading")
                raise ModelNotFoundError(f"no {FAMILY_NAMES[family]} model is loaded", "model")
            engine = pick_default(candidates, task or TASKS[family], self.settings) if only_one else candidates[0]
        else:
            engine = self.engines.get(name)
            if engine is None:
                entry = self.entries.get(name)
                if entry is not None:
                    raise EngineStoppedError(f"model '{printable(name)}' is not loaded (state: {entry.state}"
                                             f"{'; ' + entry.error if entry.error else ''})")
                if not self.started:
                    raise EngineStoppedError("models are still loading")
                raise ModelNotFoundError(f"model '{printable(name)}' not found; available: {sorted(self.entries)}",
                                         "model")
            check_family(name, engine.family, family, endpoint)
        if not engine.ready:
            raise EngineStoppedError(f"model '{engine.name}' is not ready")
        leases.lease(self.entries[engine.name])
        return engine

    # --- what /v1/models shows (``catalogue.card``) ---------------------------------------------
    def loads(self) -> list[EngineLoad]:
        """The latest load of each loaded generative model (what GET /v1/loads sums)."""
        return [e.last_load for e in list(self.engines.values()) if isinstance(e, GenerativeEngine)]

    def cards(self) -> list[dict[str, Any]]:
        return [self.card(name) for name in self.entries]

    def card(self, name: str) -> dict[str, Any]:
        return catalogue.card(self._entry(name), self.settings.keep_alive)
