"""One usage rule for every endpoint: completion tokens are the tokens the model generated,
the end-of-sequence token included (as OpenAI counts), whatever the decoding method."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from service.engines.generative import EngineEvent
from service.http.app import create_app
from tests.service.conftest import settings_for, wait_ready

SHIPPED = Path(__file__).resolve().parents[2] / "weights"


@pytest.mark.asyncio
async def test_greedy_and_beam_translations_count_tokens_alike():
    app = create_app(settings_for(SHIPPED, models="translate-en-de", warmup=False))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            await wait_ready(c)
            texts = ["Open the file", "The file could not be saved.", "Print"]
            greedy = (await c.post("/v1/translate", json={"text": texts, "beam_size": 1, "max_tokens": 32})).json()
            beam = (await c.post("/v1/translate", json={"text": texts, "beam_size": 4, "max_tokens": 32})).json()
            engine = app.state.registry.engines["translate-en-de"]
    for g, b in zip(greedy["translations"], beam["translations"]):
        assert g["finish_reason"] == b["finish_reason"] == "eos"
        assert g["text"] == b["text"]  # the same sentence: the same count, however it was found
        assert g["tokens"] == b["tokens"] == len(engine.tokenize([g["text"]], "text")[0])  # its ids + </s>
    assert greedy["usage"] == beam["usage"]
    assert greedy["usage"]["completion_tokens"] == sum(t["tokens"] for t in greedy["translations"])


def test_the_end_token_is_counted_once(weights_dir):
    from model import load
    from service.engines.generative import GenerativeEngine
    from service.metrics import Metrics

    engine = GenerativeEngine("translate-tiny", load(weights_dir / "translate-tiny"),
                              settings_for(weights_dir, warmup=False), Metrics())
    eos = 2
    sampled = EngineEvent("a", token_ids=[eos], finish_reason="eos", completion_tokens=3)  # last of 5, 6, </s>
    beam = EngineEvent("b", token_ids=[5, 6], finish_reason="eos", completion_tokens=2)  # hypothesis without </s>
    cut = EngineEvent("c", token_ids=[5, 6], finish_reason="length", completion_tokens=2)
    assert [engine.completion_tokens(e) for e in (sampled, beam, cut)] == [3, 3, 2]
    usage = engine.usage([[7, 8, 9], [7]], [sampled, beam])
    assert usage.as_dict() == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
