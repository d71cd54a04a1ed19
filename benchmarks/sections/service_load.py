"""5. The service under load: ``python -m service`` on 127.0.0.1, streaming clients.

The server runs as a subprocess (a random free port, ``TSERVE_WEIGHTS_DIR`` / ``TSERVE_MODELS``
pointing at the checkpoint, ``TSERVE_TORCH_THREADS`` = the run's threads), serving the
checkpoint given by ``service_weights`` (default weights/generate-en) or, when that is
absent, a clearly labelled random stand-in of the same shape. Every concurrency level
replays the same seeded request list (mixed prompt lengths, greedy, ``ignore_eos`` so each
request generates exactly ``service_max_tokens``); 1 client is the one-at-a-time baseline.
The load generator shares the machine with the server: on 2 cores it takes CPU from it.
"""

from __future__ import annotations

import asyncio
import time

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.load_generator import LoadResult, run_load, warm_up
from benchmarks.harness.report import Row, RunReport, Target, say
from benchmarks.harness.served import engine_totals, request_specs, resolve_checkpoint, serve_checkpoint
from benchmarks.harness.timing import Stat
from benchmarks.harness.workspace import Workspace

BASELINE = "1 client (one at a time)"
SERVICE_TARGET_CONCURRENCY = 32  # the issue: >= 5x one-at-a-time tokens/s, p99 TTFT < 1 s


def measure_service(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str) -> None:
    checkpoint, label = resolve_checkpoint(ws, cfg)
    specs = request_specs(checkpoint, cfg)
    info = report.sections[section]
    info.update(checkpoint=str(checkpoint), checkpoint_label=label,
                prompt_tokens_mean=sum(s.prompt_tokens for s in specs) / len(specs))
    with serve_checkpoint(checkpoint, cfg, ws.root / "service.log") as server:
        info["startup_s"] = server.ready_s
        say(f"{section}: service ready in {info['startup_s']:.1f} s on {server.url} serving {label}")
        warm = asyncio.run(warm_up(server.url, specs[:2], cfg.service_max_tokens))
        if any(r.error or not r.finished for r in warm):
            raise RuntimeError(f"warm-up requests failed: {[r.error for r in warm]}; {server.log_tail()}")
        results: dict[int, LoadResult] = {}
        for c in cfg.service_concurrency:
            before, cpu_before = engine_totals(server.url), time.process_time()
            say(f"{section}: {c} concurrent clients for {cfg.service_duration_s:g} s")
            start = time.perf_counter()
            results[c] = asyncio.run(run_load(server.url, specs, c, cfg.service_duration_s, cfg.service_max_tokens))
            wall = time.perf_counter() - start
            after, client_cpu = engine_totals(server.url), time.process_time() - cpu_before
            steps = after["tserve_step_batch_size_count"] - before["tserve_step_batch_size_count"]
            seqs = after["tserve_step_batch_size_sum"] - before["tserve_step_batch_size_sum"]
            # What the server saw (real batch sizes) and what the client cost (it shares the CPUs).
            info.setdefault("levels", {})[c] = {
                "engine_steps": steps, "mean_sequences_per_step": seqs / steps if steps else 0.0,
                "load_generator_cpu_share": client_cpu / wall, "wall_s": wall, "requests": len(results[c].records)}
            r = results[c]
            say(f"{section}: {c} clients: {r.tokens_per_s()[0]:.1f} tok/s, {len(r.records)} requests, "
                f"{r.errors} errors, TTFT p50/p99 {r.percentiles(r.ttfts)}")
        add_rows(report, section, cfg, results, info["levels"],
                 "synthetic weights" if label.startswith("SYNTHETIC") else checkpoint.name)


def add_rows(report: RunReport, section: str, cfg: BenchConfig, results: dict[int, LoadResult],
             levels: dict[int, dict], label: str) -> None:
    slices = max(cfg.repetitions, 1)
    base = results.get(1)
    base_tps = Stat.of(base.tokens_per_s(slices)) if base else None
    base_ttft = base.percentiles(base.ttfts) if base else None
    base_itl = base.percentiles(base.gaps) if base else None
    for c, r in results.items():
        workload = f"{c} client{'s' if c > 1 else ''} × {cfg.service_max_tokens} tokens/request, {label}"
        peer = BASELINE if base is not None and c != 1 else None
        tps = Stat.of(r.tokens_per_s(slices))
        at_target = c == SERVICE_TARGET_CONCURRENCY
        report.rows.append(Row(
            section, workload, "generated tokens/s", tps, peer=peer, peer_value=base_tps if peer else None,
            target=Target(">=", 5.0, text="≥ 5×") if at_target and peer else None,
            check=f"{r.errors} errors / {len(r.records)} requests",
            note=f"{cfg.service_duration_s:g} s window split into {slices} slices (median over slices); "
                 f"{levels[c]['mean_sequences_per_step']:.1f} sequences per engine step; the load generator "
                 f"used {levels[c]['load_generator_cpu_share']:.0%} of a core"))
        ttft, itl = r.percentiles(r.ttfts), r.percentiles(r.gaps)
        for metric, values, baseline, target in (
            ("TTFT p50 ms", ttft[0], base_ttft and base_ttft[0], None),
            ("TTFT p99 ms", ttft[1], base_ttft and base_ttft[1],
             Target("<", 1000.0, on="value", text="< 1 s") if at_target else None),
            ("inter-token p50 ms", itl[0], base_itl and base_itl[0], None),
            ("inter-token p99 ms", itl[1], base_itl and base_itl[1], None),
        ):
            n = len(r.ttfts) if metric.startswith("TTFT") else len(r.gaps)
            report.rows.append(Row(
                section, workload, metric, _one(values * 1e3), higher_is_better=False, peer=peer,
                peer_value=_one(baseline * 1e3) if peer and baseline is not None else None, target=target,
                note=f"percentile over {n} samples"))


def _one(v: float) -> Stat:
    return Stat(v, v, v, 1)


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    measure_service(ws, cfg, report, "5. service")
