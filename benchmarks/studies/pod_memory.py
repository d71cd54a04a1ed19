"""What a replica's memory request and limit rest on: ``python -m service`` with its default
settings (every shipped model loaded), its RSS once ready, then the peak (``VmHWM``) under a
mixed burst on every model at once. Served, through HTTP on 127.0.0.1.

    python -m benchmarks.studies.pod_memory [--streams 32] [--tokens 200] [TSERVE_X=value ...]

The burst: ``--streams`` sampled chat completions on smollm2-135m-instruct and as many
completions on gemma3-270m (a base model: no chat template), a quarter of each with a
~1,000-token prompt, ``--tokens`` new tokens each; beside them 8 requests each of beam-4
translation (8 sentences), fill-mask (16 texts, re-ranked by Gemma) and embeddings (64 texts).
Prints each model's memory as ``/v1/models`` reports it (weights + KV caches), the RSS once
ready and after the burst, the peak since start (``VmHWM``: loading's transient peak included),
and the status codes (all must be 200). ``TSERVE_CONVERTED_CACHE=off`` loads as the container
does (GGUF weights converted at every start). docs/deployment.md sizes the Kubernetes pod
from it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.server_process import service_process

LONG = "Summarise the following text. " + ("The committee met on Thursday to discuss the budget for the coming year, "
                                           "and the members agreed on most points. ") * 40


def rss_mib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


async def burst(url: str, streams: int, tokens: int) -> dict[int, int]:
    async def chat(c: httpx.AsyncClient, i: int) -> int:
        content = LONG if i % 4 == 0 else f"Tell me a story, number {i}."
        r = await c.post(url + "/v1/chat/completions", json={
            "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens, "temperature": 0.8})
        return r.status_code

    async def complete(c: httpx.AsyncClient, i: int) -> int:
        prompt = LONG if i % 4 == 0 else f"Once upon a time, in story {i},"
        r = await c.post(url + "/v1/completions", json={"model": "gemma3-270m", "prompt": prompt,
                                                        "max_tokens": tokens, "temperature": 0.8})
        return r.status_code

    async def encoders(c: httpx.AsyncClient, i: int) -> int:
        if i % 3 == 0:
            body = {"text": ["The meeting was moved to Thursday because the manager is ill."] * 8, "beam_size": 4,
                    "max_tokens": 64}
            r = await c.post(url + "/v1/translate", json=body)
        elif i % 3 == 1:
            r = await c.post(url + "/v1/fill-mask", json={"text": [f"The capital of France is [MASK], number {j}."
                                                                   for j in range(16)]})
        else:
            r = await c.post(url + "/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": [
                f"sentence number {j} about the weather and the sea " * 4 for j in range(64)]})
        return r.status_code

    async with httpx.AsyncClient(timeout=1800) as c:
        codes = await asyncio.gather(*[chat(c, i) for i in range(streams)], *[complete(c, i) for i in range(streams)],
                                     *[encoders(c, i) for i in range(24)])
    return {code: codes.count(code) for code in sorted(set(codes))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32, help="generation requests per decoder model")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("settings", nargs="*", help="TSERVE_X=value settings for the server")
    args = parser.parse_args(argv)
    env = {"TSERVE_API_KEY": None, **dict(s.split("=", 1) for s in args.settings)}
    log = REPO_ROOT / "benchmarks" / "results" / "pod_memory.log"
    with service_process(log, env=env, ready_timeout_s=900, stop_grace_s=120) as server:
        ready_s, url = server.ready_s, server.url
        idle = rss_mib(server.pid)[0]
        models = httpx.get(url + "/v1/models").json()["data"]
        held = {m["id"]: m.get("memory", {}).get("total_bytes", 0) for m in models}
        t = time.perf_counter()
        codes = asyncio.run(burst(url, args.streams, args.tokens))
        burst_s = time.perf_counter() - t
        after, peak = rss_mib(server.pid)
    print("| model | weights + KV caches (/v1/models) |\n|---|---|")
    for name, size in sorted(held.items()):
        print(f"| {name} | {size / 2**20:,.0f} MiB |")
    print(f"| all {len(held)} | {sum(held.values()) / 2**20:,.0f} MiB |")
    print(f"ready in {ready_s:.0f} s; RSS idle {idle:,} MiB; burst {burst_s:.0f} s, statuses {codes}; "
          f"RSS after it {after:,} MiB; peak RSS since start (loading included) {peak:,} MiB")
    if set(codes) != {200}:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
