"""What every engine shares (``GenerativeEngine`` in ``service.engines.generative``, ``EncoderEngine`` in
``service.engines.encoder``): the model's limits checked on the client's inputs, the one usage
rule, and the lifecycle (warm-up, a worker thread, a drain on stop)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from model import Checkpoint, EngineEvent
from service.engines.errors import EmptyInputError, EngineStoppedError, InputTooLongError, InvalidRequestError
from service.metrics import Metrics
from service.models.facts import TASKS, architecture, language_pair, quantization
from service.models.memory import weights_bytes
from service.settings import Settings

log = logging.getLogger("tserve.engine")

__all__ = ["TASKS", "BaseEngine", "TokenUsage"]  # TASKS: what each family serves (service.models.facts)


@dataclass(frozen=True)
class TokenUsage:
    """Tokens one HTTP request cost: what every endpoint reports as ``usage``."""

    prompt_tokens: int
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass(frozen=True)
class EngineLoad:
    """A generative engine's load after its latest step, as a gateway routes by it: requests
    holding a row or waiting for one, KV-cache tokens in use and in the pool, prefix-cache
    tokens found and looked up since the model loaded."""

    running: int
    waiting: int
    max_running: int
    used_tokens: int
    capacity_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int


class BaseEngine:
    def __init__(self, name: str, ckpt: Checkpoint, settings: Settings, metrics: Metrics):
        self.name, self.ckpt, self.settings, self.metrics = name, ckpt, settings, metrics
        self.model, self.tokenizer, self.cfg = ckpt.model, ckpt.tokenizer, ckpt.config
        if self.tokenizer is None:
            raise ValueError(f"{ckpt.path}: a served checkpoint needs a tokenizer.json")
        self.max_len = min(settings.max_seq_len or self.cfg.max_positions, self.cfg.max_positions)
        self.created = int(time.time())
        self.source_facts: tuple[str | None, str | None] = (None, None)  # (architecture, quantization) of the file
        self.parameters: int | None = None  # the float model's count, taken by the loader before quantizing
        self._weights_bytes: int | None = None
        self.ready = False
        self.accepting = False
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics.slots_total.labels(name).set(0)

    # --- what the routes call instead of reaching the tokenizer or the config ------------------
    def tokenize(self, texts: list[str], field_name: str) -> list[list[int]]:
        """Token ids of each text, checked against the model's input limit."""
        rows = self.tokenizer.encode_batch(texts)
        self._check_lengths(rows, field_name, len(texts) > 1)
        return rows

    def validate_ids(self, rows: list[list[int]], field_name: str) -> None:
        """Token ids sent by the client: non-empty, inside the vocabulary, within the limit."""
        vocab = self.cfg.vocab_size
        for ids in rows:
            if not ids:
                raise EmptyInputError(f"{field_name} contains an empty token list", field_name)
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequestError(f"{field_name} token ids must be in [0, {vocab})", field_name)
        self._check_lengths(rows, field_name, len(rows) > 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One text's token ids as the model reads them, not checked against a limit (/tokenize
        counts; it admits nothing)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Token ids a client may send are in ``[0, vocab_size)``."""
        return self.cfg.vocab_size

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``ids`` (``Ġthe``, ``▁the``: what vLLM's ``token_strs`` shows)."""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def token_text(self, token_id: int) -> str:
        """A token's text; a token holding only part of a UTF-8 character has none, so its raw
        vocabulary entry is used (unique, unlike the replacement character)."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.tokenizer.id_to_token(token_id) or text if "\ufffd" in text else text

    def is_special(self, token_id: int) -> bool:
        """A special token ([CLS], </s>, ...): APIs such as TGI flag them in their token lists."""
        return token_id in self.tokenizer.special_ids

    @property
    def eos_token_id(self) -> int | None:
        return self.cfg.eos_token_id

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def usage(self, prompts: Sequence[Sequence[int]], finals: Sequence[EngineEvent] = ()) -> TokenUsage:
        """The one usage rule: every prompt token once (``n`` copies of a prompt count once),
        and the tokens each request generated (``completion_tokens`` of its final event)."""
        return TokenUsage(sum(map(len, prompts)), sum(self.completion_tokens(e) for e in finals))

    def completion_tokens(self, final: EngineEvent) -> int:
        """Tokens the model generated for one request, the end-of-sequence token included (as
        OpenAI and vLLM count: it cost a decoding step). Beam search's hypotheses leave the end
        token out of their ids, so it is added back here: greedy and beam agree."""
        n = final.completion_tokens
        if final.finish_reason == "eos" and (not final.token_ids or final.token_ids[-1] != self.cfg.eos_token_id):
            n += 1
        return n

    def _input_limit(self) -> int | None:
        """Tokens one input may have, checked at tokenization; None: checked by ``validate``."""
        return None

    def _check_lengths(self, rows: list[list[int]], field_name: str, indexed: bool) -> None:
        limit = self._input_limit()
        for i, ids in enumerate(rows):
            if limit is not None and len(ids) > limit:
                where = f"{field_name}[{i}]" if indexed else field_name
                raise InputTooLongError(f"{where} is {len(ids)} tokens; this model accepts at most {limit}",
                                        field_name)

    @property
    def family(self) -> str:
        return self.cfg.family

    @property
    def task(self) -> str:
        return TASKS[self.family]

    def info(self) -> dict[str, Any]:
        arch, source = self.source_facts
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "transformer-serve",
                "family": self.family, "task": self.task, "max_seq_len": self.max_len,
                "parameters": self.model.num_parameters() if self.parameters is None else self.parameters,
                "metrics": self.ckpt.metrics,
                "architecture": architecture(self.cfg, arch), "context_length": self.max_len,
                "quantization": quantization(self.model, source, self.decode_q4()),
                "decode_step": self.decode_step_name, "language_pair": self.language_pair,
                "chat": False, "tools": False, "memory": self.memory()}

    @property
    def language_pair(self) -> list[str] | None:
        """A translation model's (source, target) language codes (``service.models.facts``)."""
        pair = language_pair(self.family, self.cfg, self.name)
        return list(pair) if pair else None

    def decode_q4(self) -> int:
        """Projections whose decode steps read the file's own 4-bit weights (the native step's)."""
        return 0

    @property
    def decode_step_name(self) -> str | None:
        """native, python or triton (the Python step with the Triton attention kernel); None: no decoder."""
        return None

    # --- memory (the registry's budget) -----------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes this model holds: its weights (with the copies serving adds) and its KV caches."""
        if self._weights_bytes is None:
            self._weights_bytes = weights_bytes(self.model) + self.step_bytes()
        kv = self.kv_cache_bytes()
        return {"weights_bytes": self._weights_bytes, "kv_cache_bytes": kv, "total_bytes": self._weights_bytes + kv}

    def kv_cache_bytes(self) -> int:
        return 0

    def step_bytes(self) -> int:
        """Copies of the weights the decode step holds itself (the native step's partner halves)."""
        return 0

    @property
    def in_flight(self) -> bool:
        """Requests queued or running: such a model is never unloaded (eviction, keep-alive)."""
        return bool(self._busy())

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.settings.warmup:
            await asyncio.to_thread(self._warmup)
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        self.accepting = self.ready = True
        log.info("engine ready", extra={"model": self.name, "family": self.family})

    async def stop(self, grace_s: float) -> None:
        """Stop admitting; give in-flight work ``grace_s`` to finish, then fail the rest.
        Idempotent: the server's drain calls it, then the lifespan's shutdown."""
        self.accepting = self.ready = False
        deadline = time.monotonic() + grace_s
        while not self._stopping and self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise EngineStoppedError(f"model '{self.name}' is not ready (starting or shutting down)")

    def _deliver(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # subclasses
    def _warmup(self) -> None: ...
    def _run(self) -> None: ...
    def _busy(self) -> bool: ...
