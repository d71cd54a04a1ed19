"""Two revisions of this repository served side by side, through HTTP: does a change (a
refactor, a new fast path) cost anything a user sees?

    python -m benchmarks.studies.compare_revisions OLD_REV NEW_REV [--reps 5] [--threads 2]

Each revision is checked out into its own git worktree (under ``build/revisions/``) and served
by its own ``python -m service`` (this venv, that tree on PYTHONPATH, its own weights/), both
up at once, SmolLM2-135M-Instruct and translate-en-de loaded with their default settings.
Every workload then runs against OLD, NEW, OLD, NEW, ... (alternated, so a machine that gets
busier or quieter shifts both alike), one request at a time per server:

- chat batch 1: one streamed completion of 128 tokens (greedy, EOS ignored): decode tokens/s
  after the first token, and the time to it;
- chat 8 streams: 8 concurrent streamed completions of 64 tokens: tokens/s over all;
- translation: 16 ordinary software strings in one ``/v1/translate`` request, greedy and beam 4.

It prints medians and NEW / OLD. Served figures, with HTTP and the event loop included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.server_process import ServerProcess, service_process

CHAT = "smollm2-135m-instruct"
MT = "translate-en-de"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SENTENCES = ["Open file", "Save changes before closing?", "The connection was lost.", "Delete %d items?",
             "Settings", "Could not find the printer.", "Show hidden files", "Your password has expired.",
             "Check for updates", "The download is complete.", "Undo", "Select a folder to import",
             "Quit without saving", "Network settings", "Copy link address", "Restart now"]


def checkout(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short=12", rev], cwd=REPO_ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = REPO_ROOT / "build" / "revisions" / sha
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO_ROOT, check=True,
                       capture_output=True)
    return tree


def serve(tree: Path, threads: int, log: Path, extra: dict[str, str] | None = None) -> ServerProcess:
    """``python -m service`` of the checkout ``tree`` (its code, its weights/)."""
    # Each tree its own converted-weights cache: an older revision prunes the other's entries.
    env = {"TSERVE_WEIGHTS_DIR": str(tree / "weights"), "TSERVE_WEIGHTS_CACHE": str(tree / "build" / "cache"),
           "TSERVE_MODELS": f"{CHAT},{MT}",
           "TSERVE_TORCH_THREADS": str(threads), "TSERVE_LOG_LEVEL": "warning",
           "TSERVE_PREFIX_CACHE": "false", **(extra or {})}
    return service_process(log, env=env, cwd=tree, ready_timeout_s=900)


async def stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds after it, tokens) of one streamed completion."""
    body = {"model": CHAT, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                tokens += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return first - start, end - first, tokens


async def chat_batch1(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        ttft, rest, tokens = await stream(client, url, 128)
    return {"chat b1 decode tok/s": (tokens - 1) / rest, "chat b1 TTFT ms": 1000 * ttft}


async def chat_streams(url: str, n: int = 8) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(stream(client, url, 64) for _ in range(n)))
    return {f"chat {n} streams tok/s": sum(t for _, _, t in done) / (time.perf_counter() - start)}


async def translation(url: str) -> dict[str, float]:
    out = {}
    async with httpx.AsyncClient() as client:
        for beam in (1, 4):
            start = time.perf_counter()
            r = await client.post(url + "/v1/translate", json={"model": MT, "text": SENTENCES, "beam_size": beam},
                                  timeout=300)
            r.raise_for_status()
            out[f"translate 16, beam {beam}, sentences/s"] = len(SENTENCES) / (time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.compare_revisions",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="settings for both servers, e.g. TSERVE_KV_DTYPE=bfloat16 to hold a default that "
                             "changed between the revisions fixed, so the comparison is the code alone")
    args = parser.parse_args(argv)
    logs = REPO_ROOT / "build" / "revisions"
    logs.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for label, rev in (("old", args.old), ("new", args.new)):
            servers[label] = serve(checkout(rev), args.threads, logs / f"{label}.log",
                                   dict(item.split("=", 1) for item in args.env)).start()
        for s in servers.values():
            s.wait_ready()
        results: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
        for workload in (chat_batch1, chat_streams, translation):
            asyncio.run(workload(servers["old"].url))  # warm-up, both sides
            asyncio.run(workload(servers["new"].url))
            for _ in range(args.reps):
                for label in ("old", "new"):
                    for name, value in asyncio.run(workload(servers[label].url)).items():
                        results[label].setdefault(name, []).append(value)
        print(f"| workload ({args.reps} alternated runs: median, min-max) | {args.old} | {args.new} | new / old |")
        print("|---|---|---|---|")
        for name in results["old"]:
            old, new = results["old"][name], results["new"][name]
            ratio = statistics.median(new) / statistics.median(old)
            print(f"| {name} | {statistics.median(old):.1f} ({min(old):.1f}-{max(old):.1f}) | "
                  f"{statistics.median(new):.1f} ({min(new):.1f}-{max(new):.1f}) | {ratio:.3f} |")
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
