"""A closed-loop load generator: N async httpx clients streaming /v1/generate (SSE).

Each client sends its requests back to back until the window closes; requests still
running then are allowed to finish (so every request has a complete TTFT), but only
tokens that arrived inside the window count towards throughput, which is therefore the
steady-state rate under N concurrent streams, without the drain at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class RequestSpec:
    prompt: str
    prompt_tokens: int


@dataclass
class RequestRecord:
    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in the chunk)
    error: str | None = None
    finished: bool = False

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    def inter_token_gaps(self) -> list[float]:
        """Seconds between consecutive chunks, spread evenly over the tokens of the later chunk."""
        gaps = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:]):
            gaps += [(t1 - t0) / n] * n
        return gaps


async def stream_one(client: httpx.AsyncClient, url: str, spec: RequestSpec, max_tokens: int) -> RequestRecord:
    body = {"prompt": spec.prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    record = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                record.error = f"HTTP {resp.status_code}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    record.finished = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"].get("code") or chunk["error"].get("type") or "error")
                    continue
                n = len(chunk.get("token_ids") or [])
                if n:
                    record.chunks.append((time.perf_counter(), n))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = type(exc).__name__
    return record


@dataclass
class LoadResult:
    concurrency: int
    window_s: float
    window_start: float
    records: list[RequestRecord]

    def tokens_per_s(self, slices: int = 1) -> list[float]:
        """Generated tokens/s inside the window, per equal slice of it."""
        width = self.window_s / slices
        counts = [0] * slices
        for r in self.records:
            for t, n in r.chunks:
                i = int((t - self.window_start) // width)
                if 0 <= i < slices:
                    counts[i] += n
        return [c / width for c in counts]

    def percentiles(self, values: list[float], qs: tuple[float, ...] = (50, 99)) -> list[float]:
        return [float(np.percentile(values, q)) for q in qs] if values else [float("nan")] * len(qs)

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.records if r.ttft is not None]

    @property
    def gaps(self) -> list[float]:
        return [g for r in self.records for g in r.inter_token_gaps()]

    @property
    def errors(self) -> int:
        return sum(r.error is not None or not r.finished for r in self.records)


async def run_load(base_url: str, specs: list[RequestSpec], concurrency: int, window_s: float,
                   max_tokens: int, request_timeout_s: float = 600.0) -> LoadResult:
    """``concurrency`` clients, client c sending specs c, c + N, c + 2N, ... until the window closes."""
    url = f"{base_url}/v1/generate"
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout_s)) as client:
        start = time.perf_counter()
        end = start + window_s

        async def client_loop(c: int) -> None:
            i = c
            while time.perf_counter() < end:
                records.append(await stream_one(client, url, specs[i % len(specs)], max_tokens))
                i += concurrency

        await asyncio.gather(*(client_loop(c) for c in range(concurrency)))
    return LoadResult(concurrency, window_s, start, records)


async def warm_up(base_url: str, specs: list[RequestSpec], max_tokens: int) -> list[RequestRecord]:
    """Send ``specs`` one after another (not measured): first requests pay for lazy set-up."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return [await stream_one(client, f"{base_url}/v1/generate", s, max_tokens) for s in specs]


async def sse_chunks(client, url: str, body: dict):
    """POST ``body`` to ``url`` as a streamed request and yield each Server-Sent Event's JSON
    payload (``data: [DONE]`` and non-data lines skipped); raises on a non-2xx status."""
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
