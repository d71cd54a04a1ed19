"""Bad input, table-driven, against a real server (uvicorn, the service's protocol limits):
every row is a 4xx in the OpenAI error shape with a message (naming the field where there is
one), never a 5xx; the limits are tested at the limit and one past it; the server is healthy
after all of it."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.service.conftest import settings_for
from tests.service.server_thread import ServerThread

LIMITS = dict(max_texts=4, max_text_chars=200, max_body_bytes=4096, max_seq_len=128, max_queue=64)
GEN, CMPL, TR, FM, EMB = "/v1/generate", "/v1/completions", "/v1/translate", "/v1/fill-mask", "/v1/embeddings"
CHAT = "/v1/chat/completions"
M = {"model": "generate-tiny"}
OK = 200


@pytest.fixture(scope="module")
def live(weights_dir):
    with ServerThread(settings_for(weights_dir, **LIMITS)) as s:
        yield s


def J(value) -> bytes:  # noqa: N802  (a JSON body, as sent)
    return json.dumps(value).encode()


# (id, path, raw body, expected status, the field the message must name (None: any message))
CASES = [
    # malformed JSON, empty and wrong-shaped bodies
    ("truncated-json", GEN, b'{"prompt": "x"', 400, None),
    ("trailing-garbage", GEN, b'{"prompt": "x"} x', 400, None),
    ("empty-body", GEN, b"", 400, None),
    ("json-array", GEN, b"[1, 2]", 400, None),
    ("json-string", GEN, b'"hello"', 400, None),
    ("json-null", GEN, b"null", 400, None),
    ("deep-nesting-body", GEN, b"[" * 4000, 400, None),
    ("deep-nesting-field", GEN, b'{"prompt": ' + b"[" * 64 + b"]" * 64 + b"}", 400, "prompt"),
    ("invalid-utf8", GEN, b'{"prompt": "\xff\xfe"}', 400, None),
    ("utf8-encoded-surrogate", GEN, b'{"prompt": "\xed\xa0\x80"}', 400, "prompt"),
    # lone surrogates, everywhere text goes
    ("surrogate-translate", TR, b'{"text": "\\ud83d"}', 400, "text"),
    ("surrogate-translate-list", TR, b'{"text": ["ok", "\\ud83dx"]}', 400, "text"),
    ("surrogate-embeddings", EMB, b'{"input": "\\udc00"}', 400, "input"),
    ("surrogate-fill-mask", FM, b'{"text": "the [MASK] \\ud83d"}', 400, "text"),
    ("surrogate-prompt", CMPL, b'{"model": "generate-tiny", "prompt": "a\\ud83d"}', 400, "prompt"),
    ("surrogate-model-name", CMPL, b'{"model": "x\\ud83d", "prompt": "a"}', 400, "model"),
    ("surrogate-stop", GEN, b'{"prompt": "a", "stop": ["\\udfff"]}', 400, "stop"),
    ("surrogate-user", EMB, b'{"input": "a", "user": "\\ud800"}', 400, "user"),
    ("surrogate-chat-content", CHAT, J(M | {"messages": [{"role": "user", "content": "x"}]}).replace(b'"x"',
     b'"\\ud83d"'), 400, "messages"),
    ("surrogate-chat-part", CHAT, b'{"model": "generate-tiny", "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "\\udc00"}]}]}', 400, "messages"),
    # coerced types: strict, as OpenAI's API
    ("logprobs-false", GEN, J({"prompt": "a", "logprobs": False}), 400, "logprobs"),
    ("stream-0", GEN, J({"prompt": "a", "stream": 0}), 400, "stream"),
    ("stream-string", CMPL, J(M | {"prompt": "a", "stream": "true"}), 400, "stream"),
    ("token-id-false", EMB, J({"input": [[False]]}), 400, "input"),
    ("token-id-fraction", EMB, J({"input": [1.5, 2]}), 400, "input"),
    ("token-id-integral-float", EMB, J({"input": [7.0, 8]}), OK, None),  # JSON Schema: 7.0 is an integer
    ("max-tokens-string", GEN, J({"prompt": "a", "max_tokens": "5"}), 400, "max_tokens"),
    ("max-tokens-float", GEN, J({"prompt": "a", "max_tokens": 5.5}), 400, "max_tokens"),
    ("prompt-number", GEN, J({"prompt": 5}), 400, "prompt"),
    ("stop-number", GEN, J({"prompt": "a", "stop": 5}), 400, "stop"),
    ("stop-object", GEN, J({"prompt": "a", "stop": {"a": 1}}), 400, "stop"),
    ("model-number", CMPL, J({"model": 1, "prompt": "a"}), 400, "model"),
    ("stream-options-int", CMPL, J(M | {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}),
     400, "stream_options"),
    ("temperature-bool", GEN, J({"prompt": "a", "temperature": True}), 400, "temperature"),
    ("chat-logprobs-1", CHAT, J(M | {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}), 400,
     "logprobs"),
    ("chat-stream-0", CHAT, J(M | {"messages": [{"role": "user", "content": "hi"}], "stream": 0}), 400, "stream"),
    ("chat-content-number", CHAT, J(M | {"messages": [{"role": "user", "content": 5}]}), 400, "messages"),
    ("chat-ok", CHAT, J(M | {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}), OK, None),
    # huge, negative, non-finite numbers
    ("max-tokens-huge", GEN, b'{"prompt": "a", "max_tokens": 1e400}', 400, "max_tokens"),
    ("max-tokens-bigint", GEN, J({"prompt": "a", "max_tokens": 10**40}), 400, "max_tokens"),
    ("max-tokens-negative", GEN, J({"prompt": "a", "max_tokens": -1}), 400, "max_tokens"),
    ("seed-negative", GEN, J({"prompt": "a", "seed": -1}), 400, "seed"),
    ("temperature-nan", GEN, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("temperature-inf", GEN, b'{"prompt": "a", "temperature": Infinity}', 400, "temperature"),
    ("top-p-neg-inf", CMPL, b'{"model": "generate-tiny", "prompt": "a", "top_p": -Infinity}', 400, "top_p"),
    ("token-id-negative", CMPL, J(M | {"prompt": [-1]}), 400, "prompt"),
    ("token-id-vocab", CMPL, J(M | {"prompt": [10**6]}), 400, "prompt"),
    # empty and over-long / over-many inputs
    ("prompt-empty", GEN, J({"prompt": ""}), 400, "prompt"),
    ("text-blank", TR, J({"text": "   "}), 400, "text"),
    ("text-empty-list", TR, J({"text": []}), 400, "text"),
    ("prompt-empty-token-list", CMPL, J(M | {"prompt": [[]]}), 400, "prompt"),
    ("fill-mask-no-mask", FM, J({"text": "no mask here"}), 400, "text"),
    ("wrong-family", GEN, J({"prompt": "a", "model": "translate-tiny"}), 400, "model"),
    ("unknown-model", GEN, J({"prompt": "a", "model": "nope"}), 404, "model"),
    ("unsupported-logit-bias", CMPL, J(M | {"prompt": "a", "logit_bias": {"1": 1}}), 400, None),
    # NUL and control characters are text like any other: answered, never a 5xx
    ("nul-and-controls", GEN, J({"prompt": "a\u0000b\u0001\u001b[31m\u007f", "max_tokens": 2}), OK, None),
    ("nul-translate", TR, J({"text": "\u0000", "max_tokens": 2}), OK, None),
    # every limit, at it and one past it
    ("max-tokens-4096-model-limit", GEN, J({"prompt": "a", "max_tokens": 4096}), 400, "max_tokens"),
    ("max-tokens-4097", GEN, J({"prompt": "a", "max_tokens": 4097}), 400, "max_tokens"),
    ("prompt+max-tokens-at-limit", CMPL, J(M | {"prompt": [5] * 28, "max_tokens": 100, "ignore_eos": True}), OK, None),
    # past the context, the output ends where the context does (finish_reason length)
    ("prompt+max-tokens-past-limit", CMPL, J(M | {"prompt": [5] * 29, "max_tokens": 100}), OK, None),
    ("max-tokens-past-context", CMPL, J(M | {"prompt": "a", "max_tokens": 128}), 400, "max_tokens"),
    ("temperature-2", CMPL, J(M | {"prompt": "a", "max_tokens": 1, "temperature": 2}), OK, None),
    ("temperature-2.001", CMPL, J(M | {"prompt": "a", "max_tokens": 1, "temperature": 2.001}), 400, "temperature"),
    ("top-p-1", GEN, J({"prompt": "a", "max_tokens": 1, "top_p": 1}), OK, None),
    ("top-p-0", GEN, J({"prompt": "a", "max_tokens": 1, "top_p": 0}), 400, "top_p"),
    ("n-8", CMPL, J(M | {"prompt": "a", "max_tokens": 1, "n": 8}), OK, None),
    ("n-9", CMPL, J(M | {"prompt": "a", "max_tokens": 1, "n": 9}), 400, "n"),
    ("stop-4", GEN, J({"prompt": "a", "max_tokens": 1, "stop": ["1", "2", "3", "4"]}), OK, None),
    ("stop-5", GEN, J({"prompt": "a", "max_tokens": 1, "stop": ["1", "2", "3", "4", "5"]}), 400, "stop"),
    ("logprobs-5", CMPL, J(M | {"prompt": "a", "max_tokens": 1, "logprobs": 5}), OK, None),
    ("logprobs-6", CMPL, J(M | {"prompt": "a", "max_tokens": 1, "logprobs": 6}), 400, "logprobs"),
    ("generate-logprobs-20", GEN, J({"prompt": "a", "max_tokens": 1, "logprobs": 20}), OK, None),
    ("generate-logprobs-21", GEN, J({"prompt": "a", "max_tokens": 1, "logprobs": 21}), 400, "logprobs"),
    ("seed-max", GEN, J({"prompt": "a", "max_tokens": 1, "seed": 2**53 - 1}), OK, None),
    ("seed-max+1", GEN, J({"prompt": "a", "max_tokens": 1, "seed": 2**53}), 400, "seed"),
    ("beam-8", TR, J({"text": "a", "max_tokens": 2, "beam_size": 8}), OK, None),
    ("beam-9-past-slots", TR, J({"text": "a", "max_tokens": 2, "beam_size": 9}), 400, "beam_size"),
    ("beam-17", TR, J({"text": "a", "beam_size": 17}), 400, "beam_size"),
    ("fill-top-k-100", FM, J({"text": "the [MASK]", "top_k": 100}), OK, None),
    ("fill-top-k-101", FM, J({"text": "the [MASK]", "top_k": 101}), 400, "top_k"),
    ("texts-4", EMB, J({"input": ["a"] * 4}), OK, None),
    ("texts-5", EMB, J({"input": ["a"] * 5}), 400, "input"),
    ("chars-200", EMB, J({"input": "the " * 50}), OK, None),
    ("chars-201", EMB, J({"input": "the " * 50 + "a"}), 400, "input"),
    ("body-at-limit", EMB, J({"input": "a", "user": "u" * (4096 - len(J({"input": "a", "user": ""})))}), OK, None),
    ("body-past-limit", EMB, J({"input": "a", "user": "u" * (4097 - len(J({"input": "a", "user": ""})))}), 413,
     None),
]


def _check_error(r: httpx.Response, status: int, field: str | None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    if status == OK:
        return
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"], error
    if field is not None:
        assert error["param"] == field or field in error["message"], error


@pytest.mark.parametrize(("path", "body", "status", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_the_field(live, path, body, status, field):
    r = httpx.post(live.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    _check_error(r, status, field)


def test_body_limit_holds_for_chunked_bodies(live):
    def chunks(n):
        for _ in range(n):
            yield b" " * 1024
    r = httpx.post(live.url + EMB, content=chunks(8), headers={"Content-Type": "application/json"}, timeout=60)
    _check_error(r, 413, None)


@pytest.mark.parametrize(("method", "content_type", "status"), [
    ("GET", "application/json", 405), ("PUT", "application/json", 405), ("DELETE", "application/json", 405),
    ("POST", "text/plain", 400), ("POST", "application/x-www-form-urlencoded", 400), ("POST", None, 400),
    ("POST", "application/json; charset=latin-1", OK),
])
def test_wrong_methods_and_content_types(live, method, content_type, status):
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.request(method, live.url + GEN, content=J({"prompt": "a", "max_tokens": 1}), headers=headers,
                      timeout=60)
    _check_error(r, status, None)


def _raw(live, request: bytes) -> bytes:
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def _head(extra: bytes, target: bytes = b"/health") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close" + extra


@pytest.mark.parametrize("excess", [0, 1])
def test_header_bytes_at_and_past_the_limit(live, excess):
    limit = live.app.state.settings.max_header_bytes
    filler = _head(b"\r\nX-Pad: ")
    head = filler + b"p" * (limit - len(filler) + excess)
    assert len(head) == limit + excess
    reply = _raw(live, head + b"\r\n\r\n")
    status = int(reply.split(b" ", 2)[1])
    assert status == (431 if excess else 200), reply[:200]
    if excess:
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"


@pytest.mark.parametrize("excess", [0, 1])
def test_header_count_at_and_past_the_limit(live, excess):
    limit = live.app.state.settings.max_headers
    extra = b"".join(b"\r\nX-%d: 1" % i for i in range(limit - 2 + excess))  # + Host + Connection
    reply = _raw(live, _head(extra) + b"\r\n\r\n")
    assert int(reply.split(b" ", 2)[1]) == (431 if excess else 200), reply[:200]


def test_eight_megabyte_header_is_refused_early(live):
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(_head(b"\r\nX-Big: "))
        sent = 0
        try:
            while sent < 8_000_000:
                s.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            reply = s.recv(65536)
        except ConnectionResetError:
            reply = b""
    assert sent < 8_000_000 or reply.startswith(b"HTTP/1.1 431"), reply[:100]


def test_crlf_and_junk_in_x_request_id(live):
    # CRLF in the value ends the header: the rest is another header, never a response header
    reply = _raw(live, _head(b"\r\nX-Request-ID: abc\r\nX-Injected: yes") + b"\r\n\r\n")
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200") and b"x-request-id: abc\r\n" in head + b"\r\n"
    assert b"x-injected" not in head
    # a bare CR inside a value is a protocol error: 4xx, the server stays up
    reply = _raw(live, _head(b"\r\nX-Request-ID: a\rb") + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 4"), reply[:100]
    # anything outside [A-Za-z0-9._-]{1,64} is replaced by a fresh id
    r = httpx.get(live.url + "/health", headers={"X-Request-ID": "<script>alert(1)</script>"})
    assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32


def test_malformed_chunked_encoding_is_a_4xx(live):
    bad = (b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
    assert _raw(live, bad).startswith(b"HTTP/1.1 4")


def test_server_is_healthy_after_all_of_it(live):
    assert httpx.get(live.url + "/ready").status_code == 200
    r = httpx.post(live.url + GEN, json={"prompt": "To be", "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(live.url + "/metrics").text
    served_5xx = [line for line in metrics.splitlines()
                  if line.startswith("tserve_requests_total") and 'status="5' in line and "/ready" not in line]
    assert not served_5xx, served_5xx
    assert live.metric("tserve_kv_cache_slots_used") == 0 and live.metric("tserve_running_requests") == 0


def test_output_ends_where_the_context_does(live):
    """max_tokens past what the prompt leaves: the output fills the context, finish_reason length."""
    body = M | {"prompt": [5] * 29, "max_tokens": 100, "ignore_eos": True}
    r = httpx.post(live.url + CMPL, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == LIMITS["max_seq_len"] - 29
