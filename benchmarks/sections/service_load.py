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
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.config import BenchConfig
from benchmarks.harness.load_generator import LoadResult, RequestSpec, run_load, warm_up
from benchmarks.harness.report import Row, RunReport, Target, say
from benchmarks.harness.synthetic import save_synthetic_generator, sentences
from benchmarks.harness.timing import Stat
from benchmarks.harness.workspace import Workspace
from model import Tokenizer, is_checkpoint

BASELINE = "1 client (one at a time)"
SERVICE_TARGET_CONCURRENCY = 32  # the issue: >= 5x one-at-a-time tokens/s, p99 TTFT < 1 s


def resolve_checkpoint(ws: Workspace, cfg: BenchConfig) -> tuple[Path, str]:
    """(checkpoint dir, label): the requested checkpoint, or a synthetic stand-in when absent."""
    path = cfg.service_weights if cfg.service_weights.is_absolute() else REPO_ROOT / cfg.service_weights
    if is_checkpoint(path):
        return path, f"checkpoint {cfg.service_weights}"
    say(f"no checkpoint at {path}: building a SYNTHETIC stand-in (random weights, generate-en's shape)")
    out = save_synthetic_generator(ws.root / "service-weights" / "synthetic-generate-en", cfg.seed)
    return out, f"SYNTHETIC stand-in (random weights; {cfg.service_weights} not found)"


def request_specs(checkpoint: Path, cfg: BenchConfig, count: int = 512) -> list[RequestSpec]:
    """Seeded prompts whose lengths (in the checkpoint's tokens) are drawn from service_prompt_lengths."""
    tokenizer = Tokenizer.from_file(checkpoint / "tokenizer.json")
    max_positions = json.loads((checkpoint / "config.json").read_text())["max_positions"]
    longest = max_positions - cfg.service_max_tokens - 8  # room for specials the template adds
    rng = random.Random(cfg.seed + 5)
    text = " ".join(sentences(400, cfg.seed + 11))
    words = text.split(" ")
    specs = []
    for _ in range(count):
        want = min(rng.choice(cfg.service_prompt_lengths), longest)
        start = rng.randrange(len(words) - 1)
        ids = tokenizer.encode(" ".join(words[start:start + want + 8]), add_special_tokens=False)[:want]
        prompt = tokenizer.decode(ids)
        specs.append(RequestSpec(prompt, len(tokenizer.encode(prompt))))
    return specs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """``python -m service`` for one checkpoint (``env``: more settings); stopped (only this pid) on exit."""

    def __init__(self, checkpoint: Path, cfg: BenchConfig, log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "TSERVE_HOST": "127.0.0.1", "TSERVE_PORT": str(self.port),
            "TSERVE_WEIGHTS_DIR": str(checkpoint.parent), "TSERVE_MODELS": checkpoint.name,
            "TSERVE_TORCH_THREADS": str(cfg.threads), "TSERVE_LOG_LEVEL": "warning",
            "TSERVE_MAX_QUEUE": str(max(128, 2 * max(cfg.service_concurrency))),
            **(env or {}),  # the caller's settings last
        }
        self._log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server process
        self.proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO_ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.startup_timeout_s = cfg.service_startup_timeout_s

    def wait_ready(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited with {self.proc.returncode} before /ready: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the service was not ready after {self.startup_timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def metric_totals(self) -> dict[str, float]:
        """Engine counters summed over models: steps and the sequences-per-step histogram."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        totals: dict[str, float] = {}
        for name in ("tserve_engine_steps_total", "tserve_step_batch_size_sum", "tserve_step_batch_size_count"):
            totals[name] = sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE))
        return totals

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def measure_service(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str) -> None:
    checkpoint, label = resolve_checkpoint(ws, cfg)
    specs = request_specs(checkpoint, cfg)
    info = report.sections[section]
    info.update(checkpoint=str(checkpoint), checkpoint_label=label,
                prompt_tokens_mean=sum(s.prompt_tokens for s in specs) / len(specs))
    server = ServiceProcess(checkpoint, cfg, ws.root / "service.log")
    try:
        info["startup_s"] = server.wait_ready()
        say(f"{section}: service ready in {info['startup_s']:.1f} s on {server.url} serving {label}")
        warm = asyncio.run(warm_up(server.url, specs[:2], cfg.service_max_tokens))
        if any(r.error or not r.finished for r in warm):
            raise RuntimeError(f"warm-up requests failed: {[r.error for r in warm]}; {server.log_tail()}")
        results: dict[int, LoadResult] = {}
        for c in cfg.service_concurrency:
            before, cpu_before = server.metric_totals(), time.process_time()
            say(f"{section}: {c} concurrent clients for {cfg.service_duration_s:g} s")
            start = time.perf_counter()
            results[c] = asyncio.run(run_load(server.url, specs, c, cfg.service_duration_s, cfg.service_max_tokens))
            wall = time.perf_counter() - start
            after, client_cpu = server.metric_totals(), time.process_time() - cpu_before
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
    finally:
        server.stop()


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
