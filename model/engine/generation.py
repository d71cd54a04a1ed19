"""Per-sequence generation state: stop handling, streamed text, results.

The step-shaped pieces the engine core (model.engine) is built from:
- ``SequenceTracker``: host-side state of one sequence (text deltas, stop ids and
  strings, max tokens, logprobs), fed one token per step;
- ``Sampler`` (model.engine.sampling): batched next-token choice, no host sync;
- ``BeamSearch`` (model.beam_search): one beam-search step over many sources at once.
``model.generate`` and ``model.beam_search`` drive the engine core to completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from model.engine.sampling import SampleOutput, SamplingParams
from model.tokenization.tokenizer import Tokenizer

FINISH_STOP, FINISH_LENGTH, FINISH_EOS = "stop", "length", "eos"


@dataclass
class TokenEvent:
    """What one step adds to one sequence."""

    token_id: int
    text: str  # newly completed text, stop strings cut out
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    score: float | None = None  # beam search: length-normalised log probability


class SequenceTracker:
    """Host-side bookkeeping of one generated sequence."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer | None, eos_id: int | None,
                 context: Sequence[int] = ()):
        self.params = params
        self.detok = tokenizer.detokenizer(context) if tokenizer is not None else None
        self.stop_ids = set(params.stop_token_ids)
        if eos_id is not None and not params.ignore_eos:
            self.eos_id: int | None = eos_id
        else:
            self.eos_id = None
        self.hold = max((len(s) for s in params.stop), default=1) - 1  # chars that may start a stop string
        self.token_ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.emitted = 0  # how much of self.text has been handed out
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _release(self, final: bool) -> str:
        """Emit decoded text, holding back a possible stop-string prefix unless final."""
        for stop in self.params.stop:
            at = self.text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason = FINISH_STOP
                final = True
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta

    def finish(self, reason: str) -> str:
        """End the sequence now (e.g. its grammar is complete); the text still held back."""
        self.finish_reason = reason
        if self.detok is not None:
            self.text += self.detok.flush()
        return self._release(final=True)

    def add(self, token_id: int, logprob: float | None = None,
            top: dict[int, float] | None = None) -> TokenEvent:
        if self.finished:
            raise RuntimeError("sequence already finished")
        self.token_ids.append(token_id)
        is_eos = token_id == self.eos_id
        if self.detok is not None and not is_eos and token_id not in self.stop_ids:
            self.text += self.detok.add(token_id)
        if is_eos:
            self.finish_reason = FINISH_EOS
        elif token_id in self.stop_ids:
            self.finish_reason = FINISH_STOP
        elif len(self.token_ids) >= self.params.max_new_tokens:
            self.finish_reason = FINISH_LENGTH
        if self.finished and self.detok is not None:
            self.text += self.detok.flush()
        text = self._release(final=self.finished)
        return TokenEvent(token_id, text, logprob, top, self.finish_reason)


def split_sample(out: SampleOutput, params: Sequence[SamplingParams]
                 ) -> list[tuple[int, float | None, dict[int, float] | None]]:
    """Move one step's sample to the host in one transfer and split it per row."""
    tokens = out.tokens.tolist()
    logprobs = out.logprobs.tolist() if out.logprobs is not None else None
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    rows = []
    for i, p in enumerate(params):
        lp = logprobs[i] if logprobs is not None and p.logprobs is not None else None
        top = None
        if top_ids is not None and p.logprobs:
            top = dict(zip(top_ids[i][: p.logprobs], top_lp[i][: p.logprobs]))
        rows.append((tokens[i], lp, top))
    return rows
