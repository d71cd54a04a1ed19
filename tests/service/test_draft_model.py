"""TSERVE_SPECULATIVE=draft through HTTP: a target answers greedy requests exactly as with
speculative decoding off, its card names the draft and counts its drafts; a draft of another
vocabulary fails the target's load with an error naming both models."""

from __future__ import annotations

import httpx
import pytest

from service.http.app import create_app
from tests.service.conftest import settings_for, wait_ready

PROMPTS = ["To be, or not to be", "The quick brown fox", "Open the file menu and"]


async def _answers(weights_dir, **overrides) -> tuple[list[dict], dict]:
    app = create_app(settings_for(weights_dir, models="generate-tiny", **overrides))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            await wait_ready(c)
            out = []
            for prompt in PROMPTS:
                r = await c.post("/v1/completions", json={"model": "generate-tiny", "prompt": prompt, "max_tokens": 24,
                                                          "temperature": 0, "ignore_eos": True, "logprobs": 1})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0])
            card = next(m for m in (await c.get("/v1/models")).json()["data"] if m["id"] == "generate-tiny")
    return out, card


@pytest.mark.asyncio
async def test_a_draft_model_answers_as_speculative_decoding_off(weights_dir):
    """The draft is the target itself, named as a served model: every draft is kept."""
    plain, plain_card = await _answers(weights_dir, speculative="off")
    got, card = await _answers(weights_dir, speculative="draft", draft_model="generate-tiny=generate-tiny")
    assert [c["text"] for c in got] == [c["text"] for c in plain]
    assert [c["logprobs"]["tokens"] for c in got] == [c["logprobs"]["tokens"] for c in plain]
    spec = card["speculative"]
    assert plain_card["speculative"] is None
    assert spec["method"] == "draft" and spec["draft_model"] == "generate-tiny"
    assert spec["drafted_tokens"] > 0 and spec["accepted_tokens"] == spec["drafted_tokens"]
    # the draft's weights and cache count in the model's memory
    assert card["memory"]["weights_bytes"] > plain_card["memory"]["weights_bytes"]
    assert card["memory"]["kv_cache_bytes"] > plain_card["memory"]["kv_cache_bytes"]


@pytest.mark.asyncio
async def test_a_draft_of_another_vocabulary_fails_the_load_naming_both(weights_dir):
    app = create_app(settings_for(weights_dir, models="generate-tiny", speculative="draft",
                                  draft_model=f"generate-tiny={weights_dir / 'fill-mask-tiny'}"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.post("/v1/completions", json={"model": "generate-tiny", "prompt": "To be", "max_tokens": 2})
            assert r.status_code == 503
            assert "fill-mask-tiny" in r.text and "'generate-tiny'" in r.text and "token ids" in r.text, r.text


def test_draft_pairs_are_parsed_and_a_malformed_one_is_refused(weights_dir):
    s = settings_for(weights_dir, draft_model=" big = small , coder=/models/coder-0.5b ")
    assert s.draft_models() == {"big": "small", "coder": "/models/coder-0.5b"}
    with pytest.raises(ValueError, match="TSERVE_DRAFT_MODEL: 'big' is not target=draft"):
        settings_for(weights_dir, draft_model="big")
