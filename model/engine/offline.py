"""``generate`` and ``beam_search``: the offline entry points, thin drivers of the same
engine core the service runs (add every request, step until done), so offline and served
generation cannot drift apart. Both take the decode step the service would run
(``step=`` from ``model.decode.prepare``, or ``options=``: prepared here); without either,
the model's own float Python step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.decode.step import DecodeOptions, DecodeStep, prepare
from model.engine.core import EngineCore
from model.engine.generation import FINISH_LENGTH, GenerationResult
from model.engine.grammar import GrammarSpec
from model.engine.requests import EngineEvent, EngineRequest
from model.engine.sampling import SamplingParams
from model.engine.speculative import SpeculativeConfig
from model.nn.transformer import DecoderLM, EncoderDecoder
from model.tokenization.tokenizer import Tokenizer


def _run(core: EngineCore, prompts: Sequence[Sequence[int]], params: list[SamplingParams],
         grammars: Sequence[GrammarSpec | None] = ()) -> list[list[EngineEvent]]:
    events: dict[str, list[EngineEvent]] = {str(i): [] for i in range(len(prompts))}
    # every grammar compiled before any request is queued: a bad one fails the call, not a row
    compiled = [None if g is None else core.grammars.compile(g) for g in grammars] or [None] * len(prompts)
    for i, (prompt, p, grammar) in enumerate(zip(prompts, params, compiled)):
        core.add(EngineRequest(str(i), list(prompt), p, grammar=grammar))
    while core.has_work:
        for event in core.step().events:
            events[event.request_id].append(event)
    return [events[str(i)] for i in range(len(prompts))]


def _result(events: list[EngineEvent]) -> GenerationResult:
    return GenerationResult(
        token_ids=[t for e in events for t in e.token_ids],
        text="".join(e.text for e in events),
        finish_reason=events[-1].finish_reason or FINISH_LENGTH,
        logprobs=[lp for e in events for lp in e.logprobs],
        top_logprobs=[top for e in events for top in e.top_logprobs],
        score=events[-1].score,
    )


def _core(model: DecoderLM | EncoderDecoder, tokenizer: Tokenizer | None, prompts: Sequence[Sequence[int]],
          params: list[SamplingParams], prefix_cache: bool = False, step: DecodeStep | None = None,
          options: DecodeOptions | None = None, speculative: SpeculativeConfig | None = None) -> EngineCore:
    """A core with a slot for every sequence and room for every prompt in one prefill."""
    if step is None and options is not None:
        step = prepare(model, options, tokenizer)
    encdec = isinstance(model, EncoderDecoder)
    start = [1] * len(prompts) if encdec else [len(p) for p in prompts]
    max_len = max(s + p.max_new_tokens for s, p in zip(start, params))
    return EngineCore(model, tokenizer, n_slots=sum(p.beam_size for p in params), max_len=max_len,
                      max_src_len=max(len(p) for p in prompts) if encdec else 0,
                      max_prefill_tokens=max(1, sum(len(p) for p in prompts)), prefix_cache=prefix_cache,
                      step=step, speculative=speculative)


@torch.inference_mode()
def generate(
    model: DecoderLM | EncoderDecoder,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    tokenizer: Tokenizer | None = None,
    prefix_cache: bool = False,
    step: DecodeStep | None = None,
    options: DecodeOptions | None = None,
    speculative: SpeculativeConfig | None = None,
    grammar: GrammarSpec | Sequence[GrammarSpec | None] | None = None,
) -> list[GenerationResult]:
    """Greedy or sampled generation for a batch of prompts (sources, for the encoder-decoder).

    Finished sequences leave the batch; the rest keep stepping at their own positions. With
    ``prefix_cache`` (decoder-only), prompts sharing leading blocks compute them once.
    ``step`` / ``options``: the decode step (see the module docstring). ``speculative``: draft
    tokens by prompt lookup (decoder-only; model.engine.speculative). ``grammar``: what the
    output must match (model.engine.grammar), one for every prompt or one each (None: free);
    a grammar that does not compile raises ``GrammarError`` before anything runs.
    """
    rows = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if any(r.beam_size > 1 for r in rows):
        raise ValueError("generate() samples or decodes greedily; use model.beam_search for beam_size > 1")
    grammars = [grammar] * len(prompts) if grammar is None or isinstance(grammar, GrammarSpec) else list(grammar)
    core = _core(model, tokenizer, prompts, rows, prefix_cache, step, options, speculative)
    return [_result(e) for e in _run(core, prompts, rows, grammars)]


@torch.inference_mode()
def beam_search(
    model: EncoderDecoder,
    sources: Sequence[Sequence[int]],
    beam_size: int = 4,
    length_penalty: float = 1.0,
    max_new_tokens: int = 64,
    tokenizer: Tokenizer | None = None,
    step: DecodeStep | None = None,
    options: DecodeOptions | None = None,
) -> list[GenerationResult]:
    """The best of ``beam_size`` hypotheses for each source, scored by
    ``sum logprob / length ** length_penalty``; ``step`` / ``options`` as for ``generate``."""
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, beam_size=beam_size,
                             length_penalty=length_penalty) for _ in sources]
    core = _core(model, tokenizer, sources, params, step=step, options=options)
    return [_result(e) for e in _run(core, sources, params)]
