"""12. Chat through the service: ``python -m service`` serving SmolLM2-135M-Instruct (its
default settings: int8 decode steps through the native C++ step, the prefix cache on), and
32 concurrent streaming chat clients on ``/v1/chat/completions``.

Each client holds a conversation: the same system prompt (a real deployment's), then a
question of its own; it sends one streamed request, waits for the reply to finish, and sends
the next question, ``chat_service_duration_s`` long. Replies end where the model ends them
(EOS) or at ``max_tokens`` (drawn per request from 24-96, seeded), so streams do not finish
in lockstep. All 32 clients start at once: the opening burst puts 32 prompts in front of the
first token of each, which is the worst case for TTFT; later requests arrive while the others
decode, as chat traffic does. Both are reported: TTFT over every request, and over the
requests after each client's first ("steady state").
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.config import BenchConfig
from benchmarks.harness.report import Row, RunReport, SectionSkipped, Target, say
from benchmarks.harness.served import serve_checkpoint
from benchmarks.harness.timing import Stat
from benchmarks.harness.workspace import Workspace

MODEL = "smollm2-135m-instruct"
SECTION = "12. chat service"
SYSTEM = ("You are a concise assistant for the support desk of a software company. Answer in plain English, "
          "in two or three sentences, without lists or code unless the user asks for them. If a question is "
          "outside software, say so politely and answer briefly anyway. Never invent version numbers, prices "
          "or dates; say that you do not know instead.")
QUESTIONS = [
    "How do I reset my password?", "Why is my laptop fan so loud?", "What is a memory leak?",
    "Can you explain what a VPN does?", "How do I make a backup of my files?", "What does HTTP 404 mean?",
    "Is it safe to install updates right away?", "What is the difference between RAM and storage?",
    "How can I speed up a slow computer?", "What is two-factor authentication?", "Why does my Wi-Fi drop?",
    "How do I share a large file with a colleague?", "What is a phishing email?", "What is cloud storage?",
    "How do I change the default browser?", "What does a firewall do?", "Why do programs crash?",
    "What is open-source software?", "How do I clear my browser cache?", "What is an SSD?",
    "How often should I restart my computer?", "What is a software license?", "What is a driver?",
    "How do I take a screenshot?", "What does it mean to compress a file?", "What is a strong password?",
    "How do I connect a second monitor?", "Why is my printer offline?", "What is malware?",
    "What does the task manager show?", "How do I recover a deleted file?", "What is an IP address?",
    "How do I uninstall a program?", "What is encryption?", "What is a keyboard shortcut for copy?",
    "What should I do if my screen freezes?", "What is the difference between a bug and a feature?",
    "How do I update my operating system?", "What is a spreadsheet good for?", "What is a database?",
]


@dataclass
class Turn:
    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    times: list[float] = field(default_factory=list)


async def _turn(client: httpx.AsyncClient, url: str, question: str, max_tokens: int) -> Turn:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    turn = Turn(start=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                turn.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return turn
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    turn.tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    turn.first = turn.first or now
                    turn.times.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        turn.error = type(exc).__name__
    turn.end = time.perf_counter()
    return turn


async def _load(url: str, clients: int, window_s: float, seed: int) -> tuple[list[list[Turn]], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        end = start + window_s

        async def one_client(c: int) -> list[Turn]:
            turns, i = [], c
            while time.perf_counter() < end:
                turns.append(await _turn(client, url, QUESTIONS[i % len(QUESTIONS)], rng.randint(24, 96)))
                i += clients
            return turns

        per_client = await asyncio.gather(*(one_client(c) for c in range(clients)))
    return list(per_client), time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")  # as section 5 computes them


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    checkpoint = REPO_ROOT / "weights" / MODEL
    try:
        from model.formats.manifest import locate, read_manifest

        locate(read_manifest(checkpoint))
    except Exception as exc:  # noqa: BLE001 - any reason the package is not there
        raise SectionSkipped(f"the chat model's weights are not installed ({exc})") from None
    with serve_checkpoint(checkpoint, cfg, ws.root / "chat-service.log") as server:
        say(f"{SECTION}: service ready in {server.ready_s:.1f} s")
        asyncio.run(_load(server.url, 2, 1.0, cfg.seed))  # warm-up, not measured
        per_client, wall = asyncio.run(_load(server.url, cfg.chat_streams, cfg.chat_service_duration_s, cfg.seed))
    turns = [t for client in per_client for t in client]
    errors = [t.error for t in turns if t.error]
    done = [t for t in turns if not t.error and t.first is not None]
    ttft_all = [t.first - t.start for t in done]
    ttft_steady = [t.first - t.start for client in per_client for t in client[1:] if not t.error and t.first]
    tokens = sum(t.tokens for t in done)
    gaps = [b - a for t in done for a, b in zip(t.times, t.times[1:])]
    work = (f"{MODEL}, {cfg.chat_streams} chat clients back to back for {cfg.chat_service_duration_s:g} s "
            f"(system prompt + question, 24-96 max tokens, greedy), all starting at once")
    check = f"{len(errors)} errors / {len(turns)} requests" + (f" ({errors[0]})" if errors else "")
    report.rows.append(Row(SECTION, work, "generated tokens/s", Stat.of([tokens / wall]), check=check,
                           note=f"{tokens} tokens in {len(done)} replies over {wall:.1f} s, through HTTP"))
    for label, values, target in (("TTFT p50 ms, every request", ttft_all, None),
                                  ("TTFT p99 ms, every request (the opening burst included)", ttft_all, None),
                                  ("TTFT p50 ms, steady state", ttft_steady, None),
                                  ("TTFT p99 ms, steady state", ttft_steady,
                                   Target("<", 1000.0, on="value", text="< 1 s"))):
        q = 99 if "p99" in label else 50
        report.rows.append(Row(SECTION, work, label, Stat.of([_pct(values, q) * 1e3]), higher_is_better=False,
                               target=target, note=f"over {len(values)} requests"))
    report.rows.append(Row(SECTION, work, "inter-token p99 ms", Stat.of([_pct(gaps, 99) * 1e3]),
                           higher_is_better=False, note=f"over {len(gaps)} gaps"))
    say(f"{SECTION}: {tokens / wall:.1f} tok/s, {len(done)} replies, {len(errors)} errors; TTFT p50/p99 all "
        f"{_pct(ttft_all, 50):.2f}/{_pct(ttft_all, 99):.2f} s, steady {_pct(ttft_steady, 50):.2f}/"
        f"{_pct(ttft_steady, 99):.2f} s")
