"""The plan of one engine step (vLLM v1's ``SchedulerOutput``): what the runner must do.

A plan is pure data. The scheduler makes it; the runner executes it on the model and the
cache in this order: slot moves, beam reorders, prefix-cache loads, then one forward pass
over the decode rows and one over the prompt work, then prefix-cache stores; the core
applies the outcome.
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
class PrefixLoad:
    """Copy cached prompt blocks ``blocks`` (pool indices, in order) into ``slot`` from position 0."""

    slot: int
    blocks: list[int]


@dataclass
class PrefixStore:
    """After the forward pass: copy prompt blocks ``first``, ``first + 1``, ... of ``slot``
    into pool ``blocks`` (named by ``hashes``, so a failed step can forget them)."""

    slot: int
    first: int
    blocks: list[int]
    hashes: list[bytes]


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
    prefix_loads: list[PrefixLoad] = field(default_factory=list)
    decode: list[DecodeRow] = field(default_factory=list)
    chunks: list[PromptChunk] = field(default_factory=list)  # decoder-only prompts
    sources: list[Sequence] = field(default_factory=list)  # encoder-decoder: encoded whole
    prefix_stores: list[PrefixStore] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.chunks or self.sources or self.prefix_loads)

    @property
    def batch_size(self) -> int:
        """Rows in this step's forward passes."""
        return len(self.decode) + len(self.chunks) + sum(len(s.slots) for s in self.sources)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks) + sum(len(s.req.prompt_ids) for s in self.sources)

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens of the admitted requests copied from the prefix cache, not computed."""
        return sum(s.cached_tokens for s in self.admitted)
