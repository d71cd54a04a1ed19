"""service.translation.translate: masking, unmasking, the n-best / retry fallback and placeholders_ok,
against a scripted engine (the shipped model was not trained on sentinels, so what it writes
says nothing about the mechanism)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from model import EngineEvent
from service.engines.generative import SamplingParams, TokenUsage
from service.translation import translate as translation


class ScriptedStream:
    def __init__(self, event: EngineEvent):
        self.events = [event]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def abort(self):
        pass


class ScriptedEngine:
    """Answers each submitted prompt with the next scripted (text, hypotheses)."""

    def __init__(self, masking: bool, script: list[tuple[str, list[str]]]):
        self.cfg = SimpleNamespace(mask_placeholders=masking)
        self.settings = SimpleNamespace(max_batch=8)
        self.script, self.tokenized, self.submitted = list(script), [], []

    def tokenize(self, texts, field):
        self.tokenized += texts
        return [[ord(c) for c in t] for t in texts]

    def submit_all(self, items, group_field):
        self.submitted.append([(params, field) for _, params, field in items])
        streams = []
        for _ in items:
            text, hyps = self.script.pop(0)
            streams.append(ScriptedStream(EngineEvent("r", text, [1], finish_reason="eos", hypotheses=hyps,
                                                      completion_tokens=1)))
        return streams

    def usage(self, prompts, finals=()):
        return TokenUsage(sum(map(len, prompts)), len(finals))

    def completion_tokens(self, final):
        return final.completion_tokens


async def never_gone() -> None:  # the client never leaves
    await asyncio.Event().wait()


def run(engine, texts, params):
    sources = translation.sources(engine, texts)
    ids = translation.source_ids(engine, sources, "text")
    fields = [f"text[{i}]" for i in range(len(texts))]
    return asyncio.run(translation.translate(never_gone, engine, sources, ids, params, fields, "text"))


def test_masked_source_and_unmasked_output():
    engine = ScriptedEngine(True, [("⟪2⟫ von ⟪1⟫ ", [])])
    [result], usage = run(engine, ["%1$s of %2$s"], SamplingParams(beam_size=1, temperature=0))
    assert engine.tokenized == ["⟪1⟫ of ⟪2⟫"]
    assert result.text == "%2$s von %1$s" and result.placeholders_ok and not result.retried
    assert len(engine.submitted) == 1


def test_beam_search_asks_for_n_best_and_takes_the_first_that_maps_back():
    engine = ScriptedEngine(True, [("⟪1⟫ Dateien", ["Dateien", "⟪1⟫ ⟪1⟫", "⟪1⟫ Dateien"])])
    [result], _ = run(engine, ["%d files"], SamplingParams(beam_size=3, temperature=0))
    assert engine.submitted[0][0][0].n_best == 3
    assert result.text == "%d Dateien" and result.placeholders_ok and not result.retried


def test_greedy_output_that_loses_a_sentinel_is_retried_with_beam_search():
    engine = ScriptedEngine(True, [("Dateien", []), ("ok", []), ("Dateien", ["Dateien", "⟪1⟫ Dateien"])])
    results, usage = run(engine, ["%d files", "fine"], SamplingParams(beam_size=1, temperature=0.7, seed=3))
    assert [r.text for r in results] == ["%d Dateien", "ok"]
    assert results[0].retried and not results[1].retried and all(r.placeholders_ok for r in results)
    retry = engine.submitted[1]
    assert [field for _, field in retry] == ["text[0]"]  # only the failed text, under its own field name
    assert retry[0][0].beam_size == translation.FALLBACK_BEAMS == retry[0][0].n_best
    assert usage.completion_tokens == 3  # both attempts count


def test_no_hypothesis_maps_back_returns_the_best_restored_and_reports_it():
    engine = ScriptedEngine(True, [("x", []), ("⟪2⟫ Dateien ⟪2⟫", ["⟪2⟫ Dateien ⟪2⟫", "Dateien"])])
    [result], _ = run(engine, ["%d of %s files"], SamplingParams(beam_size=1, temperature=0))
    assert result.text == "%s Dateien" and result.placeholders_ok is False and result.retried


def test_a_checkpoint_that_does_not_mask_is_checked_not_retried():
    engine = ScriptedEngine(False, [("%d Dateien", []), ("Dateien", [])])
    results, _ = run(engine, ["%d files", "%d files"], SamplingParams(beam_size=1, temperature=0))
    assert engine.tokenized == ["%d files", "%d files"]
    assert [r.placeholders_ok for r in results] == [True, False] and len(engine.submitted) == 1


@pytest.mark.parametrize("chunks,expected,ok", [
    (["⟪", "1⟫ Da", "teien ⟪2", "⟫"], "%d Dateien {x}", True),
    (["⟪1⟫ Dateien"], "%d Dateien", False),
])
def test_streamed_sentinels_are_mapped_back_as_they_complete(chunks, expected, ok):
    engine = ScriptedEngine(True, [])
    streamed = translation.StreamedTranslation(engine, translation.sources(engine, ["%d files {x}"])[0])
    sent = [streamed.feed(EngineEvent("r", c, finish_reason="eos" if i == len(chunks) - 1 else None))
            for i, c in enumerate(chunks)]
    assert "".join(sent) == expected and streamed.placeholders_ok is ok
    assert all("⟪" not in s for s in sent)


def fake_engine(name, pair=(None, None), family="encoder-decoder", ready=True):
    cfg = SimpleNamespace(source_language=pair[0], target_language=pair[1])
    return SimpleNamespace(name=name, family=family, ready=ready, cfg=cfg)


def test_the_language_pair_is_the_checkpoints_and_the_name_only_a_fallback():
    assert translation.language_pair(fake_engine("my-model", ("en", "fr"))) == ("en", "fr")
    assert translation.language_pair(fake_engine("translate-en-de", ("en", "fr"))) == ("en", "fr")
    assert translation.language_pair(fake_engine("opus-mt-en-de")) == ("en", "de")  # no metadata: the name
    assert translation.language_pair(fake_engine("my-model")) is None
    assert translation.language_pair(fake_engine("gpt-en-de", family="decoder")) is None


def test_one_rule_chooses_the_engine_for_a_pair():
    engines = [fake_engine("gpt", family="decoder"), fake_engine("loading-en-de", ready=False),
               fake_engine("a", ("en", "de")), fake_engine("b", ("fr", "de")), fake_engine("c", ("en", "de")),
               fake_engine("anonymous")]
    registry = SimpleNamespace(engines={e.name: e for e in engines})

    def chosen(source, target):
        found = translation.engine_for(registry, source, target)
        return found and (found[0], found[1].name)

    assert chosen("en", "de") == (("en", "de"), "a")  # the first ready model, in loading order
    assert chosen("fr", "de") == (("fr", "de"), "b")
    assert chosen(None, "de") == (("en", "de"), "a")  # DeepL without source_lang
    assert chosen("fr", None) == (("fr", "de"), "b")
    assert chosen("de", "en") is None
    assert chosen(None, None) == (("en", "de"), "a")  # /v1/translate without a model: any translation model
    assert list(translation.translation_pairs(registry)) == [("en", "de"), ("fr", "de")]
    assert {p: e.name for p, e in translation.translation_pairs(registry).items()} == {("en", "de"): "a",
                                                                                       ("fr", "de"): "b"}
