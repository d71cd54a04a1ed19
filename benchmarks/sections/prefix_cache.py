"""9. Prefix cache: time to first token of a burst of chat requests that share a system prompt.

``prefix_streams`` chat requests (SmolLM2-135M-Instruct's own template; a ``prefix_system_len``
token system prompt, a different short user message each) are added to an engine core at
once, and the core steps until every one has its first token; each request's TTFT is the
time from the burst to the end of the step that produced its token. Measured on the engine
core directly (no HTTP), with the prefix cache off and on (256 MiB, the service default):
- cold: the burst is the first traffic to see the system prompt (one request computes it,
  the others wait one step and copy it);
- warm: one earlier request with the same system prompt has left it in the cache.
The first tokens must be the same with and without the cache (greedy).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.report import Row, RunReport, SectionSkipped, Target, say
from benchmarks.harness.timing import Stat
from benchmarks.harness.workspace import Workspace
from model import SamplingParams, load_model
from model.engine import EngineCore, EngineRequest
from model.formats.manifest import locate, read_manifest
from model.tokenization.chat_template import ChatTemplate

MANIFEST = Path("weights/smollm2-135m-instruct")
WORKLOAD = "SmolLM2-135M-Instruct"
SYSTEM_SENTENCES = [
    "You are a helpful, careful assistant for the customer support team of a software company.",
    "Answer in plain English, in at most three short paragraphs, and never invent product features.",
    "When the user reports a bug, ask for the version, the operating system and the exact error message.",
    "When the user asks about billing, explain the plans briefly and point to the account settings page.",
    "Be polite, stay on topic, and say so when you do not know the answer instead of guessing.",
]
QUESTIONS = ["How do I reset my password?", "The app crashes on start.", "Can I change my plan?",
             "Where are my invoices?", "Is there a dark mode?", "How do I export my data?",
             "Why is sync so slow?", "Can I add a second user?"]


def _load():
    try:
        locate(read_manifest(MANIFEST))
    except Exception as exc:  # noqa: BLE001 - any reason the package is not there
        raise SectionSkipped(f"the chat model's weights are not installed ({exc})") from None
    ckpt = load_model(MANIFEST)
    ckpt.model.eval().optimize_for_inference()
    return ckpt


def _system_prompt(tokenizer, length: int) -> str:
    """Support instructions cycled until they are ``length`` tokens long."""
    words: list[str] = []
    i = 0
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < length:
        words += SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)].split()
        i += 1
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > length:
        words.pop()
    return " ".join(words)


def _prompts(ckpt, cfg: BenchConfig, system: str) -> list[list[int]]:
    tok = ckpt.tokenizer
    template = ChatTemplate(ckpt.chat_template, bos_token=tok.id_to_token(ckpt.config.bos_token_id),
                            eos_token=tok.id_to_token(ckpt.config.eos_token_id))
    out = []
    for i in range(cfg.prefix_streams):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {1000 + i})"
        text = template.render([{"role": "system", "content": system}, {"role": "user", "content": question}])
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def burst_ttft(core: EngineCore, prompts: list[list[int]], tag: str) -> tuple[list[float], list[int], int]:
    """Add every prompt at once; step until each has a token. (TTFTs in s, first tokens, steps)."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add(EngineRequest(f"{tag}{i}", p, params))
    ttft: dict[str, float] = {}
    first: dict[str, int] = {}
    steps = 0
    while len(ttft) < len(prompts):
        events = core.step().events
        steps += 1
        now = time.perf_counter() - start
        for e in events:
            if e.token_ids and e.request_id not in ttft:
                ttft[e.request_id], first[e.request_id] = now, e.token_ids[0]
    for i in range(len(prompts)):  # the rest of their tokens are not timed
        core.abort(f"{tag}{i}")
    order = [f"{tag}{i}" for i in range(len(prompts))]
    return [ttft[k] for k in order], [first[k] for k in order], steps


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def _measure(ckpt, prompts: list[list[int]], cached: bool, warm: bool, reps: int):
    """Per repetition: a fresh core (an empty prefix cache), optionally warmed by one request
    with the same system prompt, then the timed burst."""
    p50s, p99s, firsts, steps = [], [], None, 0
    max_len = max(map(len, prompts)) + 16
    for rep in range(reps):
        core = EngineCore(ckpt.model, ckpt.tokenizer, n_slots=len(prompts), max_len=max_len, prefix_cache=cached)
        if warm:
            burst_ttft(core, prompts[:1], f"w{rep}-")
        ttfts, firsts, steps = burst_ttft(core, prompts, f"r{rep}-")
        p50s.append(statistics.median(ttfts))
        p99s.append(p99(ttfts))
    return Stat.of(p50s), Stat.of(p99s), firsts, steps


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    section = "9. prefix cache"
    ckpt = _load()
    system = _system_prompt(ckpt.tokenizer, cfg.prefix_system_len)
    prompts = _prompts(ckpt, cfg, system)
    lengths = sorted(map(len, prompts))
    say(f"{section}: {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens "
        f"({cfg.prefix_system_len}-token system prompt)")
    burst_ttft(EngineCore(ckpt.model, ckpt.tokenizer, 2, max(lengths) + 16), prompts[:2], "warmup")  # first-call costs
    work = (f"{WORKLOAD}, {len(prompts)} chat requests at once, shared {cfg.prefix_system_len}-token system prompt, "
            f"engine core")
    off = _measure(ckpt, prompts, False, False, cfg.repetitions)
    say(f"{section}: cache off: TTFT p50 {off[0].median:.2f} s, p99 {off[1].median:.2f} s ({off[3]} steps)")
    for label, warm in (("cold", False), ("warm", True)):
        on = _measure(ckpt, prompts, True, warm, cfg.repetitions)
        same = "first tokens identical" if on[2] == off[2] else \
            f"MISMATCH: {sum(a != b for a, b in zip(on[2], off[2]))} first tokens differ"
        say(f"{section}: cache on ({label}): TTFT p50 {on[0].median:.2f} s, p99 {on[1].median:.2f} s "
            f"({on[3]} steps); p50 ratio {off[0].median / on[0].median:.2f}x, {same}")
        for i, metric in enumerate(("TTFT p50 (s)", "TTFT p99 (s)")):
            report.rows.append(Row(section, work, metric, on[i], higher_is_better=False,
                                   peer="prefix cache off", peer_value=off[i], check=same,
                                   target=Target("<", 1 / 3 + 1e-9, text="≥ 3× lower p50 (ratio ≤ 1/3)")
                                   if i == 0 else None,
                                   note=f"prefix cache on, {label} (256 MiB)"))
