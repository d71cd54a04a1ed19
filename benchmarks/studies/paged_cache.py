"""The paged KV cache, measured: memory waste, long conversations in today's memory, overload
with preemption, long prompts, the decode step and shared-prefix TTFT.

    python -m benchmarks.studies.paged_cache [--sections waste conversations ...] [--json PATH]

All figures are in-process (the engine core, no HTTP): component figures. The model is the
served chat model, SmolLM2-135M-Instruct, with the service's default decode step (int8
projections, the native C++ step, a bfloat16 cache), except where a section says otherwise.

Sections:
- waste: 32 closed-loop clients, 96 chat requests (prompts 40-600 tokens, 32-256 new tokens);
  at every step, KV positions allocated but not holding a token, over all allocated.
- conversations: a pool of today's default memory (32 x 512 positions): 32 conversations of
  2,000 prompt tokens and 64 new tokens each.
- overload: 64 conversations (300-token prompts, 32 new tokens) against a pool of 10 x 340
  positions, greedy, with the float32 step and the served int8 one; outputs against the same
  requests with room for all of them, and in batches of 10 without preemption.
- long: a 6,000-token prompt (SmolLM2) and a 20,000-token one (Gemma 3 270M) prefilled in
  chunks as the engine does, the last position's logits against a full recomputation.
- decode: decode steps at batch 1 / 8 / 32 (history 256), the native and the Python step.
- prefix: 32 requests sharing a 1,000-token system prompt, added at once: TTFT p50 / p99.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.harness import REPO_ROOT

SMOLLM2 = REPO_ROOT / "weights" / "smollm2-135m-instruct"
GEMMA3 = REPO_ROOT / "weights" / "gemma3-270m"


def _load(path: Path, options=None):
    from model import load_model
    from model.decode import DecodeOptions, prepare

    ckpt = load_model(path)
    model = ckpt.model.eval()
    step = prepare(model, options or DecodeOptions(), ckpt.tokenizer)
    return ckpt, model, step


def _core(model, tokenizer, step, n_slots: int, max_len: int, pool_tokens: int | None = None, prefix: bool = False):
    from model.engine import EngineCore

    kw = {}
    if pool_tokens is not None:
        per_token = 2 * len(model.decoder_layers) * model.cfg.kv_heads * model.cfg.head_dim * \
            torch.empty((), dtype=step.kv_dtype).element_size()
        kw["kv_cache_bytes"] = (pool_tokens + 16) * per_token
    return EngineCore(model, tokenizer, n_slots=n_slots, max_len=max_len, step=step, prefix_cache=prefix, **kw)


def _drain(core, requests, on_step=None):
    """Add every request, step until done: each request's tokens and errors, and the wall time."""
    for r in requests:
        core.add(r)
    tokens: dict[str, list[int]] = defaultdict(list)  # requests added on the way (a closed loop) too
    errors = {}
    start = time.perf_counter()
    while core.has_work:
        result = core.step()
        for e in result.events:
            tokens[e.request_id] += e.token_ids
            if e.error:
                errors[e.request_id] = e.error
        if on_step is not None:
            on_step(core)
    return tokens, errors, time.perf_counter() - start


def _requests(vocab: int, n: int, prompt: tuple[int, int], new: tuple[int, int], seed: int, tag: str = ""):
    from model import SamplingParams
    from model.engine import EngineRequest

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))]
        params = SamplingParams(max_new_tokens=rng.randint(*new), temperature=0.0, ignore_eos=True)
        out.append(EngineRequest(f"{tag}{i}", ids, params))
    return out


# --- sections ------------------------------------------------------------------------------

def waste(out: dict) -> None:
    ckpt, model, step = _load(SMOLLM2)
    core = _core(model, ckpt.tokenizer, step, n_slots=32, max_len=2048)
    pending = _requests(model.cfg.vocab_size, 96, (40, 600), (32, 256), seed=1)
    held_total = alloc_total = 0
    samples = 0

    def sample(c):
        nonlocal held_total, alloc_total, samples
        seqs = c.scheduler.running + c.scheduler.prefilling
        held = sum(max(s.next_pos, s.prefilled) for s in seqs)
        held_total += held
        alloc_total += c.cache.pool.used * c.cache.block_len
        samples += 1
        in_flight = len(seqs) + len(c.scheduler.waiting) + len(c.scheduler.preempted)
        for _ in range(min(32 - in_flight, len(pending))):  # closed loop: a client sends its next request
            c.add(pending.pop(0))

    first = [pending.pop(0) for _ in range(32)]
    _, errors, wall = _drain(core, first, sample)
    out["waste"] = {"steps": samples, "paged_waste": 1 - held_total / alloc_total, "errors": len(errors),
                    "seconds": wall}
    print(f"waste: paged {out['waste']['paged_waste']:.1%} of allocated positions unused "
          f"({samples} steps, 96 requests, {wall:.0f} s)", flush=True)


def conversations(out: dict) -> None:
    ckpt, model, step = _load(SMOLLM2)
    core = _core(model, ckpt.tokenizer, step, n_slots=32, max_len=8192, pool_tokens=32 * 512)
    reqs = _requests(model.cfg.vocab_size, 32, (2000, 2000), (64, 64), seed=2)
    peak = 0

    def watch(c):
        nonlocal peak
        peak = max(peak, len(c.scheduler.running))

    tokens, errors, wall = _drain(core, reqs, watch)
    done = sum(1 for k, v in tokens.items() if len(v) == 64 and k not in errors)
    out["conversations"] = {"completed": done, "of": 32, "peak_concurrent_decoding": peak,
                            "preemptions": core.scheduler.preemptions, "seconds": wall,
                            "generated_tokens_per_s": 32 * 64 / wall}
    print(f"conversations: {done}/32 conversations of 2,000 + 64 tokens completed in the memory of 32 x 512 "
          f"positions; up to {peak} decoding at once, "
          f"{core.scheduler.preemptions} preemptions, {wall:.0f} s", flush=True)


def overload(out: dict) -> None:
    """64 requests against a pool of 10 x 340 positions, greedy, for two decode steps: the float32
    reference step and the served one (int8). Each against the same requests with room for all
    64 at once, and in batches of at most 10 with room (no preemption): the int8 step quantizes
    each step's activations over the whole batch, so its rows depend slightly on their batch."""
    from model.decode import DecodeOptions

    rows = {}
    for label, options in (("float32 python step", DecodeOptions.reference()), ("served int8 step", DecodeOptions())):
        ckpt, model, step = _load(SMOLLM2, options)
        runs, preemptions, errors, seconds = {}, 0, {}, {}
        for name, slots, pool in (("room for 64", 64, None), ("batches of 10", 10, None),
                                  ("pool of 10 x 340", 64, 10 * 340)):
            core = _core(model, ckpt.tokenizer, step, n_slots=slots, max_len=1024, pool_tokens=pool)
            runs[name], err, seconds[name] = _drain(core, _requests(model.cfg.vocab_size, 64, (300, 300), (32, 32),
                                                                    seed=3))
            errors.update(err)
            preemptions += core.scheduler.preemptions
        same = {f"{a} = {b}": sum(runs[a][k] == runs[b][k] for k in runs[a])
                for a, b in (("pool of 10 x 340", "batches of 10"), ("pool of 10 x 340", "room for 64"),
                             ("batches of 10", "room for 64"))}
        rows[label] = {"errors": len(errors), "preemptions": preemptions, "identical_of_64": same,
                       "seconds": seconds}
        print(f"overload, {label} ({step.name}): {len(errors)} errors, {preemptions} preemptions; identical outputs "
              "of 64: " + ", ".join(f"{k}: {v}" for k, v in same.items()) +
              "; seconds " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()), flush=True)
        del model, ckpt, step
    out["overload"] = rows


def long_prompts(out: dict) -> None:
    from model.decode import DecodeOptions

    rows = {}
    for name, path, n in (("smollm2 6,000", SMOLLM2, 6000), ("gemma3 20,000", GEMMA3, 20000)):
        ckpt, model, step = _load(path, DecodeOptions())
        rng = random.Random(n)
        ids = [rng.randrange(100, model.cfg.vocab_size) for _ in range(n)]
        with torch.inference_mode():
            cache = model.new_cache(1, n + 16, dtype=step.kv_dtype)
            start = time.perf_counter()
            for s in range(0, n, 2048):  # TSERVE_MAX_PREFILL_TOKENS's chunks
                logits = model.prefill(cache, [ids[s:s + 2048]], [0], starts=[s])[0]
            chunked = time.perf_counter() - start
            full = model.lm_head(model.hidden_states(torch.tensor([ids]))[:, -1])[0].float()  # not 20k x 262k logits
        diff = float((logits - full).abs().max() / (full.max() - full.min()))
        rows[name] = {"max_abs_diff_over_range": diff, "same_argmax": int(logits.argmax()) == int(full.argmax()),
                      "prefill_seconds": chunked, "context": model.cfg.max_positions}
        print(f"long: {name}-token prompt: last logits vs full recomputation max |diff| = {diff:.2e} of the range, "
              f"argmax {'equal' if rows[name]['same_argmax'] else 'DIFFERENT'}; chunked prefill {chunked:.0f} s",
              flush=True)
        del model, ckpt, step, cache
    out["long"] = rows


def decode(out: dict) -> None:
    from model.decode import PythonStep

    ckpt, model, native = _load(SMOLLM2)
    rows = {}
    for label, step in (("native", native), ("python", PythonStep(model, attention=None))):
        for b in (1, 8, 32):
            cache = model.new_cache(b, 512, dtype=step.kv_dtype)
            rng = random.Random(b)
            prompts = [[rng.randrange(100, model.cfg.vocab_size) for _ in range(256)] for _ in range(b)]
            with torch.inference_mode():
                tokens = model.prefill(cache, prompts, list(range(b))).argmax(-1)
                times = []
                for i in range(40):
                    t0 = time.perf_counter()
                    logits = step(cache, tokens, list(range(b)), [256 + i] * b)
                    times.append(time.perf_counter() - t0)
                    tokens = logits.argmax(-1)
            rows[f"{label} b{b}"] = statistics.median(times[5:]) * 1000
            print(f"decode: {label} step, batch {b}, history 256: {rows[f'{label} b{b}']:.2f} ms (median of 35)",
                  flush=True)
    out["decode_ms"] = rows


def prefix(out: dict) -> None:
    from model import SamplingParams
    from model.engine import EngineRequest

    ckpt, model, step = _load(SMOLLM2)
    rng = random.Random(4)
    system = [rng.randrange(100, model.cfg.vocab_size) for _ in range(1000)]
    p50s, p99s = [], []
    for rep in range(3):
        core = _core(model, ckpt.tokenizer, step, n_slots=32, max_len=1200, prefix=True)
        reqs = [EngineRequest(f"{rep}-{i}", system + [rng.randrange(100, 5000) for _ in range(12)],
                              SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)) for i in range(32)]
        for r in reqs:
            core.add(r)
        start, ttft = time.perf_counter(), {}
        while core.has_work:
            for e in core.step().events:
                if e.token_ids and e.request_id not in ttft:
                    ttft[e.request_id] = time.perf_counter() - start
        xs = sorted(ttft.values())
        p50s.append(statistics.median(xs))
        p99s.append(xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))])
    out["prefix_ttft"] = {"p50": statistics.median(p50s), "p99": statistics.median(p99s)}
    print(f"prefix: 32 requests sharing a 1,000-token system prompt: TTFT p50 {out['prefix_ttft']['p50']:.2f} s, "
          f"p99 {out['prefix_ttft']['p99']:.2f} s (median of 3 bursts)", flush=True)


SECTIONS = {"waste": waste, "conversations": conversations, "overload": overload, "long": long_prompts,
            "decode": decode, "prefix": prefix}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.paged_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
    out: dict = {"revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                            text=True).stdout.strip(), "threads": torch.get_num_threads()}
    for name in args.sections:
        SECTIONS[name](out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
