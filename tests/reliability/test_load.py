"""Auth before anything else, a storm of streams closed early, and overload: against a real
server, bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from service.http.app import create_app
from tests.service.conftest import settings_for, wait_ready
from tests.service.server_thread import ServerThread


@pytest.mark.asyncio
async def test_api_key_is_checked_before_the_body(weights_dir):
    app = create_app(settings_for(weights_dir, warmup=False, api_key="k3y", max_body_bytes=2048))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await wait_ready(c)
        json_header = {"Content-Type": "application/json"}
        for body in (b'{"prompt": ', b"x" * 5000, b'{"prompt": "\\ud83d"}', b'{"prompt": 5}'):
            r = await c.post("/v1/generate", content=body, headers=json_header)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (body[:20], r.text)
            assert r.headers["www-authenticate"] == "Bearer"
        r = await c.get("/v1/generate")  # a wrong method on a protected path: the key first, too
        assert r.status_code == 401
        keyed = json_header | {"Authorization": "Bearer k3y"}
        assert (await c.post("/v1/generate", content=b'{"prompt": ', headers=keyed)).status_code == 400
        assert (await c.post("/v1/generate", content=b"x" * 5000, headers=keyed)).status_code == 413
        assert (await c.get("/v1/generate", headers=keyed)).status_code == 405
        assert (await c.get("/health")).status_code == 200  # probes and docs stay open
        assert (await c.get("/openapi.json")).status_code == 200
        assert (await c.get("/no/such/path")).status_code == 404


def _gauges(s: ServerThread) -> dict[str, float]:
    return {name: s.metric(name) for name in ("tserve_running_requests", "tserve_waiting_requests",
                                               "tserve_kv_cache_slots_used")}


def test_disconnect_storm_frees_every_slot(weights_dir):
    with ServerThread(settings_for(weights_dir, max_batch=8, max_queue=64)) as s:
        async def open_and_drop(c: httpx.AsyncClient, i: int) -> None:
            body = {"prompt": "To be", "max_tokens": 120, "ignore_eos": True, "stream": True}
            path = ("/v1/generate", "/v1/completions")[i % 2]
            if path == "/v1/completions":
                body |= {"model": "generate-tiny", "n": 2}
            async with c.stream("POST", s.url + path, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # leave after the first chunk: the connection closes here

        async def storm():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
                for _ in range(3):  # waves of 32 streams, each closed after its first chunk
                    await asyncio.gather(*(open_and_drop(c, i) for i in range(32)))

        started = time.monotonic()
        asyncio.run(storm())
        deadline = time.monotonic() + 30
        while any(_gauges(s).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gauges(s) == dict.fromkeys(_gauges(s), 0.0), _gauges(s)
        assert time.monotonic() - started < 60
        r = httpx.post(s.url + "/v1/generate", json={"prompt": "To be", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert s.metric("tserve_requests_total", status="500") == 0


def test_overload_streams_get_429_with_retry_after_and_accepted_ones_complete(weights_dir):
    with ServerThread(settings_for(weights_dir, max_batch=2, max_queue=2)) as s:
        async def stream(c: httpx.AsyncClient):
            body = {"prompt": "To be", "max_tokens": 100, "ignore_eos": True, "stream": True}
            async with c.stream("POST", s.url + "/v1/generate", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                return 200, None, lines

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(stream(c) for _ in range(16)))

        results = asyncio.run(burst())
        assert {status for status, _, _ in results} == {200, 429}
        for status, retry_after, payload in results:
            if status == 429:
                assert retry_after == "1" and payload["error"]["code"] == "queue_full"
                assert "queue full (2 of 2 waiting)" in payload["error"]["message"]
            else:
                assert payload[-1] == "data: [DONE]"
                assert json.loads(payload[-2][6:])["usage"]["completion_tokens"] == 100
        assert sum(status == 200 for status, _, _ in results) >= 4  # 2 slots + 2 queued
        assert not any(_gauges(s).values())
