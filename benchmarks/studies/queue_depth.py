"""Queue depth vs time to first token: the measurement behind the autoscaling target.

``python -m benchmarks.studies.queue_depth`` starts ``python -m service`` on 127.0.0.1 (one
checkpoint, as the service section does), then runs the closed-loop streaming load
generator at increasing concurrency. While each level runs, a sampler thread reads
``/metrics`` every ``--sample-s`` seconds and averages the per-pod gauges an autoscaler
would see (``tserve_waiting_requests``, ``tserve_running_requests``,
``tserve_kv_cache_usage_ratio``); the clients record TTFT. The printed table says at which
queue depth TTFT starts to climb, which is where the HorizontalPodAutoscaler's target
belongs (docs/deployment.md "Kubernetes"). The server's CPU use per level (cores, from /proc) shows
why CPU utilisation is no autoscaling signal here, and its peak RSS sizes the pod's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import threading
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.config import BenchConfig
from benchmarks.harness.load_generator import run_load, warm_up
from benchmarks.harness.served import request_specs, resolve_checkpoint, serve_checkpoint
from benchmarks.harness.workspace import Workspace

GAUGES = ("tserve_waiting_requests", "tserve_running_requests", "tserve_kv_cache_usage_ratio")


def read_gauges(url: str) -> dict[str, float]:
    """Each gauge summed over the ``model`` label (one pod = one scrape target)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {g: sum(float(v) for v in re.findall(rf"^{g}{{[^}}]*}} (\S+)$", text, re.MULTILINE)) for g in GAUGES}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (all its threads), from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> tuple[float, float]:
    """(current, peak) resident set size of ``pid`` in MiB, from /proc (Linux)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


class GaugeSampler(threading.Thread):
    """Polls the gauges until stopped; ``means()`` averages the samples taken."""

    def __init__(self, url: str, every_s: float):
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.samples: list[dict[str, float]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.samples.append(read_gauges(self.url))
            except httpx.HTTPError:
                pass
            self.stopping.wait(self.every_s)

    def means(self) -> dict[str, float]:
        n = max(1, len(self.samples))
        return {g: sum(s[g] for s in self.samples) / n for g in GAUGES}


def measure(args: argparse.Namespace) -> dict:
    cfg = BenchConfig(threads=args.threads, service_max_tokens=args.max_tokens, service_duration_s=args.window,
                      service_concurrency=tuple(args.concurrency))
    rows = []
    with Workspace(cfg) as ws:
        checkpoint, label = resolve_checkpoint(ws, cfg)
        specs = request_specs(checkpoint, cfg)
        env = {"TSERVE_MAX_BATCH": str(args.max_batch)}
        with serve_checkpoint(checkpoint, cfg, ws.root / "service.log", env=env) as server:
            startup_s = server.ready_s
            asyncio.run(warm_up(server.url, specs[:2], cfg.service_max_tokens))
            idle_rss = rss_mib(server.proc.pid)[0]
            for c in args.concurrency:
                sampler = GaugeSampler(server.url, args.sample_s)
                sampler.start()
                cpu_before, wall_before = cpu_seconds(server.proc.pid), time.perf_counter()
                result = asyncio.run(run_load(server.url, specs, c, cfg.service_duration_s, cfg.service_max_tokens))
                server_cpu = (cpu_seconds(server.proc.pid) - cpu_before) / (time.perf_counter() - wall_before)
                sampler.stopping.set()
                sampler.join()
                p50, p90, p99 = result.percentiles(result.ttfts, (50, 90, 99))
                row = {"concurrency": c, **{k: round(v, 3) for k, v in sampler.means().items()},
                       "ttft_p50_ms": p50 * 1e3, "ttft_p90_ms": p90 * 1e3, "ttft_p99_ms": p99 * 1e3,
                       "tokens_per_s": result.tokens_per_s()[0], "server_cpu_cores": server_cpu,
                       "requests": len(result.records), "errors": result.errors, "samples": len(sampler.samples)}
                rows.append(row)
                print(format_row(row), flush=True)
            peak_rss = rss_mib(server.proc.pid)[1]
    return {"checkpoint": label, "max_batch": args.max_batch, "threads": args.threads,
            "max_tokens": args.max_tokens, "window_s": args.window, "startup_s": startup_s,
            "idle_rss_mib": idle_rss, "peak_rss_mib": peak_rss, "levels": rows}


HEADER = ("| clients | mean waiting | mean running | mean KV usage | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms "
          "| tokens/s | server CPU (cores) | requests (errors) |\n|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: dict) -> str:
    return (f"| {r['concurrency']} | {r['tserve_waiting_requests']:.1f} | {r['tserve_running_requests']:.1f} "
            f"| {r['tserve_kv_cache_usage_ratio']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} "
            f"| {r['ttft_p99_ms']:.0f} | {r['tokens_per_s']:.0f} | {r['server_cpu_cores']:.2f} "
            f"| {r['requests']} ({r['errors']}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 24, 32, 40, 48, 64])
    p.add_argument("--window", type=float, default=10.0, help="seconds per concurrency level")
    p.add_argument("--max-batch", type=int, default=32, help="TSERVE_MAX_BATCH of the server")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="TSERVE_TORCH_THREADS (= the pod's CPU limit)")
    p.add_argument("--sample-s", type=float, default=0.25, help="gauge sampling period")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "queue_depth.json")
    args = p.parse_args()
    print(HEADER, flush=True)
    out = measure(args)
    print(f"startup {out['startup_s']:.1f} s; RSS idle {out['idle_rss_mib']:.0f} MiB, "
          f"peak {out['peak_rss_mib']:.0f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
