"""The models: discovery in the weights directory, loading on demand, eviction, lookup.

Every model ``discover()`` finds is *available*; the registry *loads* one (in a worker thread,
while the others keep serving) at start-up when ``TSERVE_PRELOAD`` names it, when a request
or ``POST /models/load`` asks for it, and unloads one when ``POST /models/unload`` asks, when it
has been idle for its keep-alive, or when loading another would pass ``TSERVE_MEMORY_BUDGET``
(least recently used idle model first; a model with requests in flight is never unloaded).
States: ``available`` -> ``loading`` -> ``loaded`` -> ``available``; a load that fails leaves
``failed`` with the reason (the next request tries again).

``start()`` runs in the background of the app's lifespan, so /health answers at once and
/ready turns true once the preloaded models are loaded and warmed up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model import CheckpointError, is_model_dir, load_model
from model.config import DTYPES
from model.decode import prepare, prepare_weights
from model.formats.manifest import ManifestError, is_manifest_dir, locate, read_manifest
from service.engines.base import TASKS
from service.engines.encoder import EncoderEngine
from service.engines.errors import (
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    MemoryBudgetError,
    ModelNotFoundError,
    RequestFailedError,
)
from service.engines.generative import BaseEngine, GenerativeEngine
from service.metrics import Metrics
from service.models.facts import source_facts
from service.models.memory import release_memory, source_weight_bytes
from service.schemas.common import printable
from service.settings import Settings

log = logging.getLogger("tserve.registry")

# the setting that names each task's default model (``EngineRegistry.default``)
DEFAULT_SETTINGS = {"text-generation": "default_generation_model", "feature-extraction": "default_embedding_model",
                    "fill-mask": "default_fill_mask_model", "translation": "default_translation_model"}
# what drop-in clients send when they have no model to name: TGI's and TEI's own names, test
# placeholders, an empty string, or the server's URL (huggingface_hub with a base_url)
PLACEHOLDER_MODELS = {"", "tgi", "tei", "dummy", "default", "unused", "none"}


def is_placeholder(name: str | None) -> bool:
    return name is None or name.strip().lower() in PLACEHOLDER_MODELS or name.startswith(("http://", "https://"))


FAMILY_NAMES = {"encoder-decoder": "translation (encoder-decoder)", "decoder": "text generation (decoder)",
                "encoder": "fill-mask/embedding (encoder)"}
# What /ready reports per model (the loaded ones keep the word they always had).
READY_WORDS = {"loaded": "ready", "loading": "loading", "available": "available", "failed": "failed"}
EXPIRY_TICK_S = 0.25  # how often idle models are checked against their keep-alive
# The models an HTTP request was handed (``acquire``), released when its response is done
# (``request_leases``, entered by ``service.http.middleware.ModelLeaseMiddleware``): a model is in use
# from the lookup to the last byte, grammar compilation and streaming included.
_LEASES: ContextVar[list[ModelEntry] | None] = ContextVar("tserve_model_leases", default=None)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


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
    keep_alive: float | None = None  # the last request's keep_alive (seconds, -1 forever); None: the setting
    measured_bytes: int | None = None  # weights + KV caches at its last load
    card: dict[str, Any] | None = None  # its /v1/models entry while it was last loaded

    def in_use(self) -> bool:
        return self.engine is not None and (self.leases > 0 or self.engine.in_flight)


class EngineRegistry:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.engines: dict[str, BaseEngine] = {}  # the loaded (serving) models
        self.entries: dict[str, ModelEntry] = {}  # every available model
        self.preloaded: list[str] = []
        self.error: str | None = None
        self.started = False
        self.stopping = False
        self._load_lock = asyncio.Lock()  # one load (and its evictions) at a time
        self._expiry: asyncio.Task | None = None

    # --- what there is ----------------------------------------------------------------------
    def discover(self) -> list[tuple[str, Path]]:
        """(name, path) of each model to serve. ``TSERVE_MODELS`` entries are names in the weights
        directory or paths (a model directory or a ``.gguf`` file); without it, every model
        directory there, skipping (with a warning) manifests whose weight package is missing."""
        root = self.settings.weights_dir
        found = {p.name: p for p in sorted(root.iterdir()) if is_model_dir(p)} if root.is_dir() else {}
        wanted = self.settings.model_names()
        if not wanted:
            found = {name: p for name, p in found.items() if self._installed(p)}
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

    @staticmethod
    def _installed(path: Path) -> bool:
        if not is_manifest_dir(path):
            return True
        try:
            locate(read_manifest(path))
        except ManifestError as exc:
            log.warning("skipping %s: %s", path.name, exc)
            return False
        return True

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Find the models, load the preloaded ones in order; a failure is ``self.error``."""
        try:
            self.entries = {name: ModelEntry(name, path) for name, path in self.discover()}
            wanted = self.settings.preload_names()
            self.preloaded = list(self.entries) if wanted is None else wanted
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
            if self._expiry is None:
                self._expiry = asyncio.create_task(self._expire_idle())

    async def stop(self, grace_s: float) -> None:
        self.stopping = True
        if self._expiry is not None:
            self._expiry.cancel()
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

    # --- loading and unloading ---------------------------------------------------------------
    async def load(self, name: str) -> BaseEngine:
        """The engine of ``name``, loading it first if needed; concurrent callers share one load.
        A caller that gives up (deadline, client gone) does not cancel it for the others."""
        entry = self._entry(name)
        if entry.state == "loaded" and entry.engine is not None:
            return entry.engine
        if entry.loading is None or entry.loading.done():
            entry.loading = asyncio.create_task(self._load(entry), name=f"load-{name}")
            entry.loading.add_done_callback(self._loaded)
        await asyncio.shield(entry.loading)
        if entry.engine is None:  # unloaded again before this caller resumed (evicted by the next load)
            raise EngineStoppedError(f"model '{name}' was unloaded again while loading; retry")
        return entry.engine

    def _loaded(self, task: asyncio.Task) -> None:
        """The load task is done: forget it (it must not keep anything alive) and retrieve its
        exception, which its waiters have raised already."""
        for entry in self.entries.values():
            if entry.loading is task:
                entry.loading = None
        if not task.cancelled():
            task.exception()

    async def _load(self, entry: ModelEntry) -> None:
        """Load ``entry`` (the task ``load`` shares). It returns nothing: a task's result outlives
        it in every reference to the task, and an engine kept that way would never be freed."""
        async with self._load_lock:
            if entry.state == "loaded" and entry.engine is not None:
                return
            entry.state, entry.error = "loading", None
            started = time.perf_counter()
            try:
                await self._make_room(entry, entry.measured_bytes or await asyncio.to_thread(self._estimate, entry))
                engine = await self._build(entry)
                size = (await asyncio.to_thread(engine.memory))["total_bytes"]
                entry.measured_bytes = size
                try:
                    await self._make_room(entry, size)  # the estimate was low: make room for what it is
                except MemoryBudgetError:
                    await engine.stop(0)
                    del engine
                    await asyncio.to_thread(release_memory)
                    raise
                # what reading, quantizing and packing left behind (a GGUF file's parsed tensors,
                # float copies the native step let go): ~400 MiB of RSS for SmolLM2 otherwise
                await asyncio.to_thread(release_memory)
            except MemoryBudgetError as exc:  # not the model's fault: it stays available
                entry.state, entry.error = "available", exc.message
                raise
            except Exception as exc:
                entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
                log.error("loading model %s failed: %s", entry.name, entry.error, extra={"model": entry.name})
                raise
            entry.engine, entry.state = engine, "loaded"
            entry.last_used = time.monotonic()
            self.engines[entry.name] = engine
            entry.card = engine.info()
            seconds = time.perf_counter() - started
            self.metrics.load_seconds.labels(entry.name).observe(seconds)
            self._observe_memory(entry)
            log.info("model loaded", extra={"model": entry.name, "seconds": round(seconds, 2),
                                            "bytes": size, "loaded": sorted(self.engines)})

    async def _build(self, entry: ModelEntry) -> BaseEngine:
        """Load, prepare and warm up one model; the heavy parts run in worker threads."""
        name, settings = entry.name, self.settings
        ckpt = await asyncio.to_thread(load_model, entry.path, settings.device, DTYPES[settings.dtype])
        options = settings.decode_options()
        if ckpt.config.has_decoder:
            # One place chooses the decode step (model.decode.prepare); the engine holds it.
            step = await asyncio.to_thread(prepare, ckpt.model, options, ckpt.tokenizer)
            build = getattr(step, "build_seconds", None)
            log.info("decode step", extra={"model": name, "step": step.name, "kv_dtype": str(step.kv_dtype),
                                           **({} if build is None else {"build_seconds": round(build, 1)})})
            engine: BaseEngine = GenerativeEngine(name, ckpt, settings, self.metrics, step)
            self.metrics.decode_step.labels(name, engine.decode_step_name).set(1)  # as /v1/models says
        else:
            await asyncio.to_thread(prepare_weights, ckpt.model, options, ckpt.tokenizer)
            engine = EncoderEngine(name, ckpt, settings, self.metrics)
        engine.source_facts = await asyncio.to_thread(source_facts, entry.path)
        await engine.start()
        return engine

    def _estimate(self, entry: ModelEntry) -> int:
        """Bytes a first load will take, before it is measured: the source's tensors at the
        serving dtype (a GGUF file's quantized tensors dequantized). Serving adds KV caches and int8
        copies on top, so the measured size after the load is checked against the budget again."""
        return source_weight_bytes(entry.path, DTYPES[self.settings.dtype])

    async def _make_room(self, entry: ModelEntry, needed: int) -> None:
        """Unload least recently used idle models until ``needed`` more bytes fit the budget."""
        budget = self.settings.memory_budget
        if budget is None:
            return
        if needed > budget:
            raise MemoryBudgetError(f"model '{entry.name}' needs {mib(needed)} (weights + KV caches), more than "
                                    f"TSERVE_MEMORY_BUDGET ({mib(budget)}) allows even with every other model "
                                    "unloaded")
        while True:
            others = [e for e in self.entries.values() if e is not entry and e.engine is not None]
            used = sum(e.engine.memory()["total_bytes"] for e in others)
            if used + needed <= budget:
                return
            # While preloading, the preloaded models must all fit: evicting one for the next
            # would leave start-up "ready" with models the operator wanted warm already gone.
            idle = sorted((e for e in others if not e.in_use() and (self.started or e.name not in self.preloaded)),
                          key=lambda e: e.last_used)
            if not idle and not self.started:
                raise MemoryBudgetError(
                    f"the preloaded models need more than TSERVE_MEMORY_BUDGET ({mib(budget)}): {mib(used)} loaded "
                    f"({', '.join(e.name for e in others)}) and '{entry.name}' needs {mib(needed)}; preload fewer "
                    "(TSERVE_PRELOAD) or raise the budget")
            if not idle:
                raise MemoryBudgetError(
                    f"model '{entry.name}' needs {mib(needed)} but TSERVE_MEMORY_BUDGET is {mib(budget)} and "
                    f"{mib(used)} is held by models with requests in flight ({', '.join(e.name for e in others)}), "
                    "which are never unloaded; retry when they are idle")
            victim = idle[0]
            log.info("evicting model", extra={"model": victim.name, "for": entry.name, "budget": budget,
                                              "used": used, "needed": needed})
            self.metrics.evictions.labels(victim.name).inc()
            await self._unload(victim, "budget")

    async def unload(self, name: str) -> None:
        """Unload ``name`` now (``POST /models/unload``); in-flight requests get the shutdown grace."""
        entry = self._entry(name)
        async with self._load_lock:
            if entry.engine is None:
                raise InvalidRequestError(f"model '{printable(name)}' is not loaded (state: {entry.state})", "model",
                                          code="model_not_loaded")
            await self._unload(entry, "request")

    async def _unload(self, entry: ModelEntry, reason: str) -> None:
        engine, entry.engine = entry.engine, None
        self.engines.pop(entry.name, None)
        entry.state = "available"
        if engine is None:
            return
        grace = self.settings.shutdown_grace_s if reason == "request" else 0.0
        await engine.stop(grace)
        del engine  # the last reference outside the routes still finishing with it
        await asyncio.to_thread(release_memory)
        self.metrics.unloads.labels(entry.name, reason).inc()
        self._observe_memory(entry)
        log.info("model unloaded", extra={"model": entry.name, "reason": reason, "loaded": sorted(self.engines)})

    async def _expire_idle(self) -> None:
        """Unload models idle past their keep-alive (the last request's ``keep_alive``, else
        ``TSERVE_KEEP_ALIVE``); the idle time counts from the last request in flight."""
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            try:
                await self._expire_once(time.monotonic())
            except Exception:  # a bug here must not end expiry for good
                log.exception("keep-alive check failed")

    async def _expire_once(self, now: float) -> None:
        for entry in list(self.entries.values()):
            if entry.engine is None:
                continue
            if entry.engine.in_flight:
                entry.last_used = now
                continue
            keep = self.settings.keep_alive if entry.keep_alive is None else entry.keep_alive
            if keep >= 0 and now - entry.last_used >= keep and not entry.in_use():
                async with self._load_lock:
                    if entry.engine is not None and not entry.in_use():
                        await self._unload(entry, "keep_alive")

    def _observe_memory(self, entry: ModelEntry) -> None:
        memory = entry.engine.memory() if entry.engine is not None else {"weights_bytes": 0, "kv_cache_bytes": 0}
        self.metrics.model_loaded.labels(entry.name).set(1 if entry.engine is not None else 0)
        self.metrics.model_memory.labels(entry.name, "weights").set(memory["weights_bytes"])
        self.metrics.model_memory.labels(entry.name, "kv_cache").set(memory["kv_cache_bytes"])

    # --- lookup --------------------------------------------------------------------------------
    def _entry(self, name: str) -> ModelEntry:
        entry = self.entries.get(name)
        if entry is None:
            if not self.started and not self.entries:
                raise EngineStoppedError("models are still being discovered")
            raise ModelNotFoundError(f"model '{printable(name)}' not found; available: {sorted(self.entries)}",
                                     "model")
        return entry

    async def acquire(self, name: str | None, family: str, endpoint: str, task: str | None = None,
                      only_one: bool = False, keep_alive: float | None = None) -> BaseEngine:
        """``get``, loading a named model that is available but not loaded first (within the
        request's deadline, TSERVE_REQUEST_TIMEOUT_S). ``keep_alive``: how long the model stays
        loaded after this request (seconds, -1 forever; None: TSERVE_KEEP_ALIVE)."""
        entry = self.entries.get(name) if name is not None else None
        if entry is not None and entry.engine is None and not self.stopping:
            if entry.card is not None:  # loaded before: its family is known without loading it
                self.check_family(name, entry.card["family"], family, endpoint)
            await self.load_within_deadline(name)
        engine = self.get(name, family, endpoint, task, only_one)
        self.entries[engine.name].keep_alive = keep_alive
        return engine

    @contextlib.contextmanager
    def request_leases(self) -> Iterator[None]:
        """The scope of one HTTP request: the models it is handed stay in use until it ends."""
        token = _LEASES.set([])
        try:
            yield
        finally:
            held = _LEASES.get() or []
            _LEASES.reset(token)
            now = time.monotonic()
            for entry in held:
                entry.leases -= 1
                entry.last_used = now

    async def load_within_deadline(self, name: str) -> BaseEngine:
        """``load``, waiting at most TSERVE_REQUEST_TIMEOUT_S (504 after; the load goes on). A load
        that fails for another reason than the budget is a 503 naming the cause."""
        self._entry(name)
        if self.stopping:
            raise EngineStoppedError("the server is shutting down")
        timeout = self.settings.request_timeout_s
        try:
            return await asyncio.wait_for(self.load(name), timeout)
        except asyncio.TimeoutError:  # noqa: UP041 - not the builtin before Python 3.11
            raise RequestFailedError("timeout", f"model '{name}' did not load within {timeout:g} s "
                                     "(TSERVE_REQUEST_TIMEOUT_S); it goes on loading") from None
        except EngineError:
            raise
        except Exception as exc:
            raise EngineStoppedError(f"model '{name}' failed to load: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def check_family(name: str, actual: str, family: str, endpoint: str) -> None:
        if actual != family:
            raise InvalidRequestError(f"model '{name}' is a {FAMILY_NAMES[actual]} model; {endpoint} "
                                      f"needs a {FAMILY_NAMES[family]} model", "model")

    def default(self, task: str) -> BaseEngine | None:
        """The model a drop-in request of ``task`` (``TASKS``' values, or ``feature-extraction``)
        without a model goes to: ``TSERVE_DEFAULT_<TASK>_MODEL`` when set, else for text generation
        the first model with a chat template (then any), else the first of the task."""
        candidates = [e for e in self.engines.values() if e.task == task]
        return self._default(candidates, task) if candidates else None

    def _default(self, candidates: list[BaseEngine], task: str) -> BaseEngine:
        setting = DEFAULT_SETTINGS.get(task)
        wanted = getattr(self.settings, setting) if setting else ""
        if wanted:
            found = next((e for e in candidates if e.name == wanted), None)
            if found is None:
                raise InvalidRequestError(f"TSERVE_{setting.upper()} names '{wanted}', which is not a loaded {task} "
                                          f"model (loaded: {sorted(e.name for e in candidates)})", "model")
            return found
        if task == "text-generation":
            return next((e for e in candidates if getattr(e, "chat", None) is not None), candidates[0])
        return candidates[0]

    def get(self, name: str | None, family: str, endpoint: str, task: str | None = None,
            only_one: bool = False) -> BaseEngine:
        """The loaded engine for ``name``; without a name, the first loaded model of ``family`` (of
        ``task`` where models of other tasks could answer too). With ``only_one`` (the drop-in APIs,
        whose clients send no model or a placeholder such as ``"tgi"``) the task's default model
        answers (``default``), and a placeholder counts as no name."""
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
            engine = self._default(candidates, task or TASKS[family]) if only_one else candidates[0]
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
            self.check_family(name, engine.family, family, endpoint)
        if not engine.ready:
            raise EngineStoppedError(f"model '{engine.name}' is not ready")
        self._lease(engine.name)
        return engine

    def _lease(self, name: str) -> None:
        """``name`` is in use until the current HTTP request ends (outside one: just touched)."""
        entry = self.entries[name]
        entry.last_used = time.monotonic()
        held = _LEASES.get()
        if held is not None:
            entry.leases += 1
            held.append(entry)

    # --- what /v1/models shows ----------------------------------------------------------------
    def cards(self) -> list[dict[str, Any]]:
        return [self.card(name) for name in self.entries]

    def card(self, name: str) -> dict[str, Any]:
        """One model's /v1/models entry: what it is (its last load's facts, once loaded) and where
        it stands (state, why it failed, the memory it holds now)."""
        entry = self._entry(name)
        if entry.engine is not None:
            card = entry.engine.info()
        else:
            created = int(entry.path.stat().st_mtime) if entry.path.exists() else 0
            card = {**(entry.card or {"id": name, "object": "model", "created": created,
                                      "owned_by": "transformer-serve"}),
                    "memory": {"weights_bytes": 0, "kv_cache_bytes": 0, "total_bytes": 0}}
        keep = self.settings.keep_alive if entry.keep_alive is None else entry.keep_alive
        return {**card, "state": entry.state, "state_reason": entry.error, "keep_alive": keep}
