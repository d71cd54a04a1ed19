"""The drop-in translation APIs (LibreTranslate, DeepL, Hugging Face ``POST /``) go through
``service.translation.translate`` like /v1/translate: with a checkpoint trained on masked placeholders
the model reads sentinels, and what the client gets has its placeholders mapped back.

The shipped en->de weights never saw sentinels, so the real-model tests check the mechanism
(what the model read, that no sentinel leaks, that the reply is the helper's text) and the
scripted ones replace the engine's output to check the unmasking and the beam retry exactly."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from model import EngineEvent
from service.http.app import create_app
from service.translation import translate as translation
from tests.conftest import checkpoint_variant
from tests.service.conftest import settings_for, wait_ready

SHIPPED = Path(__file__).resolve().parents[2] / "weights" / "translate-en-de"
MODEL = "translate-masked-en-de"  # the compat APIs find a language pair from the name's tail
SOURCE = "Delete %s files"


@pytest.fixture(scope="module")
def masked_weights(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compat-masked")
    checkpoint_variant(SHIPPED, root / MODEL, mask_placeholders=True)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(masked_weights):
    app = create_app(settings_for(masked_weights, max_seq_len=256, max_batch=8, max_queue=64))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=300) as c:
            await wait_ready(c, timeout=120)
            yield c


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def libretranslate(client: httpx.AsyncClient, texts: list[str]) -> list[str]:
    r = await client.post("/translate", json={"q": texts, "source": "en", "target": "de"})
    assert r.status_code == 200, r.text
    return r.json()["translatedText"]


async def deepl(client: httpx.AsyncClient, texts: list[str]) -> list[str]:
    r = await client.post("/v2/translate", json={"text": texts, "target_lang": "DE"})
    assert r.status_code == 200, r.text
    translations = r.json()["translations"]
    assert all(t["detected_source_language"] == "EN" for t in translations)
    return [t["text"] for t in translations]


async def hf_inference(client: httpx.AsyncClient, texts: list[str]) -> list[str]:
    r = await client.post("/", json={"inputs": texts, "parameters": {"src_lang": "en", "tgt_lang": "de"}})
    assert r.status_code == 200, r.text
    return [item["translation_text"] for item in r.json()]


APIS = [libretranslate, deepl, hf_inference]


@pytest.mark.parametrize("api", APIS, ids=lambda f: f.__name__)
async def test_real_model_reads_sentinels_and_no_sentinel_leaks(client, monkeypatch, api):
    seen = []
    real = translation.translate

    async def spy(request, engine, sources, *args):
        results, usage = await real(request, engine, sources, *args)
        seen.append((sources, results))
        return results, usage

    monkeypatch.setattr(translation, "translate", spy)
    texts = [SOURCE, "Open the file"]
    out = await api(client, texts)
    [(sources, results)] = seen
    assert [s.masked for s in sources] == ["Delete ⟪1⟫ files", "Open the file"]
    assert [s.originals for s in sources] == [("%s",), ()]
    assert out == [r.text for r in results]  # the reply is the helper's (unmasked) text, shape unchanged
    assert all("⟪" not in t and "⟫" not in t for t in out)
    # restore() never repeats a placeholder: exactly one %s when it survived, none when it was lost
    assert out[0].count("%s") == (1 if results[0].placeholders_ok else 0)


def scripted_run(script: list[list[str]], calls: list):
    """A stand-in for ``translation._run`` answering each call's prompts with scripted hypotheses."""

    async def run(request, engine, ids, params, fields, group_field):
        calls.append((params, fields))
        answers = script.pop(0)
        finals = [EngineEvent("r", "", [5], finish_reason="length", hypotheses=hyps, completion_tokens=1)
                  for hyps in answers[: len(ids)]]
        return finals, [hyps[0] for hyps in answers[: len(ids)]]

    return run


@pytest.mark.parametrize("api", APIS, ids=lambda f: f.__name__)
async def test_sentinels_in_the_output_are_mapped_back(client, monkeypatch, api):
    calls = []
    monkeypatch.setattr(translation, "_run", scripted_run([[["⟪1⟫ Dateien löschen"], ["Datei öffnen"]]], calls))
    assert await api(client, [SOURCE, "Open the file"]) == ["%s Dateien löschen", "Datei öffnen"]
    [(params, fields)] = calls
    assert all(p.n_best == p.beam_size == 4 for p in params)  # the compat APIs' beam asks for its n best


@pytest.mark.parametrize("api", APIS, ids=lambda f: f.__name__)
async def test_a_lost_sentinel_falls_back_to_a_hypothesis_that_keeps_it(client, monkeypatch, api):
    calls = []
    script = [[["Dateien löschen", "⟪1⟫ ⟪1⟫ löschen"]],  # every hypothesis lost or repeated it
              [["Dateien entfernen", "⟪1⟫ Dateien entfernen"]]]  # the retry: the second one keeps it
    monkeypatch.setattr(translation, "_run", scripted_run(script, calls))
    assert await api(client, [SOURCE]) == ["%s Dateien entfernen"]
    assert len(calls) == 2 and calls[1][0][0].beam_size == translation.FALLBACK_BEAMS


async def test_nothing_keeps_it_restores_what_survived(client, monkeypatch):
    calls = []
    script = [[["⟪2⟫ Dateien ⟪2⟫"]], [["⟪2⟫ Dateien ⟪2⟫ ⟪7⟫"]]]
    monkeypatch.setattr(translation, "_run", scripted_run(script, calls))
    assert await libretranslate(client, ["Delete %d of %s files"]) == ["%s Dateien"]
