"""1. Decode throughput of the decoder-only model: ours vs transformers ``generate()``.

Both sides run the same imported GPT-2 weights on the same random prompts, greedy, for
exactly ``decode_new_tokens`` tokens (ours: ``ignore_eos``; transformers: ``min_new_tokens``).
tokens/s covers the whole call (prefill included); the per-token latency is the decode
step alone: (time for N tokens - time for 1 token) / (N - 1), which removes the prefill.

The floor: a decode step must read every weight once (the tied embedding matrix as the
LM head; the position table only one row), so weight bytes / measured memory bandwidth
is a lower bound on the step time at small batch.
"""

from __future__ import annotations

import torch

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.generation import compare_tokens, exact_dtype, ours_generate, step_time
from benchmarks.harness.machine import memory_bandwidth
from benchmarks.harness.report import Row, RunReport, Target, say
from benchmarks.harness.timing import Stat, time_interleaved
from benchmarks.harness.workspace import Workspace

PEER = "transformers generate()"
DECODE_TARGETS = {1: 1.5, 8: 2.0}  # the goals, on tokens/s ours/peer


def peer_generate(hf_model, prompts: torch.Tensor, n: int) -> list[list[int]]:
    with torch.inference_mode():
        out = hf_model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, num_beams=1, use_cache=True,
                                pad_token_id=hf_model.config.eos_token_id)
    return out[:, prompts.size(1):].tolist()


def decode_weight_bytes(model) -> int:
    """Bytes of parameters a decode step reads: all of them (tied tensors once), except the
    learned position table, of which a step reads one row per sequence."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    positions = getattr(model.embed, "positions", None)
    if positions is not None:
        total -= positions.weight.numel() * positions.weight.element_size()
    return total


def measure_decode(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str,
                   device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    ours = ws.gpt2_ours(device, dtype)
    peer = ws.gpt2_peer(device, dtype)
    n, p = cfg.decode_new_tokens, cfg.decode_prompt_len
    eos = ours.cfg.eos_token_id

    bandwidth = memory_bandwidth(device=device)
    weight_bytes = decode_weight_bytes(ours)
    floor_s = weight_bytes / bandwidth["bytes_per_s"]
    report.sections[section]["bandwidth"] = bandwidth
    report.sections[section]["weight_bytes_per_step"] = weight_bytes
    say(f"{section}: {weight_bytes / 2**20:.0f} MiB of weights per step, memory bandwidth "
        f"{bandwidth['bytes_per_s'] / 1e9:.1f} GB/s -> floor {floor_s * 1e3:.2f} ms/step")

    gen = torch.Generator().manual_seed(cfg.seed)
    for b in cfg.decode_batches:
        # Avoid the first ids: tokenizer specials (EOS) in a prompt would change nothing but look odd.
        prompts = torch.randint(8, ours.cfg.vocab_size, (b, p), generator=gen).to(device)
        say(f"{section}: batch {b}, prompt {p}, {n} new tokens ({cfg.repetitions} repetitions)")
        def ours_run(m: int, prompts: torch.Tensor = prompts) -> list[list[int]]:
            return ours_generate(ours, prompts, m)

        def peer_run(m: int, prompts: torch.Tensor = prompts) -> list[list[int]]:
            return peer_generate(peer, prompts, m)

        stats, outs = time_interleaved(
            {"ours": lambda: ours_run(n), "peer": lambda: peer_run(n),
             "ours_1": lambda: ours_run(1), "peer_1": lambda: peer_run(1)},
            cfg.repetitions, device, warmups={"ours": lambda: ours_run(min(n, 8)), "peer": lambda: peer_run(min(n, 8))})
        check = compare_tokens(outs["ours"], outs["peer"], eos, f"decode batch {b}", exact=exact_dtype(dtype))
        workload = f"GPT-2 {cfg.gpt2_layers}L d{cfg.gpt2_d_model}, batch {b}, prompt {p}, {n} new, greedy"
        target = DECODE_TARGETS.get(b)
        report.rows.append(Row(
            section, workload, "tokens/s", stats["ours"].map(lambda t, b=b: b * n / t), peer=PEER,
            peer_value=stats["peer"].map(lambda t, b=b: b * n / t), check=check,
            target=Target(">=", target, text=f"≥ {target:g}×") if target else None,
            note="whole generate() call, prefill included"))
        ours_step = step_time(stats["ours"], stats["ours_1"], n)
        peer_step = step_time(stats["peer"], stats["peer_1"], n)
        report.rows.append(Row(section, workload, "ms/token (decode step)", ours_step.map(lambda s: s * 1e3),
                               higher_is_better=False, peer=PEER, peer_value=peer_step.map(lambda s: s * 1e3),
                               note="(t(N) - t(1)) / (N - 1): prefill excluded"))
        report.rows.append(Row(
            section, workload, "ms/step vs floor", ours_step.map(lambda s: s * 1e3), higher_is_better=False,
            peer="weights / bandwidth floor", peer_value=Stat(floor_s * 1e3, floor_s * 1e3, floor_s * 1e3, 1),
            note=f"{weight_bytes / 2**20:.0f} MiB weights per step at {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s; "
                 "ratio = how many times above the floor"))
        say(f"{section}: batch {b}: ours {b * n / stats['ours'].median:.1f} tok/s, "
            f"peer {b * n / stats['peer'].median:.1f} tok/s; {check}")


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    measure_decode(ws, cfg, report, "1. decode")
