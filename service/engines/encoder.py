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
from model.engine.rescore import FillRescorer
from model.formats.sentence_transformers import truncating
from service.engines.errors import EngineStoppedError, InvalidRequestError, QueueFullError, RequestFailedError
from service.engines.generative import BaseEngine, queue_full_message
from service.metrics import Metrics
from service.models.memory import weights_bytes
from service.settings import Settings

log = logging.getLogger("tserve.engine")


@dataclass(eq=False)
class _Job:
    kind: str  # "fill_mask" | "embed" | "embed_raw" (not normalised)
    rows: list[list[int]]
    top_k: int
    future: asyncio.Future
    arrival: float = field(default_factory=time.monotonic)
    texts: list[str] | None = None  # fill-mask: the texts as sent, for the rescorer (model.engine.rescore)


class EncoderEngine(BaseEngine):
    def __init__(self, name: str, ckpt: Checkpoint, settings: Settings, metrics: Metrics):
        super().__init__(name, ckpt, settings, metrics)
        if self.cfg.max_input_tokens:  # an embedding model's trained length (sentence-transformers' max_seq_length)
            self.max_len = min(self.max_len, self.cfg.max_input_tokens)
        self._truncating = truncating(self.tokenizer, self.max_len)  # for clients that ask to truncate
        self.mask_id = self.cfg.mask_token_id if self.cfg.mlm_head else None
        self.mask_token = self.tokenizer.id_to_token(self.mask_id) if self.mask_id is not None else None
        self._jobs: deque[_Job] = deque()
        self._active = 0
        # [CLS], [SEP], [PAD], [MASK]... are never offered as fill-mask candidates
        self._special = torch.tensor(sorted(self.tokenizer.special_ids), dtype=torch.long, device=self.model.device)
        # A causal LM that re-ranks the masked LM's candidates, where the model's manifest names one
        # (weights/fill-mask-en: Gemma 3 270M) and the settings allow it.
        self.rescorer: FillRescorer | None = None
        if self.mask_id is not None and ckpt.fill_rescore is not None and settings.fill_mask_rescore:
            self.rescorer = FillRescorer.load(ckpt.fill_rescore, settings.decode_options(), self.model.device)

    # --- the async API ------------------------------------------------------------------
    def _input_limit(self) -> int | None:
        return self.max_len

    def tokenize(self, texts: list[str], field_name: str, truncate: bool = False) -> list[list[int]]:
        """Token ids of each text; too long is an error, or (``truncate``) cut to the limit as
        sentence-transformers and TEI do."""
        if truncate:
            return self._truncating.encode_batch(texts)
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
        """The rescorer's causal LM, which this model holds besides its own weights."""
        if self.rescorer is None:
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
        job = _Job(kind, rows, top_k, future, texts=texts)
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
        hidden, pooled = self.model.encode_rows(rows)  # per row (T_i, d); (B, d)
        results, start = [], 0
        for job in batch:
            part = slice(start, start + len(job.rows))
            start += len(job.rows)
            if job.kind in ("embed", "embed_raw"):
                results.append((F.normalize(pooled[part], dim=-1) if job.kind == "embed" else pooled[part]).tolist())
            else:
                results.append(self._fill(job, hidden[part]))
        return results

    def _fill(self, job: _Job, hidden: list[torch.Tensor]) -> list[list[list[dict[str, Any]]]]:
        where = [(row, pos) for row, ids in enumerate(job.rows) for pos, t in enumerate(ids) if t == self.mask_id]
        at_masks = torch.stack([hidden[row][pos] for row, pos in where])  # (n_masks, d)
        logits = self.model.lm_head(at_masks).float()  # (n_masks, V)
        logits[:, self._special] = float("-inf")
        logp = logits.log_softmax(-1)
        rescored = self._rescored(job, where)
        wanted = max(job.top_k, self.rescorer.spec.candidates) if rescored else job.top_k
        top_logp, top_tokens = logp.topk(min(wanted, logp.size(-1)), dim=-1)
        ranked = [list(zip(sc, tk)) for sc, tk in zip(top_logp.exp().tolist(), top_tokens.tolist())]
        if rescored:
            ranked = self._rerank(job, where, rescored, ranked, top_logp)
        out: list[list[list[dict[str, Any]]]] = [[] for _ in job.rows]
        for (row, pos), row_ranked in zip(where, ranked):
            candidates = []
            for score, token in row_ranked[:job.top_k]:
                filled = list(job.rows[row])
                filled[pos] = token
                candidates.append({"score": score, "token": token,
                                   "token_str": self.tokenizer.decode([token]).strip(),
                                   "sequence": self.tokenizer.decode(filled)})
            out[row].append(candidates)
        return out

    def _rescored(self, job: _Job, where: list[tuple[int, int]]) -> list[int]:
        """Indices into ``where`` of the masks the rescorer re-ranks: each the only mask of its text,
        the text as sent holding the mask token once."""
        if self.rescorer is None or job.texts is None:
            return []
        per_row = [0] * len(job.rows)
        for row, _ in where:
            per_row[row] += 1
        return [i for i, (row, _) in enumerate(where)
                if per_row[row] == 1 and job.texts[row].count(self.mask_token) == 1]

    def _rerank(self, job: _Job, where, rescored: list[int], ranked: list[list[tuple[float, int]]],
                top_logp: torch.Tensor) -> list[list[tuple[float, int]]]:
        """The rescorer's order and scores for the masks it takes: every candidate ``_fill``
        drew (the rescorer's number, or ``top_k`` where larger), so the scores still descend."""
        words = [[self.tokenizer.id_to_token(t) for _, t in ranked[i]] for i in rescored]
        orders = self.rescorer.rerank([job.texts[where[i][0]] for i in rescored], self.mask_token, words,
                                      [top_logp[i].tolist() for i in rescored])
        ranked = list(ranked)
        for i, order in zip(rescored, orders):
            ranked[i] = [(score, ranked[i][j][1]) for j, score in order]
        return ranked


def _resolve(future: asyncio.Future, setter, value) -> None:
    if not future.cancelled():
        setter(value)
