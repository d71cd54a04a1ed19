"""Soak: a few thousand mixed requests at bounded concurrency against ``python -m service``
(the shipped checkpoints, 127.0.0.1 only), watching the server's memory.

``python -m benchmarks.studies.soak [--requests 3000] [--concurrency 8] [--out DIR]`` (also ``make soak``).
A seeded mix of every endpoint, streamed and not, with one request in ten a bad one (a lone
surrogate, a coerced type, an unknown model, malformed JSON, a past-the-limit value) that must
get a 4xx. The server's RSS (``/proc/<pid>/status``) is sampled after every request; reported:
the counts by status class, RSS after warm-up (the first 10 %) and at the end, and the growth
over the second half (target < 2 %). Exit status 1 on any 5xx, transport error, unexpected
status, or growth at or past the target. Not a test: its figures are in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.server_process import ServerExited, service_process

TARGET_GROWTH = 0.02
GOOD = [  # (path, body, stream)
    ("/v1/generate", {"prompt": "To be, or not to be", "max_tokens": 16, "temperature": 0.8}, False),
    ("/v1/generate", {"prompt": "ROMEO:", "max_tokens": 24, "stream": True, "logprobs": 2}, True),
    ("/v1/completions", {"model": "generate-en", "prompt": "HAMLET:", "max_tokens": 12, "n": 2}, False),
    ("/v1/completions", {"model": "generate-en", "prompt": ["A", "B"], "max_tokens": 8, "stream": True}, True),
    ("/v1/translate", {"text": "Open the file", "beam_size": 2, "max_tokens": 16}, False),
    ("/v1/translate", {"text": ["Save the document", "Close the window"], "beam_size": 1, "max_tokens": 16}, False),
    ("/v1/translate", {"text": "Print the page", "beam_size": 1, "stream": True, "max_tokens": 16}, True),
    ("/v1/fill-mask", {"text": "The [MASK] of the river was calm.", "top_k": 3}, False),
    ("/v1/embeddings", {"model": "fill-mask-en", "input": ["first sentence", "second one"]}, False),
    ("/v1/models", None, False),
]
BAD = [  # (path, raw body, expected status)
    ("/v1/translate", b'{"text": "\\ud83d"}', 400),
    ("/v1/embeddings", b'{"input": "\\udc00"}', 400),
    ("/v1/generate", b'{"prompt": "a", "max_tokens": "5"}', 400),
    ("/v1/generate", b'{"prompt": "a", "stream": 0}', 400),
    ("/v1/completions", b'{"model": "nope", "prompt": "a"}', 404),
    ("/v1/generate", b'{"prompt": "a"', 400),
    ("/v1/generate", b'{"prompt": "a", "max_tokens": 4097}', 400),
    ("/v1/fill-mask", b'{"text": "no mask"}', 400),
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def one(c: httpx.AsyncClient, rng: random.Random) -> tuple[str, int]:
    if rng.random() < 0.1:
        path, raw, expected = rng.choice(BAD)
        r = await c.post(path, content=raw, headers={"Content-Type": "application/json"})
        ok = r.status_code == expected and r.json()["error"]["message"]
        return ("bad" if ok else f"unexpected {r.status_code} on {path}"), r.status_code
    path, body, stream = rng.choice(GOOD)
    if body is None:
        r = await c.get(path)
        return ("ok" if r.status_code == 200 else f"unexpected {r.status_code}"), r.status_code
    if stream:
        async with c.stream("POST", path, json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        ok = r.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in lines[-2]
        return ("ok" if ok else f"unexpected stream end on {path}"), r.status_code
    r = await c.post(path, json=body)
    return ("ok" if r.status_code == 200 else f"unexpected {r.status_code} on {path}: {r.text[:200]}"), r.status_code


async def soak(url: str, pid: int, n: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    problems: list[str] = []
    rss: list[tuple[int, float]] = []
    done = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal done
        while not queue.empty():
            queue.get_nowait()
            try:
                outcome, status = await one(c, rng)
            except httpx.HTTPError as exc:
                outcome, status = f"transport error {type(exc).__name__}", 0
            key = f"{status // 100}xx" if status else "transport"
            statuses[key] = statuses.get(key, 0) + 1
            if outcome not in ("ok", "bad"):
                problems.append(outcome)
            done += 1
            rss.append((done, rss_mib(pid)))

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    after_warmup = next(m for d, m in rss if d >= n // 10)
    half = next(m for d, m in rss if d >= n // 2)
    end = rss[-1][1]
    return {"requests": n, "concurrency": concurrency, "seconds": round(elapsed, 1), "statuses": statuses,
            "problems": problems[:20], "rss_mib_after_warmup": round(after_warmup, 1),
            "rss_mib_at_half": round(half, 1), "rss_mib_end": round(end, 1),
            "rss_growth_second_half": round((end - half) / half, 4), "rss_peak_mib": round(max(m for _, m in rss), 1),
            "rss_mib_by_tenth": [round(next(m for d, m in rss if d >= n * k // 10), 1) for k in range(1, 11)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    log = args.out / "soak-server.log"
    args.out.mkdir(parents=True, exist_ok=True)
    server = service_process(log, env={"TSERVE_LOG_LEVEL": "warning", "TSERVE_MAX_QUEUE": "256"}).start()
    try:
        server.wait_ready()
        result = asyncio.run(soak(server.url, server.pid, args.requests, args.concurrency, args.seed))
    except (ServerExited, TimeoutError) as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        result_exit = server.stop(grace_s=60)
    result["server_exit"] = result_exit
    result["server_log_tracebacks"] = log.read_text().count("Traceback")
    (args.out / "soak-latest.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    failed = (result["problems"] or result["statuses"].get("5xx") or result["statuses"].get("transport")
              or result["rss_growth_second_half"] >= TARGET_GROWTH or result["server_log_tracebacks"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
