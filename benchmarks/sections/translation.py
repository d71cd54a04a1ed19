"""2. Translation throughput, Marian architecture: ours vs CTranslate2 vs transformers.

All three run the same weights (one HF directory: ours imports it with ``load_hf``,
CTranslate2 converts it, transformers loads it) on the same source token ids. The
output bias of the synthetic model bans </s> and <pad>, so every system decodes exactly
``translate_new_tokens`` tokens per sentence and tokens/s compare the same work. Each
system's tokens are counted from its own output, and outputs are compared with ours. Ours
decodes through the step the engine runs (``model.decode.prepare``: on the CPU the native
library's decode attention, on CUDA the Triton kernel where it runs), its weights as given.
"""

from __future__ import annotations

import json

import torch

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.generation import compare_tokens, exact_dtype, ours_translate
from benchmarks.harness.report import Row, RunReport, Target, say
from benchmarks.harness.synthetic import sentences
from benchmarks.harness.timing import time_interleaved
from benchmarks.harness.workspace import Workspace
from model.decode import DecodeOptions, prepare

HF_PEER = "transformers generate()"
OURS_INT8 = "ours int8"
CT2_COMPUTE_TYPES = {"cpu": ("float32", "int8"), "cuda": ("bfloat16", "int8_bfloat16")}


def served_step(model):
    """The decode step the engine would run for ``model``, its weights as they are."""
    return prepare(model, DecodeOptions(quantize="none"))


def ct2_translate(translator, groups: list[list[list[str]]], beam: int, n: int, vocab: dict[str, int]
                  ) -> list[list[int]]:
    out = []
    for sources in groups:
        results = translator.translate_batch(sources, beam_size=beam, max_decoding_length=n, length_penalty=1.0,
                                             max_batch_size=len(sources))
        out += [[vocab[p] for p in r.hypotheses[0]] for r in results]
    return out


def hf_translate(hf_model, groups: list[tuple[torch.Tensor, torch.Tensor]], beam: int, n: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for ids, mask in groups:
            gen = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, num_beams=beam,
                                    do_sample=False, length_penalty=1.0, use_cache=True)
            out += gen[:, 1:].tolist()  # drop the decoder start token
    return out


def padded(sources: list[list[int]], pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), pad, dtype=torch.long)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
    return ids.to(device), (ids != pad).long().to(device)


def measure_translation(ws: Workspace, cfg: BenchConfig, report: RunReport, section: str,
                        device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    import ctranslate2

    imported = ws.marian_ours(device, dtype)
    ours, tokenizer = imported.model, imported.tokenizer
    ours_int8 = None
    if device == "cpu":  # our optional int8 projections, measured against CTranslate2 int8
        from model.quant.int8 import quantize_checkpoint_

        ours_int8 = ws.marian_ours(device, dtype).model
        quantize_checkpoint_(ours_int8, None)  # as TSERVE_QUANTIZE=int8 serves it
    steps = {"ours": served_step(ours), OURS_INT8: served_step(ours_int8) if ours_int8 is not None else None}
    peer = ws.marian_peer(device, dtype)
    vocab = json.loads((ws.marian_dir / "vocab.json").read_text(encoding="utf-8"))
    pieces = {i: p for p, i in vocab.items()}
    pad = ours.cfg.pad_token_id
    translators = {
        f"CTranslate2 {ct}": ctranslate2.Translator(str(ws.marian_ct2_dir), device=device, compute_type=ct,
                                                    intra_threads=cfg.threads, inter_threads=1)
        for ct in CT2_COMPUTE_TYPES[device]
    }
    n = cfg.translate_new_tokens
    # Sources: pseudo-English sentences through our tokenizer (which appends </s> as Marian's does).
    texts = sentences(max(max(cfg.translate_batches), cfg.translate_single_sentences), cfg.seed + 7)
    sources = [tokenizer.encode(t)[:96] for t in texts]
    report.sections[section]["source_tokens"] = [len(s) for s in sources]
    shape = f"Marian {cfg.marian_layers}+{cfg.marian_layers}L d{cfg.marian_d_model} vocab {ours.cfg.vocab_size}"

    for beam in cfg.translate_beams:
        for b in cfg.translate_batches:
            if b == 1:  # one sentence per call, a few sentences one after another
                groups = [[s] for s in sources[: cfg.translate_single_sentences]]
            else:
                groups = [sources[:b]]
            piece_groups = [[[pieces[i] for i in s] for s in g] for g in groups]
            hf_groups = [padded(g, pad, device) for g in groups]

            def calls(m: int, groups=groups, piece_groups=piece_groups, hf_groups=hf_groups, beam=beam) -> dict:
                """Every system on these groups, m tokens per sentence."""
                fns = {"ours": lambda: ours_translate(ours, groups, beam, m, steps["ours"])}
                if ours_int8 is not None:
                    fns[OURS_INT8] = lambda: ours_translate(ours_int8, groups, beam, m, steps[OURS_INT8])
                for name, tr in translators.items():
                    fns[name] = lambda tr=tr: ct2_translate(tr, piece_groups, beam, m, vocab)
                fns[HF_PEER] = lambda: hf_translate(peer, hf_groups, beam, m)
                return fns

            fns = calls(n)
            mode = "greedy" if beam == 1 else f"beam {beam}"
            batching = f"{len(groups)} × batch 1" if b == 1 else f"batch {b}"
            say(f"{section}: {mode}, {batching} ({cfg.repetitions} repetitions)")
            stats, outs = time_interleaved(fns, cfg.repetitions, device, warmups=calls(min(n, 4)))
            workload = f"{shape}, {batching}, {mode}, {n} new/sentence"
            ours_tokens = sum(len(t) for t in outs["ours"])
            ours_tps = stats["ours"].map(lambda t, k=ours_tokens: k / t)
            for name in fns:
                if name in ("ours", OURS_INT8):
                    continue
                tokens = sum(len(t) for t in outs[name])
                check = compare_tokens(outs["ours"], outs[name], ours.cfg.eos_token_id, f"{workload} vs {name}",
                                       exact="int8" not in name and exact_dtype(dtype))
                if tokens != ours_tokens:
                    check += f"; {tokens} tokens vs ours {ours_tokens}"
                report.rows.append(Row(
                    section, workload, "tokens/s", ours_tps, peer=name,
                    peer_value=stats[name].map(lambda t, k=tokens: k / t), check=check,
                    target=translation_target(name, beam, b, device),
                    note="EOS and pad banned in the output bias: every system decodes to the limit"))
            if OURS_INT8 in outs and "CTranslate2 int8" in outs:
                tokens = sum(len(t) for t in outs[OURS_INT8])
                ct2 = sum(len(t) for t in outs["CTranslate2 int8"])
                report.rows.append(Row(
                    section, workload + " (ours int8)", "tokens/s", stats[OURS_INT8].map(lambda t, k=tokens: k / t),
                    peer="CTranslate2 int8", peer_value=stats["CTranslate2 int8"].map(lambda t, k=ct2: k / t),
                    check=compare_tokens(outs["ours"], outs[OURS_INT8], ours.cfg.eos_token_id,
                                         f"{workload}: ours int8 vs ours float32", exact=False),
                    note="both sides int8 weights (ours: TSERVE_QUANTIZE=int8)"))
            summary = ", ".join(f"{k} {(sum(len(t) for t in outs[k])) / s.median:.0f}" for k, s in stats.items())
            say(f"{section}: {mode} {batching}: tokens/s {summary}")


def translation_target(peer: str, beam: int, batch: int, device: str) -> Target | None:
    """The issue's goals: >= 0.8x CTranslate2 float32 greedy at batch 32; ahead of transformers everywhere."""
    if peer == HF_PEER:
        return Target(">=", 1.0, text="≥ 1× (ahead)")
    if device == "cpu" and peer == "CTranslate2 float32" and beam == 1 and batch == 32:
        return Target(">=", 0.8, text="≥ 0.8× (stretch 1×)")
    return None


def run(ws: Workspace, cfg: BenchConfig, report: RunReport) -> None:
    measure_translation(ws, cfg, report, "2. translation")

