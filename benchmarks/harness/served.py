"""The service as the served benchmarks start it: the checkpoint to serve (or a labelled
synthetic stand-in), a seeded list of requests for it, ``python -m service`` configured by the
run's settings, and the engine's counters read from ``/metrics``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.config import BenchConfig
from benchmarks.harness.load_generator import RequestSpec
from benchmarks.harness.report import say
from benchmarks.harness.server_process import ServerProcess, metric_total, service_process
from benchmarks.harness.synthetic import save_synthetic_generator, sentences
from benchmarks.harness.workspace import Workspace
from model import Tokenizer, is_checkpoint

ENGINE_COUNTERS = ("tserve_engine_steps_total", "tserve_step_batch_size_sum", "tserve_step_batch_size_count")


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


def serve_checkpoint(checkpoint: Path, cfg: BenchConfig, log_path: Path,
                     env: dict[str, str] | None = None) -> ServerProcess:
    """``python -m service`` serving ``checkpoint`` alone on the run's threads, its queue long
    enough for the most concurrent clients; ``env``: more settings, applied last. Use it in a
    ``with`` (started and ready inside, ``ready_s`` the seconds that took; stopped after)."""
    settings = {
        "TSERVE_WEIGHTS_DIR": str(checkpoint.parent), "TSERVE_MODELS": checkpoint.name,
        "TSERVE_TORCH_THREADS": str(cfg.threads), "TSERVE_LOG_LEVEL": "warning",
        "TSERVE_MAX_QUEUE": str(max(128, 2 * max(cfg.service_concurrency))),
        **(env or {}),
    }
    return service_process(log_path, env=settings, ready_timeout_s=cfg.service_startup_timeout_s)


def engine_totals(url: str) -> dict[str, float]:
    """Engine counters summed over models: steps and the sequences-per-step histogram."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {name: metric_total(text, name) for name in ENGINE_COUNTERS}
