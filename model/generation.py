"""Generation on top of the slot KV cache: greedy / sampled decoding and beam search.

The pieces a serving scheduler needs are public and step-shaped:
- ``SequenceTracker``: host-side state of one sequence (text deltas, stop ids and
  strings, max tokens, logprobs), fed one token per step;
- ``Sampler`` (model.sampling): batched next-token choice, no host sync;
- ``BeamSearch``: one beam-search step over many sources at once.
``generate`` and ``beam_search`` are the offline loops built from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model.host_transfer import to_device
from model.sampling import SampleOutput, Sampler, SamplingParams, make_generator
from model.tokenizer import Tokenizer
from model.transformer import DecoderLM, EncoderDecoder

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


@torch.inference_mode()
def generate(
    model: DecoderLM | EncoderDecoder,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    tokenizer: Tokenizer | None = None,
) -> list[GenerationResult]:
    """Greedy or sampled generation for a batch of prompts (sources, for the encoder-decoder).

    Finished sequences leave the batch; the rest keep stepping at their own positions.
    """
    n = len(prompts)
    rows = [params] * n if isinstance(params, SamplingParams) else list(params)
    if any(r.beam_size > 1 for r in rows):
        raise ValueError("generate() samples or decodes greedily; use model.beam_search for beam_size > 1")
    cfg = model.cfg
    encdec = isinstance(model, EncoderDecoder)
    start_len = [1] * n if encdec else [len(p) for p in prompts]
    max_len = max(s + r.max_new_tokens for s, r in zip(start_len, rows))
    cache = model.new_cache(n, max_len, max_src_len=max(len(p) for p in prompts) if encdec else 0)
    trackers = [SequenceTracker(r, tokenizer, cfg.eos_token_id, () if encdec else p) for r, p in zip(rows, prompts)]
    generators = [make_generator(r.seed, model.device) for r in rows]
    seen = torch.zeros(n, cfg.vocab_size, dtype=torch.bool, device=model.device)
    if not encdec:
        for i, p in enumerate(prompts):
            seen[i, torch.as_tensor(list(p), dtype=torch.long)] = True
    sampler = Sampler()

    logits = model.prefill(cache, prompts, list(range(n)))
    active, next_pos = list(range(n)), list(start_len)  # where each slot's next token goes
    events: dict[int, list[TokenEvent]] = {i: [] for i in range(n)}
    while active:
        act_params = [rows[i] for i in active]
        out = sampler(logits, act_params, [generators[i] for i in active], seen[active])
        seen[to_device(active, torch.long, model.device), out.tokens] = True
        keep_rows = []
        for j, (i, (tok, lp, top)) in enumerate(zip(active, split_sample(out, act_params))):
            events[i].append(trackers[i].add(tok, lp, top))
            if not trackers[i].finished:
                keep_rows.append(j)
        if not keep_rows:
            break
        tokens = out.tokens
        if len(keep_rows) < len(active):
            tokens = tokens[to_device(keep_rows, torch.long, model.device)]
        active = [active[j] for j in keep_rows]
        logits = model.decode_step(cache, tokens, active, [next_pos[i] for i in active])
        for i in active:
            next_pos[i] += 1
    return [_result(trackers[i], events[i]) for i in range(n)]


def _result(tracker: SequenceTracker, events: list[TokenEvent]) -> GenerationResult:
    return GenerationResult(
        token_ids=tracker.token_ids,
        text="".join(e.text for e in events),
        finish_reason=tracker.finish_reason or FINISH_LENGTH,
        logprobs=[e.logprob for e in events if e.logprob is not None],
        top_logprobs=[e.top_logprobs for e in events if e.top_logprobs is not None],
    )
