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

import threading
from dataclasses import dataclass

import torch

from model.decode.step import DecodeStep, PythonStep
from model.engine.draft_model import DraftModel
from model.engine.families import prompts_for
from model.engine.grammar import DEFAULT_CACHE_SIZE, GrammarCompiler
from model.engine.prefix_cache import PrefixCache
from model.engine.requests import BeamDecoding, EngineEvent, EngineRequest
from model.engine.runner import ModelRunner, StepOutput
from model.engine.scheduler import Scheduler
from model.engine.speculative import SpeculativeConfig
from model.nn.kv_cache import BLOCK_LEN, PagedKVCache, blocks_for
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
    preempted: int = 0  # sequences that gave their blocks back this step
    drafted_tokens: int = 0  # speculative decoding: draft tokens fed this step
    accepted_tokens: int = 0  # of those, kept


class EngineCore:
    def __init__(self, model: DecoderLM | EncoderDecoder, tokenizer: Tokenizer | None, n_slots: int, max_len: int,
                 max_src_len: int = 0, max_prefill_tokens: int = 2048, prefix_cache: bool = False,
                 step: DecodeStep | None = None, kv_cache_bytes: int = 0,
                 speculative: SpeculativeConfig | None = None, grammar_cache_size: int = DEFAULT_CACHE_SIZE,
                 kv_cache_min_tokens: int = 0, draft: DecoderLM | None = None, draft_step: DecodeStep | None = None):
        """``n_slots``: the most sequences in flight (rows); ``max_len``: one sequence's context;
        ``kv_cache_bytes``: the block pool's size, at most every row at ``max_len`` (0: exactly
        that, nothing waits for memory), at least ``kv_cache_min_tokens`` positions (the service
        asks for one sequence at ``max_len``: a budget in bytes never cuts a model's context).
        ``prefix_cache``: share cached prompt blocks (decoder-only). ``step``: the
        decode step (``model.decode.prepare``); default the model's own Python step, float, SDPA.
        ``speculative``: draft tokens by prompt lookup (model.engine.speculative); default none.
        ``grammar_cache_size``: compiled grammars kept (LRU), fixed for the core's life.
        ``draft`` / ``draft_step``: the draft model of ``speculative`` method ``draft``
        (model.engine.draft_model) and its decode step (default its Python step); it must share
        the model's vocabulary (``check_vocabulary``). Its cache has as many rows and blocks as
        the model's."""
        self.model, self.tokenizer = model, tokenizer
        self.decode_step: DecodeStep = step or PythonStep(model)
        self.n_slots, self.max_len, self.max_src_len = n_slots, max_len, max_src_len
        prompts = prompts_for(model, self.decode_step)
        n_blocks = None  # every row at max_len: nothing ever waits for memory
        if kv_cache_bytes:  # no more than that, though: a budget beyond it would only be reserved, never used
            n_blocks = min(max(self.pool_blocks(model, kv_cache_bytes, self.decode_step.kv_dtype),
                               1 + blocks_for(kv_cache_min_tokens)), 1 + n_slots * blocks_for(max_len))
        self.runner = ModelRunner(model, prompts, n_slots, max_len, self.decode_step, max_src_len, n_blocks)
        cache = self.runner.cache
        self.prefix = (PrefixCache(cache.pool, cache.block_len)
                       if prefix_cache and not prompts.encodes_source else None)
        cfg = model.cfg
        every_layer_windowed = cfg.sliding_window is not None and all(
            layer.self_attn.window for layer in model.decoder_layers)
        self.draft: DraftModel | None = None
        if speculative is not None and speculative.method == "draft" and not prompts.encodes_source:
            if draft is None:
                raise ValueError("speculative method 'draft' needs a draft model")
            if draft.cfg.vocab_size != cfg.vocab_size:
                raise ValueError(f"the draft model has {draft.cfg.vocab_size} token ids and the model "
                                 f"{cfg.vocab_size}: a draft must share its target's vocabulary")
            self.draft = DraftModel(draft, draft_step or PythonStep(draft), n_slots,
                                    min(max_len, draft.cfg.max_positions), cache.n_blocks, target_cfg=cfg,
                                    cost=speculative.draft_cost)
        self.scheduler = Scheduler(prompts, tokenizer, cfg.eos_token_id, cache, max_prefill_tokens, self.prefix,
                                   cfg.sliding_window if every_layer_windowed else 0, speculative, self.draft)
        self.drafted_tokens = self.accepted_tokens = 0  # speculative decoding, since start
        self._grammars: GrammarCompiler | None = None
        self._grammar_cache_size = grammar_cache_size
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles this model's grammars; made on first use, once (the service's compile
        threads may ask at the same time), with the cache size the core was given."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("constrained decoding needs the model's tokenizer")
                cfg = self.model.cfg
                self._grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_id,
                                                 self._grammar_cache_size)
            return self._grammars

    @staticmethod
    def pool_blocks(model: DecoderLM | EncoderDecoder, budget_bytes: int, dtype) -> int:
        """Blocks (the null block included) that fit in ``budget_bytes`` at the model's cache
        shape and dtype."""
        return max(2, budget_bytes // EngineCore.block_bytes(model, dtype))

    @staticmethod
    def block_bytes(model: DecoderLM | EncoderDecoder, dtype) -> int:
        """One block's K and V over every layer: what a model's layers, KV heads, head size and
        the cache's dtype make of BLOCK_LEN positions."""
        return 2 * len(model.decoder_layers) * model.cfg.kv_heads * model.cfg.head_dim * BLOCK_LEN * \
            torch.empty((), dtype=dtype).element_size()

    @property
    def cache(self) -> PagedKVCache:
        return self.runner.cache

    def kv_cache_info(self) -> dict:
        """The block pool's shape and use, now."""
        cache, pool = self.cache, self.cache.pool
        return {"block_tokens": cache.block_len, "blocks": pool.n_blocks - 1, "blocks_used": pool.used,
                "blocks_cached": len(pool.evictable), "bytes": cache.k.nbytes + cache.v.nbytes,
                "capacity_tokens": self.scheduler.capacity_tokens(), "preemptions": self.scheduler.preemptions,
                "evictions": pool.evictions}

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
        """Requests waiting for a row or blocks: new ones and preempted ones."""
        return len(self.scheduler.waiting) + len(self.scheduler.preempted)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.prefilling)

    def prefix_cache_info(self) -> dict | None:
        """The prefix cache's shape and counters; None when there is none."""
        if self.prefix is None:
            return None
        return {"block_tokens": self.prefix.block, "blocks_named": len(self.prefix),
                "blocks_cached": len(self.cache.pool.evictable), "hit_tokens": self.prefix.hit_tokens,
                "query_tokens": self.prefix.query_tokens}

    def add(self, req: EngineRequest) -> None:
        """Queue a request. Its grammar, if any, comes compiled (``self.grammars``): compiling
        is never done here, on the thread that steps every other request."""
        if req.grammar is not None and req.params.beam_size > 1:
            raise ValueError("beam search cannot follow a grammar: constrained decoding needs beam_size 1, "
                             f"got beam_size {req.params.beam_size}")
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Forget a request (client gone); its rows and blocks are free for the next step."""
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
        if plan.draft_limits:  # the draft model's drafts, for every sequence that wants some, in one batch
            plan.drafts.update(self.draft.propose(plan.draft_limits))
            self.scheduler.decode_rows(plan)
        try:
            output = self.runner.run(plan) if not plan.empty else StepOutput()
        except Exception:
            for block in plan.named:  # blocks named this step were never written
                self.cache.pool.forget(block)
            raise
        self.scheduler.advance(plan)
        events = self._update(output, plan.drafts)
        drafted = sum(len(d) for d in plan.drafts.values())
        accepted = sum(len(run) - 1 for run in output.runs.values())
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        events += [EngineEvent(r.request_id, error="input_too_long", prompt_tokens=len(r.prompt_ids),
                               message=f"the request needs more KV cache than this model has: prompt and "
                                       f"max_tokens together may be at most {self.scheduler.capacity_tokens()} "
                                       "tokens") for r in plan.rejected]
        query = sum(len(s.req.prompt_ids) for s in plan.admitted) if self.prefix is not None else 0
        constrained = sum(1 for seq in output.samples if getattr(seq.decoding, "matcher", None) is not None)
        return StepResult(events, [s.req for s in plan.admitted if not s.resumed], plan.batch_size,
                          plan.prompt_tokens, plan.prefix_hit_tokens, query, constrained, len(plan.preempted),
                          drafted, accepted)

    def _update(self, output: StepOutput, drafts: dict) -> list[EngineEvent]:
        events = []
        for seq, sample in output.samples.items():
            event = seq.decoding.apply(seq, sample)
            if seq.drafter is not None:
                seq.drafter.extend(event.token_ids)
            events.append(event)
            if event.finished:
                self.scheduler.retire(seq)
        for seq, run in output.runs.items():
            event = self._apply_run(seq, run, len(drafts[seq]))
            events.append(event)
            if event.finished:
                self.scheduler.retire(seq)
        beams = list(output.beam_logprobs.items())
        for (seq, _), event in zip(beams, BeamDecoding.apply_all(beams) if beams else []):
            if event is not None:
                events.append(event)
                self.scheduler.retire(seq)
        return events

    def _apply_run(self, seq, run: list, drafted: int) -> EngineEvent:
        """A drafting sequence's tokens of this step, applied one by one until one ends it,
        as one event; the sequence moves on past the drafts it kept."""
        event, n = None, 0
        for sample in run:
            n += 1
            e = seq.decoding.apply(seq, sample)
            if event is None:
                event = e
            else:
                event.text += e.text
                event.token_ids += e.token_ids
                event.logprobs += e.logprobs
                event.top_logprobs += e.top_logprobs
                event.finish_reason, event.completion_tokens = e.finish_reason, e.completion_tokens
            if e.finished:
                break
        seq.next_pos += n - 1  # advance() moved it past the fed token; the kept drafts follow it
        seq.drafter.extend(seq.output_ids[-n:])
        seq.drafter.settle(drafted, len(run) - 1)
        return event
