"""One request per endpoint against a running transformer-serve, checking status and shape.

Standard library only, so the container smoke test can run it with any python3:

    python3 deploy/smoke_requests.py --url http://127.0.0.1:8000 --wait-ready 180 \
        --expect-models translate-en-de,generate-en,fill-mask-en --metrics-out metrics.txt

The models named by --native-models (default: SmolLM2) that /v1/models lists must decode
through the native C++ step (``tserve_decode_step_info{step="native"}`` in /metrics), and
answer a completion through it.

Exits non-zero with a line naming the endpoint and what was wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.request

FINISH_REASONS = {"stop", "length", "eos"}
# Served through the native decode step wherever the image has one (the container ships it).
NATIVE_MODELS = "smollm2-135m-instruct"


class SmokeFailure(Exception):
    pass


def expect(condition: bool, endpoint: str, what: str) -> None:
    if not condition:
        raise SmokeFailure(f"{endpoint}: {what}")


def call(base: str, method: str, path: str, body: dict | None = None, timeout: float = 60.0):
    """Returns (status, content type, body bytes); HTTP errors are answers, not exceptions."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read()


def call_json(base: str, method: str, path: str, body: dict | None = None):
    status, ctype, raw = call(base, method, path, body)
    endpoint = f"{method} {path}"
    expect(status == 200, endpoint, f"status {status}, body {raw[:300]!r}")
    expect("application/json" in ctype, endpoint, f"content type {ctype!r}")
    return json.loads(raw)


def wait_ready(base: str, timeout_s: float) -> float:
    """Polls /ready until 200; returns the seconds it took."""
    start = time.monotonic()
    last = "no answer"
    while time.monotonic() - start < timeout_s:
        try:
            status, _, raw = call(base, "GET", "/ready", timeout=5)
            if status == 200:
                return time.monotonic() - start
            last = f"status {status} {raw[:200]!r}"
        except OSError as err:  # connection refused while the server starts
            last = repr(err)
        time.sleep(1.0)
    raise SmokeFailure(f"GET /ready: not ready after {timeout_s:.0f}s (last: {last})")


def check_usage(usage: dict, endpoint: str, max_completion: int | None) -> None:
    expect(isinstance(usage, dict) and usage.get("prompt_tokens", 0) > 0, endpoint, f"usage {usage!r}")
    if max_completion is not None:
        n = usage.get("completion_tokens", -1)
        expect(1 <= n <= max_completion, endpoint, f"completion_tokens {n} outside [1, {max_completion}]")


def check_health(base: str) -> None:
    body = call_json(base, "GET", "/health")
    expect(body.get("status") == "ok", "GET /health", f"body {body!r}")
    call_json(base, "GET", "/ready")


def check_models(base: str, expected: list[str]) -> None:
    body = call_json(base, "GET", "/v1/models")
    expect(body.get("object") == "list", "GET /v1/models", f"object {body.get('object')!r}")
    ids = {m.get("id") for m in body.get("data", [])}
    missing = sorted(set(expected) - ids)
    expect(not missing, "GET /v1/models", f"missing {missing}, listed {sorted(ids)}")


def check_translate(base: str) -> None:
    body = call_json(base, "POST", "/v1/translate", {"text": "Open the file", "max_tokens": 32})
    translations = body.get("translations")
    expect(isinstance(translations, list) and len(translations) == 1, "POST /v1/translate", f"body {body!r}")
    text = translations[0].get("text")
    expect(isinstance(text, str) and text.strip() != "", "POST /v1/translate", f"translation {translations[0]!r}")


def check_generate(base: str) -> None:
    body = call_json(base, "POST", "/v1/generate", {"prompt": "To be", "max_tokens": 16})
    expect(isinstance(body.get("text"), str), "POST /v1/generate", f"body {body!r}")
    expect(body.get("finish_reason") in FINISH_REASONS, "POST /v1/generate", f"finish_reason {body!r}")
    check_usage(body.get("usage"), "POST /v1/generate", 16)


def check_generate_stream(base: str) -> None:
    endpoint = "POST /v1/generate (stream)"
    status, ctype, raw = call(base, "POST", "/v1/generate", {"prompt": "To be", "max_tokens": 16, "stream": True})
    expect(status == 200, endpoint, f"status {status}, body {raw[:300]!r}")
    expect(ctype.startswith("text/event-stream"), endpoint, f"content type {ctype!r}")
    events = [block for block in raw.decode().split("\n\n") if block.strip()]
    expect(all(e.startswith("data: ") for e in events), endpoint, f"non-SSE block in {events[:3]!r}")
    expect(len(events) >= 2 and events[-1] == "data: [DONE]", endpoint, f"no closing [DONE]: {events[-2:]!r}")
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    finals = [c for c in chunks if c.get("finish_reason") in FINISH_REASONS
              or any(ch.get("finish_reason") in FINISH_REASONS for ch in c.get("choices", []))]
    expect(len(finals) == 1, endpoint, f"expected one final chunk with a finish_reason, got {len(finals)}")


def check_completions(base: str) -> None:
    endpoint = "POST /v1/completions"
    body = call_json(base, "POST", "/v1/completions", {"model": "generate-en", "prompt": "To be", "max_tokens": 16})
    expect(body.get("object") == "text_completion", endpoint, f"object {body.get('object')!r}")
    choices = body.get("choices")
    expect(isinstance(choices, list) and len(choices) == 1, endpoint, f"choices {choices!r}")
    expect(isinstance(choices[0].get("text"), str), endpoint, f"choice {choices[0]!r}")
    expect(choices[0].get("finish_reason") in FINISH_REASONS, endpoint, f"choice {choices[0]!r}")
    check_usage(body.get("usage"), endpoint, 16)


def check_fill_mask(base: str) -> None:
    endpoint = "POST /v1/fill-mask"
    body = call_json(base, "POST", "/v1/fill-mask", {"text": "The [MASK] of the river."})
    expect(isinstance(body, list) and len(body) >= 1, endpoint, f"body {body!r}")
    for cand in body:
        expect(isinstance(cand.get("score"), float) and 0.0 <= cand["score"] <= 1.0, endpoint, f"score {cand!r}")
        expect(isinstance(cand.get("token"), int), endpoint, f"token {cand!r}")
        expect(isinstance(cand.get("token_str"), str), endpoint, f"token_str {cand!r}")
        expect(isinstance(cand.get("sequence"), str) and "[MASK]" not in cand["sequence"], endpoint,
               f"sequence {cand!r}")
    scores = [c["score"] for c in body]
    expect(scores == sorted(scores, reverse=True), endpoint, f"scores not in descending order: {scores}")


def check_embeddings(base: str) -> None:
    endpoint = "POST /v1/embeddings"
    body = call_json(base, "POST", "/v1/embeddings", {"model": "fill-mask-en", "input": "hello world"})
    expect(body.get("object") == "list", endpoint, f"object {body.get('object')!r}")
    data = body.get("data")
    expect(isinstance(data, list) and len(data) == 1, endpoint, f"data {str(data)[:300]}")
    vector = data[0].get("embedding")
    expect(isinstance(vector, list) and len(vector) > 0, endpoint, f"embedding {str(vector)[:200]}")
    expect(all(isinstance(x, float) and math.isfinite(x) for x in vector), endpoint, "non-finite or non-float value")
    expect(any(x != 0.0 for x in vector), endpoint, "all-zero embedding")


def decode_steps(metrics: str) -> dict[str, str]:
    """model -> decode step, from the ``tserve_decode_step_info`` series set to 1."""
    steps = {}
    for labels, value in re.findall(r'^tserve_decode_step_info\{([^}]*)\}\s+(\S+)$', metrics, re.MULTILINE):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if float(value) == 1.0 and "model" in pairs:
            steps[pairs["model"]] = pairs.get("step", "")
    return steps


def check_native_steps(base: str, metrics: str, models: list[str]) -> None:
    """Each of ``models`` that /v1/models lists decodes through the native step, and completes
    a prompt through it."""
    endpoint = "GET /metrics"
    steps = decode_steps(metrics)
    expect(bool(steps), endpoint, "no tserve_decode_step_info series")
    print("smoke: decode steps: " + ", ".join(f"{m}={s}" for m, s in sorted(steps.items())), flush=True)
    listed = {m.get("id") for m in call_json(base, "GET", "/v1/models").get("data", [])}
    for model in models:
        if model not in listed:
            print(f"smoke: native step of {model}: not checked (the server does not list it)", flush=True)
            continue
        expect(steps.get(model) == "native", endpoint,
               f"{model} decodes through the {steps.get(model)!r} step, not the native one: "
               f'no tserve_decode_step_info{{model="{model}",step="native"}} 1.0 (the server log says why)')
        body = call_json(base, "POST", "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                                           "max_tokens": 8, "temperature": 0})
        choices = body.get("choices") or [{}]
        expect(isinstance(choices[0].get("text"), str), f"POST /v1/completions ({model})", f"body {body!r}")
        check_usage(body.get("usage"), f"POST /v1/completions ({model})", 8)
        print(f'smoke: native step of {model}: tserve_decode_step_info{{model="{model}",step="native"}} 1.0; '
              f"completion {choices[0]['text']!r}", flush=True)


def check_playground(base: str) -> None:
    """The web page at / and every script and stylesheet it names (all from this server)."""
    status, ctype, raw = call(base, "GET", "/")
    expect(status == 200 and ctype.startswith("text/html"), "GET /", f"status {status}, content type {ctype!r}")
    assets = re.findall(r'(?:src|href)="([^"]+)"', raw.decode())
    expect(bool(assets), "GET /", "the page names no script or stylesheet")
    for asset in assets:
        status, _, body = call(base, "GET", "/" + asset)
        expect(status == 200 and len(body) > 0, f"GET /{asset}", f"status {status}")


def fetch_metrics(base: str) -> str:
    status, ctype, raw = call(base, "GET", "/metrics")
    expect(status == 200, "GET /metrics", f"status {status}")
    expect(ctype.startswith("text/plain"), "GET /metrics", f"content type {ctype!r}")
    text = raw.decode()
    expect("tserve_requests_total{" in text, "GET /metrics", "no tserve_requests_total series")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS",
                        help="poll /ready this long before the requests (0: don't wait)")
    parser.add_argument("--expect-models", default="", help="comma-separated ids /v1/models must list")
    parser.add_argument("--metrics-out", help="write the /metrics text here (for promtool check metrics)")
    parser.add_argument("--native-models", default=NATIVE_MODELS,
                        help="comma-separated ids that must decode through the native step when /v1/models "
                             f"lists them (default {NATIVE_MODELS}; '' checks none)")
    args = parser.parse_args()
    base = args.url.rstrip("/")

    checks = [
        ("health + ready", check_health),
        ("models", lambda b: check_models(b, [m for m in args.expect_models.split(",") if m])),
        ("translate", check_translate),
        ("generate", check_generate),
        ("generate stream", check_generate_stream),
        ("completions", check_completions),
        ("fill-mask", check_fill_mask),
        ("embeddings", check_embeddings),
        ("playground page", check_playground),
    ]
    try:
        if args.wait_ready > 0:
            print(f"smoke: ready after {wait_ready(base, args.wait_ready):.1f}s", flush=True)
        for name, check in checks:
            start = time.monotonic()
            check(base)
            print(f"smoke: {name}: ok ({time.monotonic() - start:.2f}s)", flush=True)
        metrics = fetch_metrics(base)
        print("smoke: metrics: ok", flush=True)
        native = [m for m in args.native_models.split(",") if m]
        if native:
            check_native_steps(base, metrics, native)
    except SmokeFailure as failure:
        print(f"smoke: FAILED: {failure}", file=sys.stderr)
        return 1
    if args.metrics_out:
        with open(args.metrics_out, "w") as out:
            out.write(metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
