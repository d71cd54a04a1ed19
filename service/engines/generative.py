"""The generative engine: one per translation or generation model, owning its model, tokenizer
and a worker thread that batches requests continuously over KV-cache slots.

The HTTP layer sees only this interface:
- ``GenerativeEngine.submit(prompt_ids, params) -> RequestStream`` (an async iterator of
  ``EngineEvent``; raises ``QueueFullError`` at once when the queue is full) and
  ``abort(request_id)``;
- ``EncoderEngine.fill_mask(...)`` / ``embed(...)`` (``service.engines.encoder``), batched
  across concurrent requests;
- what every engine shares (limits, usage, lifecycle): ``BaseEngine`` in ``service.engines.base``.
``EngineRegistry`` (``service.models.registry``) loads the checkpoints (its ``ModelLoader``, in
``service.models.loading``) and starts and stops the engines.
The worker thread steps the model's engine core (``model.engine.EngineCore``); results cross
to the event loop with one ``call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from model import Checkpoint, EngineCore, EngineEvent, EngineRequest, SamplingParams
from model.decode import DecodeStep
from model.decode.triton_attention import kernel_runs_on
from model.engine.grammar import CompiledGrammar, GrammarError, GrammarSpec
from model.engine.sampling import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from model.engine.speculative import SpeculativeConfig
from model.tokenization.chat_template import ChatMessageError, ChatTemplate, ChatTemplateError
from model.tokenization.tool_format import ToolFormat, detect
from service.engines.base import BaseEngine, EngineLoad, TokenUsage
from service.engines.errors import (
    EmptyInputError,
    GrammarBusyError,
    InputTooLongError,
    InvalidRequestError,
    QueueFullError,
)
from service.metrics import Metrics
from service.models.memory import weights_bytes
from service.models.sampling import SamplingDefaults
from service.settings import Settings

GRAMMAR_BYTES_PER_SPAN = 16384  # grammar text that earns one more TSERVE_GRAMMAR_TIMEOUT_S to compile
PREFILL_MARK = "\ue000tserve-prefill\ue000"  # a private-use character no template trims

log = logging.getLogger("tserve.engine")

# Routes and schemas take these from here, not from `model`: the engine is their one door to it.
__all__ = ["MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS", "BaseEngine", "EngineEvent", "GenerativeEngine", "GrammarSpec",
           "RequestStream", "SamplingParams", "TokenUsage"]


def queue_full_message(model: str, waiting: int, limit: int, asked: int = 1) -> str:
    """The 429's message: the queue as configured (TSERVE_MAX_QUEUE), not the engine's inbox."""
    if asked > 1:
        return (f"model '{model}' is overloaded: {waiting} of {limit} queue places taken and this request needs "
                f"{asked}; retry later")
    return f"model '{model}' is overloaded: queue full ({waiting} of {limit} waiting); retry later"


class RequestStream:
    """Events of one request, in order; the last one is ``finished``."""

    def __init__(self, engine: GenerativeEngine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineEvent:
        if self.done:
            raise StopAsyncIteration
        event = await self.queue.get()
        self.done = event.finished
        return event

    def abort(self) -> None:
        """Free the request's slot at the next step (no-op once finished)."""
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)




class GenerativeEngine(BaseEngine):
    """Decoder-only and encoder-decoder models: continuous batching over KV-cache slots."""

    def __init__(self, name: str, ckpt: Checkpoint, settings: Settings, metrics: Metrics,
                 step: DecodeStep | None = None, draft: tuple[str, Checkpoint, DecodeStep] | None = None):
        """``step``: the decode step ``model.decode.prepare`` chose (default: the model's Python step).
        ``draft``: under TSERVE_SPECULATIVE=draft, the draft model (its name, checkpoint and decode
        step), held by the engine core and freed with it; without one, n-gram drafting."""
        super().__init__(name, ckpt, settings, metrics)
        self.encdec = self.family == "encoder-decoder"
        self.max_src_len = self.max_len if self.encdec else 0
        self.core = EngineCore(self.model, self.tokenizer, settings.max_batch, self.max_len, self.max_src_len,
                               settings.max_prefill_tokens, settings.prefix_cache and not self.encdec, step=step,
                               kv_cache_bytes=settings.kv_cache_bytes, speculative=SpeculativeConfig(
                                   settings.speculative if settings.speculative != "draft" or draft else "ngram",
                                   settings.speculative_tokens, max_batch=settings.speculative_max_batch),
                               grammar_cache_size=settings.grammar_cache_size,
                               kv_cache_min_tokens=self.max_len, draft=draft[1].model if draft else None,
                               draft_step=draft[2] if draft else None)
        self.draft_name = draft[0] if draft else None
        # One sequence may use the whole pool, no more: the context a request sees is the smaller.
        self.max_len = min(self.max_len, self.core.scheduler.capacity_tokens())
        # Held around each step: a fill-mask rescorer may share this decoder's model and decode
        # step from its own thread (model.encoder.rescore), and the native plan is not reentrant.
        self.step_lock = threading.Lock()
        # what a request's unset sampling fields take; the loader reads the model's (service.models.sampling)
        self.sampling_defaults = SamplingDefaults()
        self._inbox: list[EngineRequest] = []
        self._aborts: set[str] = set()
        self._streams: dict[str, RequestStream] = {}
        self._timing: dict[str, list[float]] = {}  # request id -> [arrival, last token time or 0]
        # What a gateway reads to route (GET /v1/loads): replaced whole after each step on the
        # engine thread, read whole by the route, so the two never see half an update.
        self._prefix_counts = [0, 0]  # prompt tokens found in the prefix cache, looked up (as /metrics counts)
        self.last_load = self._load(0, 0)
        self.metrics.slots_total.labels(name).set(settings.max_batch)
        self.metrics.kv_blocks.labels(name).set(self.core.cache.n_blocks - 1)
        self.metrics.kv_blocks_used.labels(name).set(0)
        self.metrics.preemptions.labels(name)  # the series exists (at 0) before the first preemption
        prefix = self.core.prefix_cache_info()
        if prefix is not None:
            self.metrics.prefix_blocks_used.labels(name).set(0)
            self.metrics.prefix_hit_tokens.labels(name)  # the series exist (at 0) before the first request
            self.metrics.prefix_query_tokens.labels(name)
        self.chat = None if ckpt.chat_template is None else ChatTemplate(
            ckpt.chat_template, bos_token=self._special(self.cfg.bos_token_id),
            eos_token=self._special(self.cfg.eos_token_id))
        # how this model writes a tool call: its template and vocabulary say, or its manifest
        self.tool_format: ToolFormat = detect(ckpt.chat_template, self.tokenizer.token_to_id,
                                              getattr(ckpt, "tool_format", None))
        # grammars compile here, never on the engine thread: a slow one cannot stall a step
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"grammar-{name}")
        self._compiling: dict[GrammarSpec, asyncio.Future] = {}  # compiles in flight, shared by their retries

    def _special(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    @property
    def template_takes_tools(self) -> bool:
        """The chat template renders ``tools`` itself; otherwise the generic tool prompt is used."""
        return self.chat is not None and "tools" in self.chat.source

    def info(self) -> dict[str, Any]:
        constrained = not self.encdec and self.cfg.eos_token_id is not None
        return {**super().info(), "chat": self.chat is not None, "prefix_cache": self.prefix_cache(),
                "kv_cache": self.kv_cache(), "speculative": self.speculative(),
                "structured_outputs": constrained, "tools": constrained and self.chat is not None,
                "tool_prompt": ("template" if self.template_takes_tools else "generic") if self.chat else None,
                "tool_format": self.tool_format.name if self.chat else None,
                **({} if self.encdec else {"sampling_defaults": self.sampling_defaults.card()})}

    def sampling(self, **fields: Any) -> SamplingParams:
        """One request's ``SamplingParams``: each of temperature, top_p, top_k and
        repetition_penalty it leaves unset (None) takes this model's default
        (``sampling_defaults``); a value it sends, whatever it is, stays."""
        for name, value in self.sampling_defaults.values.items():
            if fields.get(name) is None:
                fields[name] = value
        return SamplingParams(**fields)

    @property
    def decode_step_name(self) -> str | None:
        step = self.core.decode_step
        kernel = getattr(step, "attention", None)  # under "auto" the kernel object exists but runs on CUDA only
        device = self.model.device
        if step.name == "python" and kernel is not None and kernel.mode == "native":
            return "python+native-attention"
        triton = kernel is not None and (kernel.mode == "triton" or device.type == "cuda" and kernel_runs_on(device))
        return "triton" if step.name == "python" and triton else step.name

    def decode_q4(self) -> int:
        return getattr(self.core.decode_step, "weights4", 0)

    def step_bytes(self) -> int:
        draft = self.core.draft  # a draft model's weights count as this model's: it loads and goes with it
        extra = 0 if draft is None else weights_bytes(draft.model) + getattr(draft.step, "extra_bytes", 0)
        return getattr(self.core.decode_step, "extra_bytes", 0) + extra

    def kv_cache_bytes(self) -> int:
        runner, draft = self.core.runner, self.core.draft
        # the block pool (the prefix cache's blocks among them), cross-attention memory, a draft model's pool
        return runner.cache.nbytes + (0 if draft is None else draft.cache.nbytes)

    async def stop(self, grace_s: float) -> None:
        await super().stop(grace_s)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def grammar_deadline(self, spec: GrammarSpec) -> float:
        """Seconds one grammar may take to compile: ``TSERVE_GRAMMAR_TIMEOUT_S`` for a small one,
        one more such span per ``GRAMMAR_BYTES_PER_SPAN`` bytes of its text (a large tools list
        or schema does more work; the host's load is not the grammar's fault)."""
        return self.settings.grammar_timeout_s * (1 + len(spec.value.encode()) / GRAMMAR_BYTES_PER_SPAN)

    async def compile_grammar(self, spec: GrammarSpec, field: str) -> CompiledGrammar:
        """The compiled grammar (cached), compiled in this engine's grammar threads within
        ``grammar_deadline``. A grammar that does not compile is a 400 naming ``field``; one not
        compiled in time is a 503 with Retry-After: its compile goes on (llguidance bounds its
        work) into the cache, and a retry of the same grammar waits for that compile rather than
        starting another. The vocabulary's index, built once per model on its first grammar,
        is not counted against any grammar's deadline."""
        if self.encdec or self.cfg.eos_token_id is None:
            raise InvalidRequestError(f"model '{self.name}' cannot follow a grammar (decoder models with an "
                                      "end-of-sequence token only)", field)
        compiler = self.core.grammars
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._grammar_pool, lambda: compiler.backend)
        deadline = self.grammar_deadline(spec)
        start = time.perf_counter()
        future = self._compiling.get(spec)
        if future is None:
            future = self._compiling[spec] = loop.run_in_executor(self._grammar_pool, compiler.lookup, spec)
            future.add_done_callback(lambda f: self._compiling.pop(spec, None) if self._compiling.get(spec) is f
                                     else None)
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody waits
        try:
            grammar, hit = await asyncio.wait_for(asyncio.shield(future), deadline)
        except asyncio.TimeoutError:  # noqa: UP041 - not the builtin before Python 3.11
            self.metrics.rejected.labels(self.name, "grammar_timeout").inc()
            raise GrammarBusyError(f"{field}: the grammar did not compile within {deadline:.3g} s (its deadline: "
                                   "TSERVE_GRAMMAR_TIMEOUT_S, scaled by its size); the server is busy, its compile "
                                   "goes on: retry", field, retry_after=max(1, math.ceil(deadline / 2))) from None
        except GrammarError as exc:
            raise InvalidRequestError(f"{field} cannot be compiled: {exc}", field) from None
        if hit:
            self.metrics.grammar_cache_hits.labels(self.name).inc()
        else:
            self.metrics.grammar_compile.labels(self.name).observe(time.perf_counter() - start)
        return grammar

    async def submit_constrained(self, items: list[tuple[list[int], SamplingParams, str]], spec: GrammarSpec | None,
                                 spec_field: str = "response_format", group_field: str = "prompt",
                                 limit_field: str = "max_tokens") -> list[RequestStream]:
        """``submit_all``, every item following ``spec`` (compiled first, off the engine thread)."""
        if spec is None:
            return self.submit_all(items, group_field, limit_field)
        self._check_accepting()
        grammar = await self.compile_grammar(spec, spec_field)
        return self.submit_all(items, group_field, limit_field, grammar=grammar)

    def speculative(self) -> dict[str, Any] | None:
        """Speculative decoding's settings and counts (None: off, or an encoder-decoder model)."""
        spec = self.core.scheduler.speculative
        if spec is None:
            return None
        drafted, accepted = self.core.drafted_tokens, self.core.accepted_tokens
        info = {"method": spec.method, "tokens": spec.tokens, "max_batch": spec.max_batch,
                "ngram": [spec.ngram_min, spec.ngram_max], "drafted_tokens": drafted, "accepted_tokens": accepted}
        if self.core.draft is not None:
            info["draft_model"] = self.draft_name
        return info

    def prefix_cache(self) -> dict[str, int] | None:
        """The prefix cache's state (None: off, or an encoder-decoder model)."""
        info = self.core.prefix_cache_info()
        return None if info is None else {"block_tokens": info["block_tokens"], "blocks_named": info["blocks_named"]}

    def kv_cache(self) -> dict[str, int]:
        """The paged KV cache's shape: block size, pool blocks and bytes, the tokens it holds."""
        info = self.core.kv_cache_info()
        return {k: info[k] for k in ("block_tokens", "blocks", "bytes", "capacity_tokens")}

    # --- the async API --------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams, prompt_field: str = "prompt",
                 limit_field: str = "max_tokens") -> None:
        """Model-specific limits; raises InvalidRequestError naming the field and the limit."""
        n = len(prompt_ids)
        if n == 0:
            raise EmptyInputError(f"{prompt_field} must not be empty", prompt_field)
        if self.encdec:
            if n > self.max_src_len:
                raise InputTooLongError(f"{prompt_field} is {n} tokens; this model accepts at most "
                                        f"{self.max_src_len}", prompt_field)
            if params.max_new_tokens + 1 > self.max_len:
                raise InvalidRequestError(f"{limit_field} must be <= {self.max_len - 1} for this model", limit_field)
            if params.beam_size > self.settings.max_batch:
                raise InvalidRequestError(f"beam_size must be <= {self.settings.max_batch} (the engine's slots)",
                                          "beam_size")
        else:
            if params.beam_size != 1:
                raise InvalidRequestError("beam_size > 1 is only supported for translation models", "beam_size")
            if n >= self.max_len:  # the prompt alone leaves no room: name it, not max_tokens
                raise InputTooLongError(
                    f"{prompt_field} is {n} tokens; this model's limit is {self.max_len} tokens, prompt and "
                    f"generated tokens together ({self._limit_source()}), so a prompt may have at most "
                    f"{self.max_len - 1}", prompt_field.split("[", 1)[0])
            if params.max_new_tokens > self.max_len - 1:  # more than any prompt leaves room for
                raise InvalidRequestError(
                    f"{limit_field} must be <= {self.max_len - 1}: this model's limit is {self.max_len} tokens, "
                    f"prompt and generated tokens together ({self._limit_source()})", limit_field)

    def _limit_source(self) -> str:
        """What sets ``max_len``: the context (the model's positions, TSERVE_MAX_SEQ_LEN) or the pool."""
        pool = self.core.scheduler.capacity_tokens()
        if self.max_len == pool and pool < self.core.max_len:
            return f"the KV cache's pool, TSERVE_KV_CACHE_BYTES, holds {pool} tokens"
        return "its context length"

    def chat_prompt(self, messages: list[dict[str, str]], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final: bool = False) -> list[int]:
        """The prompt ids of a conversation, rendered by the model's own chat template (in a
        sandbox, with a time limit) with the assistant's turn opened (unless
        ``add_generation_prompt`` is false: /tokenize); ``tools`` (OpenAI's shape) for a template
        that renders them (``template_takes_tools``). ``continue_final``: a final assistant
        message is a prefill the model continues (its turn left open, as transformers'
        ``continue_final_message`` does; trailing whitespace dropped, as Anthropic asks)."""
        if self.chat is None:
            raise InvalidRequestError(f"model '{self.name}' has no chat template; use /v1/completions for plain "
                                      "text generation", "model")
        prefill = None
        if continue_final and messages and messages[-1].get("role") == "assistant":
            # rendered with a marker for its text, cut at the marker: the turn stays open
            prefill = (messages[-1].get("content") or "").rstrip()
            messages = [*messages[:-1], {**messages[-1], "content": PREFILL_MARK}]
        try:
            text = self.chat.render(messages, add_generation_prompt=add_generation_prompt and prefill is None,
                                    **({"tools": tools} if tools else {}))
        except (ChatMessageError, ChatTemplateError) as exc:
            raise InvalidRequestError(f"messages: {exc}", "messages") from None
        if prefill is not None:
            end = text.rfind(PREFILL_MARK)
            if end < 0:
                raise InvalidRequestError("messages: this model's chat template does not keep the final assistant "
                                          "message's text, so it cannot be continued", "messages")
            text = text[:end] + prefill
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        self._check_lengths([ids], "messages", False)
        return ids

    def submit(self, prompt_ids: list[int], params: SamplingParams, prompt_field: str = "prompt") -> RequestStream:
        return self.submit_all([(prompt_ids, params, prompt_field)])[0]

    def submit_all(self, items: list[tuple[list[int], SamplingParams, str]],
                   group_field: str = "prompt", limit_field: str = "max_tokens",
                   grammar: CompiledGrammar | None = None) -> list[RequestStream]:
        """Queue several requests (a list input, ``n`` completions) all or nothing.

        A group larger than the engine could ever hold is a client error (400 naming
        ``group_field``), not a 429 that no retry can cure; a group that does not fit now is
        rejected whole, so no part of it runs for a client that got an error.
        """
        self._check_accepting()
        for ids, params, field in items:
            self.validate(ids, params, field, limit_field)
        items = [(ids, self._with_stop_tokens(self._fitted(ids, params)), field) for ids, params, field in items]
        capacity = self.settings.max_queue + self.settings.max_batch
        if len(items) > capacity:
            raise InvalidRequestError(
                f"{group_field} asks for {len(items)} sequences; this server queues at most {capacity} "
                f"(TSERVE_MAX_QUEUE + TSERVE_MAX_BATCH)", group_field)
        now = time.monotonic()
        reqs = [EngineRequest(uuid.uuid4().hex, list(ids), params, now, now + self.settings.request_timeout_s,
                              grammar=grammar) for ids, params, _ in items]
        streams = [RequestStream(self, r.request_id) for r in reqs]
        with self._cv:
            queued = len(self._inbox) + self.core.num_waiting
            if queued + len(reqs) > self.settings.max_queue + self.core.free_slots:
                self.metrics.rejected.labels(self.name, "queue_full").inc()
                # Report the queue as configured: requests about to take a free slot are not waiting.
                waiting = min(self.settings.max_queue, max(0, queued - self.core.free_slots))
                raise QueueFullError(queue_full_message(self.name, waiting, self.settings.max_queue, len(reqs)),
                                     retry_after=1)
            for req, stream in zip(reqs, streams):
                self._streams[req.request_id] = stream
                self._timing[req.request_id] = [now, 0.0]
            self._inbox.extend(reqs)
            self._cv.notify()
        return streams

    def _fitted(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """max_tokens is a ceiling: a decoder's output also ends where the context does (finish
        reason ``length``), as llama.cpp and Ollama stop at a full context; the schema states it."""
        room = self.max_len - len(ids)
        if self.encdec or params.max_new_tokens <= room:
            return params
        return dataclasses.replace(params, max_new_tokens=room)

    def _with_stop_tokens(self, params: SamplingParams) -> SamplingParams:
        """The params with the checkpoint's extra stop tokens (e.g. <|eot_id|> besides
        <|end_of_text|>): a copy, the caller's params stay as they were."""
        extra = set(self.ckpt.stop_token_ids) - set(params.stop_token_ids)
        if not extra or params.ignore_eos:
            return params
        return dataclasses.replace(params, stop_token_ids=sorted({*params.stop_token_ids, *extra}))

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._streams.pop(request_id, None)
            self._aborts.add(request_id)
            self._cv.notify()

    # --- the worker thread -----------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._inbox) or self.core.has_work

    def _warmup(self) -> None:
        """Run one request through prefill, decode and sampling before reporting ready."""
        ids = self.tokenizer.encode("warm up the engine")[: max(1, self.max_len // 4)] or [self.cfg.pad_token_id]
        params = SamplingParams(max_new_tokens=min(4, self.max_len - len(ids) - 1), temperature=0.8, seed=0,
                                ignore_eos=True)
        self.core.add(EngineRequest("warmup", ids, params))
        while self.core.has_work:
            with self.step_lock:
                self.core.step()

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self._aborts or self.core.has_work):
                    self._cv.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            # New requests first: a request aborted while still in the inbox (client gone,
            # or a multi-prompt request rejected part-way) must be removed, not run.
            for req in inbox:
                self.core.add(req)
            for request_id in aborts:
                self.core.abort(request_id)
                self._timing.pop(request_id, None)
            events = self.core.expire(time.monotonic())
            if self.core.has_work:
                try:
                    with self.step_lock:
                        result = self.core.step()
                except Exception:  # a bug must not hang every client: fail the batch, keep serving
                    log.exception("engine step failed", extra={"model": self.name})
                    events += self.core.fail_all("internal", "internal engine error")
                else:
                    events += result.events
                    self._observe_step(result)
            self._observe_events(events)
            self._update_gauges()
            if events:
                self._deliver(self._dispatch, events)
        events = self.core.fail_all("shutdown", "the server is shutting down")
        with self._cv:  # requests queued after the last step never reached the core: fail them too
            inbox, self._inbox = self._inbox, []
        events += [EngineEvent(r.request_id, error="shutdown", message="the server is shutting down",
                               prompt_tokens=len(r.prompt_ids)) for r in inbox]
        self._update_gauges()
        if events:
            self._deliver(self._dispatch, events)

    def _dispatch(self, events: list[EngineEvent]) -> None:  # on the event loop
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                stream.queue.put_nowait(event)
                if event.finished:
                    self._streams.pop(event.request_id, None)

    def _observe_step(self, result) -> None:
        m, name, now = self.metrics, self.name, time.monotonic()
        for req in result.admitted:
            m.queue_time.labels(name).observe(now - req.arrival)
        if result.prompt_tokens or result.prefix_hit_tokens:  # every prompt token once, computed or cached
            m.prompt_tokens.labels(name).inc(result.prompt_tokens + result.prefix_hit_tokens)
        if result.prefix_query_tokens:
            m.prefix_query_tokens.labels(name).inc(result.prefix_query_tokens)
            m.prefix_hit_tokens.labels(name).inc(result.prefix_hit_tokens)
            self._prefix_counts[0] += result.prefix_hit_tokens
            self._prefix_counts[1] += result.prefix_query_tokens
        if result.constrained_tokens:
            m.constrained_tokens.labels(name).inc(result.constrained_tokens)
        if result.preempted:
            m.preemptions.labels(name).inc(result.preempted)
        if result.drafted_tokens:
            m.draft_tokens.labels(name).inc(result.drafted_tokens)
            m.accepted_tokens.labels(name).inc(result.accepted_tokens)
            m.acceptance.labels(name).set(self.core.accepted_tokens / self.core.drafted_tokens)
        if result.batch_size:
            m.steps.labels(name).inc()
            m.batch_size.labels(name).set(result.batch_size)
            m.step_batch.labels(name).observe(result.batch_size)

    def _observe_events(self, events: list[EngineEvent]) -> None:
        m, name, now = self.metrics, self.name, time.monotonic()
        for event in events:
            timing = self._timing.get(event.request_id)
            if event.token_ids:
                m.generated_tokens.labels(name).inc(len(event.token_ids))
                if timing is not None:
                    if timing[1] == 0.0:
                        m.ttft.labels(name).observe(now - timing[0])
                    else:
                        m.itl.labels(name).observe(now - timing[1])
                    timing[1] = now
            if event.finished:
                self._timing.pop(event.request_id, None)

    def _update_gauges(self) -> None:
        m, name, s = self.metrics, self.name, self.core
        running, waiting = s.num_running, s.num_waiting + len(self._inbox)
        m.running.labels(name).set(running)
        m.waiting.labels(name).set(waiting)
        m.slots_used.labels(name).set(s.slots_used)
        pool = s.cache.pool
        m.kv_blocks_used.labels(name).set(pool.used)
        m.kv_usage.labels(name).set(pool.used / (pool.n_blocks - 1))
        if s.prefix is not None:
            m.prefix_blocks_used.labels(name).set(len(s.prefix))
        self.last_load = self._load(running, waiting)

    def _load(self, running: int, waiting: int) -> EngineLoad:
        cache = self.core.cache
        return EngineLoad(running, waiting, self.settings.max_batch, cache.pool.used * cache.block_len,
                          (cache.pool.n_blocks - 1) * cache.block_len, *self._prefix_counts)
