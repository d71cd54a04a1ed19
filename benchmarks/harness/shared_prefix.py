"""A multi-tenant chat workload for routing across replicas: a few long system prompts (one per
tenant: an agent's instructions, a RAG document), each shared by many short user turns, all
arriving at once. What a router can save is the system prompts' prefill: a replica that already
holds a tenant's prompt in its prefix cache computes only the turn.

``run_workload`` sends it through one URL (a gateway) as streamed chat completions and measures,
per run: time to first token (client side), and, from every replica's /metrics before and after,
prompt tokens computed (``tserve_prompt_tokens_total`` less ``tserve_prefix_cache_hit_tokens_total``),
the prefix-cache hit rate and the requests each replica served. The text is made-up
pseudo-English from a seed (``synthetic.sentences``), so a run with another seed shares no
prefix with the last one: two policies measured on the same replicas start from equally cold
caches without restarting them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from benchmarks.harness.synthetic import sentences

COUNTERS = {"prompt": "tserve_prompt_tokens_total", "hit": "tserve_prefix_cache_hit_tokens_total",
            "query": "tserve_prefix_cache_query_tokens_total"}
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Workload:
    tenants: int = 8
    system_chars: int = 2700  # ~1,080 SmolLM2 tokens of this text (over 1,000: count_tokens checks)
    turns: int = 3  # user turns per tenant: round robin then sends each tenant to all 3 replicas
    max_tokens: int = 4
    concurrency: int = 12  # requests in flight at once (all are queued at the start)
    seed: int = 0
    # Sends start this far apart (the first 12 within 0.6 s), so the gateway sees them in the
    # order sent, not in the order connections happen to open: round robin then puts a
    # tenant's turns on different replicas, as it does over any long run.
    arrival_gap_s: float = 0.05

    def system_prompts(self) -> list[str]:
        prompts = []
        for t in range(self.tenants):
            text = f"You are assistant {t} of tenant {self.seed}-{t}. Answer from this document only.\n"
            for s in sentences(400, seed=self.seed * 1000 + t):
                if len(text) >= self.system_chars:
                    break
                text += s + " "
            prompts.append(text.strip())
        return prompts

    def requests(self) -> list[tuple[int, list[dict]]]:
        """(tenant, messages) in arrival order: turn 0 of every tenant, then turn 1, ...: each
        tenant's first request is still being prefilled when its next ones arrive."""
        turns = sentences(self.tenants * self.turns, seed=self.seed * 1000 + 999, min_words=4, max_words=10)
        system = self.system_prompts()
        return [(t, [{"role": "system", "content": system[t]},
                     {"role": "user", "content": turns[u * self.tenants + t]}])
                for u in range(self.turns) for t in range(self.tenants)]


@dataclass
class Record:
    tenant: int
    status: int | None = None
    ttft: float | None = None
    error: str | None = None
    content: str = ""


@dataclass
class RunResult:
    policy: str
    records: list[Record]
    replicas: list[dict[str, float]]  # per replica: counter deltas and requests served
    wall_s: float
    extra: dict = field(default_factory=dict)

    @property
    def computed_tokens(self) -> float:
        return sum(r["prompt"] - r["hit"] for r in self.replicas)

    @property
    def hit_rate(self) -> float:
        query = sum(r["query"] for r in self.replicas)
        return sum(r["hit"] for r in self.replicas) / query if query else 0.0

    def ttft(self, q: float) -> float:
        values = [r.ttft for r in self.records if r.ttft is not None]
        return float(np.percentile(values, q)) if values else float("nan")

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if r.status != 200 or r.error or r.ttft is None]

    def row(self) -> dict:
        return {"policy": self.policy, "requests": len(self.records), "failed": len(self.failed),
                "prompt_tokens": int(sum(r["prompt"] for r in self.replicas)),
                "computed_tokens": int(self.computed_tokens), "hit_rate": round(self.hit_rate, 3),
                "ttft_p50_s": round(self.ttft(50), 3), "ttft_p99_s": round(self.ttft(99), 3),
                "per_replica_requests": [int(r["requests"]) for r in self.replicas], "wall_s": round(self.wall_s, 1)}


def replica_counters(text: str) -> dict[str, float]:
    """The counters above and the chat requests served, from one replica's /metrics text."""
    out = {key: 0.0 for key in (*COUNTERS, "requests")}
    for line in text.splitlines():
        for key, name in COUNTERS.items():
            if line.startswith(name + "{"):
                out[key] += float(line.rsplit(" ", 1)[1])
        if line.startswith("tserve_requests_total{") and f'endpoint="{CHAT}"' in line:
            out["requests"] += float(line.rsplit(" ", 1)[1])
    return out


def snapshot(replica_urls: Sequence[str]) -> list[dict[str, float]]:
    return [replica_counters(httpx.get(u + "/metrics", timeout=10).text) for u in replica_urls]


def count_tokens(replica_url: str, model: str, texts: Sequence[str]) -> list[int]:
    """Tokens of each text in ``model``'s tokenizer (the replica's POST /tokenize)."""
    return [httpx.post(replica_url + "/tokenize", json={"model": model, "prompt": t}, timeout=30).json()["count"]
            for t in texts]


async def _one(client: httpx.AsyncClient, url: str, model: str, tenant: int, messages: list[dict],
               max_tokens: int) -> Record:
    record, start = Record(tenant), time.perf_counter()
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", url + CHAT, json=body) as resp:
            record.status = resp.status_code
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    record.error = str(event["error"])
                    continue
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") or ""
                    if (text or choice.get("finish_reason")) and record.ttft is None:
                        record.ttft = time.perf_counter() - start
                    record.content += text
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _send(url: str, model: str, workload: Workload) -> list[Record]:
    gate = asyncio.Semaphore(workload.concurrency)
    limits = httpx.Limits(max_connections=workload.concurrency, max_keepalive_connections=workload.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def bounded(i: int, tenant: int, messages: list[dict]) -> Record:
            await asyncio.sleep(i * workload.arrival_gap_s)
            async with gate:
                return await _one(client, url, model, tenant, messages, workload.max_tokens)

        return list(await asyncio.gather(*(bounded(i, t, m) for i, (t, m) in enumerate(workload.requests()))))


def run_workload(url: str, replica_urls: Sequence[str], model: str, workload: Workload, policy: str) -> RunResult:
    """The workload through ``url``; the replicas' counters are read before and after."""
    before = snapshot(replica_urls)
    start = time.perf_counter()
    records = asyncio.run(_send(url, model, workload))
    wall = time.perf_counter() - start
    after = snapshot(replica_urls)
    deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return RunResult(policy, records, deltas, wall)
