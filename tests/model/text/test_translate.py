"""model.text.translate: the one placeholder-safe sequence (mask -> decode -> unmask -> retry ->
restore), driven by a plain and by an async callback, against scripted decoders."""

from __future__ import annotations

import asyncio

import pytest

from model.text.translate import Attempt, Decoded, sources, translate, translate_async

TEXTS = ["%1$s of %2$s", "Delete %s files", "Copy %s to {dir}", "Open"]
FIRST = {"⟪1⟫ of ⟪2⟫": ["⟪2⟫ von ⟪1⟫"], "Delete ⟪1⟫ files": ["Dateien löschen", "⟪1⟫ ⟪1⟫"],
         "Copy ⟪1⟫ to ⟪2⟫": ["⟪2⟫ ⟪2⟫ kopieren ⟪3⟫"], "Open": ["Öffnen ⟪1⟫"]}
RETRY = {"Delete ⟪1⟫ files": ["Dateien", "⟪1⟫ Dateien löschen"], "Copy ⟪1⟫ to ⟪2⟫": ["kopieren ⟪1⟫ ⟪1⟫"],
         "Open": ["Öffnen"]}


def scripted(calls: list[Attempt]):
    def decode(attempt: Attempt) -> list[Decoded[str]]:
        calls.append(attempt)
        table = RETRY if attempt.retry else FIRST
        return [Decoded(table[t], "retry" if attempt.retry else "first") for t in attempt.texts]

    return decode


def run_both(texts, masking, **options):
    """The plain and the async driver on the same script: they must agree, call for call."""
    plain_calls, async_calls = [], []
    plain = translate(sources(texts, masking), scripted(plain_calls), masking, **options)
    decode = scripted(async_calls)

    async def adecode(attempt: Attempt) -> list[Decoded[str]]:
        await asyncio.sleep(0)
        return decode(attempt)

    awaited = asyncio.run(translate_async(sources(texts, masking), adecode, masking, **options))
    assert plain == awaited and plain_calls == async_calls
    return plain, plain_calls


def test_masks_unmasks_and_retries_only_the_failures():
    results, calls = run_both(TEXTS, True)
    assert calls == [Attempt([0, 1, 2, 3], ["⟪1⟫ of ⟪2⟫", "Delete ⟪1⟫ files", "Copy ⟪1⟫ to ⟪2⟫", "Open"], False),
                     Attempt([1, 2, 3], ["Delete ⟪1⟫ files", "Copy ⟪1⟫ to ⟪2⟫", "Open"], True)]
    assert [(r.text, r.placeholders_ok, r.info, r.retried) for r in results] == [
        ("%2$s von %1$s", True, "first", False),
        ("%s Dateien löschen", True, "retry", True),  # the first candidate that maps back
        ("kopieren %s ", False, "retry", True),  # nothing mapped back: the retry's best, restored
        ("Öffnen", True, "retry", True),  # an invented sentinel is a failure too
    ]


def test_restore_from_the_first_decoding():
    results, _ = run_both(TEXTS, True, restore_from="first")
    assert (results[2].text, results[2].placeholders_ok, results[2].info) == ("{dir}  kopieren ", False, "first")


def test_without_retry_the_first_output_is_restored():
    results, calls = run_both(TEXTS, True, retry=False)
    assert len(calls) == 1 and not any(r.retried for r in results)
    assert [r.text for r in results] == ["%2$s von %1$s", "Dateien löschen", "{dir}  kopieren ", "Öffnen "]


def test_a_checkpoint_that_does_not_mask_reads_the_text_and_is_checked_not_retried():
    calls = []
    texts = ["Delete %s files", "Open"]
    results = translate(sources(texts, False), lambda a: calls.append(a) or [Decoded(["Dateien"], None)] * 2, False)
    assert calls == [Attempt([0, 1], texts, False)]
    assert [(r.text, r.placeholders_ok) for r in results] == [("Dateien", False), ("Dateien", True)]


@pytest.mark.parametrize("masking", [True, False])
def test_nothing_to_translate_is_one_empty_attempt(masking):
    calls = []
    assert translate([], lambda a: calls.append(a) or [], masking) == []
    assert calls == [Attempt([], [], False)]
