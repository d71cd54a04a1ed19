"""Placeholder-safe translation for /v1/translate, /v1/translate/po and the drop-in APIs'
translation (``routes/compat/common.translate_texts``): the engine side of the one sequence
in ``model.text.translate`` (mask -> decode -> unmask -> retry -> restore).

A checkpoint trained with ``mask_placeholders`` (``model.text.placeholders``) sees each format
placeholder (``%s``, ``{0}``, ``%(name)s``, ``$1``...) as a numbered sentinel ``⟪n⟫``: the
source is masked before tokenisation and the sentinels of the output are mapped back.
When the output lost, repeated or invented a sentinel, the fallback is defined:

1. a beam search request already asks for its ``beam_size`` best hypotheses (``n_best``);
   the first, best first, whose sentinels map back is taken;
2. the sources none of whose hypotheses mapped back are retried once, together, with beam
   search of ``FALLBACK_BEAMS`` hypotheses (capped by the engine's slots), same rule;
3. if none maps back, the retry's best hypothesis is returned with the placeholders restored
   as far as they survived (``model.text.placeholders.restore``) and ``placeholders_ok`` false.

Every translation reports ``placeholders_ok``: for a checkpoint that does not mask, it
compares the placeholders of the source and of the output (``same_placeholders``); its
output is never retried. Texts are returned stripped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from model.text.placeholders import restore, same_placeholders, unmask
from model.text.translate import Attempt, Decoded, Source, choose, restored, translate_async
from model.text.translate import sources as placeholder_sources
from service.engines.generative import BaseEngine, EngineEvent, GenerativeEngine, SamplingParams, TokenUsage
from service.engines.waiting import ClientGone, collect
from service.models import facts

if TYPE_CHECKING:
    from service.models.registry import EngineRegistry

FALLBACK_BEAMS = 4


@dataclass
class Translated:
    text: str
    placeholders_ok: bool
    finish_reason: str
    tokens: int  # generated tokens of the request whose output was taken
    retried: bool = False


# --- which engine translates a language pair ------------------------------------------------

Pair = tuple[str, str]


def language_pair(engine: BaseEngine) -> Pair | None:
    """(source, target) language codes of a translation model (``service.models.facts``: its
    config's, else a guess from its name); None if it has none."""
    return facts.language_pair(engine.family, engine.cfg, engine.name)


def engine_for(registry: EngineRegistry, source: str | None = None,
               target: str | None = None) -> tuple[Pair | None, GenerativeEngine] | None:
    """The translation engine for ``source`` -> ``target``, the one rule of /v1/translate (no
    ``model`` given), LibreTranslate, DeepL and the HF Inference API: the first ready
    encoder-decoder model, in loading order, whose pair has that source and that target (either
    None: any; both None: any translation model, with or without a known pair), and its pair.
    None: no ready model translates it."""
    for engine in registry.engines.values():
        if engine.family != "encoder-decoder" or not engine.ready:
            continue
        pair = language_pair(engine)
        if (source is None and target is None) or (
                pair is not None and source in (None, pair[0]) and target in (None, pair[1])):
            return pair, engine  # type: ignore[return-value]
    return None


async def reload_unloaded(registry: EngineRegistry, families: tuple[str, ...] = ("encoder-decoder",),
                          defaults: bool = True) -> None:
    """Load again the translation models (or those of ``families``) unloaded since they last
    served (keep_alive, POST /models/unload), and, with ``defaults``, the default model of each
    family none of whose models is loaded (``EngineRegistry.default_to_load``: never loaded yet,
    TSERVE_PRELOAD=none). The routes that pick a model by its language pair or its task
    (LibreTranslate, DeepL, the HF Inference API) read them from the loaded models, and the
    OpenAPI schema promises what the loaded models served."""
    names = [e.name for e in registry.entries.values()
             if e.engine is None and e.state == "available" and (e.card or {}).get("family") in families]
    if defaults and not names:
        names += [n for n in map(registry.default_to_load, families) if n is not None and n not in names]
    for name in names:
        await registry.load(name)


def translation_pairs(registry: EngineRegistry) -> dict[Pair, GenerativeEngine]:
    """Every language pair served, with the engine ``engine_for`` picks for it."""
    pairs: dict[Pair, GenerativeEngine] = {}
    for engine in registry.engines.values():
        pair = language_pair(engine)
        if pair is not None and engine.ready:
            pairs.setdefault(pair, engine)  # type: ignore[arg-type]
    return pairs


# --- placeholder-safe translation -------------------------------------------------------------

def masks_placeholders(engine: GenerativeEngine) -> bool:
    return bool(getattr(engine.cfg, "mask_placeholders", False))


def sources(engine: GenerativeEngine, texts: list[str]) -> list[Source]:
    return placeholder_sources(texts, masks_placeholders(engine))


def source_ids(engine: GenerativeEngine, items: list[Source], field: str) -> list[list[int]]:
    """Token ids of what the model reads, checked against its input limit (400 naming ``field``)."""
    return engine.tokenize([s.masked for s in items], field)


def _candidates(final: EngineEvent, streamed: str) -> list[str]:
    return final.hypotheses or [streamed]


async def translate(client_gone: ClientGone, engine: GenerativeEngine, items: list[Source],
                    ids: list[list[int]], params: SamplingParams, fields: list[str],
                    group_field: str) -> tuple[list[Translated], TokenUsage]:
    """Translate every source in one group (``engine.submit_all``: all or nothing, errors name
    ``fields[i]``), then retry, together, those whose placeholders did not survive; the usage
    counts both."""
    masking = masks_placeholders(engine)
    usage = TokenUsage(0)

    async def decode(attempt: Attempt) -> list[Decoded[EngineEvent]]:
        nonlocal usage
        if attempt.retry:
            beams = min(FALLBACK_BEAMS, engine.settings.max_batch)
            run = replace(params, beam_size=beams, n_best=beams, temperature=0.0, seed=None)
        else:
            run = _with_n_best(params) if masking else params
        rows = [ids[i] for i in attempt.indices]
        finals, texts = await _run(client_gone, engine, rows, [run] * len(rows),
                                   [fields[i] for i in attempt.indices], group_field)
        more = engine.usage(rows, finals)
        usage = TokenUsage(usage.prompt_tokens + more.prompt_tokens, usage.completion_tokens + more.completion_tokens)
        return [Decoded(_candidates(final, text), final) for final, text in zip(finals, texts)]

    done = await translate_async(items, decode, masking)
    return [Translated(r.text.strip(), r.placeholders_ok, r.info.finish_reason, engine.completion_tokens(r.info),
                       r.retried) for r in done], usage


def _with_n_best(params: SamplingParams) -> SamplingParams:
    return replace(params, n_best=params.beam_size) if params.beam_size > 1 else params


async def _run(client_gone: ClientGone, engine: GenerativeEngine, ids: list[list[int]],
               params: list[SamplingParams], fields: list[str],
               group_field: str) -> tuple[list[EngineEvent], list[str]]:
    streams = engine.submit_all([(row, p, f) for row, p, f in zip(ids, params, fields)], group_field)
    results = await collect(client_gone, streams)
    return [events[-1] for events in results], ["".join(e.text for e in events) for events in results]


_OPEN_SENTINEL = re.compile(r"⟪\d*$")


class StreamedTranslation:
    """A streamed translation of one masked source: sentinels are mapped back as they complete
    (a partial ``⟪1`` is held back until its ``⟫`` arrives); no retry is possible once text
    has been sent, so ``placeholders_ok`` only reports."""

    def __init__(self, engine: GenerativeEngine, src: Source):
        self.engine, self.src = engine, src
        self.raw, self.pending, self.sent = "", "", ""
        self.placeholders_ok: bool | None = None

    def params(self, params: SamplingParams) -> SamplingParams:
        return _with_n_best(params) if masks_placeholders(self.engine) else params

    def feed(self, event: EngineEvent) -> str:
        """The text to send for ``event`` (with the rest of the held-back text once it is the last)."""
        if event.finished and event.hypotheses:  # beam search: one final event, hypotheses to choose from
            chosen = choose(self.src, event.hypotheses, masks_placeholders(self.engine))
            text, self.placeholders_ok = chosen or (restored(self.src, event.hypotheses), False)
            return text.strip()
        self.raw += event.text
        if not masks_placeholders(self.engine):
            out = event.text
        else:
            self.pending += event.text
            hold = _OPEN_SENTINEL.search(self.pending)
            cut = len(self.pending) if event.finished or hold is None else hold.start()
            out, self.pending = restore(self.pending[:cut], self.src.originals), self.pending[cut:]
        self.sent += out
        if event.finished:
            if masks_placeholders(self.engine):
                self.placeholders_ok = unmask(self.raw, self.src.originals) is not None
            else:
                self.placeholders_ok = same_placeholders(self.src.text, self.sent)
        return out
