"""Encoder-only engine: fill-mask and embeddings, batched across concurrent requests.

Jobs queue up while a forward pass runs; the worker then packs as many queued texts as
``max_encoder_batch`` allows into one padded batch (fill-mask and embedding jobs
together: both need the same hidden states) and answers every job from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from model import Checkpoint
from service.engine import BaseEngine, queue_full_message
from service.engine_errors import EngineStoppedError, InvalidRequestError, QueueFullError, RequestFailedError
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger("tserve.engine")


@dataclass(eq=False)
class _Job:
    kind: str  # "fill_mask" | "embed"
    rows: list[list[int]]
    top_k: int
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)


class EncoderEngine(BaseEngine):
    def __init__(self, name: str, ckpt: Checkpoint, settings: Settings, metrics: Metrics):
        super().__init__(name, ckpt, settings, metrics)
        self.mask_id = self.cfg.mask_token_id
        self.mask_token = self.tokenizer.id_to_token(self.mask_id) if self.mask_id is not None else None
        self._jobs: deque[_Job] = deque()
        self._active = 0
        # [CLS], [SEP], [PAD], [MASK]... are never offered as fill-mask candidates
        self._special = torch.tensor(sorted(self.tokenizer.special_ids), dtype=torch.long, device=self.model.device)

    # --- the async API ------------------------------------------------------------------
    def _input_limit(self) -> int | None:
        return self.max_len

    def check_dimensions(self, dimensions: int | None) -> None:
        """OpenAI's ``dimensions``: only the model's own width (no truncation)."""
        if dimensions is not None and dimensions != self.cfg.d_model:
            raise InvalidRequestError(f"dimensions must be {self.cfg.d_model} for this model (no truncation)",
                                      "dimensions")

    async def fill_mask(self, rows: list[list[int]], top_k: int) -> list[list[list[dict[str, Any]]]]:
        """Per text, per mask position: the top_k candidates (HF fill-mask fields)."""
        for i, ids in enumerate(rows):
            if self.mask_id not in ids:
                raise InvalidRequestError(f"text[{i}] must contain the mask token {self.mask_token}", "text")
        return await self._submit("fill_mask", rows, top_k)

    async def embed(self, rows: list[list[int]]) -> list[list[float]]:
        """L2-normalised sentence embeddings (the config's pooling over real tokens)."""
        return await self._submit("embed", rows, 0)

    async def _submit(self, kind: str, rows: list[list[int]], top_k: int):
        self._check_accepting()
        future = asyncio.get_running_loop().create_future()
        job = _Job(kind, rows, top_k, future)
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
        ids = self.tokenizer.encode("warm up the engine")
        self._forward([_Job("embed", [ids], 0, None)])  # type: ignore[arg-type]

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
        torch.set_grad_enabled(False)
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

    @torch.inference_mode()
    def _forward(self, batch: list[_Job]) -> list[Any]:
        rows = [r for job in batch for r in job.rows]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.cfg.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        lengths = torch.tensor([len(r) for r in rows])
        real = torch.arange(width)[None, :] < lengths[:, None]  # (B, T)
        ids, real = ids.to(self.model.device), real.to(self.model.device)
        hidden = self.model.hidden_states(ids, real)  # (B, T, d)
        results, start = [], 0
        for job in batch:
            part = slice(start, start + len(job.rows))
            start += len(job.rows)
            if job.kind == "embed":
                pooled = F.normalize(self.model.pool(hidden[part], real[part]).float(), dim=-1)
                results.append(pooled.tolist())
            else:
                results.append(self._fill(job, ids[part], hidden[part]))
        return results

    def _fill(self, job: _Job, ids: torch.Tensor, hidden: torch.Tensor) -> list[list[list[dict[str, Any]]]]:
        where = (ids == self.mask_id).nonzero().tolist()  # [[row, pos], ...]
        logits = self.model.lm_head(hidden[ids == self.mask_id]).float()  # (n_masks, V)
        logits[:, self._special] = float("-inf")
        scores, tokens = logits.softmax(-1).topk(job.top_k, dim=-1)
        out: list[list[list[dict[str, Any]]]] = [[] for _ in job.rows]
        for (row, pos), sc, tk in zip(where, scores.tolist(), tokens.tolist()):
            candidates = []
            for score, token in zip(sc, tk):
                filled = list(job.rows[row])
                filled[pos] = token
                candidates.append({"score": score, "token": token,
                                   "token_str": self.tokenizer.decode([token]).strip(),
                                   "sequence": self.tokenizer.decode(filled)})
            out[row].append(candidates)
        return out


def _resolve(future: asyncio.Future, setter, value) -> None:
    if not future.cancelled():
        setter(value)
