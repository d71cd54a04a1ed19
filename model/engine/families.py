"""How a request's prompt enters the cache: the one thing the two generative families
do differently, so each is a small class and the rest of the engine has no branches on it.

- ``DecoderPrompts``: the prompt is the start of the sequence; long prompts are written in
  chunks over several steps (bounded tokens per step), and the tracker sees the prompt as
  context for detokenization and the repetition penalty.
- ``SourcePrompts``: the source is encoded whole, its cross-attention memory is kept in
  the slots, and decoding starts from the decoder start token at position 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.engine.plan import PromptChunk, StepPlan
from model.engine.requests import Sequence
from model.nn.kv_cache import PagedKVCache
from model.nn.transformer import DecoderLM, EncoderDecoder


class DecoderPrompts:
    encodes_source = False

    def __init__(self, model: DecoderLM, step=None):
        """``step``: the decode step; where it takes prompts (``prefills``: the native step, int8,
        row by row), every chunk goes through its ``prefill``, else through the model's float
        forward (``TSERVE_PREFILL=model``, and the Python step). The native step's prompts attend
        row by row up to 128 rows of a sequence, as blocks beyond (model.decode.native.
        PROMPT_ATTENTION_ROWS). Measured against the float forward (2 cores, ``python -m
        benchmarks.studies.prefill``, docs/benchmarks.md): 2.0-4.1x the prompt tokens/s for SmolLM2-135M
        and 2.8-4.6x for Gemma 3 270M from 16 to ~7,000 tokens."""
        self.model, self.step = model, step
        self.prefill = step.prefill if getattr(step, "prefills", False) else model.prefill

    def context(self, prompt: list[int]) -> list[int]:
        return prompt

    def can_admit(self, prompt: list[int], first: bool, budget: int) -> bool:
        return budget > 0  # chunking keeps the step bounded whatever the prompt's length

    def positions_needed(self, seq: Sequence, max_len: int) -> int:
        """Positions a newly admitted sequence gets blocks for: its input (decode steps add
        blocks as they go, and may preempt)."""
        return len(seq.input_ids)

    def preemptible(self, seq: Sequence) -> bool:
        return True  # a sampled sequence replays its output; a beam search starts again, unseen

    def plan(self, plan: StepPlan, prefilling: list[Sequence], budget: int) -> None:
        """Chunks for the sequences still prefilling, oldest first, ``budget`` tokens at most
        (the first always gets at least one token so a prompt always progresses)."""
        for seq in prefilling:
            take = min(seq.prompt_left, max(budget, 0))
            if take <= 0 and plan.chunks:
                break
            take = max(take, 1)
            if seq.resumed and seq.prefilled < len(seq.req.prompt_ids):  # the prompt first, then the output
                take = min(take, len(seq.req.prompt_ids) - seq.prefilled)
            plan.chunks.append(PromptChunk(seq, seq.input_ids[seq.prefilled: seq.prefilled + take], seq.prefilled))
            budget -= take

    def run(self, cache: PagedKVCache, plan: StepPlan) -> tuple[Tensor | None, list[Sequence]]:
        """Write the chunks; logits rows for the sequences whose prompt is now complete (not for
        a resumed sequence: its next token is already chosen)."""
        chunks = [c for c in plan.chunks if not self._replayed(c)]
        if chunks:
            logits = self._prefill(cache, chunks)
        replays = [c for c in plan.chunks if self._replayed(c)]
        if replays:
            self._replay(cache, replays)
        rows = [i for i, c in enumerate(chunks) if c.completes and not c.seq.resumed]
        if not rows:
            return None, []
        return logits[torch.tensor(rows, device=logits.device)], [chunks[i].seq for i in rows]

    @staticmethod
    def _replayed(chunk: PromptChunk) -> bool:
        """A resumed sequence's output (``plan`` never mixes it with its prompt in one chunk)."""
        return chunk.seq.resumed and chunk.start >= len(chunk.seq.req.prompt_ids)

    def _replay(self, cache: PagedKVCache, chunks: list[PromptChunk]) -> None:
        """A preempted sequence's output written again as its decode steps wrote it (the decode
        step's weights: a prompt's may differ, 4-bit against int8, or int8 against float), so
        that its K/V, and the tokens after, are those of the run that was never preempted."""
        slots = [c.seq.slots[0] for c in chunks]
        starts = [c.start for c in chunks]
        if hasattr(self.step, "replay"):
            self.step.replay(cache, [c.tokens for c in chunks], slots, starts)
        elif self.step is not None:
            tokens = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long, device=cache.k.device)
            self.step(cache, tokens, [s for c, s in zip(chunks, slots) for _ in c.tokens],
                      [st + i for c, st in zip(chunks, starts) for i in range(len(c.tokens))])
        else:
            self._prefill(cache, chunks)

    def first_position(self, seq: Sequence) -> int:
        return len(seq.input_ids)

    def _prefill(self, cache: PagedKVCache, chunks: list[PromptChunk]) -> Tensor:
        """Logits after each chunk's last token (B, V)."""
        return self.prefill(cache, [c.tokens for c in chunks], [c.seq.slots[0] for c in chunks],
                            starts=[c.start for c in chunks])


class SourcePrompts:
    encodes_source = True

    def __init__(self, model: EncoderDecoder, step=None):
        self.model = model
        self.step = step  # the decode step, which feeds the decoder start token (None: the model's forward)

    def context(self, prompt: list[int]) -> list[int]:
        return []  # the output is another language: the source is no context for it

    def can_admit(self, prompt: list[int], first: bool, budget: int) -> bool:
        return first or len(prompt) <= budget  # sources are encoded whole; keep the step bounded

    def positions_needed(self, seq: Sequence, max_len: int) -> int:
        """A sampled translation gets the blocks of its whole output at admission, so it is never
        preempted (it streams; replaying it would need the decoder's prefill over the output). A
        beam search gets the start token's and grows, preemptible: it starts again, unseen."""
        if seq.req.params.beam_size > 1:
            return 1
        return min(seq.req.params.max_new_tokens + 1, max_len)

    def preemptible(self, seq: Sequence) -> bool:
        return seq.req.params.beam_size > 1

    def plan(self, plan: StepPlan, prefilling: list[Sequence], budget: int) -> None:
        plan.sources = list(prefilling)

    def run(self, cache: PagedKVCache, plan: StepPlan) -> tuple[Tensor | None, list[Sequence]]:
        """Encode the sources, keep their memory in every beam's slot, feed the start token."""
        if not plan.sources:
            return None, []
        seqs = plan.sources
        logits = self.model.prefill(cache, [s.req.prompt_ids for s in seqs], [x for s in seqs for x in s.slots],
                                    group_sizes=[len(s.slots) for s in seqs], step=self.step)
        return logits, [s for s in seqs for _ in s.slots]

    def first_position(self, seq: Sequence) -> int:
        return 1  # position 0 holds the decoder start token


def prompts_for(model: DecoderLM | EncoderDecoder, step=None) -> DecoderPrompts | SourcePrompts:
    return SourcePrompts(model, step) if isinstance(model, EncoderDecoder) else DecoderPrompts(model, step)
