"""Loading and unloading models: one shared load per model, warm-up, the decode step, room in the budget.

``ModelLoader`` turns an entry from ``available`` into ``loaded`` (an engine serving) and back.
Concurrent requests for one model share one load task; a caller that gives up (deadline,
client gone) does not cancel it for the others. ``lock`` lets one load (with the evictions it
needs), one unload or one keep-alive expiry run at a time; ``unload`` expects it held.

The loader is the only writer of the registry's ``engines`` dict and of an entry's ``engine``
and ``state``; it reads the ``entries`` dict (to find what to evict) but never changes it.

Threads: the coroutines and the done-callback run on the event loop. The heavy parts run in
worker threads through ``asyncio.to_thread`` (reading the checkpoint, preparing the decode step,
measuring, ``release_memory``), so the loop and the loaded engines keep serving meanwhile;
nothing in a worker thread touches an entry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from model import load_model
from model.config import DTYPES
from model.decode import DecodeOptions, native, prepare, prepare_weights
from model.engine.draft_model import check_vocabulary
from service.engines.encoder import EncoderEngine
from service.engines.errors import EngineError, EngineStoppedError, MemoryBudgetError, RequestFailedError
from service.engines.generative import BaseEngine, GenerativeEngine
from service.metrics import Metrics
from service.models.budget import check_fits_alone, choose_eviction
from service.models.catalogue import ModelEntry, rescore_spec
from service.models.facts import source_facts
from service.models.memory import release_memory, source_weight_bytes
from service.models.sampling import sampling_defaults
from service.settings import Settings

log = logging.getLogger("tserve.registry")


class ModelLoader:
    """Loads and unloads the registry's models. ``preloading()`` says which models start-up is
    still preloading (None once it is done): the budget must not evict those."""

    def __init__(self, settings: Settings, metrics: Metrics, entries: Mapping[str, ModelEntry],
                 engines: dict[str, BaseEngine], preloading: Callable[[], Collection[str] | None]):
        self.settings, self.metrics = settings, metrics
        self.entries, self.engines, self.preloading = entries, engines, preloading
        self.lock = asyncio.Lock()  # one load (and its evictions), unload or expiry at a time

    async def load(self, entry: ModelEntry) -> BaseEngine:
        """The engine of ``entry``, loading it first if needed; concurrent callers share one load."""
        if entry.state == "loaded" and entry.engine is not None:
            return entry.engine
        if entry.loading is None or entry.loading.done():
            entry.loading = asyncio.create_task(self._load(entry), name=f"load-{entry.name}")
            entry.loading.add_done_callback(self._loaded)
        await asyncio.shield(entry.loading)
        if entry.engine is None:  # unloaded again before this caller resumed (evicted by the next load)
            raise EngineStoppedError(f"model '{entry.name}' was unloaded again while loading; retry")
        return entry.engine

    async def load_within_deadline(self, entry: ModelEntry) -> BaseEngine:
        """``load``, waiting at most TSERVE_REQUEST_TIMEOUT_S (504 after; the load goes on). A load
        that fails for another reason than the budget is a 503 naming the cause."""
        name, timeout = entry.name, self.settings.request_timeout_s
        try:
            return await asyncio.wait_for(self.load(entry), timeout)
        except asyncio.TimeoutError:  # noqa: UP041 - not the builtin before Python 3.11
            raise RequestFailedError("timeout", f"model '{name}' did not load within {timeout:g} s "
                                     "(TSERVE_REQUEST_TIMEOUT_S); it goes on loading") from None
        except EngineError:
            raise
        except Exception as exc:
            raise EngineStoppedError(f"model '{name}' failed to load: {type(exc).__name__}: {exc}") from None

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
        async with self.lock:
            await self._load_locked(entry)

    async def _load_locked(self, entry: ModelEntry) -> None:
        """``_load`` under the lock: a fill-mask model's rescorer first (the served decoder it
        shares, ``rescorer_entry``), held loaded from here until this model unloads."""
        if entry.state == "loaded" and entry.engine is not None:
            return
        source = self.rescorer_entry(entry)
        if source is not None and source.engine is None:
            try:
                await self._load_locked(source)
            except Exception as exc:
                entry.state = "available" if isinstance(exc, MemoryBudgetError) else "failed"
                entry.error = f"its rescorer '{source.name}' did not load: {exc}"
                raise
        if source is not None:
            source.users += 1  # never evicted to make room for this model, nor while it is loaded
        try:
            await self._load_one(entry, source)
        except BaseException:
            if source is not None:
                source.users -= 1
            raise
        entry.rescorer_source = source

    async def _load_one(self, entry: ModelEntry, source: ModelEntry | None) -> None:
        entry.state, entry.error = "loading", None
        started = time.perf_counter()
        try:
            await self.make_room(entry, entry.measured_bytes or await asyncio.to_thread(self._estimate, entry))
            engine = await self._build(entry, source)
            size = (await asyncio.to_thread(engine.memory))["total_bytes"]
            entry.measured_bytes = size
            try:
                await self.make_room(entry, size)  # the estimate was low: make room for what it is
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

    async def _build(self, entry: ModelEntry, source: ModelEntry | None = None) -> BaseEngine:
        """Load, prepare and warm up one model; the heavy parts run in worker threads."""
        name, settings = entry.name, self.settings
        native.use_library(settings.native_library)  # the GGUF import's block kernels load it too
        ckpt = await asyncio.to_thread(load_model, entry.path, settings.device, DTYPES[settings.dtype])
        # counted before any int8 quantizing: afterwards each projection's bias is found by unpacking
        # its fbgemm weights (41-65 s for Qwen2.5-Coder 1.5B on a loaded host, on /v1/models' event loop)
        parameters = await asyncio.to_thread(ckpt.model.num_parameters)
        options = settings.decode_options()
        if ckpt.config.has_decoder:
            # One place chooses the decode step (model.decode.prepare); the engine holds it.
            step = await asyncio.to_thread(prepare, ckpt.model, options, ckpt.tokenizer)
            build = getattr(step, "build_seconds", None)
            log.info("decode step", extra={"model": name, "step": step.name, "kv_dtype": str(step.kv_dtype),
                                           **({} if build is None else {"build_seconds": round(build, 1)})})
            draft = await asyncio.to_thread(self._draft, name, ckpt, options)
            engine: BaseEngine = GenerativeEngine(name, ckpt, settings, self.metrics, step, draft)
            if not engine.encdec:
                engine.sampling_defaults = await asyncio.to_thread(sampling_defaults, entry.path, settings, name)
            self.metrics.decode_step.labels(name, engine.decode_step_name).set(1)  # as /v1/models says
        else:
            await asyncio.to_thread(prepare_weights, ckpt.model, options, ckpt.tokenizer)
            decoder = source.engine if source is not None else None
            engine = EncoderEngine(name, ckpt, settings, self.metrics,
                                   decoder if isinstance(decoder, GenerativeEngine) else None)
        engine.source_facts = await asyncio.to_thread(source_facts, entry.path)
        engine.parameters = parameters
        await engine.start()
        return engine

    def _draft(self, name: str, ckpt, options: DecodeOptions) -> tuple | None:
        """Under TSERVE_SPECULATIVE=draft, the draft model TSERVE_DRAFT_MODEL names for ``name``
        (a served model's name or a path): loaded (its own copy, held by this model's engine and
        freed with it), its vocabulary checked against the target's, its decode step prepared as
        the target's is. None where no draft is named."""
        settings = self.settings
        ref = settings.draft_models().get(name) if settings.speculative == "draft" else None
        if ref is None or ckpt.config.family != "decoder":
            return None
        path = self.entries[ref].path if ref in self.entries else Path(ref)
        if not path.exists():
            raise ValueError(f"TSERVE_DRAFT_MODEL: the draft of '{name}', {ref!r}, is neither a served model nor a "
                             "path")
        draft = load_model(path, settings.device, DTYPES[settings.dtype])
        check_vocabulary(name, ckpt, ref, draft)
        step = prepare(draft.model, options, draft.tokenizer)
        log.info("draft model", extra={"model": name, "draft": ref, "step": step.name})
        return ref, draft, step

    def _estimate(self, entry: ModelEntry) -> int:
        """Bytes a first load will take, before it is measured: the source's tensors at the
        serving dtype (a GGUF file's quantized tensors dequantized). Serving adds KV caches and int8
        copies on top, so the measured size after the load is checked against the budget again."""
        shared = self.rescorer_entry(entry) is not None  # the decoder's own entry counts its weights
        return source_weight_bytes(entry.path, DTYPES[self.settings.dtype], rescorer=not shared)

    def rescorer_entry(self, entry: ModelEntry) -> ModelEntry | None:
        """The served decoder whose model and decode step ``entry``'s fill-mask rescorer shares:
        the model at the path its manifest's ``rescore`` names, where this registry serves it
        (``fill-mask-en`` -> ``gemma3-270m``), TSERVE_FILL_MASK_RESCORE is on and the serving dtype
        is float32; else None (the rescorer, if any, loads its own copy)."""
        if not self.settings.fill_mask_rescore or self.settings.dtype != "float32":
            return None  # a copy of its own loads float32: a decoder served at another dtype would score otherwise
        spec = rescore_spec(entry.path)
        if spec is None:
            return None
        target = spec.model.resolve()
        return next((e for e in self.entries.values() if e is not entry and e.path.resolve() == target), None)

    async def make_room(self, entry: ModelEntry, needed: int) -> None:
        """Unload the models the budget chooses (``service.models.budget``) until ``needed`` more
        bytes fit ``TSERVE_MEMORY_BUDGET``. The caller holds ``lock``."""
        budget = self.settings.memory_budget
        if budget is None:
            return
        check_fits_alone(entry.name, needed, budget)
        while True:
            others = [e for e in self.entries.values() if e is not entry and e.engine is not None]
            used = sum(e.engine.memory()["total_bytes"] for e in others)
            victim = choose_eviction(entry.name, needed, budget, others, used, self.preloading())
            if victim is None:
                return
            log.info("evicting model", extra={"model": victim.name, "for": entry.name, "budget": budget,
                                              "used": used, "needed": needed})
            self.metrics.evictions.labels(victim.name).inc()
            await self.unload(victim, "budget")

    async def unload(self, entry: ModelEntry, reason: str) -> None:
        """Stop ``entry``'s engine and give its memory back; ``reason``: budget, keep_alive or
        request (only a request's unload gives in-flight work the shutdown grace). The caller
        holds ``lock``."""
        engine, entry.engine = entry.engine, None
        self.engines.pop(entry.name, None)
        if entry.rescorer_source is not None:  # the shared decoder may go from now on
            entry.rescorer_source.users -= 1
            entry.rescorer_source = None
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

    def _observe_memory(self, entry: ModelEntry) -> None:
        memory = entry.engine.memory() if entry.engine is not None else {"weights_bytes": 0, "kv_cache_bytes": 0}
        self.metrics.model_loaded.labels(entry.name).set(1 if entry.engine is not None else 0)
        self.metrics.model_memory.labels(entry.name, "weights").set(memory["weights_bytes"])
        self.metrics.model_memory.labels(entry.name, "kv_cache").set(memory["kv_cache_bytes"])
