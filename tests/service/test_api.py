"""Every endpoint end to end in-process (httpx.ASGITransport with the app's lifespan)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

import httpx
import numpy as np
import pytest
import pytest_asyncio

from service.http.app import create_app
from tests.service.conftest import settings_for, wait_ready


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(weights_dir):
    app = create_app(settings_for(weights_dir, max_body_bytes=4096, max_texts=4, max_text_chars=500))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            await wait_ready(c)
            yield c


pytestmark = pytest.mark.asyncio(loop_scope="module")


def sse_chunks(text: str) -> list[dict | str]:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_generate_plain_and_streamed_agree(client):
    body = {"prompt": "To be, or not", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 123,
            "ignore_eos": True}
    plain = (await client.post("/v1/generate", json=body)).json()
    assert plain["object"] == "text_generation" and plain["finish_reason"] == "length"
    assert plain["usage"]["completion_tokens"] == 12 and plain["usage"]["prompt_tokens"] >= 3
    r = await client.post("/v1/generate", json=body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    assert "".join(c["text"] for c in data) == plain["text"]
    assert [c["finish_reason"] for c in data[:-1]] == [None] * (len(data) - 1)
    assert data[-1]["finish_reason"] == "length" and data[-1]["usage"] == plain["usage"]
    assert sum(len(c["token_ids"]) for c in data) == 12


async def test_generate_logprobs(client):
    r = await client.post("/v1/generate", json={"prompt": "Open the", "max_tokens": 4, "temperature": 0,
                                                "logprobs": 3, "ignore_eos": True})
    lps = r.json()["logprobs"]
    assert len(lps) == 4
    for item in lps:
        top = item["top_logprobs"]
        assert item["logprob"] <= 0 and len(top) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["token_id"] == item["token_id"]  # greedy picks the most likely token
        assert item["logprob"] == pytest.approx(top[0]["logprob"], abs=1e-6)


async def test_completions_openai_shape(client):
    r = await client.post("/v1/completions", json={"model": "generate-tiny", "prompt": ["To be", "Open"],
                                                   "max_tokens": 5, "n": 2, "temperature": 0, "ignore_eos": True})
    body = r.json()
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy: n copies agree
    assert body["usage"]["completion_tokens"] == 20
    r = await client.post("/v1/completions", json={"model": "generate-tiny", "prompt": "To be", "max_tokens": 3,
                                                   "echo": True, "temperature": 0})
    assert r.json()["choices"][0]["text"].startswith("To be")


async def test_completions_stream_with_logprobs(client):
    body = {"model": "generate-tiny", "prompt": "Shall I", "max_tokens": 6, "temperature": 0, "stream": True,
            "logprobs": 2, "ignore_eos": True}
    chunks = sse_chunks((await client.post("/v1/completions", json=body)).text)
    data = chunks[:-1]
    assert chunks[-1] == "[DONE]" and data[-1]["choices"][0]["finish_reason"] == "length"
    assert data[-1]["usage"]["completion_tokens"] == 6
    offsets = [o for c in data for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets)
    plain = (await client.post("/v1/completions", json=body | {"stream": False})).json()
    assert "".join(c["choices"][0]["text"] for c in data) == plain["choices"][0]["text"]


async def test_translate_list_beam_and_stream(client):
    r = await client.post("/v1/translate", json={"text": ["Open the file", "Save"], "max_tokens": 6, "beam_size": 2})
    body = r.json()
    assert r.status_code == 200 and len(body["translations"]) == 2
    assert all(t["tokens"] <= 6 for t in body["translations"])
    greedy = {"text": "Close the window", "max_tokens": 6, "beam_size": 1}
    plain = (await client.post("/v1/translate", json=greedy)).json()["translations"][0]["text"]
    chunks = sse_chunks((await client.post("/v1/translate", json=greedy | {"stream": True})).text)
    assert "".join(c["text"] for c in chunks[:-1]).strip() == plain


async def test_fill_mask_hf_shape(client):
    one = (await client.post("/v1/fill-mask", json={"text": "open the [MASK] menu", "top_k": 3})).json()
    assert len(one) == 3 and set(one[0]) == {"score", "token", "token_str", "sequence"}
    assert one[0]["score"] >= one[1]["score"] >= one[2]["score"]
    assert one[0]["sequence"] == f"open the {one[0]['token_str']} menu"
    two = (await client.post("/v1/fill-mask", json={"inputs": "[MASK] the [MASK]", "top_k": 2})).json()
    assert len(two) == 2 and all(len(per_mask) == 2 for per_mask in two)
    many = (await client.post("/v1/fill-mask", json={"text": ["a [MASK]", "[MASK] b [MASK]"], "top_k": 1})).json()
    assert len(many) == 2 and len(many[0]) == 1 and len(many[1]) == 2 and len(many[1][0]) == 1
    special = {"[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]", ""}
    assert not any(c["token_str"] in special for c in one + [c for m in two for c in m])


async def test_embeddings_float_and_base64_agree(client):
    body = {"model": "fill-mask-tiny", "input": ["hello world", "open the file"]}
    floats = (await client.post("/v1/embeddings", json=body)).json()
    b64 = (await client.post("/v1/embeddings", json=body | {"encoding_format": "base64"})).json()
    for f, b in zip(floats["data"], b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert np.allclose(decoded, f["embedding"], atol=1e-6)
        assert np.linalg.norm(f["embedding"]) == pytest.approx(1.0, abs=1e-5)
    assert floats["usage"]["prompt_tokens"] > 0
    single = (await client.post("/v1/embeddings", json={"input": "hello world"})).json()
    assert np.allclose(single["data"][0]["embedding"], floats["data"][0]["embedding"], atol=1e-5)  # batch = alone


async def test_models_health_ready(client):
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert {m["id"]: m["task"] for m in models["data"]} == {
        "generate-tiny": "text-generation", "translate-tiny": "translation", "fill-mask-tiny": "fill-mask"}
    assert (await client.get("/v1/models/generate-tiny")).json()["family"] == "decoder"
    assert (await client.get("/health")).json() == {"status": "ok"}
    assert (await client.get("/ready")).json()["ready"] is True


INVALID = [
    ("/v1/generate", {"prompt": "x", "temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ("/v1/generate", {"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ("/v1/generate", {"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ("/v1/generate", {"prompt": "x", "top_k": -1}, "top_k", "greater than or equal to 0"),
    ("/v1/generate", {"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/v1/generate", {"prompt": "x", "max_tokens": 200}, "max_tokens", "limit is 128 tokens"),
    ("/v1/generate", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("/v1/generate", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("/v1/generate", {"prompt": "   "}, "prompt", "must not be empty"),
    ("/v1/generate", {"prompt": ""}, "prompt", "at least 1 character"),
    ("/v1/generate", {"prompt": "x" * 501}, "prompt", "at most 500"),
    ("/v1/generate", {"max_tokens": 3}, "prompt", "field required"),
    ("/v1/generate", {"prompt": 5}, "prompt", "valid string"),
    ("/v1/generate", {"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/generate", {"prompt": "x", "model": "translate-tiny"}, "model", "needs a text generation"),
    ("/v1/fill-mask", {"text": "no mask here"}, "text", "must contain the mask token [MASK]"),
    ("/v1/fill-mask", {"text": ["a [MASK]"] * 5}, "text", "at most 4"),
    ("/v1/fill-mask", {"text": "[MASK]", "top_k": 0}, "top_k", "greater than or equal to 1"),
    ("/v1/translate", {"text": []}, "text", "must not be an empty list"),
    ("/v1/translate", {"text": ["a", ""]}, "text", "text[1] must not be empty"),
    ("/v1/translate", {"text": "a", "beam_size": 17}, "beam_size", "less than or equal to 16"),
    ("/v1/translate", {"text": "a", "beam_size": 9, "max_tokens": 8}, "beam_size", "<= 8"),
    ("/v1/translate", {"text": ["a", "b"], "stream": True}, "stream", "single text"),
    ("/v1/translate", {"text": "a", "max_tokens": 128}, "max_tokens", "<= 127"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "temperature": 2.5}, "temperature", "2"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty",
     "less than or equal to 2"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": [[5, 100000]]}, "prompt", "token ids"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "n": 9}, "n", "less than or equal to 8"),
    ("/v1/completions", {"prompt": "x"}, "model", "field required"),
    ("/v1/embeddings", {"input": "x", "dimensions": 7}, "dimensions", "must be 32"),
    ("/v1/embeddings", {"input": [[1, 2, 99999]]}, "input", "token ids"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    # list sizes, ranges and model limits on every endpoint
    ("/v1/translate", {"text": ["a"] * 5}, "text", "at most 4"),
    ("/v1/translate", {"text": "a", "length_penalty": 6}, "length_penalty", "less than or equal to 5"),
    ("/v1/translate", {"text": "a", "max_tokens": 1025}, "max_tokens", "less than or equal to 1024"),
    ("/v1/translate", {"text": "a", "seed": -1}, "seed", "greater than or equal to 0"),
    ("/v1/translate", {"text": "word " * 99}, "text", "this model accepts at most 128"),
    ("/v1/fill-mask", {"text": "[MASK]", "top_k": 101}, "top_k", "less than or equal to 100"),
    ("/v1/fill-mask", {"text": "[MASK] " + "w " * 140}, "text", "this model accepts at most 128"),
    ("/v1/generate", {"prompt": "x", "repetition_penalty": 11}, "repetition_penalty", "less than or equal to 10"),
    ("/v1/generate", {"prompt": "x", "stop": [""]}, "stop", "empty"),
    ("/v1/generate", {"prompt": "x", "seed": 2**63}, "seed", "less than or equal to"),
    ("/v1/embeddings", {"input": ["a"] * 5}, "input", "at most 4"),
    ("/v1/embeddings", {"input": [[1]] * 5}, "input", "at most 4"),
    ("/v1/embeddings", {"input": []}, "input", "must not be an empty list"),
    ("/v1/embeddings", {"input": [[]]}, "input", "empty token list"),
    ("/v1/embeddings", {"input": "x", "model": "generate-tiny"}, "model", "needs a fill-mask"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": ["a"] * 5}, "prompt", "at most 4"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": [[5]] * 5}, "prompt", "at most 4"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": ["a", "b", "c", "d"], "n": 8}, "n",
     "this server queues at most 24"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": [5] * 100, "max_tokens": 128}, "max_tokens",
     "limit is 128 tokens"),
    # unknown fields: refused as OpenAI refuses them, on every route of the service's own API
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "max_tokenz": 3}, "max_tokenz",
     "Unrecognized request argument supplied: max_tokenz"),
    ("/v1/embeddings", {"input": "x", "foo": None}, "foo", "Unrecognized request argument supplied: foo"),
    ("/v1/generate", {"prompt": "x", "temprature": 0}, "temprature", "Unrecognized request argument"),
    ("/v1/translate", {"text": "x", "beams": 2}, "beams", "Unrecognized request argument"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": [5] * 128, "max_tokens": 1}, "prompt",
     "at most 127"),  # the prompt alone is over the limit: named, not max_tokens
    ("/v1/completions", {"model": "generate-tiny", "prompt": [[5], [5] * 130]}, "prompt", "prompt[1] is 130 tokens"),
    ("/v1/generate", {"prompt": "word " * 99}, "prompt", "limit is 128 tokens"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "best_of": 2}, None, "best_of"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "logit_bias": {"5": 1}}, None, "logit_bias"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "suffix": "y"}, None, "suffix"),
    ("/v1/completions", {"model": "generate-tiny", "prompt": "x", "echo": True, "logprobs": 1}, "echo", "echo"),
]


@pytest.mark.parametrize("path,body,param,needle", INVALID, ids=[f"{p}:{n}" for p, _, _, n in INVALID])
async def test_invalid_input_is_a_400_naming_the_field(client, path, body, param, needle):
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param and param in err["message"]


async def test_unknown_model_malformed_json_and_oversized_body(client):
    r = await client.post("/v1/generate", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert (await client.get("/v1/models/nope")).status_code == 404
    r = await client.post("/v1/generate", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = await client.post("/v1/generate")
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body required (a JSON object)"
    r = await client.post("/v1/generate", json={"prompt": "x" * 5000})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

    async def chunked():  # no Content-Length: the limit still holds
        for _ in range(10):
            yield b" " * 1000
    r = await client.post("/v1/generate", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert (await client.get("/no/such/path")).json()["error"]["type"] == "not_found_error"


async def test_metrics_count_requests_and_tokens(client):
    def value(text: str, name: str, **labels) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = (await client.get("/metrics")).text
    for _ in range(3):
        await client.post("/v1/generate", json={"prompt": "To be", "max_tokens": 5, "ignore_eos": True})
    await client.post("/v1/generate", json={"prompt": "x", "temperature": -1})
    after = (await client.get("/metrics")).text
    ok = dict(model="generate-tiny", endpoint="/v1/generate", status="200")
    assert value(after, "tserve_requests_total", **ok) - value(before, "tserve_requests_total", **ok) == 3
    assert value(after, "tserve_requests_total", endpoint="/v1/generate", status="400") - \
        value(before, "tserve_requests_total", endpoint="/v1/generate", status="400") == 1
    gen = dict(model="generate-tiny")
    assert value(after, "tserve_generated_tokens_total", **gen) - value(before, "tserve_generated_tokens_total",
                                                                        **gen) == 15
    prompt_len = len(client._transport.app.state.registry.engines["generate-tiny"].tokenizer.encode("To be"))
    assert value(after, "tserve_prompt_tokens_total", **gen) - value(before, "tserve_prompt_tokens_total",
                                                                     **gen) == 3 * prompt_len
    ttft = "tserve_time_to_first_token_seconds_count"
    assert value(after, ttft, **gen) - value(before, ttft, **gen) == 3
    itl = "tserve_inter_token_latency_seconds_count"
    assert value(after, itl, **gen) - value(before, itl, **gen) == 12
    assert value(after, "tserve_kv_cache_slots", **gen) == 8
    for name in ("tserve_running_requests", "tserve_waiting_requests", "tserve_kv_cache_usage_ratio",
                 "tserve_step_batch_size_bucket", "tserve_queue_time_seconds_bucket",
                 "tserve_request_duration_seconds_bucket"):
        assert name in after


async def test_prefix_cache_shown_and_counted(client):
    def value(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") and 'model="generate-tiny"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards["generate-tiny"]["prefix_cache"]["block_tokens"] == 16
    assert cards["translate-tiny"]["prefix_cache"] is None
    kv = cards["generate-tiny"]["kv_cache"]
    assert kv["block_tokens"] == 16 and kv["blocks"] * 16 == kv["capacity_tokens"] and kv["bytes"] > 0
    names = ("tserve_prefix_cache_hit_tokens_total", "tserve_prefix_cache_query_tokens_total",
             "tserve_prompt_tokens_total")
    before = (await client.get("/metrics")).text
    ids = [(7 * i) % 300 + 10 for i in range(70)]
    for _ in range(2):  # one after the other: the second finds the first's four full blocks (of 16)
        r = await client.post("/v1/completions", json={"model": "generate-tiny", "prompt": [ids], "max_tokens": 2})
        assert r.status_code == 200
    after = (await client.get("/metrics")).text
    hit, query, prompt = (value(after, n) - value(before, n) for n in names)
    assert (hit, query, prompt) == (64, 140, 140)
    assert value(after, "tserve_prefix_cache_blocks_used") >= 4 and value(after, "tserve_kv_cache_blocks") > 0


async def test_loads_for_a_gateway_report_what_the_metrics_count(client):
    """GET /v1/loads, the shape SMG polls (it sends ?include=...): one rank, the generative
    models' figures summed; the hit rate is the prefix-cache counters' ratio."""
    def total(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    ids = [(11 * i) % 300 + 10 for i in range(70)]
    for _ in range(2):  # the second finds the first's four full blocks
        r = await client.post("/v1/completions", json={"model": "generate-tiny", "prompt": [ids], "max_tokens": 2})
        assert r.status_code == 200
    r = await client.get("/v1/loads", params={"include": "core,disagg,queues,memory"})
    assert r.status_code == 200
    body, metrics = r.json(), (await client.get("/metrics")).text
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1 and body["timestamp"]
    load = body["loads"][0]
    hits = total(metrics, "tserve_prefix_cache_hit_tokens_total")
    queries = total(metrics, "tserve_prefix_cache_query_tokens_total")
    assert hits >= 64 and load["cache_hit_rate"] == pytest.approx(hits / queries)
    cards = (await client.get("/v1/models")).json()["data"]
    generative = [c for c in cards if c["kv_cache"] is not None]
    assert {c["id"] for c in generative} == {"generate-tiny", "translate-tiny"}  # the encoder has no KV cache
    assert load["max_total_num_tokens"] == sum(c["kv_cache"]["capacity_tokens"] for c in generative)
    assert load["max_running_requests"] == 8 * len(generative)  # TSERVE_MAX_BATCH each
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"]) == (0, 0, 0)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (CI installs prometheus)")
async def test_metrics_pass_promtool(client):
    await client.post("/v1/embeddings", json={"input": "warm"})
    text = (await client.get("/metrics")).text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "" and result.stderr.strip() == "", \
        result.stdout + result.stderr


async def test_openapi_documents_every_endpoint_with_examples(client):
    spec = (await client.get("/openapi.json")).json()
    for path in ("/v1/generate", "/v1/completions", "/v1/translate", "/v1/fill-mask", "/v1/embeddings"):
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        assert spec["components"]["schemas"][ref].get("examples"), f"{path} has no request example"
        assert {"400", "429", "503"} <= set(op["responses"]), path
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        assert "get" in spec["paths"][path]
    assert (await client.get("/docs")).status_code == 200


async def test_docs_pages_load_everything_from_this_server(client):
    for page in ("/docs", "/redoc"):
        r = await client.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        refs = [a or b for a, b in re.findall(r"""(?:src|href|spec-url)=["']([^"']+)["']|url: '([^']+)'""", r.text)]
        assert len(refs) >= 3, r.text  # the script, the favicon, the schema (and Swagger's stylesheet)
        for ref in refs:
            assert ref.startswith("/") and not ref.startswith("//"), f"{page} loads {ref} from another host"
            assert (await client.get(ref)).status_code == 200, ref
        assert "http://" not in r.text and "https://" not in r.text
    assert (await client.get("/docs/assets/nope.js")).status_code == 404


async def test_docs_and_schema_have_their_own_endpoint_labels(client):
    def count(text: str, endpoint: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tserve_requests_total{") and f'endpoint="{endpoint}"' in line)

    paths = ["/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"]
    labels = paths[:3] + ["/docs/assets/{name}"]
    before = (await client.get("/metrics")).text
    for path in paths:
        assert (await client.get(path)).status_code == 200
    after = (await client.get("/metrics")).text
    assert [count(after, e) - count(before, e) for e in labels] == [1, 1, 1, 1]
    assert count(after, "unmatched") == count(before, "unmatched")


async def test_a_body_not_sent_as_json_says_so(client):
    r = await client.post("/v1/generate", content=b'{"prompt": "x"}',
                          headers={"content-type": "application/x-www-form-urlencoded"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_json" and err["param"] == "Content-Type"
    assert "must be JSON" in err["message"] and "Content-Type: application/json" in err["message"]
    assert "application/x-www-form-urlencoded" in err["message"]
    r = await client.post("/v1/generate", content=b'{"prompt": "To be", "max_tokens": 2}')  # no header at all
    assert r.status_code == 400 and "this request sent no Content-Type" in r.json()["error"]["message"]
    r = await client.post("/v1/generate", json=["a", "list"])  # JSON, but not an object
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"


async def test_max_tokens_past_what_the_prompt_leaves_is_a_ceiling(client):
    """max_tokens bounds the output; the context ends it first when the prompt leaves less (as
    llama.cpp and Ollama treat it): 100 prompt tokens of a 128-token context leave 28."""
    r = await client.post("/v1/completions", json={"model": "generate-tiny", "prompt": [5] * 100, "max_tokens": 50,
                                                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 100, "completion_tokens": 28, "total_tokens": 128}
