"""SIGTERM with requests in flight, against the real process (``python -m service`` with the
shipped generate-en): with enough grace every request completes; with too little, every
stream ends with an error event in the OpenAI shape and ``data: [DONE]``, every other request
gets a 503, the log has one line per failed request and no traceback, and the process exits."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.reliability.live import LiveServer

pytestmark = pytest.mark.slow
LONG = {"prompt": "To be, or not to be", "max_tokens": 480, "ignore_eos": True}  # ~4 s on a 2-core CPU


async def _stream(c: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> list[str]:
    events = []
    async with c.stream("POST", url + "/v1/generate", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


async def _in_flight(server: LiveServer, body: dict, n_streams: int, n_plain: int):
    """Start the requests, SIGTERM once every stream has its first chunk, read everything to the end."""
    async with httpx.AsyncClient(timeout=60) as c:
        flags = [asyncio.Event() for _ in range(n_streams)]
        streams = [asyncio.create_task(_stream(c, server.url, body, f)) for f in flags]
        plain = [asyncio.create_task(c.post(server.url + "/v1/generate", json=body)) for _ in range(n_plain)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 60)
        server.terminate()
        sigterm_at = time.monotonic()
        return await asyncio.gather(*streams), await asyncio.gather(*plain), sigterm_at


def _exited_cleanly(server: LiveServer) -> None:
    code = server.wait(timeout=30)
    assert code in (0, -signal.SIGTERM), code  # uvicorn re-raises the SIGTERM it caught after a clean stop
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "Cancel " not in log, log  # uvicorn never had to cancel a connection


def test_sigterm_with_too_little_grace_fails_each_request_with_a_word(tmp_path):
    with LiveServer(tmp_path / "log", "--models", "generate-en", shutdown_grace_s=1) as server:
        streams, plain, sigterm_at = asyncio.run(_in_flight(server, LONG, n_streams=6, n_plain=2))
        done_in = time.monotonic() - sigterm_at
        for events in streams:
            assert events[-1] == "[DONE]", events[-3:]
            final = json.loads(events[-2])
            assert final == {"error": {"message": "request failed: the server is shutting down",
                                       "type": "unavailable_error", "code": "shutdown", "param": None}}
            assert 0 < len(events) - 2 < LONG["max_tokens"]  # some tokens, then the error: cut by the shutdown
        for r in plain:
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown", r.text
        assert done_in < 1 + 5, done_in  # the grace, then the failed requests' last bytes
        _exited_cleanly(server)
        failed = [r for r in server.log_records() if r.get("msg") == "request" and r.get("path") == "/v1/generate"]
        assert len(failed) == 8, failed  # one line per failed request
        assert sorted((r["status"], r.get("error")) for r in failed) == [(200, "shutdown")] * 6 + [(503, None)] * 2
        assert not [r for r in server.log_records() if r["level"] == "error"]


def test_sigterm_with_enough_grace_lets_every_request_finish(tmp_path):
    body = LONG | {"max_tokens": 120}
    with LiveServer(tmp_path / "log", "--models", "generate-en", shutdown_grace_s=30) as server:
        streams, plain, _ = asyncio.run(_in_flight(server, body, n_streams=4, n_plain=2))
        for events in streams:
            assert events[-1] == "[DONE]"
            final = json.loads(events[-2])
            assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 120
        for r in plain:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 120
        _exited_cleanly(server)
        with pytest.raises(httpx.TransportError):  # and nothing listens any more
            httpx.get(server.url + "/health", timeout=2)
