"""Models on demand: available vs loaded models in /v1/models, loading on a request (shared,
off the event loop), the memory budget (LRU eviction of idle models, never one in flight, a
503 when nothing can go), keep-alive, and the load/unload routes."""

from __future__ import annotations

import asyncio
import gc
import re
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest

import service.models.loading as loading_module
from service.http.app import create_app
from tests.service.conftest import settings_for, wait_ready

pytestmark = pytest.mark.asyncio
TINY = ["fill-mask-tiny", "generate-tiny", "translate-tiny"]
REQUESTS = {"generate-tiny": ("/v1/generate", {"prompt": "To be", "max_tokens": 3, "ignore_eos": True}),
            "fill-mask-tiny": ("/v1/fill-mask", {"text": "the [MASK] menu"}),
            "translate-tiny": ("/v1/translate", {"text": "Open the file", "max_tokens": 4})}


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def metric(text: str, name: str, **labels) -> float:
    """The value of one series in a /metrics scrape (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def request(c: httpx.AsyncClient, model: str, **extra) -> httpx.Response:
    path, body = REQUESTS[model]
    return await c.post(path, json={**body, "model": model, **extra})


async def cards(c: httpx.AsyncClient) -> dict[str, dict]:
    listing = (await c.get("/v1/models")).json()
    assert listing["object"] == "list"
    return {m["id"]: m for m in listing["data"]}


async def test_models_lists_available_and_loaded_with_their_facts(weights_dir):
    app = create_app(settings_for(weights_dir, preload="generate-tiny"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        models = await cards(c)
        assert sorted(models) == TINY
        gen = models["generate-tiny"]
        assert gen["object"] == "model" and gen["owned_by"] == "transformer-serve" and gen["created"] > 0
        assert gen["state"] == "loaded" and gen["state_reason"] is None
        assert gen["architecture"] == "gpt2" and gen["context_length"] == 128
        assert gen["decode_step"] == "python+native-attention"  # the Python step, the native library's attention
        assert gen["quantization"] == {"weights": "float32", "decode": "float32", "source": None, "decode_q4": 0}
        engine = app.state.registry.engines["generate-tiny"]
        memory = gen["memory"]
        kv = engine.core.runner.cache.nbytes  # the block pool, the prefix cache's blocks among them
        assert memory["kv_cache_bytes"] == kv > 0
        params = sum(p.numel() * 4 for p in engine.model.parameters())  # float32, tied head counted once
        assert params <= memory["weights_bytes"] < 2 * params
        assert memory["total_bytes"] == memory["weights_bytes"] + memory["kv_cache_bytes"]
        for name in ("fill-mask-tiny", "translate-tiny"):
            assert models[name]["state"] == "available" and models[name]["memory"]["total_bytes"] == 0
        assert (await c.get("/ready")).json()["models"] == {
            "fill-mask-tiny": "available", "generate-tiny": "ready", "translate-tiny": "available"}
        one = (await c.get("/v1/models/translate-tiny")).json()
        assert one["id"] == "translate-tiny" and one["state"] == "available"
        assert (await c.get("/v1/models/nope")).status_code == 404


async def test_a_request_loads_its_model_once_while_the_others_serve(weights_dir, monkeypatch):
    """Three concurrent requests for an unloaded model share one load; the load runs in a worker
    thread, so a loaded model answers meanwhile (the load is made slow to see it)."""
    real_load = loading_module.load_model
    loading = threading.Event()

    def slow_load(*args, **kwargs):
        loading.set()
        time.sleep(1.5)
        return real_load(*args, **kwargs)

    app = create_app(settings_for(weights_dir, preload="generate-tiny"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        monkeypatch.setattr(loading_module, "load_model", slow_load)
        started = time.monotonic()
        fills = [asyncio.create_task(request(c, "fill-mask-tiny")) for _ in range(3)]
        while not loading.is_set():
            await asyncio.sleep(0.01)
        assert (await cards(c))["fill-mask-tiny"]["state"] == "loading"
        served = await request(c, "generate-tiny")
        assert served.status_code == 200 and time.monotonic() - started < 1.5  # not behind the load
        assert [r.status_code for r in await asyncio.gather(*fills)] == [200, 200, 200]
        scrape = (await c.get("/metrics")).text
        assert metric(scrape, "tserve_model_load_seconds_count", model="fill-mask-tiny") == 1
        assert metric(scrape, "tserve_model_loaded", model="fill-mask-tiny") == 1
        assert metric(scrape, "tserve_model_memory_bytes", model="fill-mask-tiny", kind="weights") > 0


async def measured_sizes(weights_dir) -> dict[str, int]:
    app = create_app(settings_for(weights_dir))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        return {name: card["memory"]["total_bytes"] for name, card in (await cards(c)).items()}


async def test_a_budget_for_two_models_serves_all_three_by_evicting(weights_dir):
    sizes = await measured_sizes(weights_dir)
    two = sorted(sizes.values())[-2:]
    budget = sum(two) + 1024  # any two fit, never three
    assert budget < sum(sizes.values())
    app = create_app(settings_for(weights_dir, preload="none", memory_budget=str(budget)))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        for model in TINY * 3:
            r = await request(c, model)
            assert r.status_code == 200, r.text
            loaded = [n for n, card in (await cards(c)).items() if card["state"] == "loaded"]
            assert model in loaded and len(loaded) <= 2
            assert sum(sizes[n] for n in loaded) <= budget
        scrape = (await c.get("/metrics")).text
        evictions = sum(metric(scrape, "tserve_model_evictions_total", model=n) for n in TINY)
        loads = sum(metric(scrape, "tserve_model_load_seconds_count", model=n) for n in TINY)
        assert evictions >= 6 and loads == evictions + 2  # each load past the first two evicted one
        assert metric(scrape, "tserve_model_unloads_total", reason="budget") == evictions


async def test_a_model_in_flight_is_never_evicted_and_the_refusal_is_a_503(weights_dir):
    sizes = await measured_sizes(weights_dir)
    budget = sizes["generate-tiny"] + sizes["fill-mask-tiny"] - 1  # not both at once
    app = create_app(settings_for(weights_dir, preload="generate-tiny", memory_budget=str(budget)))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        engine = app.state.registry.engines["generate-tiny"]
        step = engine.core.step

        def slow_step():  # a long generation, so a request really is in flight
            time.sleep(0.02)
            return step()

        engine.core.step = slow_step
        long = asyncio.create_task(request(c, "generate-tiny", max_tokens=100))
        while not engine.in_flight:
            await asyncio.sleep(0.01)
        refused = await request(c, "fill-mask-tiny")
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
        error = refused.json()["error"]
        assert error["code"] == "memory_budget" and error["param"] == "model"
        assert "TSERVE_MEMORY_BUDGET" in error["message"] and "generate-tiny" in error["message"]
        assert f"{budget / 2**20:,.1f} MiB" in error["message"]
        assert (await cards(c))["fill-mask-tiny"]["state_reason"] == error["message"]
        assert (await long).status_code == 200  # the in-flight request finished undisturbed
        engine.core.step = step
        assert (await request(c, "fill-mask-tiny")).status_code == 200  # now generate-tiny is idle: evicted
        assert "generate-tiny" not in app.state.registry.engines


async def test_a_model_too_big_for_the_budget_is_refused_without_loading(weights_dir):
    app = create_app(settings_for(weights_dir, preload="none", memory_budget="1KiB"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        r = await request(c, "generate-tiny")
        assert r.status_code == 503 and "retry-after" in r.headers
        assert "more than TSERVE_MEMORY_BUDGET (0.0 MiB)" in r.json()["error"]["message"]
        assert (await cards(c))["generate-tiny"]["state"] == "available"


async def test_load_serve_idle_unload_reload(weights_dir):
    app = create_app(settings_for(weights_dir, preload="none", keep_alive="300ms"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        assert (await request(c, "generate-tiny")).status_code == 200
        assert (await cards(c))["generate-tiny"]["state"] == "loaded"
        deadline = time.monotonic() + 10
        while "generate-tiny" in app.state.registry.engines and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        listed = await cards(c)
        assert listed["generate-tiny"]["state"] == "available" and listed["generate-tiny"]["memory"]["total_bytes"] == 0
        assert listed["generate-tiny"]["architecture"] == "gpt2"  # what it is stays known
        r = await request(c, "generate-tiny", keep_alive=-1)  # reloads; then stays
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        await asyncio.sleep(0.8)
        assert (await cards(c))["generate-tiny"]["state"] == "loaded"
        scrape = (await c.get("/metrics")).text
        assert metric(scrape, "tserve_model_load_seconds_count", model="generate-tiny") == 2
        assert metric(scrape, "tserve_model_unloads_total", model="generate-tiny", reason="keep_alive") == 1
        assert (await c.get("/ready")).status_code == 200  # nothing preloaded: ready to route all along


async def test_keep_alive_zero_on_a_chat_request_unloads_after_it(weights_dir):
    app = create_app(settings_for(weights_dir, preload="generate-tiny"))  # TSERVE_KEEP_ALIVE: forever
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        r = await c.post("/v1/completions", json={"model": "generate-tiny", "prompt": "To be", "max_tokens": 2,
                                                  "keep_alive": "0s"})
        assert r.status_code == 200
        deadline = time.monotonic() + 5
        while "generate-tiny" in app.state.registry.engines and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "generate-tiny" not in app.state.registry.engines


async def test_load_and_unload_routes(weights_dir):
    app = create_app(settings_for(weights_dir, preload="none", api_key="k"))
    auth = {"Authorization": "Bearer k"}
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        assert (await c.post("/models/load", json={"model": "fill-mask-tiny"})).status_code == 401
        assert (await c.post("/models/unload", json={"model": "fill-mask-tiny"})).status_code == 401
        r = await c.post("/models/load", json={"model": "fill-mask-tiny"}, headers=auth)
        assert r.status_code == 200 and r.json() == {"success": True, "model": "fill-mask-tiny", "state": "loaded"}
        assert "fill-mask-tiny" in app.state.registry.engines
        r = await c.post("/models/unload", json={"model": "fill-mask-tiny"}, headers=auth)
        assert r.json() == {"success": True, "model": "fill-mask-tiny", "state": "available"}
        assert "fill-mask-tiny" not in app.state.registry.engines
        again = await c.post("/models/unload", json={"model": "fill-mask-tiny"}, headers=auth)
        assert again.status_code == 409 and "not loaded" in again.json()["error"]["message"]  # its state conflicts
        for path in ("/models/load", "/models/unload"):
            unknown = await c.post(path, json={"model": "nope"}, headers=auth)
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
            missing = await c.post(path, json={}, headers=auth)
            assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
        for bad in ("5x", True, "", [1]):
            r = await c.post("/v1/chat/completions", headers=auth, json={
                "model": "generate-tiny", "messages": [{"role": "user", "content": "hi"}], "keep_alive": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive", (bad, r.text)


async def test_preload_names_must_be_served(weights_dir):
    app = create_app(settings_for(weights_dir, preload="generate-tiny,typo"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await app.state.loading
        ready = await c.get("/ready")
        assert ready.status_code == 503 and "TSERVE_PRELOAD" in ready.json()["error"]
        assert "typo" in ready.json()["error"]


async def test_an_unloaded_model_is_freed(weights_dir):
    """Nothing keeps an unloaded engine alive (a finished load task once did): its weights and KV
    cache are garbage, and malloc_trim can hand their pages back."""
    app = create_app(settings_for(weights_dir, preload="generate-tiny,fill-mask-tiny"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        assert (await request(c, "generate-tiny")).status_code == 200
        engine = app.state.registry.engines["generate-tiny"]
        model, cache = weakref.ref(engine.model), weakref.ref(engine.core.runner.cache)
        del engine
        assert (await c.post("/models/unload", json={"model": "generate-tiny"})).status_code == 200
        gc.collect()
        assert model() is None and cache() is None
        assert (await request(c, "fill-mask-tiny")).status_code == 200  # the other model still serves


async def test_a_load_hands_back_what_it_freed(weights_dir, monkeypatch):
    """After each load the heap its temporaries left is returned (gc + malloc_trim), once the
    model is measured and before it is marked loaded."""
    calls = []
    real = loading_module.release_memory
    monkeypatch.setattr(loading_module, "release_memory", lambda: calls.append(sorted(app.state.registry.engines))
                        or real())
    app = create_app(settings_for(weights_dir, preload="generate-tiny,fill-mask-tiny"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        assert len(calls) == 2 and calls[0] == [] and len(calls[1]) == 1  # one per load, before it counts as loaded


async def test_drop_in_apis_answer_the_budget_in_their_own_shape(weights_dir):
    app = create_app(settings_for(weights_dir, preload="none", memory_budget="1KiB"))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        tgi = await c.post("/generate", json={"inputs": "To be", "model": "generate-tiny"})
        assert tgi.status_code == 503 and tgi.headers["retry-after"] == "5"
        assert tgi.json()["error_type"] == "overloaded" and "TSERVE_MEMORY_BUDGET" in tgi.json()["error"]
        tei = await c.post("/embed", json={"inputs": "To be", "model": "fill-mask-tiny"})
        assert tei.status_code == 503 and "retry-after" in tei.headers and "TSERVE_MEMORY_BUDGET" in tei.json()["error"]


async def test_preloaded_models_past_the_budget_fail_start_up(weights_dir):
    sizes = await measured_sizes(weights_dir)
    budget = max(sizes.values()) + 1024  # one at a time: two preloaded models cannot both fit
    app = create_app(settings_for(weights_dir, preload="generate-tiny,translate-tiny", memory_budget=str(budget)))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await app.state.loading
        ready = await c.get("/ready")
        assert ready.status_code == 503
        assert "TSERVE_PRELOAD" in ready.json()["error"] and "TSERVE_MEMORY_BUDGET" in ready.json()["error"]
        assert "generate-tiny" in app.state.registry.engines  # not evicted for the second one


@pytest.mark.parametrize("name", ["generate-tiny", "fill-mask-tiny"])
async def test_tokenize_and_detokenize_load_an_unloaded_model_again(weights_dir, name):
    """/tokenize and /detokenize reach a named model through a lease, as generation does: once
    /models/unload has unloaded it, they load it again (was a 503), and the ids round-trip."""
    app = create_app(settings_for(weights_dir, preload=name))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        before = await c.post("/tokenize", json={"model": name, "prompt": "the menu"})
        assert before.status_code == 200, before.text
        ids = before.json()["tokens"]
        for route, body in (("/tokenize", {"model": name, "prompt": "the menu"}),
                            ("/detokenize", {"model": name, "tokens": ids})):
            assert (await c.post("/models/unload", json={"model": name})).status_code == 200
            assert name not in app.state.registry.engines
            again = await c.post(route, json=body)
            assert again.status_code == 200, again.text
            assert name in app.state.registry.engines
            if route == "/tokenize":
                assert again.json()["tokens"] == ids
            else:
                assert "the menu" in again.json()["prompt"]


async def test_a_manifest_saying_preload_false_is_listed_not_loaded(weights_dir, tmp_path, monkeypatch):
    """Start-up loads every model found but those whose manifest says "preload": false (listed,
    available); naming it in TSERVE_MODELS preloads it as any named model."""
    import hashlib
    import importlib.metadata
    import json

    monkeypatch.setenv("TSERVE_WEIGHTS_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "weights"
    root.mkdir()
    (root / "generate-tiny").symlink_to(weights_dir / "generate-tiny")
    dist = importlib.metadata.distribution("gguf")  # any installed files serve as chunks: it is never loaded
    names = sorted(str(f) for f in dist.files if str(f).endswith(".py"))[:2]
    data = [Path(str(dist.locate_file(n))).read_bytes() for n in names]
    parts = [{"package": "gguf", "version": dist.version, "file": n, "sha256": hashlib.sha256(d).hexdigest()}
             for n, d in zip(names, data)]
    (root / "lazy").mkdir()
    (root / "lazy" / "manifest.json").write_text(json.dumps({
        "format": "gguf", "package": "gguf", "version": dist.version, "file": "lazy.gguf", "licence": "MIT",
        "sha256": hashlib.sha256(b"".join(data)).hexdigest(), "parts": parts, "preload": False}))
    app = create_app(settings_for(root))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        assert (await c.get("/ready")).json()["models"] == {"generate-tiny": "ready", "lazy": "available"}
    assert app.state.registry.preloaded == ["generate-tiny"]
