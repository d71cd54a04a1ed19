"""Draft-model speculative decoding (issue 41 §4) on Qwen2.5-Coder 1.5B with the 0.5B as its
draft, against our own server without a draft and against llama-server with and without one.

    python -m benchmarks.studies.draft_model [--streams 1 4] [--tokens 128] [--reps 3]
        [--target FILE.gguf] [--draft FILE.gguf] [--llama-server PATH] [--json OUT]
    python -m benchmarks.studies.draft_model --in-process [--tokens 64] [--prompts 2]

Through HTTP, one server at a time (each alone on the cores), alternated within each repetition:
- ``ours off``: ``python -m service`` with ``TSERVE_SPECULATIVE=off``;
- ``ours ngram``: ``TSERVE_SPECULATIVE=ngram`` (prompt lookup, our default);
- ``ours draft``: ``TSERVE_SPECULATIVE=draft``, ``TSERVE_DRAFT_MODEL=<target>=<draft file>``;
- ``llama-server``: ``-m target`` alone;
- ``llama-server draft``: ``-m target -md draft --spec-type draft-simple --spec-draft-n-max 4`` (our
  ``TSERVE_SPECULATIVE_TOKENS`` default is 4 too).
Each workload is ``n`` concurrent streamed ``/v1/chat/completions`` requests (code-writing
prompts, Qwen's chat template on both sides, greedy, ``max_tokens`` tokens). Reported per side
and stream count: medians of tokens/s, TTFT p50 and ITL p50 over the repetitions, ratios against
``ours off`` and ``llama-server``, and the acceptance rate (ours: the drafted and accepted
counters of ``/metrics``, their growth over the measured workloads; llama-server: its
``draft_n`` / ``draft_n_accepted`` timings, where it reports them).

``--in-process``: no server; the engine core with and without the draft over a few prompts
(greedy): whether the tokens are equal, drafts, acceptance and engine steps per token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.load_generator import sse_chunks
from benchmarks.harness.server_process import ServerProcess, free_port, metric_total, service_process

GGUF = Path("/work/tools/gguf")
TARGET = GGUF / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = GGUF / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
LLAMA_SERVER = Path("/work/tools/llama.cpp/build/bin/llama-server")
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
           "Write a Python class for a stack with push, pop, peek and is_empty methods.",
           "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
           "Write a Python function that merges two sorted lists into one sorted list.",
           "Write a JavaScript function that debounces another function.",
           "Write a Python function that counts the words in a text file and returns the ten most common.",
           "Write a SQL query that returns the five customers with the highest total order amount.",
           "Write a Python function that parses a date string in ISO format and returns the weekday name."]
SIDES = ("ours off", "ours ngram", "ours draft", "llama-server", "llama-server draft")


def ours(side: str, target: Path, draft: Path, threads: int, log: Path) -> ServerProcess:
    env = {"TSERVE_MODELS": str(target), "TSERVE_TORCH_THREADS": str(threads), "TSERVE_LOG_LEVEL": "warning",
           "TSERVE_SPECULATIVE": side.split()[1]}
    if side == "ours draft":
        env["TSERVE_DRAFT_MODEL"] = f"{target.name.removesuffix('.gguf')}={draft}"
    return service_process(log, env=env, ready_timeout_s=900)


def peer(side: str, binary: Path, target: Path, draft: Path, threads: int, parallel: int, ctx: int,
         log: Path) -> ServerProcess:
    port = free_port()
    argv = [str(binary), "-m", str(target), "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "--parallel", str(parallel), "-c", str(parallel * ctx), "--no-webui", "--jinja"]
    if side == "llama-server draft":
        # an explicit type: a plain draft GGUF names none, and the default type is none (no drafting)
        argv += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "-td", str(threads),
                 "-tbd", str(threads)]
    return ServerProcess(argv, log, port=port, ready_path="/health", ready_timeout_s=900)


async def chat_one(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps: list[float] = []
    n, draft = 0, {}
    async for chunk in sse_chunks(client, url + "/v1/chat/completions", body):
        choices = chunk.get("choices") or []
        if choices and (choices[0].get("delta") or {}).get("content"):
            stamps.append(time.perf_counter())
            n += 1
        usage = chunk.get("usage") or {}
        n = usage.get("completion_tokens") or n
        timings = chunk.get("timings") or {}  # llama-server's per-request figures
        if "draft_n" in timings:
            draft = {"drafted": timings["draft_n"], "accepted": timings.get("draft_n_accepted", 0)}
    return {"ttft": stamps[0] - start, "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": n,
            **draft}


async def workload(url: str, model: str, streams: int, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=streams + 4)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(chat_one(client, url, model, PROMPTS[i % len(PROMPTS)], tokens)
                                         for i in range(streams)))
        wall = time.perf_counter() - start
    gaps = sorted(g for r in results for g in r["gaps"])
    out = {"tokens_per_s": sum(r["tokens"] for r in results) / wall,
           "ttft_p50": statistics.median(r["ttft"] for r in results),
           "itl_p50": statistics.median(gaps) if gaps else 0.0}
    if all("drafted" in r for r in results):
        out["drafted"] = sum(r["drafted"] for r in results)
        out["accepted"] = sum(r["accepted"] for r in results)
    return out


def counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return metric_total(text, "tserve_spec_draft_tokens_total"), metric_total(text, "tserve_spec_accepted_tokens_total")


def served(args) -> None:
    logs = REPO_ROOT / "build" / "draft_model"
    logs.mkdir(parents=True, exist_ok=True)
    name = args.target.name.removesuffix(".gguf")
    runs: dict[str, dict[int, list[dict]]] = {side: {} for side in args.sides}
    print(f"target {args.target.name}, draft {args.draft.name}; {args.threads} threads; one server at a time",
          flush=True)
    for rep in range(args.reps):
        for side in args.sides:
            log = logs / f"{side.replace(' ', '-')}-{rep}.log"
            server = (ours(side, args.target, args.draft, args.threads, log) if side.startswith("ours") else
                      peer(side, args.llama_server, args.target, args.draft, args.threads, max(args.streams),
                           args.tokens + 256, log))
            with server:
                asyncio.run(workload(server.url, name, 1, 8))  # warm up: first-call costs
                for n in args.streams:
                    before = counters(server.url) if side.startswith("ours") else None
                    result = asyncio.run(workload(server.url, name, n, args.tokens))
                    if before is not None:
                        after = counters(server.url)
                        result["drafted"], result["accepted"] = after[0] - before[0], after[1] - before[1]
                    runs[side].setdefault(n, []).append(result)
                    rate = (f", accepted {result['accepted']:.0f}/{result['drafted']:.0f}"
                            if result.get("drafted") else "")
                    print(f"rep {rep} {side} {n} streams: {result['tokens_per_s']:.2f} tok/s, TTFT p50 "
                          f"{result['ttft_p50'] * 1000:.0f} ms, ITL p50 {result['itl_p50'] * 1000:.1f} ms{rate}",
                          flush=True)
    report = {"target": str(args.target), "draft": str(args.draft), "threads": args.threads, "rows": {}}
    print("\n| side | streams | tok/s | vs ours off | vs llama-server | TTFT p50 ms | ITL p50 ms | accepted |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.streams:
        med = {side: {k: statistics.median(r[k] for r in runs[side][n]) for k in ("tokens_per_s", "ttft_p50",
                                                                                     "itl_p50")}
               for side in args.sides}
        for side in args.sides:
            row = med[side]
            drafted = sum(r.get("drafted", 0) for r in runs[side][n])
            accepted = sum(r.get("accepted", 0) for r in runs[side][n])
            row["acceptance"] = accepted / drafted if drafted else None
            base = {k: med[k]["tokens_per_s"] for k in ("ours off", "llama-server") if k in med}
            ratios = [f"{row['tokens_per_s'] / base[k]:.2f}x" if k in base else "-" for k in ("ours off",
                                                                                               "llama-server")]
            acc = f"{row['acceptance']:.0%} of {drafted:.0f}" if drafted else "-"
            print(f"| {side} | {n} | {row['tokens_per_s']:.2f} | {ratios[0]} | {ratios[1]} | "
                  f"{row['ttft_p50'] * 1000:.0f} | {row['itl_p50'] * 1000:.1f} | {acc} |", flush=True)
            report["rows"][f"{side} x{n}"] = row
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def in_process(args) -> None:
    """The engine core with and without the draft, greedy, over ``--prompts`` prompts one at a time."""
    import torch

    from model import EngineCore, EngineRequest, SamplingParams, load_model
    from model.decode import DecodeOptions, prepare
    from model.engine.draft_model import check_vocabulary
    from model.engine.speculative import SpeculativeConfig
    from model.tokenization.chat_template import ChatTemplate

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target, draft = load_model(args.target), load_model(args.draft)
    check_vocabulary(args.target.name, target, args.draft.name, draft)
    steps = {}
    for name, ckpt in (("target", target), ("draft", draft)):
        steps[name] = prepare(ckpt.model, DecodeOptions(), ckpt.tokenizer)
    print(f"loaded and prepared in {time.perf_counter() - t0:.0f} s; steps {steps['target'].name} / "
          f"{steps['draft'].name}", flush=True)
    cfg = target.config
    chat = ChatTemplate(target.chat_template, bos_token=None, eos_token=target.tokenizer.id_to_token(cfg.eos_token_id))
    cores = {"plain": EngineCore(target.model, target.tokenizer, 1, 2048, step=steps["target"]),
             "draft": EngineCore(target.model, target.tokenizer, 1, 2048, step=steps["target"],
                                 speculative=SpeculativeConfig("draft", args.draft_tokens),
                                 draft=draft.model, draft_step=steps["draft"])}
    print(f"draft cost estimate: {cores['draft'].draft.cost:.3f} of a target step", flush=True)
    totals = {k: {"tokens": 0, "steps": 0, "seconds": 0.0} for k in cores}
    equal = 0
    for i, prompt in enumerate(PROMPTS[:args.prompts]):
        text = chat.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = target.tokenizer.encode(text, add_special_tokens=False)
        outs = {}
        for kind in ("plain", "draft"):
            core = cores[kind]
            core.add(EngineRequest(f"{kind}{i}", ids, SamplingParams(max_new_tokens=args.tokens, temperature=0.0)))
            toks, n, start = [], 0, time.perf_counter()
            while core.has_work:
                for e in core.step().events:
                    toks += e.token_ids
                n += 1
            totals[kind]["seconds"] += time.perf_counter() - start
            totals[kind]["tokens"] += len(toks)
            totals[kind]["steps"] += n
            outs[kind] = toks
        equal += outs["plain"] == outs["draft"]
        print(f"prompt {i}: {len(outs['plain'])} tokens, equal {outs['plain'] == outs['draft']}; drafted "
              f"{cores['draft'].drafted_tokens}, accepted {cores['draft'].accepted_tokens} so far", flush=True)
    d = cores["draft"]
    for kind, t in totals.items():
        print(f"{kind}: {t['tokens']} tokens in {t['steps']} steps, {t['tokens'] / t['seconds']:.2f} tok/s")
    rate = d.accepted_tokens / d.drafted_tokens if d.drafted_tokens else 0.0
    speed = {k: t["tokens"] / t["seconds"] for k, t in totals.items()}
    print(f"equal outputs {equal}/{args.prompts}; drafted {d.drafted_tokens}, accepted {d.accepted_tokens} "
          f"({rate:.0%}); speed ratio draft/plain {speed['draft'] / speed['plain']:.2f}x (in-process, loaded host)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.draft_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--draft", type=Path, default=DRAFT)
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--in-process", action="store_true", help="the engine core, no server (see above)")
    parser.add_argument("--prompts", type=int, default=2, help="--in-process: prompts run")
    parser.add_argument("--draft-tokens", type=int, default=4, help="--in-process: drafts per step at most")
    args = parser.parse_args(argv)
    if args.in_process:
        in_process(args)
    else:
        served(args)


if __name__ == "__main__":
    main()
