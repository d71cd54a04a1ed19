"""Readiness, failed start-up, CORS, request logs, and isolation of bad requests."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from model.quant.int8 import DecodeInt8Linear
from service.http.app import create_app
from service.logging_config import JsonFormatter
from tests.service.conftest import settings_for, wait_ready

pytestmark = pytest.mark.asyncio


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_ready_is_503_until_models_are_warm(weights_dir):
    app = create_app(settings_for(weights_dir))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        first = await c.get("/ready")
        assert first.status_code == 503 and first.json()["ready"] is False
        assert (await c.get("/health")).status_code == 200  # alive while loading
        r = await c.post("/v1/generate", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        await wait_ready(c)
        assert (await c.get("/ready")).json()["models"] == {
            "fill-mask-tiny": "ready", "generate-tiny": "ready", "translate-tiny": "ready"}


async def test_failed_start_up_is_reported(tmp_path, weights_dir):
    app = create_app(settings_for(tmp_path))  # no checkpoints at all
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await app.state.loading
        ready = await c.get("/ready")
        assert ready.status_code == 503 and "no model directories" in ready.json()["error"]
        assert (await c.get("/health")).status_code == 503
    app = create_app(settings_for(weights_dir, models="generate-tiny,typo"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await app.state.loading
        assert "typo" in (await c.get("/ready")).json()["error"]


async def test_models_setting_selects_checkpoints(weights_dir):
    app = create_app(settings_for(weights_dir, models="fill-mask-tiny"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["fill-mask-tiny"]
        r = await c.post("/v1/generate", json={"prompt": "x"})
        assert r.status_code == 404 and "no text generation" in r.json()["error"]["message"]


async def test_cors_and_request_id(weights_dir):
    app = create_app(settings_for(weights_dir, cors_origins="https://app.example", warmup=False))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        pre = await c.options("/v1/generate", headers={"Origin": "https://app.example",
                                                       "Access-Control-Request-Method": "POST"})
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        other = await c.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        r = await c.get("/health", headers={"X-Request-ID": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        assert len((await c.get("/health")).headers["x-request-id"]) == 32


async def test_one_structured_log_line_per_request(weights_dir):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    app = create_app(settings_for(weights_dir, warmup=False, log_level="info"))
    logging.getLogger("tserve.access").addHandler(handler)
    try:
        async with app.router.lifespan_context(app), asgi_client(app) as c:
            await wait_ready(c)
            records.clear()
            await c.post("/v1/generate", json={"prompt": "To be", "max_tokens": 3, "ignore_eos": True},
                         headers={"X-Request-ID": "req-1"})
    finally:
        logging.getLogger("tserve.access").removeHandler(handler)
    (rec,) = [r for r in records if getattr(r, "request_id", None) == "req-1"]
    line = json.loads(JsonFormatter().format(rec))
    assert line["msg"] == "request" and line["status"] == 200 and line["endpoint"] == "/v1/generate"
    assert line["model"] == "generate-tiny" and line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
    assert line["latency_ms"] > 0


async def test_invalid_requests_never_reach_the_engine(weights_dir):
    app = create_app(settings_for(weights_dir))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        engine = app.state.registry.engines["generate-tiny"]
        submitted = []
        original = engine.core.add
        engine.core.add = lambda req: (submitted.append(req.request_id), original(req))[1]
        good = {"prompt": "To be", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        expected = (await c.post("/v1/generate", json=good)).json()["text"]
        submitted.clear()
        bad = [{"prompt": "x", "temperature": -1}, {"prompt": "x", "max_tokens": 10_000}, {"prompt": ""},
               {"prompt": "x", "stop": ["1", "2", "3", "4", "5"]}, {"prompt": "x", "model": "nope"}]
        import asyncio

        results = await asyncio.gather(c.post("/v1/generate", json=good),
                                       *(c.post("/v1/generate", json=b) for b in bad))
        assert [r.status_code for r in results] == [200, 400, 400, 400, 400, 404]
        assert results[0].json()["text"] == expected  # the valid request is undisturbed
        assert len(submitted) == 1  # only the valid one reached the scheduler


async def test_int8_quantized_serving(weights_dir):
    app = create_app(settings_for(weights_dir, quantize="int8"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        engine = app.state.registry.engines["generate-tiny"]
        head = engine.model.lm_head.proj  # generative models: int8 for decode steps, float prompts
        assert isinstance(head, DecodeInt8Linear)
        assert type(head.quantized).__module__.startswith("torch.ao.nn.quantized")
        encoder = app.state.registry.engines["fill-mask-tiny"] if "fill-mask-tiny" in app.state.registry.engines \
            else next(e for e in app.state.registry.engines.values() if e.model.cfg.family == "encoder")
        assert any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in encoder.model.modules())
        r = await c.post("/v1/generate", json={"prompt": "To be", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert (await c.post("/v1/fill-mask", json={"text": "the [MASK] menu"})).status_code == 200
        assert (await c.post("/v1/translate", json={"text": "Open", "max_tokens": 4})).status_code == 200


async def test_a_bfloat16_kv_cache_serves_decoder_models(weights_dir):
    """TSERVE_KV_DTYPE=bfloat16: a float32 decoder-only model keeps its K/V blocks (the prefix
    cache's among them) in bfloat16 and reads them back in float32; translation keeps its own dtype."""
    app = create_app(settings_for(weights_dir, kv_dtype="bfloat16"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        engines = app.state.registry.engines
        runner = engines["generate-tiny"].core.runner
        assert runner.cache.k.dtype == torch.bfloat16 and engines["generate-tiny"].model.dtype == torch.float32
        body = {"prompt": "To be or not to be, that is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        first, again = [(await c.post("/v1/generate", json=body)).json() for _ in range(2)]
        assert first["usage"]["completion_tokens"] == 12 and again["text"] == first["text"]
        translate = next(e for e in engines.values() if e.model.cfg.family == "encoder-decoder")
        assert translate.core.runner.cache.k.dtype == torch.float32
        assert (await c.post("/v1/translate", json={"text": "Open", "max_tokens": 4})).status_code == 200


async def test_probes_can_be_put_behind_the_api_key(weights_dir):
    app = create_app(settings_for(weights_dir, warmup=False, api_key="k3y", protect_health_and_metrics=True))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await app.state.loading
        for path in ("/health", "/ready", "/metrics"):
            denied = await c.get(path)
            assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error", path
            assert (await c.get(path, headers={"Authorization": "Bearer k3y"})).status_code == 200, path
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
