"""7. The real chat model (SmolLM2-135M-Instruct, the GGUF that weights/smollm2-135m-instruct
names): ours against transformers on the dequantized weights and against llama.cpp on the
GGUF itself (Q4_1), same machine, same threads.

- batch-1 decode: (t(N) - t(1)) / (N - 1) per token, greedy, prompt of ``chat_prompt_len``;
- prompt processing: a ``chat_prefill_len``-token prompt and one new token;
- 32 streams: 32 prompts decoded together (our engine core with 32 slots; llama.cpp with 32
  sequences in each ``llama_decode`` batch, as its server's ``--parallel 32`` does).
Each row names each side's weight format. Token agreement with transformers (float32) must
be exact; with llama.cpp (4-bit arithmetic) it is reported, not required.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import llama_cpp_peer
from benchmarks.config import BenchConfig
from benchmarks.decode import compare_tokens, step_time
from benchmarks.report import Row, RunReport, SectionSkipped, Target, say
from benchmarks.timing import time_interleaved
from benchmarks.workspace import Workspace
from model import SamplingParams, generate, load_model
from model.int8 import quantize_int8_
from model.manifest import locate, read_manifest

MANIFEST = Path("weights/smollm2-135m-instruct")
WORKLOAD = "SmolLM2-135M-Instruct"


def _ours(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in generate(model, prompts, params)]


def _hf(hf_model, prompts: list[list[int]], n: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, num_beams=1, pad_token_id=0)
    return out[:, ids.size(1):].tolist()


def _load(cfg: BenchConfig):
    try:
        gguf = locate(read_manifest(MANIFEST))
    except Exception as exc:  # noqa: BLE001 - any reason the package is not there
        raise SectionSkipped(f"the chat model's weights are not installed ({exc})") from None
    import transformers

    ours = load_model(MANIFEST).model.eval()
    ours.optimize_for_inference()
    int8 = load_model(MANIFEST).model.eval()
    quantize_int8_(int8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           torch_dtype=torch.float32).eval()
    peer = (llama_cpp_peer.LlamaCppBatch(str(gguf), cfg.threads, n_ctx=4096, n_seq=cfg.chat_streams)
            if llama_cpp_peer.available() else None)
    return ours, int8, hf, peer


def _prompts(b: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (b, length), generator=g).tolist()


def _batch1(report: RunReport, section: str, cfg: BenchConfig, sides: dict, n: int) -> None:
    prompts = _prompts(1, cfg.chat_prompt_len, 49152, cfg.seed)
    fns = {}
    for name, fn in sides.items():
        fns[name] = lambda fn=fn: fn(prompts, n)
        fns[name + "_1"] = lambda fn=fn: fn(prompts, 1)
    stats, outs = time_interleaved(fns, cfg.repetitions, warmups={k: (lambda f=f: f(prompts, 4))
                                                                   for k, f in sides.items()})
    steps = {name: step_time(stats[name], stats[name + "_1"], n).map(lambda s: 1.0 / s) for name in sides}
    work = f"{WORKLOAD}, batch 1, prompt {cfg.chat_prompt_len}, {n} new, greedy"
    exact = compare_tokens(outs["ours fp32"], outs["transformers fp32"], None, "chat batch 1")
    report.rows.append(Row(section, work, "decode tokens/s", steps["ours fp32"], peer="transformers (fp32)",
                           peer_value=steps["transformers fp32"], check=exact, target=Target(">=", 3.0, text="≥ 3×"),
                           note="ours fp32 (GGUF dequantized) vs transformers fp32, same weights"))
    report.rows.append(Row(section, work, "decode tokens/s", steps["ours int8"], peer="transformers (fp32)",
                           peer_value=steps["transformers fp32"],
                           check=compare_tokens(outs["ours int8"], outs["transformers fp32"], None, "int8",
                                                exact=False),
                           note="ours int8 dynamic (weights per-channel int8) vs transformers fp32"))
    if "llama.cpp" in sides:
        for name in ("ours fp32", "ours int8"):
            report.rows.append(Row(
                section, work, "decode tokens/s", steps[name], peer="llama.cpp (GGUF Q4_1)",
                peer_value=steps["llama.cpp"],
                check=compare_tokens(outs[name], outs["llama.cpp"], None, "llama.cpp", exact=False),
                note=f"{name.split()[1]} weights vs llama.cpp's own 4-bit kernels on the same file"))
    say(f"{section}: batch-1 decode tok/s " + ", ".join(f"{k} {v.median:.1f}" for k, v in steps.items()))


def _prefill(report: RunReport, section: str, cfg: BenchConfig, sides: dict) -> None:
    prompts = _prompts(1, cfg.chat_prefill_len, 49152, cfg.seed + 1)
    stats, _ = time_interleaved({k: (lambda f=f: f(prompts, 1)) for k, f in sides.items()}, cfg.repetitions)
    rate = {k: v.map(lambda t: cfg.chat_prefill_len / t) for k, v in stats.items()}
    work = f"{WORKLOAD}, one {cfg.chat_prefill_len}-token prompt + 1 token"
    for peer in [p for p in ("transformers fp32", "llama.cpp") if p in sides]:
        report.rows.append(Row(section, work, "prompt tokens/s", rate["ours fp32"], peer=peer,
                               peer_value=rate[peer], note="ours fp32"))
    say(f"{section}: prompt tok/s " + ", ".join(f"{k} {v.median:.0f}" for k, v in rate.items()))


def _streams(report: RunReport, section: str, cfg: BenchConfig, sides: dict, n: int) -> None:
    b = cfg.chat_streams
    prompts = _prompts(b, cfg.chat_prompt_len, 49152, cfg.seed + 2)
    wanted = {k: f for k, f in sides.items() if k != "transformers fp32"}
    stats, outs = time_interleaved({k: (lambda f=f: f(prompts, n)) for k, f in wanted.items()}, cfg.repetitions,
                                   warmups={k: (lambda f=f: f(prompts, 2)) for k, f in wanted.items()})
    rate = {k: v.map(lambda t: b * n / t) for k, v in stats.items()}
    work = f"{WORKLOAD}, {b} streams decoded together, prompt {cfg.chat_prompt_len}, {n} new"
    if "llama.cpp" in wanted:
        for name in ("ours fp32", "ours int8"):
            report.rows.append(Row(section, work, "aggregate tokens/s", rate[name], peer=f"llama.cpp (Q4_1, {b} seqs)",
                                   peer_value=rate["llama.cpp"], target=Target(">=", 1.0, text="≥ 1×"),
                                   check=compare_tokens(outs[name], outs["llama.cpp"], None, "streams", exact=False),
                                   note=f"{name}: engine core, 32 slots (prefill included, no HTTP on either side)"))
    say(f"{section}: {b} streams tok/s " + ", ".join(f"{k} {v.median:.1f}" for k, v in rate.items()))


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    section = "7. chat model"
    ours, int8, hf, peer = _load(cfg)
    sides = {"ours fp32": lambda p, n: _ours(ours, p, n), "ours int8": lambda p, n: _ours(int8, p, n),
             "transformers fp32": lambda p, n: _hf(hf, p, n)}
    if peer is not None:
        sides["llama.cpp"] = peer.generate
    else:
        say(f"{section}: llama-cpp-python not installed: llama.cpp rows left out")
    n = cfg.chat_new_tokens
    _batch1(report, section, cfg, sides, n)
    _prefill(report, section, cfg, sides)
    _streams(report, section, cfg, sides, n)
