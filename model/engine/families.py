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

# Up to where the native step's prefill was measured to pay. Its int8 projections cost about
# half the float forward's per row; its attention walks each row's positions one by one for
# short chunks and attends as blocks (model.decode.native.PROMPT_ATTENTION_ROWS) from 128 rows
# of one sequence on (on windowed layers too, where the window is wider than a block): over a
# bfloat16 cache with the CPU's bfloat16 dot products where it has them (csrc attend_block_bf16),
# else torch's flash attention. Measured (2 cores, `python -m benchmarks.prefill`, 2026-11-26
# 10:42 UTC), native / float prompt tokens/s: SmolLM2-135M 4.1x at 16 tokens, 3.0x at 256,
# 2.6x at 1,000, 2.0x at 3,000 and 6,000, 2.2x at 6,764; Gemma 3 270M 4.1x, 2.8x, 2.9x, 3.4x,
# 4.3x, 4.6x at 6,937. A chunk goes native while the mean position of its rows is at most this
# (a 6,000-token prompt written from position 0); longer ones were not measured and go through
# the float forward.
NATIVE_PREFILL_MEAN_POSITION = 3000


class DecoderPrompts:
    encodes_source = False

    def __init__(self, model: DecoderLM, step=None):
        """``step``: the decode step; where it takes prompts (``prefills``: the native step),
        chunks whose rows sit at a mean position up to ``NATIVE_PREFILL_MEAN_POSITION`` go
        through its ``prefill`` (int8, row by row), the rest through the model's float forward."""
        self.model = model
        self.native_prefill = step.prefill if getattr(step, "prefills", False) else None

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
            plan.chunks.append(PromptChunk(seq, seq.input_ids[seq.prefilled: seq.prefilled + take], seq.prefilled))
            budget -= take

    def run(self, cache: PagedKVCache, plan: StepPlan) -> tuple[Tensor | None, list[Sequence]]:
        """Write the chunks; logits rows for the sequences whose prompt is now complete (not for
        a resumed sequence: its next token is already chosen)."""
        if not plan.chunks:
            return None, []
        chunks = plan.chunks
        logits = self._prefill(cache, chunks)
        rows = [i for i, c in enumerate(chunks) if c.completes and not c.seq.resumed]
        if not rows:
            return None, []
        return logits[torch.tensor(rows, device=logits.device)], [chunks[i].seq for i in rows]

    def first_position(self, seq: Sequence) -> int:
        return len(seq.input_ids)

    def _prefill(self, cache: PagedKVCache, chunks: list[PromptChunk]) -> Tensor:
        """Logits after each chunk's last token (B, V), each chunk through the cheaper path."""
        native = [self.native_prefill is not None and c.start + (len(c.tokens) - 1) / 2 <= NATIVE_PREFILL_MEAN_POSITION
                  for c in chunks]
        groups = [(run, [i for i, n in enumerate(native) if n == want]) for run, want in
                  ((self.native_prefill, True), (self.model.prefill, False))]
        out: Tensor | None = None
        for run, index in groups:
            if not index:
                continue
            part = run(cache, [chunks[i].tokens for i in index], [chunks[i].seq.slots[0] for i in index],
                       starts=[chunks[i].start for i in index])
            if len(index) == len(chunks):
                return part
            if out is None:
                out = part.new_empty((len(chunks), part.size(-1)))
            out[torch.tensor(index, device=part.device)] = part
        return out


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
