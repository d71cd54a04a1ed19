"""The engine core: one decode loop for every generative model, served or offline.

    core = EngineCore(model, tokenizer, n_slots=8, max_len=512)
    core.add(EngineRequest("a", prompt_ids, SamplingParams(max_new_tokens=20)))
    while core.has_work:
        for event in core.step().events: ...

Each step is planned, run, then applied (vLLM v1's schedule -> execute -> update):
``Scheduler.schedule()`` makes a ``StepPlan``, ``ModelRunner.run(plan)`` executes it on the
model and chooses tokens, and ``EngineCore._update`` turns the choices into events and
retires finished sequences. Synchronous and single-threaded by design: the service calls
``step()`` from its worker thread; ``model.generate`` / ``model.beam_search`` call it in a loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.decode.step import DecodeStep, PythonStep
from model.engine.families import prompts_for
from model.engine.grammar import GrammarCompiler
from model.engine.prefix_cache import PREFIX_BLOCK, PrefixIndex
from model.engine.requests import EngineEvent, EngineRequest
from model.engine.runner import ModelRunner, StepOutput
from model.engine.scheduler import Scheduler
from model.nn.kv_cache import PrefixKVPool
from model.nn.transformer import DecoderLM, EncoderDecoder
from model.tokenization.tokenizer import Tokenizer


@dataclass
class StepResult:
    events: list[EngineEvent]
    admitted: list[EngineRequest]
    batch_size: int  # rows in this step's forward passes
    prompt_tokens: int  # prompt (or source) tokens written this step
    prefix_hit_tokens: int = 0  # prompt tokens of the admitted requests copied from the prefix cache
    prefix_query_tokens: int = 0  # prompt tokens of the admitted requests looked up in it
    constrained_tokens: int = 0  # tokens chosen under a grammar this step


class EngineCore:
    def __init__(self, model: DecoderLM | EncoderDecoder, tokenizer: Tokenizer | None, n_slots: int, max_len: int,
                 max_src_len: int = 0, max_prefill_tokens: int = 2048, prefix_cache_mb: float = 0.0,
                 step: DecodeStep | None = None):
        """``prefix_cache_mb``: memory for the prefix cache's pool of prompt blocks
        (decoder-only; 0 or an encoder-decoder model: no prefix cache). ``step``: the decode
        step (``model.decode.prepare``); default the model's own Python step, float, SDPA."""
        self.model, self.tokenizer = model, tokenizer
        self.decode_step: DecodeStep = step or PythonStep(model)
        self.n_slots, self.max_len, self.max_src_len = n_slots, max_len, max_src_len
        prompts = prompts_for(model)
        blocks = 0 if prompts.encodes_source else self._prefix_blocks(model, prefix_cache_mb, self.decode_step.kv_dtype)
        self.prefix = PrefixIndex(blocks, PREFIX_BLOCK) if blocks else None
        self.scheduler = Scheduler(prompts, tokenizer, model.cfg.eos_token_id, n_slots, max_prefill_tokens,
                                   self.prefix)
        self.runner = ModelRunner(model, prompts, n_slots, max_len, self.decode_step, max_src_len, blocks, PREFIX_BLOCK)
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles this model's grammars (thread-safe: the service calls it off the engine thread)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer")
            self._grammars = GrammarCompiler(self.tokenizer, self.model.cfg.vocab_size, self.model.cfg.eos_token_id)
        return self._grammars

    @staticmethod
    def _prefix_blocks(model: DecoderLM, budget_mb: float, dtype) -> int:
        """Pool blocks that fit in ``budget_mb`` at the model's cache shape and dtype."""
        if budget_mb <= 0:
            return 0
        per_block = PrefixKVPool.block_bytes(len(model.decoder_layers), model.cfg.kv_heads, model.cfg.head_dim,
                                             PREFIX_BLOCK, dtype)
        return int(budget_mb * 2**20) // per_block

    # --- requests in and out -----------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def slots_used(self) -> int:
        return self.scheduler.slots_used

    @property
    def free_slots(self) -> int:
        return len(self.scheduler.free)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.prefilling)

    def prefix_cache_info(self) -> dict | None:
        """The prefix cache's shape and counters; None when there is none."""
        if self.prefix is None:
            return None
        pool = self.runner.prefix_pool
        return {"block_tokens": self.prefix.block, "blocks": self.prefix.n_blocks, "blocks_used": len(self.prefix),
                "bytes": pool.nbytes, "hit_tokens": self.prefix.hit_tokens, "query_tokens": self.prefix.query_tokens}

    def add(self, req: EngineRequest) -> None:
        """Queue a request; a grammar not yet compiled is compiled here (offline use: the
        service compiles off the engine thread, with a deadline, and passes ``req.grammar``)."""
        if req.params.grammar is not None and req.grammar is None:
            req.grammar = self.grammars.compile(req.params.grammar)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Forget a request (client gone); its slots are free for the next step."""
        return self.scheduler.remove(request_id) is not None

    def expire(self, now: float) -> list[EngineEvent]:
        """Fail every request past its deadline."""
        return self._fail(self.scheduler.expired(now), "timeout", "request timed out")

    def fail_all(self, error: str, message: str) -> list[EngineEvent]:
        return self._fail(self.scheduler.all_requests(), error, message)

    def _fail(self, reqs: list[EngineRequest], error: str, message: str) -> list[EngineEvent]:
        for req in reqs:
            self.scheduler.remove(req.request_id)
        return [EngineEvent(r.request_id, error=error, message=message, prompt_tokens=len(r.prompt_ids))
                for r in reqs]

    # --- one step: plan, run, apply ---------------------------------------------------------
    def step(self) -> StepResult:
        plan = self.scheduler.schedule(self.runner.device)
        try:
            output = self.runner.run(plan) if not plan.empty else StepOutput()
        except Exception:
            if self.prefix is not None:  # blocks planned for this step were never written
                self.prefix.forget([h for store in plan.prefix_stores for h in store.hashes])
            raise
        self.scheduler.advance(plan)
        events = self._update(output)
        query = sum(len(s.req.prompt_ids) for s in plan.admitted) if self.prefix is not None else 0
        constrained = sum(1 for seq in output.samples if getattr(seq.decoding, "matcher", None) is not None)
        return StepResult(events, [s.req for s in plan.admitted], plan.batch_size, plan.prompt_tokens,
                          plan.prefix_hit_tokens, query, constrained)

    def _update(self, output: StepOutput) -> list[EngineEvent]:
        events = []
        for seq, sample in output.samples.items():
            event = seq.decoding.apply(seq, sample)
            events.append(event)
            if event.finished:
                self.scheduler.retire(seq)
        for seq, logprobs in output.beam_logprobs.items():
            event = seq.decoding.apply(seq, logprobs)
            if event is not None:
                events.append(event)
                self.scheduler.retire(seq)
        return events
