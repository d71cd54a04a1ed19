"""Speculative decoding (prompt lookup) as a user sees it: ``python -m service`` through HTTP,
with ``TSERVE_SPECULATIVE=ngram`` against ``off``, one request at a time (batch 1).

    python -m benchmarks.studies.speculative [--model smollm2-135m-instruct] [--tokens 256] [--reps 3]

Two kinds of work, greedy chat completions:
- input-grounded: a code edit, a JSON extraction from a document, a spelling fix of a paragraph
  (the answer repeats long spans of the prompt: what prompt lookup is for);
- open-ended: a story and an explanation (little to look up: drafting must not slow it).

The two servers run one at a time (never both: they would share the cores), alternated ON,
OFF, ON, OFF... ``reps`` times; each prompt's figure is the median tokens/s (completion tokens
over the request's wall time, through HTTP). Also printed: the share of drafted tokens kept
(``tserve_spec_*`` counters) and whether the greedy answers are the same with and without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness.server_process import ServerProcess, metric_total, service_process

CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] == "cancelled":
            continue
        total += order["price"] * order["quantity"]
        count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
'''

DOCUMENT = """From: Maria Keller <maria.keller@example.org>
Date: 3 March 2026
Subject: Order 48213 arrived damaged

Hello, my order number 48213 arrived yesterday, but the blue ceramic teapot was broken and the
two tea cups were fine. I paid 54.90 euros by credit card. Please send a replacement teapot to
Lindenstrasse 12, 10115 Berlin, or refund the teapot. My phone number is +49 30 1234567.
Best regards, Maria Keller"""

PARAGRAPH = ("The comittee met on tuesday to discus the new libary budget. Most members agreed that the "
             "childrens section needs more books, and that the opening hours should be extented on weekends. "
             "The treasurer warned that the heating sytem will have to be replaced next year, wich could cost "
             "more then the entire book budget.")

GROUNDED = {
    "code edit": f"Rename the variable `total` to `revenue` in this Python function and return the whole "
                 f"function:\n\n```python\n{CODE}```",
    "JSON extraction": f"Read this email and return a JSON object with the fields name, email, order_number, "
                       f"amount and address, copying the values from the email:\n\n{DOCUMENT}",
    "spelling fix": f"Correct the spelling mistakes in this paragraph and return the corrected paragraph:\n\n"
                    f"{PARAGRAPH}",
}
OPEN = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "explanation": "Explain why the sky is blue to a ten-year-old, in a few paragraphs.",
}


def start(model: str, method: str, threads: int, log: Path) -> ServerProcess:
    env = {"TSERVE_MODELS": model, "TSERVE_TORCH_THREADS": str(threads), "TSERVE_LOG_LEVEL": "warning",
           "TSERVE_SPECULATIVE": method}
    return service_process(log, env=env, ready_timeout_s=900)


def ask(server: ServerProcess, model: str, prompt: str, tokens: int) -> tuple[float, str]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0}
    start_t = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)
    wall = time.perf_counter() - start_t
    r.raise_for_status()
    data = r.json()
    return data["usage"]["completion_tokens"] / wall, data["choices"][0]["message"]["content"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.speculative",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    prompts = {**GROUNDED, **OPEN}
    speed: dict[str, dict[str, list[float]]] = {m: {p: [] for p in prompts} for m in ("ngram", "off")}
    answers: dict[str, dict[str, str]] = {"ngram": {}, "off": {}}
    kept: dict[str, list[float]] = {p: [] for p in prompts}
    logs = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    for rep in range(args.reps):
        for method in ("ngram", "off"):
            with start(args.model, method, args.threads, logs / f"{method}-{rep}.log") as server:
                ask(server, args.model, "Hello!", 8)  # warm
                for name, prompt in prompts.items():
                    before = httpx.get(server.url + "/metrics").text
                    tps, text = ask(server, args.model, prompt, args.tokens)
                    after = httpx.get(server.url + "/metrics").text
                    speed[method][name].append(tps)
                    answers[method].setdefault(name, text)
                    if method == "ngram":
                        drafted = metric_total(after, "tserve_spec_draft_tokens_total") - \
                            metric_total(before, "tserve_spec_draft_tokens_total")
                        accepted = metric_total(after, "tserve_spec_accepted_tokens_total") - \
                            metric_total(before, "tserve_spec_accepted_tokens_total")
                        kept[name].append(accepted / drafted if drafted else 0.0)
    print(f"# speculative decoding, served: {args.model}, greedy, {args.tokens} tokens max, batch 1, "
          f"{args.reps} reps alternated, {args.threads} threads")
    print("| prompt | kind | off tok/s | ngram tok/s | ratio | drafts kept | same answer |")
    print("|---|---|---|---|---|---|---|")
    for name in prompts:
        off, on = statistics.median(speed["off"][name]), statistics.median(speed["ngram"][name])
        kind = "input-grounded" if name in GROUNDED else "open-ended"
        same = answers["ngram"][name] == answers["off"][name]
        print(f"| {name} | {kind} | {off:.1f} | {on:.1f} | **{on / off:.2f}×** | "
              f"{statistics.median(kept[name]):.0%} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
