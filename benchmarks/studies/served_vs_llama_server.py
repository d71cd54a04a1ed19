"""What a user sees through HTTP: ``python -m service`` against llama.cpp's own ``llama-server``,
on the same GGUF file, the same cores, the same requests.

    python -m benchmarks.studies.served_vs_llama_server [--models smollm2-135m-instruct gemma3-270m]
        [--streams 1 8 32] [--tokens 128] [--reps 3] [--llama-server PATH]
        [--speculation off ngram] [--long-prompt 2000] [--floor] [--peer-flag='--load-mode none']

For each model, each server is started alone (never both at once: they would share the cores)
with its defaults but the port and thread count (ours: ``TSERVE_TORCH_THREADS``; llama-server:
``-t``/``-tb`` the same, ``--parallel`` the largest stream count, ``-c`` that many times the
tokens a stream needs). Each workload is ``n`` concurrent streamed ``/v1/completions`` requests
(a different prompt each, ``max_tokens`` tokens, greedy, EOS ignored, the OpenAI-compatible
route both servers have), repeated ``reps`` times: OURS, PEER, OURS, PEER, ... are alternated
by model, and each side's figures are medians over the repetitions:
- TTFT p50 / p99 over all requests (the time to the first streamed token),
- inter-token latency p50 / p99 (gaps between streamed chunks carrying tokens),
- tokens/s: all generated tokens over the wall time of the workload.

``--speculation`` runs each side once per setting: ``off`` (no drafting on either side: ours
``TSERVE_SPECULATIVE=off``, llama-server without ``--spec-type``) and ``ngram`` (prompt lookup on
both: ours ``TSERVE_SPECULATIVE=ngram``, llama-server ``--spec-type ngram-simple``). The rows
"defaults" pair what each server does unasked (ours drafts by n-gram, llama-server does not), from
the same runs. ``--long-prompt N`` adds, per server start, the TTFT of one streamed request whose
prompt is about N tokens (plain prose, new to the server). ``--floor`` reads this CPU's memory
bandwidth at 1 and 2 threads (a float32 sum over 512 MiB, best of 5) before any server starts and
reports each batch-1 rate as a share of the bandwidth floor: the weight bytes a token reads (every
weight tensor of the GGUF as stored, the token table only where it is also the head) over the
bandwidth, against the measured time per token.

``--peer-flag`` (repeatable; split at spaces) adds flags to every llama-server start:
``--peer-flag='--load-mode none'`` reads its weights into its own memory, as ours are, where a
host reclaims cold file pages of mapped files (a VM whose DAMON pages out the page cache between
workloads slows a mapped peer's first requests; the report says which flags ran).

``llama-server`` is found on PATH or at ``--llama-server``; ``--build`` builds it from the
llama.cpp sources vendored in the llama-cpp-python sdist on PyPI (cmake + ninja + a C++
compiler, a few minutes on 2 cores) into ``build/llama-server/``; the report says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.load_generator import sse_chunks
from benchmarks.harness.server_process import ServerProcess, free_port, service_process

SDIST = "llama-cpp-python==0.3.36"  # the pin of the `llama` extra: its vendored llama.cpp
PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a refrigerator keeps food cold, step by step.",
           "Describe a walk through a city market early on a summer morning.",
           "Tell me about the history of the bicycle and how it changed cities.",
           "Write a letter to a friend describing your new job at a bakery.",
           "What makes a good teacher? Give a few examples from school.",
           "Describe the journey of a river from the mountains to the sea.",
           "Write a recipe for a simple vegetable soup and explain each step."]


def gguf_of(model: str) -> Path:
    from model.formats.manifest import locate, read_manifest

    return locate(read_manifest(REPO_ROOT / "weights" / model))


def build_llama_server() -> Path:
    """llama-server from the sdist's vendored llama.cpp, into build/llama-server/."""
    out = REPO_ROOT / "build" / "llama-server"
    binary = out / "src" / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d",
                    str(out)], check=True)
    (archive,) = out.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    (src,) = out.glob("llama_cpp_python-*/vendor/llama.cpp")
    (out / "src").unlink(missing_ok=True)
    (out / "src").symlink_to(src.resolve())
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-server"], check=True)
    return binary


# Each speculation setting, as each side is told it: our environment, llama-server's flags.
SPECULATION = {"off": ({"TSERVE_SPECULATIVE": "off"}, []),
               "ngram": ({"TSERVE_SPECULATIVE": "ngram"}, ["--spec-type", "ngram-simple"])}
DEFAULTS = {"ours": "ngram", "llama-server": "off"}  # what each server does when not told


def ours(model: str, threads: int, log: Path, env: dict[str, str] | None = None) -> ServerProcess:
    env = {"TSERVE_MODELS": model, "TSERVE_TORCH_THREADS": str(threads), "TSERVE_LOG_LEVEL": "warning",
           **(env or {})}
    return service_process(log, env=env, ready_timeout_s=900)


def peer(binary: Path, model: str, threads: int, parallel: int, ctx_per_stream: int, log: Path,
         flags: list[str] | None = None) -> ServerProcess:
    port = free_port()
    argv = [str(binary), "-m", str(gguf_of(model)), "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "--parallel", str(parallel), "-c", str(parallel * ctx_per_stream), "--no-webui", *(flags or [])]
    return ServerProcess(argv, log, port=port, ready_path="/health", ready_timeout_s=900)


def long_prompt(words: int) -> str:
    """About ``words`` tokens of plain prose that no earlier request shares (numbered sentences)."""
    sentences = [f"Note {i}: the {['river', 'market', 'school', 'harbour', 'library'][i % 5]} opened at "
                 f"{6 + i % 5} in the morning and {['stayed busy', 'grew quiet', 'filled slowly'][i % 3]} "
                 f"until noon." for i in range(words // 20 + 1)]
    return "Summarise these notes in one line.\n" + " ".join(sentences)


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode token reads from this GGUF as stored: every 2-D weight tensor
    but the token table, which counts only where no separate head exists (a tied head reads it)."""
    from model.formats.gguf_import import GGUFFile

    f = GGUFFile(path)
    tied = "output.weight" not in f.tensors
    return sum(t.n_bytes for name, t in f.tensors.items()
               if name.endswith(".weight") and len(t.shape) == 2 and (name != "token_embd.weight" or tied))


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    stamps: list[float] = []
    n = 0
    async for chunk in sse_chunks(client, url + "/v1/completions", body):
        text = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
        if text:
            stamps.append(time.perf_counter())
            n += 1
        usage = chunk.get("usage") or {}
        if usage.get("completion_tokens"):
            n = usage["completion_tokens"]
    return {"ttft": stamps[0] - start, "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": n}


async def workload(url: str, model: str, streams: int, tokens: int, prompt: str | None = None) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, url, model, prompt or PROMPTS[i % len(PROMPTS)]
                                                     + f" ({i})", tokens) for i in range(streams)))
        wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    pick = lambda xs, q: xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]  # noqa: E731
    return {"ttft_p50": pick(ttfts, 0.5), "ttft_p99": pick(ttfts, 0.99), "itl_p50": pick(gaps, 0.5) if gaps else 0,
            "itl_p99": pick(gaps, 0.99) if gaps else 0, "tokens_per_s": sum(r["tokens"] for r in results) / wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.served_vs_llama_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-server", type=Path, help="the peer's binary (default: PATH, else --build)")
    parser.add_argument("--build", action="store_true", help="build llama-server from the sdist if not found")
    parser.add_argument("--speculation", nargs="+", choices=sorted(SPECULATION), default=None,
                        help="speculation settings to run on both sides (default: each side's own default only)")
    parser.add_argument("--long-prompt", type=int, default=0, help="TTFT of one prompt of about N tokens")
    parser.add_argument("--floor", action="store_true", help="batch-1 rates as a share of the bandwidth floor")
    parser.add_argument("--peer-flag", action="append", default=[],
                        help="flags for every llama-server start (repeatable, split at spaces; "
                        "e.g. --peer-flag='--load-mode none')")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    binary = args.llama_server or (Path(shutil.which("llama-server")) if shutil.which("llama-server") else None)
    how = "given" if args.llama_server else "found on PATH"
    if binary is None:
        if not args.build:
            raise SystemExit("no llama-server: pass --llama-server PATH or --build")
        binary, how = build_llama_server(), f"built from {SDIST}'s vendored llama.cpp"
    print(f"peer: {binary} ({how}); {args.threads} threads each, served one at a time"
          + (f"; peer flags {' '.join(args.peer_flag)}" if args.peer_flag else ""), flush=True)
    logs = REPO_ROOT / "build" / "served_vs_llama_server"
    logs.mkdir(parents=True, exist_ok=True)
    report: dict = {"peer": str(binary), "peer_how": how, "threads": args.threads, "rows": {}}
    if args.floor:
        from benchmarks.harness.machine import read_bandwidth

        report["bandwidth"] = {t: read_bandwidth(t) for t in (1, 2)}
        print("read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.2f} GB/s"
                                             for t, b in report["bandwidth"].items()), flush=True)
    settings = args.speculation or [None]  # None: each side's defaults
    for model in args.models:
        runs: dict[tuple[str, str | None], dict] = {}
        for rep in range(args.reps):
            for setting in settings:
                for side in ("ours", "llama-server"):
                    env, flags = SPECULATION[setting] if setting else ({}, [])
                    flags = [*flags, *(f for extra in args.peer_flag for f in extra.split())]
                    tag = setting or "defaults"
                    log = logs / f"{model}-{side}-{tag}-{rep}.log"
                    server = (ours(model, args.threads, log, env) if side == "ours" else
                              peer(binary, model, args.threads, max(args.streams), args.tokens + 64, log, flags))
                    with server:
                        got = runs.setdefault((side, setting), {"ready_s": [], "long_ttft": []})
                        got["ready_s"].append(server.ready_s)
                        asyncio.run(workload(server.url, model, 1, 8))  # warm up: first-call costs
                        for n in args.streams:
                            result = asyncio.run(workload(server.url, model, n, args.tokens))
                            got.setdefault(n, []).append(result)
                            print(f"{model} {side} {tag} rep {rep} {n} streams: {result['tokens_per_s']:.1f} tok/s, "
                                  f"TTFT p50 {result['ttft_p50'] * 1000:.0f} ms, "
                                  f"ITL p50 {result['itl_p50'] * 1000:.1f} ms", flush=True)
                    if args.long_prompt and setting == settings[0]:
                        # a server of its own, each side sized for one long prompt (llama-server
                        # allocates its context per slot: the streams' servers keep theirs to
                        # what a stream needs, this one to the prompt)
                        log = logs / f"{model}-{side}-long-{rep}.log"
                        server = (ours(model, args.threads, log, env) if side == "ours" else
                                  peer(binary, model, args.threads, 1, args.long_prompt + 256, log, flags))
                        with server:
                            asyncio.run(workload(server.url, model, 1, 8))
                            long = asyncio.run(workload(server.url, model, 1, 2, prompt=long_prompt(args.long_prompt)))
                        for other in settings:  # prefill does not draft: one figure serves every setting
                            runs.setdefault((side, other), {"ready_s": [], "long_ttft": []})["long_ttft"].append(
                                long["ttft_p50"])
                        print(f"{model} {side} rep {rep} ~{args.long_prompt}-token prompt: TTFT "
                              f"{long['ttft_p50'] * 1000:.0f} ms", flush=True)
        nbytes = weight_bytes_per_token(gguf_of(model)) if args.floor else 0
        pairs = [(s, s, s) for s in settings if s] or [("defaults", None, None)]
        if args.speculation and all(DEFAULTS[side] in settings for side in DEFAULTS):
            pairs.append(("defaults", DEFAULTS["ours"], DEFAULTS["llama-server"]))
        for label, mine, theirs in pairs:
            sides = {"ours": runs[("ours", mine)], "llama-server": runs[("llama-server", theirs)]}
            for n in args.streams:
                row = {side: {k: statistics.median(r[k] for r in got[n]) for k in got[n][0]}
                       for side, got in sides.items()}
                row["ratio_tokens_per_s"] = row["ours"]["tokens_per_s"] / row["llama-server"]["tokens_per_s"]
                row["ratio_ttft_p50"] = row["ours"]["ttft_p50"] / row["llama-server"]["ttft_p50"]
                o, p = row["ours"], row["llama-server"]
                floor = ""
                if nbytes and n == 1:
                    row["floor_share"] = {side: {t: nbytes * r["tokens_per_s"] / b
                                                 for t, b in report["bandwidth"].items()}
                                          for side, r in (("ours", o), ("llama-server", p))}
                    floor = " floor share (1 / 2 threads' bandwidth): ours " + " / ".join(
                        f"{v:.0%}" for v in row["floor_share"]["ours"].values()) + ", llama-server " + " / ".join(
                        f"{v:.0%}" for v in row["floor_share"]["llama-server"].values())
                report["rows"][f"{model} {label} x{n}"] = row
                print(f"| {model} | {label} | {n} | {o['tokens_per_s']:.1f} | {p['tokens_per_s']:.1f} | "
                      f"{row['ratio_tokens_per_s']:.2f}x | {o['ttft_p50'] * 1000:.0f} / {o['ttft_p99'] * 1000:.0f} | "
                      f"{p['ttft_p50'] * 1000:.0f} / {p['ttft_p99'] * 1000:.0f} | {row['ratio_ttft_p50']:.2f}x | "
                      f"{o['itl_p50'] * 1000:.1f} / {o['itl_p99'] * 1000:.1f} | "
                      f"{p['itl_p50'] * 1000:.1f} / {p['itl_p99'] * 1000:.1f} |{floor}", flush=True)
            if args.long_prompt:
                o, p = (statistics.median(g["long_ttft"]) for g in sides.values())
                report["rows"][f"{model} {label} long prompt"] = {"ours_ttft": o, "llama_server_ttft": p,
                                                                   "ratio": o / p}
                print(f"| {model} | {label} | ~{args.long_prompt}-token prompt TTFT | {o * 1000:.0f} ms | "
                      f"{p * 1000:.0f} ms | {o / p:.2f}x |", flush=True)
            ready = {side: statistics.median(g["ready_s"]) for side, g in sides.items()}
            print(f"{model} {label}: start to ready, median: ours {ready['ours']:.1f} s, "
                  f"llama-server {ready['llama-server']:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
