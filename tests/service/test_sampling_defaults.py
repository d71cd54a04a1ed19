"""A generation request that sends no sampling fields gets the model's recommended ones
(TSERVE_GENERATION_CONFIG=auto), on every generation route; a field it sends wins; the
server-wide override and ``none`` work; ``/v1/models`` shows what applies.

``chat-tiny`` recommends temperature 0 (its ``generation_config.json``), so a request without
sampling fields must answer exactly what an explicit ``temperature: 0`` request answers;
``generate-tiny`` recommends nothing."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from service.http.app import create_app
from tests.service.conftest import make_weights, settings_for, wait_ready
from tests.service.test_structured_outputs import make_weights as make_chat_weights

pytestmark = pytest.mark.asyncio
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
API = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
N = 12


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = make_chat_weights(tmp_path_factory.mktemp("sampling-weights"))
    (root / "chat-tiny" / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 0}))
    return make_weights(root)  # generate-tiny (and two models not served here)


@contextlib.asynccontextmanager
async def serving(weights, **overrides):
    settings = settings_for(weights, models="chat-tiny,generate-tiny", quantize="none", native_decode="off",
                            speculative="off", **overrides)
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as client:
        await wait_ready(client)
        yield client


async def defaults(client) -> dict[str, dict]:
    return {m["id"]: m.get("sampling_defaults") for m in (await client.get("/v1/models")).json()["data"]}


# route -> (a request without sampling fields, how to read its text, the fields that make it greedy)
ROUTES = {
    "/v1/chat/completions": ({"model": "chat-tiny", "messages": ASK, "max_tokens": N},
                             lambda r: r["choices"][0]["message"]["content"], {"temperature": 0}),
    "/v1/completions": ({"model": "chat-tiny", "prompt": "To be", "max_tokens": N, "ignore_eos": True},
                        lambda r: r["choices"][0]["text"], {"temperature": 0}),
    "/v1/generate": ({"model": "chat-tiny", "prompt": "To be", "max_tokens": N, "ignore_eos": True},
                     lambda r: r["text"], {"temperature": 0}),
    "/v1/messages": ({"model": "chat-tiny", "messages": ASK, "max_tokens": N},
                     lambda r: "".join(b.get("text", "") for b in r["content"]), {"temperature": 0}),
    "/v1/responses": ({"model": "chat-tiny", "input": "What is the weather?", "max_output_tokens": N},
                      lambda r: r["output"][0]["content"][0]["text"], {"temperature": 0}),
}


async def text(client, path: str, body: dict) -> str:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return ROUTES[path][1](r.json())


async def test_models_show_their_sampling_defaults(weights):
    async with serving(weights) as client:
        shown = await defaults(client)
    assert shown["chat-tiny"] == {**API, "temperature": 0.0, "source": ["generation_config.json"], "not_applied": []}
    assert shown["generate-tiny"] == {**API, "source": [], "not_applied": []}


async def test_no_sampling_fields_take_the_models_defaults_on_every_route(weights):
    async with serving(weights) as client:
        for path, (body, _, greedy) in ROUTES.items():
            assert await text(client, path, body) == await text(client, path, {**body, **greedy}), path
        # TGI samples only when asked: asked without a temperature, it takes the model's (0)
        tgi = {"model": "chat-tiny", "inputs": "To be", "parameters": {"max_new_tokens": N}}
        asked = {**tgi, "parameters": {**tgi["parameters"], "do_sample": True, "seed": 3}}
        a, b = [(await client.post("/generate", json=x)).json()["generated_text"] for x in (tgi, asked)]
        assert a == b
        # the Responses object says what it ran with
        r = (await client.post("/v1/responses", json=ROUTES["/v1/responses"][0])).json()
        assert r["temperature"] == 0.0 and r["top_p"] == 1.0


async def test_explicit_fields_win_and_none_restores_the_api_defaults(weights):
    body, read, _ = ROUTES["/v1/completions"]
    sampled = {**body, "temperature": 1, "seed": 11}
    async with serving(weights) as client:
        greedy = await text(client, "/v1/completions", body)
        explicit = await text(client, "/v1/completions", sampled)
    async with serving(weights, generation_config="none") as client:
        assert (await defaults(client))["chat-tiny"] == {**API, "source": [], "not_applied": []}
        assert await text(client, "/v1/completions", sampled) == explicit  # temperature 1 stayed 1
        # unset now means the API's temperature 1: the same draw as the explicit request, not greedy
        assert await text(client, "/v1/completions", {**body, "seed": 11}) == explicit != greedy


async def test_the_override_setting_applies_to_every_model(weights):
    async with serving(weights, generation_override={"temperature": 0.0, "top_p": 0.5}) as client:
        shown = await defaults(client)
        assert shown["generate-tiny"] == {**API, "temperature": 0.0, "top_p": 0.5,
                                          "source": ["TSERVE_GENERATION_OVERRIDE"], "not_applied": []}
        assert shown["chat-tiny"]["source"] == ["generation_config.json", "TSERVE_GENERATION_OVERRIDE"]
        body = {"model": "generate-tiny", "prompt": "To be", "max_tokens": N, "ignore_eos": True, "seed": 5}
        unset = await text(client, "/v1/completions", body)
        assert unset == await text(client, "/v1/completions", {**body, "temperature": 0})
        assert unset != await text(client, "/v1/completions", {**body, "temperature": 1, "top_p": 1})


async def test_a_bad_override_is_refused_at_start_naming_the_field(weights):
    with pytest.raises(ValueError, match=r"TSERVE_GENERATION_OVERRIDE.top_p must be in \(0, 1\]"):
        settings_for(weights, generation_override={"top_p": 2})
