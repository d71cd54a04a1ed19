"""The plan of one engine step (vLLM v1's ``SchedulerOutput``): what the runner must do.

A plan is pure data. The scheduler makes it; the runner executes it on the model and the
cache in this order: slot moves, beam reorders, then one forward pass over the decode rows
and one over the prompt work; the core applies the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.engine.requests import Sequence


@dataclass
class SlotMove:
    """Copy ``length`` positions (and any cross-attention memory) of slot ``src`` to ``dst``."""

    src: int
    dst: int
    length: int


@dataclass
class BeamReorder:
    """Beam search kept some hypotheses twice: copy their histories over the dropped ones."""

    src: list[int]
    dst: list[int]
    length: int


@dataclass
class DecodeRow:
    """One new token at ``position`` of ``slot``, fed back from the previous step."""

    seq: Sequence
    slot: int
    token: int
    position: int


@dataclass
class PromptChunk:
    """Prompt tokens ``tokens`` of ``seq`` written from position ``start`` (decoder-only)."""

    seq: Sequence
    tokens: list[int]
    start: int

    @property
    def completes(self) -> bool:
        return self.start + len(self.tokens) == len(self.seq.req.prompt_ids)


@dataclass
class StepPlan:
    moves: list[SlotMove] = field(default_factory=list)
    reorders: list[BeamReorder] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    chunks: list[PromptChunk] = field(default_factory=list)  # decoder-only prompts
    sources: list[Sequence] = field(default_factory=list)  # encoder-decoder: encoded whole

    @property
    def empty(self) -> bool:
        return not (self.decode or self.chunks or self.sources)

    @property
    def batch_size(self) -> int:
        """Rows in this step's forward passes."""
        return len(self.decode) + len(self.chunks) + sum(len(s.slots) for s in self.sources)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks) + sum(len(s.req.prompt_ids) for s in self.sources)
