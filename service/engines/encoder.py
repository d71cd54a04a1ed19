"""Encoder-only engine: fill-mask and embeddings, batched across concurrent requests.

Jobs queue up while a forward pass runs; the worker then takes as many queued texts as
``max_encoder_batch`` allows (fill-mask and embedding jobs together: both need the same hidden
states) and the model-side core (``model.encoder.EncoderCore``) answers them all from one
padded batch. This module keeps the queue, the thread, the deadlines, the metrics and the
errors; the PyTorch is the core's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from model import Checkpoint
from model.encoder import EncoderCore, EncoderJob
from model.encoder.rescore import FillRescorer
from service.engines.errors import EngineStoppedError, InvalidRequestError, QueueFullError, RequestFailedError
from service.engines.generative import BaseEngine, GenerativeEngine, queue_full_message
from service.metrics import Metrics
from service.models.memory import weights_bytes
from service.settings import Settings

log = logging.getLogger("tserve.engine")


@dataclass(eq=False)
class _Job(EncoderJob):
    """A core job with the client waiting on it."""

    future: asyncio.Future | None = None
    arrival: float = field(default_factory=time.monotonic)


class EncoderEngine(BaseEngine):
    def __init__(self, name: str, ckpt: Checkpoint, settings: Settings, metrics: Metrics,
                 decoder: GenerativeEngine | None = None):
        """``decoder``: the served engine of the causal LM the manifest names as rescorer, whose
        model and decode step the rescorer shares instead of loading a second copy (the registry
        keeps it loaded while this engine is); without it the rescorer loads its own."""
        super().__init__(name, ckpt, settings, metrics)
        # A causal LM that re-ranks the masked LM's candidates, where the model's manifest names one
        # (weights/fill-mask-en: Gemma 3 270M) and the settings allow it.
        rescorer: FillRescorer | None = None
        spec = ckpt.fill_rescore
        if self.cfg.mlm_head and spec is not None and settings.fill_mask_rescore:
            if decoder is not None:
                rescorer = FillRescorer(decoder.ckpt, spec, step=decoder.core.decode_step, lock=decoder.step_lock)
            else:
                rescorer = FillRescorer.load(spec, settings.decode_options(), self.model.device)
        self.core = EncoderCore(ckpt, self.max_len, rescorer)
        self.max_len = self.core.max_len  # an embedding model's trained length (sentence-transformers' max_seq_length)
        self.mask_id, self.mask_token = self.core.mask_id, self.core.mask_token
        self._jobs: deque[_Job] = deque()
        self._active = 0

    @property
    def rescorer(self) -> FillRescorer | None:
        return self.core.rescorer

    # --- the async API ------------------------------------------------------------------
    def _input_limit(self) -> int | None:
        return self.max_len

    def tokenize(self, texts: list[str], field_name: str, truncate: bool = False) -> list[list[int]]:
        """Token ids of each text; too long is an error, or (``truncate``) cut to the limit as
        sentence-transformers and TEI do."""
        if truncate:
            return self.core.encode(texts, truncate=True)
        return super().tokenize(texts, field_name)

    @property
    def pooling(self) -> str:
        return self.cfg.pooling

    @property
    def task(self) -> str:
        return "fill-mask" if self.mask_id is not None else "feature-extraction"

    @property
    def dimensions(self) -> int:
        """The width of an embedding: the model's own (no truncation)."""
        return self.cfg.d_model

    def check_dimensions(self, dimensions: int | None) -> None:
        """OpenAI's ``dimensions``: only the model's own width (no truncation)."""
        if dimensions is not None and dimensions != self.dimensions:
            raise InvalidRequestError(f"dimensions must be {self.dimensions} for this model (no truncation)",
                                      "dimensions")

    def step_bytes(self) -> int:
        """The rescorer's causal LM, which this model holds besides its own weights (unless it
        shares a served decoder's, which that model counts)."""
        if self.rescorer is None or self.rescorer.shared:
            return 0
        return weights_bytes(self.rescorer.model) + self.rescorer.extra_bytes

    async def fill_mask(self, rows: list[list[int]], top_k: int,
                        texts: list[str] | None = None) -> list[list[list[dict[str, Any]]]]:
        """Per text, per mask position: the top_k candidates (HF fill-mask fields). ``texts``: the
        texts as sent, which a rescorer reads (a text with one mask is re-ranked)."""
        if self.mask_id is None:
            raise InvalidRequestError(f"model '{self.name}' is an embedding model without a masked-LM head; "
                                      "fill-mask needs a fill-mask model", "model")
        for i, ids in enumerate(rows):
            if self.mask_id not in ids:
                raise InvalidRequestError(f"text[{i}] must contain the mask token {self.mask_token}", "text")
        return await self._submit("fill_mask", rows, top_k, texts)

    async def embed(self, rows: list[list[int]], normalize: bool = True) -> list[list[float]]:
        """Sentence embeddings (the config's pooling over real tokens), L2-normalised unless
        ``normalize`` is false."""
        return await self._submit("embed" if normalize else "embed_raw", rows, 0)

    async def _submit(self, kind: str, rows: list[list[int]], top_k: int, texts: list[str] | None = None):
        self._check_accepting()
        future = asyncio.get_running_loop().create_future()
        job = _Job(kind, rows, top_k, texts, future)
        with self._cv:
            if len(self._jobs) >= self.settings.max_queue + 1:
                self.metrics.rejected.labels(self.name, "queue_full").inc()
                # one job beyond the queue may be about to run (the worker takes it next)
                waiting = min(self.settings.max_queue, len(self._jobs))
                raise QueueFullError(queue_full_message(self.name, waiting, self.settings.max_queue), retry_after=1)
            self._jobs.append(job)
            self._cv.notify()
        self.metrics.waiting.labels(self.name).set(len(self._jobs))
        # Cancelled with the client (or by the timeout): the worker skips cancelled jobs.
        try:
            return await asyncio.wait_for(future, self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestFailedError("timeout", "request failed: request timed out") from None

    # --- the worker thread --------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._jobs) or self._active > 0

    def _warmup(self) -> None:
        self.core.warmup()

    def _take_batch(self) -> list[_Job]:
        batch, rows = [], 0
        while self._jobs:
            job = self._jobs[0]
            if batch and rows + len(job.rows) > self.settings.max_encoder_batch:
                break
            self._jobs.popleft()
            if job.future.cancelled():
                continue
            batch.append(job)
            rows += len(job.rows)
        return batch

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._jobs):
                    self._cv.wait()
                if self._stopping:
                    break
                batch = self._take_batch()
                self._active = len(batch)
            self._observe_start(batch)
            try:
                results = self._forward(batch)
            except Exception:  # a bug must not hang every client: fail this batch, keep serving
                log.exception("encoder forward pass failed", extra={"model": self.name})
                results = [RequestFailedError("internal", "request failed: internal engine error")] * len(batch)
            for job, result in zip(batch, results):
                setter = job.future.set_exception if isinstance(result, Exception) else job.future.set_result
                self._deliver(_resolve, job.future, setter, result)
            with self._cv:
                self._active = 0
            self.metrics.running.labels(self.name).set(0)
        with self._cv:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            self._deliver(_resolve, job.future, job.future.set_exception,
                          EngineStoppedError(f"model '{self.name}' is shutting down"))

    def _observe_start(self, batch: list[_Job]) -> None:
        m, name, now = self.metrics, self.name, time.monotonic()
        rows = sum(len(j.rows) for j in batch)
        for job in batch:
            m.queue_time.labels(name).observe(now - job.arrival)
        m.prompt_tokens.labels(name).inc(sum(len(r) for j in batch for r in j.rows))
        m.running.labels(name).set(len(batch))
        m.waiting.labels(name).set(len(self._jobs))
        m.steps.labels(name).inc()
        m.batch_size.labels(name).set(rows)
        m.step_batch.labels(name).observe(rows)


    def _forward(self, batch: list[_Job]) -> list[Any]:
        """The one pass through the model: every job's answer (``EncoderCore.run``)."""
        return self.core.run(batch)


def _resolve(future: asyncio.Future, setter, value) -> None:
    if not future.cancelled():
        setter(value)
