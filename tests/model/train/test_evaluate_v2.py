"""Evaluation helpers of v2: placeholder masking in translate_all (the shipped en->de weights,
told they were trained on sentinels: the mechanism is checked, not the quality), the
hash-ordered evaluation subset, and placeholder preservation counts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from model.formats.checkpoint import load
from model.train import evaluate
from model.train.evaluate import eval_subset, placeholder_preservation, translate_all
from tests.conftest import checkpoint_variant

SHIPPED = Path(__file__).resolve().parents[3] / "weights" / "translate-en-de"
SOURCES = ["Delete %s files", "%1$s of %2$s", "Open the file", "100%% done"]


@pytest.fixture(scope="module")
def masked_checkpoint(tmp_path_factory):
    root = checkpoint_variant(SHIPPED, tmp_path_factory.mktemp("masked") / "ckpt", mask_placeholders=True)
    ckpt = load(root)
    assert ckpt.model.cfg.mask_placeholders is True
    return ckpt.model.eval(), ckpt.tokenizer


def spy_on_translate(monkeypatch) -> list[tuple[list[str], int]]:
    calls = []
    real = evaluate._translate

    def spy(model, tok, sources, max_new_tokens, beam_size, batch_size, step=None):
        calls.append((list(sources), beam_size))
        return real(model, tok, sources, max_new_tokens, beam_size, batch_size, step)

    monkeypatch.setattr(evaluate, "_translate", spy)
    return calls


def test_translate_all_with_the_real_model_masks_and_restores(masked_checkpoint, monkeypatch):
    model, tok = masked_checkpoint
    calls = spy_on_translate(monkeypatch)
    out = translate_all(model, tok, SOURCES, max_new_tokens=24)
    assert calls[0] == (["Delete ⟪1⟫ files", "⟪1⟫ of ⟪2⟫", "Open the file", "100%% done"], 1)
    if len(calls) > 1:  # a greedy output lost a sentinel: only those are retried, with beam 4
        assert calls[1][1] == 4 and set(calls[1][0]) <= {"Delete ⟪1⟫ files", "⟪1⟫ of ⟪2⟫"}
    assert all("⟪" not in o and "⟫" not in o for o in out)
    assert out[0].count("%s") <= 1 and out[1].count("%1$s") <= 1 and out[1].count("%2$s") <= 1
    assert "%" not in out[2]  # restore never invents a placeholder
    monkeypatch.undo()
    assert translate_all(model, tok, SOURCES, max_new_tokens=24) == out  # deterministic (greedy)


def test_translate_all_unmasks_retries_and_restores(masked_checkpoint, monkeypatch):
    """With a scripted decoder: the mapping back, the beam-4 retry of the failures only, and
    restore() of the first output when the retry fails too."""
    model, tok = masked_checkpoint
    greedy = {"⟪1⟫ of ⟪2⟫": "⟪2⟫ von ⟪1⟫", "Delete ⟪1⟫ files": "Dateien löschen",
              "Copy ⟪1⟫ to ⟪2⟫": "⟪2⟫ ⟪2⟫ kopieren ⟪3⟫", "Open": "Öffnen ⟪1⟫"}
    beam = {"Delete ⟪1⟫ files": "⟪1⟫ Dateien löschen", "Copy ⟪1⟫ to ⟪2⟫": "kopieren", "Open": "Öffnen"}
    calls = []

    def scripted(model, tok, sources, max_new_tokens, beam_size, batch_size, step=None):
        calls.append((list(sources), beam_size))
        return [(greedy if beam_size == 1 else beam)[s] for s in sources]

    monkeypatch.setattr(evaluate, "_translate", scripted)
    out = translate_all(model, tok, ["%1$s of %2$s", "Delete %s files", "Copy %s to {dir}", "Open"], 16)
    # "Copy": both attempts fail, so the greedy output is restored (repeated and invented sentinels
    # dropped, the text around them kept); "Open": a sentinel invented for a source without any
    # placeholder is a failure too, and the retry's clean output is taken.
    assert out == ["%2$s von %1$s", "%s Dateien löschen", "{dir}  kopieren ", "Öffnen"]
    assert calls == [(["⟪1⟫ of ⟪2⟫", "Delete ⟪1⟫ files", "Copy ⟪1⟫ to ⟪2⟫", "Open"], 1),
                     (["Delete ⟪1⟫ files", "Copy ⟪1⟫ to ⟪2⟫", "Open"], 4)]

    calls.clear()  # a beam request is not retried: its output is restored directly
    beam["⟪1⟫ of ⟪2⟫"] = "⟪1⟫ ⟪1⟫"
    assert translate_all(model, tok, ["%1$s of %2$s"], 16, beam_size=4) == ["%1$s "]
    assert calls == [(["⟪1⟫ of ⟪2⟫"], 4)]


def test_translate_all_without_masking_sends_raw_text(masked_checkpoint, monkeypatch):
    model, tok = masked_checkpoint
    calls = []
    monkeypatch.setattr(evaluate, "_translate",
                        lambda m, t, s, n, b, bs, step=None: calls.append(list(s)) or ["⟪1⟫"] * len(s))
    monkeypatch.setattr(model.cfg, "mask_placeholders", False)
    assert translate_all(model, tok, ["Delete %s files"], 8) == ["⟪1⟫"]  # passed through untouched
    assert calls == [["Delete %s files"]]


def test_eval_subset_is_a_deterministic_hash_order():
    records = [{"source": f"String number {i}", "target": f"Zeichenkette {i}"} for i in range(200)]
    shuffled = records[:]
    random.Random(3).shuffle(shuffled)
    first = eval_subset(records, 20)
    assert len(first) == 20 and eval_subset(shuffled, 20) == first  # input order does not matter
    assert first != records[:20]  # a spread, not the first records in corpus order
    everything = eval_subset(records, None)
    assert everything[:20] == first and sorted(r["source"] for r in everything) == sorted(
        r["source"] for r in records)
    assert eval_subset(records, 500) == everything
    more = eval_subset(records + [{"source": "Another one", "target": "Noch eine"}], 20)
    assert len(set(map(str, more)) & set(map(str, first))) >= 19  # adding a record moves at most one out


def test_placeholder_preservation_counts():
    sources = ["Delete %s files", "%1$s of %2$s", "Open", "Save {name}", "Quit"]
    outputs = ["%s Dateien löschen", "%2$s von %1$s", "Öffnen %d", "Speichern", "Beenden"]
    assert placeholder_preservation(sources, outputs) == {
        "strings_with_placeholders": 3, "preserved": round(2 / 3, 4), "preserved_all_strings": 0.6}
    assert placeholder_preservation(["Open", "Quit"], ["Öffnen", "Beenden"]) == {
        "strings_with_placeholders": 0, "preserved": None, "preserved_all_strings": 1.0}
    assert placeholder_preservation([], []) == {
        "strings_with_placeholders": 0, "preserved": None, "preserved_all_strings": 0.0}
