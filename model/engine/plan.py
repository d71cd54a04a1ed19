"""The plan of one engine step (vLLM v1's ``SchedulerOutput``): what the runner must do.

A plan is pure data. The scheduler makes it, having already done the host side of the
cache's bookkeeping (block tables, allocations, forks, prefix matches: ``PagedKVCache``'s
host half); the runner executes what touches tensors, in this order: row moves (the
cross-attention memory and the per-row penalty state), block copies (copy on write), then one
forward pass over the decode rows and one over the prompt work; the core applies the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.engine.requests import EngineRequest, Sequence


@dataclass
class SlotMove:
    """Row ``src`` moved to the empty row ``dst`` (its block table moved when planned)."""

    src: int
    dst: int


@dataclass
class DecodeRow:
    """One new token at ``position`` of ``slot``, fed back from the previous step, or a draft
    (speculative decoding: the rows after a sequence's fed token, at the positions after it)."""

    seq: Sequence
    slot: int
    token: int
    position: int


@dataclass
class PromptChunk:
    """Input tokens ``tokens`` of ``seq`` written from position ``start`` (decoder-only): the
    prompt, or for a sequence resumed after preemption its prompt and output so far."""

    seq: Sequence
    tokens: list[int]
    start: int

    @property
    def completes(self) -> bool:
        return self.start + len(self.tokens) == len(self.seq.input_ids)


@dataclass
class StepPlan:
    moves: list[SlotMove] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (shared block, its new private copy)
    admitted: list[Sequence] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    chunks: list[PromptChunk] = field(default_factory=list)  # decoder-only prompts
    sources: list[Sequence] = field(default_factory=list)  # encoder-decoder: encoded whole
    named: list[int] = field(default_factory=list)  # blocks named for the prefix cache, written by this step
    preempted: list[Sequence] = field(default_factory=list)  # gave their blocks back; resume later
    rejected: list[EngineRequest] = field(default_factory=list)  # can never fit the pool
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # speculative: rows after the fed token
    # speculative with a draft model: drafts each sequence wants (the core has them proposed into ``drafts``)
    draft_limits: dict[Sequence, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.chunks or self.sources or self.copies)

    @property
    def batch_size(self) -> int:
        """Rows in this step's forward passes (drafts included)."""
        return len(self.decode) + len(self.chunks) + sum(len(s.slots) for s in self.sources)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks) + sum(len(s.req.prompt_ids) for s in self.sources)

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens of the admitted requests found in the prefix cache, not computed."""
        return sum(s.cached_tokens for s in self.admitted)
