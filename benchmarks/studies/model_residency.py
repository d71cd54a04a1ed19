"""Models on demand, measured: does memory really return after an unload, and does a memory
budget smaller than the models serve them all?

    python -m benchmarks.studies.model_residency rss --keep smollm2-135m-instruct --unload gemma3-270m
    python -m benchmarks.studies.model_residency rss --keep smollm2-135m-instruct --unload all
    python -m benchmarks.studies.model_residency cycle --budget 1.6GiB --rounds 2

``rss``: each case runs in a fresh Python process (the service's app, its registry and routes
driven in-process through ASGI, no socket): (a) only ``--keep`` preloaded; (b) ``--keep`` and the
``--unload`` models preloaded, then ``POST /models/unload`` for each, with the registry's
``malloc_trim`` after freeing; (c) the same without it (gc only). Every loaded model answers one
request first. RSS is the process's resident set (``/proc/self/statm``).

``cycle``: nothing preloaded, ``TSERVE_MEMORY_BUDGET`` set, one request to each served model in
turn for ``--rounds`` rounds; reports every status, the loads and evictions from ``/metrics``,
the largest memory the loaded models held together (``/v1/models``) and the RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time

from benchmarks.harness.server_process import metric_total

REQUESTS = {  # family -> (path, body)
    "decoder": ("/v1/completions", {"prompt": "The weather today is", "max_tokens": 8, "temperature": 0}),
    "encoder": ("/v1/embeddings", {"input": ["a short sentence to embed"]}),
    "encoder-decoder": ("/v1/translate", {"text": "Open the file", "max_tokens": 8}),
}


async def _child(args: dict) -> dict:
    import httpx

    import service.models.loading
    from service.http.app import create_app
    from service.models.memory import rss_bytes
    from service.settings import Settings

    if not args["trim"]:
        service.models.loading.release_memory = lambda: gc.collect() and False  # gc only, no malloc_trim
    settings = Settings(preload=",".join(args["preload"]) or "none", log_level="warning",
                        memory_budget=args.get("budget"), request_timeout_s=600)
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    out: dict = {}
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://x",
                                                                   timeout=600) as c:
        while (await c.get("/ready")).status_code != 200:
            if app.state.registry.error:
                raise SystemExit(app.state.registry.error)
            await asyncio.sleep(0.2)

        async def ask(name: str, family: str) -> int:
            path, body = REQUESTS[family]
            return (await c.post(path, json={**body, "model": name})).status_code

        cards = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        if args["mode"] == "rss":
            for name, card in cards.items():
                if card["state"] == "loaded":
                    assert await ask(name, card["family"]) == 200
            gc.collect()
            out["rss_loaded"] = rss_bytes()
            out["models_bytes"] = {n: m["memory"]["total_bytes"] for n, m in cards.items() if m["state"] == "loaded"}
            for name in args["unload"]:
                r = await c.post("/models/unload", json={"model": name})
                assert r.status_code == 200, r.text
            await asyncio.sleep(0.5)
            out["rss_after"] = rss_bytes()
            return out
        statuses, peak, started = [], 0, time.perf_counter()
        families: dict[str, str] = {}
        for _ in range(args["rounds"]):
            for name in cards:
                family = families.get(name) or (await c.get(f"/v1/models/{name}")).json().get("family")
                if family is None:  # never loaded yet: load it to learn what it answers
                    r = await c.post("/models/load", json={"model": name})
                    assert r.status_code == 200, r.text
                    family = (await c.get(f"/v1/models/{name}")).json()["family"]
                families[name] = family
                statuses.append((name, await ask(name, family)))
                listed = (await c.get("/v1/models")).json()["data"]
                held = sum(m["memory"]["total_bytes"] for m in listed)
                peak = max(peak, held)
        scrape = (await c.get("/metrics")).text
        out.update(statuses=statuses, peak_models_bytes=peak, rss=rss_bytes(), seconds=time.perf_counter() - started,
                   loads=metric_total(scrape, "tserve_model_load_seconds_count"),
                   evictions=metric_total(scrape, "tserve_model_evictions_total"),
                   sizes={m["id"]: (await c.get(f"/v1/models/{m['id']}")).json().get("memory") for m in listed})
        return out


def _run_child(args: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.studies.model_residency", "child", json.dumps(args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child failed: {args}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _served() -> list[str]:
    from service.metrics import Metrics
    from service.models.registry import EngineRegistry
    from service.settings import Settings

    return [name for name, _ in EngineRegistry(Settings(), Metrics()).discover()]


def rss(keep: str, unload: list[str]) -> None:
    if unload == ["all"]:
        unload = [n for n in _served() if n != keep]
    fresh = _run_child({"mode": "rss", "preload": [keep], "unload": [], "trim": True})
    rows = [("fresh process, only " + keep, fresh["rss_loaded"], None)]
    sizes = {}
    for trim in (True, False):
        r = _run_child({"mode": "rss", "preload": [keep, *unload], "unload": unload, "trim": trim})
        label = (f"{keep} + {', '.join(unload)}, then unload all but {keep} "
                 f"({'gc + malloc_trim' if trim else 'gc only'})")
        rows.append((label, r["rss_loaded"], r["rss_after"]))
        sizes = r["models_bytes"]
    print(f"| case | RSS loaded | RSS after unload | vs fresh ({_mib(fresh['rss_loaded'])}) |")
    print("|---|---|---|---|")
    for label, loaded, after in rows:
        ratio = "" if after is None else f"{after / fresh['rss_loaded']:.2f}x"
        print(f"| {label} | {_mib(loaded)} | {'' if after is None else _mib(after)} | {ratio} |")
    print("\nweights + KV caches per model (/v1/models memory):",
          ", ".join(f"{name} {_mib(n)}" for name, n in sorted(sizes.items())))


def cycle(budget: str, rounds: int) -> None:
    r = _run_child({"mode": "cycle", "preload": [], "unload": [], "trim": True, "budget": budget, "rounds": rounds})
    ok = sum(1 for _, status in r["statuses"] if status == 200)
    print(f"budget {budget}: {ok}/{len(r['statuses'])} requests 200 over {rounds} rounds of "
          f"{len(r['sizes'])} models in {r['seconds']:.0f} s; loads {r['loads']:.0f}, evictions "
          f"{r['evictions']:.0f}; most memory held at once {_mib(r['peak_models_bytes'])}; RSS at the end "
          f"{_mib(r['rss'])}")
    print("statuses:", " ".join(f"{n}:{s}" for n, s in r["statuses"]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.model_residency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rss")
    p.add_argument("--keep", default="smollm2-135m-instruct")
    p.add_argument("--unload", nargs="+", default=["gemma3-270m"], help="models to load and unload; 'all': the rest")
    p = sub.add_parser("cycle")
    p.add_argument("--budget", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p = sub.add_parser("child")
    p.add_argument("spec")
    args = parser.parse_args()
    if args.command == "child":
        print(json.dumps(asyncio.run(_child(json.loads(args.spec)))))
    elif args.command == "rss":
        rss(args.keep, args.unload)
    else:
        cycle(args.budget, args.rounds)


if __name__ == "__main__":
    main()
