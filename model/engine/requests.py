"""What the engine core is asked to do, what it answers, and the state of one sequence.

A sequence chooses its tokens in one of two ways, each a small class:
- ``SampledDecoding``: one cache slot, one logits row per step, tokens drawn by the
  shared batched sampler (greedy, temperature, top-k/p, penalties, seeds, logprobs);
- ``BeamDecoding``: ``beam_size`` slots and rows, advanced by one beam-search step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from model.engine.beam_search import BeamSearch, BeamStep, steps_together
from model.engine.generation import FINISH_STOP, SequenceTracker
from model.engine.grammar import CompiledGrammar
from model.engine.sampling import SamplingParams, make_generator
from model.engine.speculative import Drafter
from model.tokenization.tokenizer import Tokenizer


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]  # the prompt (decoder) or the source sentence (encoder-decoder)
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    # constrained decoding: what the output must match, compiled (``EngineCore.grammars``); the one
    # place a request carries a grammar, so the engine thread never compiles
    grammar: CompiledGrammar | None = None


@dataclass
class EngineEvent:
    """What one step produced for one request; the last event of a request is ``finished``."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # "timeout", "aborted", "internal", "shutdown", "grammar_limit"
    message: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    score: float | None = None  # beam search: length-normalised log probability
    hypotheses: list[str] = field(default_factory=list)  # beam search with n_best > 1: the n best texts, best first

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


# A sampled row's result, moved to the host: token, its logprob, top alternatives.
Sample = tuple[int, float | None, dict[int, float] | None]


class SampledDecoding:
    """One row per step; the engine's sampler draws its token with everyone else's."""

    def __init__(self, req: EngineRequest, tokenizer: Tokenizer | None, eos_id: int | None,
                 context: list[int], device: torch.device):
        self.tracker = SequenceTracker(req.params, tokenizer, eos_id, context)
        self.generator = make_generator(req.params.seed, device)
        self.matcher = req.grammar.matcher() if req.grammar is not None else None

    width = 1

    def apply(self, seq: Sequence, sample: Sample) -> EngineEvent:
        tok, lp, top = sample
        if self.matcher is not None and not self.matcher.accept(tok):
            # the grammar engine gave up (its per-step limits: a grammar that grows too large as it
            # is matched, e.g. nested counted repetitions); the request's fault, said as such
            why = self.matcher.error or f"token {tok} was refused"
            return EngineEvent(seq.req.request_id, error="grammar_limit", prompt_tokens=len(seq.req.prompt_ids),
                               message=f"the output's grammar failed after {seq.generated} tokens: {why}",
                               completion_tokens=seq.generated)
        event = self.tracker.add(tok, lp, top)
        if self.matcher is not None and event.finish_reason is None and self.matcher.done:
            event.text += self.tracker.finish(FINISH_STOP)  # the grammar is complete: nothing but the end may follow
            event.finish_reason = FINISH_STOP
        seq.generated += 1
        seq.output_ids.append(tok)
        seq.next_tokens = [tok]
        return EngineEvent(seq.req.request_id, event.text, [tok], [lp] if lp is not None else [],
                           [top] if top else [], event.finish_reason, prompt_tokens=len(seq.req.prompt_ids),
                           completion_tokens=seq.generated)


class BeamDecoding:
    """``beam_size`` rows per step, kept in consecutive slots; reorders them between steps."""

    def __init__(self, req: EngineRequest, tokenizer: Tokenizer | None, eos_id: int | None):
        p = req.params
        self.search = BeamSearch(1, p.beam_size, p.length_penalty, p.max_new_tokens,
                                 None if p.ignore_eos else eos_id)
        self.tokenizer = tokenizer
        self.width = p.beam_size

    def apply(self, seq: Sequence, logprobs: torch.Tensor) -> EngineEvent | None:
        """logprobs (beam_size, V) -> the final event, or None while the search goes on."""
        return self.take(seq, self.search.step(logprobs))

    @staticmethod
    def apply_all(items: list[tuple[Sequence, torch.Tensor]]) -> list[EngineEvent | None]:
        """``apply`` for several beam sequences of one step, their searches' top-k calls batched."""
        steps = steps_together([seq.decoding.search for seq, _ in items], [lp for _, lp in items])
        return [seq.decoding.take(seq, step) for (seq, _), step in zip(items, steps)]

    def take(self, seq: Sequence, step: BeamStep) -> EngineEvent | None:
        seq.generated += 1
        if not self.search.live:
            score, tokens, reason = self.search.best(0)
            decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: "")
            n_best = seq.req.params.n_best
            hypotheses = [decode(h[1]) for h in self.search.finished[0][:n_best]] if n_best > 1 else []
            return EngineEvent(seq.req.request_id, decode(tokens), tokens, finish_reason=reason, score=score,
                               prompt_tokens=len(seq.req.prompt_ids), completion_tokens=len(tokens),
                               hypotheses=hypotheses)
        seq.beam_moves = (step.copy_src, step.copy_dst)  # beam indices: slots may move before the next step
        seq.next_tokens = step.tokens
        return None


@dataclass(eq=False)  # identity semantics: sequences live in lists and dicts
class Sequence:
    req: EngineRequest
    slots: list[int]
    decoding: SampledDecoding | BeamDecoding | None  # None until admitted
    prefilled: int = 0  # input tokens already in the cache (vLLM's num_computed_tokens)
    cached_tokens: int = 0  # of those, found in the prefix cache at admission
    prefix_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the input's full blocks
    blocks_named: int = 0  # leading input blocks already named for the prefix cache
    next_pos: int = 0  # cache position of the next input token
    next_tokens: list[int] = field(default_factory=list)  # next input token of each slot
    beam_moves: tuple[list[int], list[int]] | None = None  # beam copies (src, dst indices) before the next step
    generated: int = 0
    output_ids: list[int] = field(default_factory=list)  # sampled tokens so far (a resumed sequence replays them)
    admitted_at: float = 0.0
    resumed: bool = False  # preempted, then admitted again: its prefill replays prompt and output
    drafter: Drafter | None = None  # speculative decoding: an n-gram index of its tokens, or its draft model's row

    @property
    def input_ids(self) -> list[int]:
        """What the prefill writes: the prompt, and after a preemption the output but its last
        token (which the next decode step feeds, as it would have)."""
        return self.req.prompt_ids + self.output_ids[:-1] if self.resumed else self.req.prompt_ids

    @property
    def prompt_left(self) -> int:
        return len(self.input_ids) - self.prefilled
