"""Translation served through HTTP, one server setup against another: ``python -m service`` with
``translate-en-de`` alone, started under each ``--setup``'s settings in turn (alternated
``--rounds`` times, one server at a time), ``--clients`` concurrent clients sending one sentence
per ``/v1/translate`` request, greedy and beam 4. Output tokens/s (the responses'
``usage.completion_tokens`` over the wall time), medians over the rounds, and how many sentences
came out the same under both.

    python -m benchmarks.studies.served_translation [--setup NAME:VAR=VALUE,...] [--setup ...] [--clients 32]

The default setups: ``before`` (float32 weights, the Python step, SDPA: the translator as served
before its native step) and ``default`` (the service's defaults). A setup's settings are
environment variables of the server (``TSERVE_QUANTIZE=none``, ``TSERVE_NATIVE_DECODE=off``, ...).

The sentences: the held-out prose ``benchmarks.harness.quality.heldout_text`` reads (the start of
the standard library's docstrings), 20-160 characters each, numbered to fill ``--requests``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.config import BenchConfig
from benchmarks.harness.quality import heldout_text
from benchmarks.harness.served import serve_checkpoint


def sentences(n: int) -> list[str]:
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", heldout_text()) if 20 <= len(s.strip()) <= 160]
    return [f"{s} ({i})" for i in range(-(-n // len(found))) for s in found][:n]


async def load(url: str, texts: list[str], beam: int, clients: int) -> tuple[float, dict[str, str]]:
    """Output tokens/s sending every text as its own request, ``clients`` at a time; the translations."""
    queue, tokens, out = list(reversed(texts)), 0, {}

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            text = queue.pop()
            r = await http.post(f"{url}/v1/translate", json={"text": text, "beam_size": beam, "max_tokens": 128})
            r.raise_for_status()
            body = r.json()
            tokens += body["usage"]["completion_tokens"]
            out[text] = body["translations"][0]["text"]

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as http:
        start_s = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return tokens / (time.perf_counter() - start_s), out


DEFAULT_SETUPS = ["before:TSERVE_QUANTIZE=none,TSERVE_NATIVE_DECODE=off,TSERVE_DECODE_ATTENTION=sdpa", "default:"]


def setup(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE,VAR=VALUE`` -> (name, environment)."""
    name, sep, spec = text.partition(":")
    pairs = [p.partition("=") for p in spec.split(",") if p]
    if not sep or not name or any(not eq or not var for var, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"--setup must be NAME:VAR=VALUE,..., got {text!r}")
    return name, {var: value for var, _, value in pairs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.served_translation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="append", type=setup, help="NAME:VAR=VALUE,... (give two)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    setups = dict(args.setup or [setup(s) for s in DEFAULT_SETUPS])
    if len(setups) != 2:
        parser.error("give two --setup (distinct names)")
    texts = sentences(args.requests)
    rates: dict[tuple[str, int], list[float]] = {}
    outs: dict[tuple[str, int], dict[str, str]] = {}
    cfg, logs = BenchConfig(), Path(tempfile.mkdtemp(prefix="served-translation-"))
    for rnd in range(args.rounds):
        for name, env in setups.items():
            with serve_checkpoint(REPO_ROOT / "weights" / "translate-en-de", cfg, logs / f"{name}-{rnd}.log",
                                  env=env) as server:
                url = server.url
                card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
                asyncio.run(load(url, texts[:8], 1, 8))  # warm-up
                for beam in (1, 4):
                    rate, outs[(name, beam)] = asyncio.run(load(url, texts, beam, args.clients))
                    rates.setdefault((name, beam), []).append(rate)
                    print(f"round {rnd}: {name} ({card.get('decode_step')}, {card.get('quantization')}), "
                          f"beam {beam}: {rate:.0f} tokens/s", flush=True)
    a, b = setups
    for beam in (1, 4):
        ra, rb = statistics.median(rates[(a, beam)]), statistics.median(rates[(b, beam)])
        same = sum(outs[(a, beam)][t] == outs[(b, beam)][t] for t in texts)
        print(f"beam {beam}: {a} {ra:.0f}, {b} {rb:.0f} tokens/s: {rb / ra:.2f}x; the same translation "
              f"{same}/{len(texts)}")


if __name__ == "__main__":
    main()
