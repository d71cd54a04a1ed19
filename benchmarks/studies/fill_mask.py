"""Fill-mask as a user sees it: ``python -m service`` serving ``fill-mask-en`` through HTTP, with
its rescorer (``TSERVE_FILL_MASK_RESCORE=true``, the default: Gemma 3 270M re-ranks the masked
LM's top 20) against the masked LM alone (``false``).

    python -m benchmarks.studies.fill_mask [--sentences 200] [--reps 2]

One client, one text per request, sequential (the latency a user waits for one answer). The
texts are held-out everyday sentences with one word masked (``python -m
model.train.fill_mask_head data`` builds them; without that, the model card's examples). The two
servers run one at a time, alternated ``reps`` times. Printed: the median and p90 request
latency, exact-match top-1 of the answers (the same sentences for both), and the model's memory
as the service reports it (``tserve_model_memory_bytes``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.server_process import ServerProcess, service_process


def texts(n: int) -> list[tuple[str, str | None]]:
    """(text with one [MASK], the masked word or None) for ``n`` sentences."""
    from model.train import fill_mask_head as fmh

    held = REPO_ROOT / fmh.OUT / "heldout.jsonl.gz"
    if held.is_file():
        return [(r["text"], r["answer"]) for r in fmh.read_jsonl_gz(held)[:n]]
    return [(t, None) for t in fmh.EXAMPLES]


def serve(rescore: bool, threads: int, log: Path) -> ServerProcess:
    env = {"TSERVE_MODELS": "fill-mask-en", "TSERVE_TORCH_THREADS": str(threads), "TSERVE_LOG_LEVEL": "warning",
           "TSERVE_FILL_MASK_RESCORE": "true" if rescore else "false"}
    return service_process(log, env=env, ready_timeout_s=900)


def measure(server: ServerProcess, items: list[tuple[str, str | None]]) -> tuple[list[float], list[str]]:
    """Per request: seconds and the top answer."""
    seconds, answers = [], []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        client.post("/v1/fill-mask", json={"text": items[0][0], "top_k": 5}).raise_for_status()  # warm
        for text, _ in items:
            start = time.perf_counter()
            r = client.post("/v1/fill-mask", json={"text": text, "top_k": 5})
            seconds.append(time.perf_counter() - start)
            r.raise_for_status()
            answers.append(r.json()[0]["token_str"])
    return seconds, answers


def p90(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    items = texts(args.sentences)
    runs: dict[bool, list[float]] = {True: [], False: []}
    answers: dict[bool, list[str]] = {}
    memory: dict[bool, float] = {}
    logs = Path(tempfile.mkdtemp(prefix="fill-mask-bench-"))
    for rep in range(args.reps):
        for rescore in (True, False):
            with serve(rescore, args.threads, logs / f"{rescore}-{rep}.log") as server:
                seconds, got = measure(server, items)
                metrics = httpx.get(server.url + "/metrics", timeout=10).text
                memory[rescore] = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                      if line.startswith("tserve_model_memory_bytes{") and 'kind="weights"' in line)
            runs[rescore].append(statistics.median(seconds))
            answers[rescore] = got
            print(f"rep {rep} rescore={rescore}: median {statistics.median(seconds) * 1e3:.1f} ms, "
                  f"p90 {p90(seconds) * 1e3:.1f} ms over {len(items)} requests", flush=True)
    known = [(i, a) for i, (_, a) in enumerate(items) if a is not None]
    print(f"\nfill-mask-en served, 1 client, {len(items)} one-mask texts, {args.threads} threads, "
          f"medians of {args.reps} runs")
    print("| setting | request latency, median | top-1 | weights memory |")
    print("|---|---:|---:|---:|")
    for rescore in (True, False):
        top1 = f"{sum(answers[rescore][i] == a for i, a in known) / len(known):.1%}" if known else "-"
        print(f"| TSERVE_FILL_MASK_RESCORE={'true' if rescore else 'false'} | "
              f"{statistics.median(runs[rescore]) * 1e3:.1f} ms | {top1} | {memory[rescore] / 2**20:.0f} MiB |")
    print(f"latency ratio (rescored / masked LM alone): "
          f"{statistics.median(runs[True]) / statistics.median(runs[False]):.1f}x")


if __name__ == "__main__":
    main()
