"""The service over real sockets: the official openai client, concurrency, overload,
disconnects and graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from model import ModelConfig, build_model, save
from model.tokenization.tokenizer import train_bpe
from tests.service.conftest import CORPUS, settings_for
from tests.service.server_thread import ServerThread

API_KEY = "test-secret-key"


@pytest.fixture(scope="module")
def server(weights_dir):
    with ServerThread(settings_for(weights_dir, max_batch=32, max_queue=64, api_key=API_KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def slow_weights(tmp_path_factory):
    """A decoder big enough that 1000 tokens take seconds on a CPU, for disconnect tests."""
    tok = train_bpe(CORPUS, vocab_size=320, template="<s> $A")
    cfg = ModelConfig(family="decoder", vocab_size=tok.vocab_size, d_model=256, n_heads=4, n_decoder_layers=6,
                      d_ff=1024, dropout=0.0, max_positions=1024, bos_token_id=1, eos_token_id=2,
                      norm_placement="pre", final_norm=True, positional="learned")
    root = tmp_path_factory.mktemp("slow")
    save(root / "generate-slow", build_model(cfg).init_weights(5).eval(), tok)
    return root


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_openai_client_completions_plain_and_streaming(server):
    oc = client(server)
    kwargs = dict(model="generate-tiny", prompt="To be, or not to be", max_tokens=10, temperature=0.8, seed=42,
                  extra_body={"ignore_eos": True})
    plain = oc.completions.create(**kwargs)
    assert plain.object == "text_completion" and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 10
    pieces, finish, usage = [], None, None
    for chunk in oc.completions.create(stream=True, **kwargs):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == plain.choices[0].text
    assert finish == "length" and usage.completion_tokens == 10


def test_openai_client_embeddings_and_models(server):
    oc = client(server)
    emb = oc.embeddings.create(model="fill-mask-tiny", input=["hello world", "open the file"])  # base64 on the wire
    assert [d.index for d in emb.data] == [0, 1] and len(emb.data[0].embedding) == 32
    floats = oc.embeddings.create(model="fill-mask-tiny", input=["hello world"], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(emb.data[0].embedding, abs=1e-6)
    assert emb.usage.prompt_tokens > 0
    assert sorted(m.id for m in oc.models.list()) == ["fill-mask-tiny", "generate-tiny", "translate-tiny"]
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oc.completions.create(model="generate-tiny", prompt="x", max_tokens=2, temperature=3)


def test_api_key_is_required_but_probes_stay_open(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.post(server.url + "/v1/generate", json={"prompt": "x"}).status_code == 401
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200


async def _stream_tokens(c: httpx.AsyncClient, url: str, body: dict) -> list[int]:
    tokens = []
    async with c.stream("POST", url + "/v1/generate", json=body | {"stream": True},
                        headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += json.loads(line[6:])["token_ids"]
    return tokens


def test_32_concurrent_streams_equal_one_at_a_time_and_are_batched(server):
    words = "the quick brown fox jumps over the lazy dog and runs far away".split()
    bodies = [{"prompt": " ".join(words[: 1 + i % 12]), "max_tokens": 6 + (i * 7) % 25, "temperature": 0,
               "ignore_eos": True} for i in range(32)]
    steps_before = server.metric("tserve_step_batch_size_count", model="generate-tiny")
    wide_before = server.metric("tserve_step_batch_size_count", model="generate-tiny") - \
        server.metric("tserve_step_batch_size_bucket", model="generate-tiny", le="8.0")

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(_stream_tokens(c, server.url, b) for b in bodies))

    concurrent = asyncio.run(run_all())
    wide_steps = server.metric("tserve_step_batch_size_count", model="generate-tiny") - \
        server.metric("tserve_step_batch_size_bucket", model="generate-tiny", le="8.0") - wide_before
    steps = server.metric("tserve_step_batch_size_count", model="generate-tiny") - steps_before
    assert wide_steps > 0, "no engine step ever ran more than 8 sequences together"
    assert steps < sum(b["max_tokens"] for b in bodies) / 4  # far fewer steps than tokens: batching

    async def one_at_a_time():
        async with httpx.AsyncClient(timeout=120) as c:
            return [await _stream_tokens(c, server.url, b) for b in bodies]

    sequential = asyncio.run(one_at_a_time())
    assert [len(t) for t in concurrent] == [b["max_tokens"] for b in bodies]
    assert concurrent == sequential


def test_overload_returns_429_while_admitted_requests_complete(weights_dir):
    with ServerThread(settings_for(weights_dir, max_batch=2, max_queue=2)) as s:
        rejected_before = s.metric("tserve_rejected_requests_total", model="generate-tiny", reason="queue_full")

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "To be", "max_tokens": 100, "ignore_eos": True}
                return await asyncio.gather(*(c.post(s.url + "/v1/generate", json=body) for _ in range(16)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) == {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "overloaded_error"
                assert "queue full (2 of 2 waiting)" in r.json()["error"]["message"]  # the queue as configured
            else:
                assert r.json()["usage"]["completion_tokens"] == 100
        assert codes.count(200) >= 4  # 2 slots + 2 queued were always admitted
        rejected = s.metric("tserve_rejected_requests_total", model="generate-tiny", reason="queue_full")
        assert rejected - rejected_before == codes.count(429)
        assert s.metric("tserve_requests_total", endpoint="/v1/generate", status="429") == codes.count(429)


def _wait_for(predicate, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def test_dropped_stream_and_dropped_request_free_their_slots(slow_weights):
    with ServerThread(settings_for(slow_weights, max_seq_len=1024)) as s:
        body = {"prompt": "To be", "max_tokens": 1000, "ignore_eos": True}
        gen_before = s.metric("tserve_generated_tokens_total", model="generate-slow")
        with httpx.stream("POST", s.url + "/v1/generate", json=body | {"stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert s.metric("tserve_running_requests", model="generate-slow") == 1
            # what a gateway polls (GET /v1/loads) says the same: one running, KV blocks held
            [load] = httpx.get(s.url + "/v1/loads").json()["loads"]
            assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 0) and load["num_used_tokens"] > 0
        _wait_for(lambda: s.metric("tserve_running_requests", model="generate-slow") == 0)
        assert s.metric("tserve_kv_cache_slots_used", model="generate-slow") == 0
        [load] = httpx.get(s.url + "/v1/loads").json()["loads"]
        assert (load["num_running_reqs"], load["num_used_tokens"], load["token_usage"]) == (0, 0, 0.0)
        assert s.metric("tserve_generated_tokens_total", model="generate-slow") - gen_before < 1000

        gen_before = s.metric("tserve_generated_tokens_total", model="generate-slow")
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            httpx.post(s.url + "/v1/generate", json=body, timeout=0.5)
        _wait_for(lambda: s.metric("tserve_running_requests", model="generate-slow") == 0)
        assert s.metric("tserve_generated_tokens_total", model="generate-slow") - gen_before < 1000
        # logged and counted as the client's doing (499), never as a server error
        _wait_for(lambda: s.metric("tserve_requests_total", endpoint="/v1/generate", status="499") == 1)
        assert s.metric("tserve_requests_total", status="500") == 0


def test_request_timeout_is_a_504_and_frees_the_slot(slow_weights):
    with ServerThread(settings_for(slow_weights, max_seq_len=1024, request_timeout_s=0.5)) as s:
        r = httpx.post(s.url + "/v1/generate", json={"prompt": "To be", "max_tokens": 1000, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert s.metric("tserve_kv_cache_slots_used", model="generate-slow") == 0
        chunks = httpx.post(s.url + "/v1/generate", timeout=30, json={
            "prompt": "To be", "max_tokens": 1000, "ignore_eos": True, "stream": True}).text
        assert '"type": "timeout_error"' in chunks and chunks.endswith("data: [DONE]\n\n")


def test_graceful_shutdown_finishes_in_flight_requests(slow_weights):
    s = ServerThread(settings_for(slow_weights, max_seq_len=1024, shutdown_grace_s=30)).__enter__()
    results = {}

    def request():
        r = httpx.post(s.url + "/v1/generate", json={"prompt": "To be", "max_tokens": 300, "ignore_eos": True},
                       timeout=60)
        results["status"], results["tokens"] = r.status_code, r.json()["usage"]["completion_tokens"]

    t = threading.Thread(target=request)
    t.start()
    _wait_for(lambda: s.metric("tserve_generated_tokens_total", model="generate-slow") > 10)
    assert s.metric("tserve_running_requests", model="generate-slow") == 1  # still generating
    s.stop()  # like SIGTERM: stop accepting, let the in-flight request finish
    t.join(timeout=60)
    assert results == {"status": 200, "tokens": 300}
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=2)


def test_shutdown_fails_what_cannot_finish_within_the_grace_time(slow_weights):
    s = ServerThread(settings_for(slow_weights, max_seq_len=1024, shutdown_grace_s=1)).__enter__()
    results = {}

    def request():
        try:
            r = httpx.post(s.url + "/v1/generate", timeout=60,
                           json={"prompt": "To be", "max_tokens": 1000, "ignore_eos": True})
            results["status"] = r.status_code
        except httpx.TransportError as exc:  # the server may close the connection instead
            results["status"] = type(exc).__name__

    t = threading.Thread(target=request)
    t.start()
    _wait_for(lambda: s.metric("tserve_generated_tokens_total", model="generate-slow") > 10)
    started = time.monotonic()
    s.stop()  # 1 s of grace for a request that needs many more
    stopped_in = time.monotonic() - started
    t.join(timeout=30)
    assert not t.is_alive()
    assert results["status"] == 503, results  # failed by the shutdown, with an answer (not a cut connection)
    assert stopped_in < 10, stopped_in  # bounded by the grace time (uvicorn's, then the engines')
