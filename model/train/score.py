"""Score translation checkpoints side by side on named corpus splits.

``python -m model.train.score --set NAME=CORPUS_DIR:SPLIT ... --system NAME=CHECKPOINT_DIR ... [--limit 2000]
[--out FILE.json]``

Each set is at most ``--limit`` records chosen by the sha256 of their source
(``evaluate.eval_subset``, as the export does); every system decodes it greedily through the
placeholder-safe path the service runs, and gets sacreBLEU BLEU/chrF (signatures recorded),
placeholder preservation and decoding speed (target tokens per second).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from model.formats.checkpoint import load as load_checkpoint
from model.train.data.corpus import load_split
from model.train.evaluate import bleu_chrf, eval_subset, placeholder_preservation, translate_all


def _pair(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{what} must be NAME=VALUE, got {text!r}")
    return name, value


def score(sets: dict[str, list[dict]], systems: dict[str, str], max_new_tokens: int = 96,
          log=print, int8: Sequence[str] = ()) -> dict[str, Any]:
    """``int8``: systems quantized as the service's ``TSERVE_QUANTIZE=int8`` does (row-wise int8
    everywhere) and decoded through the step the service then runs (``model.decode.prepare``)."""
    import sacrebleu

    from model.decode import DecodeOptions, prepare

    out: dict[str, Any] = {"systems": systems, "int8": list(int8), "sets": {}}
    loaded = {name: load_checkpoint(path) for name, path in systems.items()}
    steps = {}
    for name in int8:
        steps[name] = prepare(loaded[name].model.eval(), DecodeOptions(quantize="int8"), loaded[name].tokenizer)
    for set_name, records in sets.items():
        sources, refs = [r["source"] for r in records], [r["target"] for r in records]
        entry: dict[str, Any] = {"sentences": len(records), "copy_source": bleu_chrf(sources, refs)}
        for name, ckpt in loaded.items():
            ckpt.model.eval()
            start = time.perf_counter()
            hyps = translate_all(ckpt.model, ckpt.tokenizer, sources, max_new_tokens, step=steps.get(name))
            seconds = time.perf_counter() - start
            tokens = sum(len(ckpt.tokenizer.encode(h)) for h in hyps)
            entry[name] = {**bleu_chrf(hyps, refs), "placeholders": placeholder_preservation(sources, hyps),
                           "decode_seconds": round(seconds, 1), "output_tokens_per_s": round(tokens / seconds),
                           "examples": [{"source": s, "reference": r, "output": h}
                                        for s, r, h in list(zip(sources, refs, hyps))[:5]]}
            log(f"[{set_name}] {name}: BLEU {entry[name]['bleu']} chrF {entry[name]['chrf']} "
                f"placeholders {entry[name]['placeholders']['preserved']} ({seconds:.0f} s)")
        entry["signatures"] = {}
        for metric_name, metric in (("bleu", sacrebleu.BLEU()), ("chrf", sacrebleu.CHRF())):
            metric.corpus_score(sources, [refs])
            entry["signatures"][metric_name] = str(metric.get_signature())
        out["sets"][set_name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.train.score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", required=True, type=lambda t: _pair(t, "--set"),
                        help="NAME=CORPUS_DIR:SPLIT (repeatable)")
    parser.add_argument("--system", action="append", required=True, type=lambda t: _pair(t, "--system"),
                        help="NAME=CHECKPOINT_DIR (repeatable)")
    parser.add_argument("--int8", action="append", default=[], metavar="NAME",
                        help="score system NAME quantized to int8 as the service does (repeatable)")
    parser.add_argument("--limit", type=int, default=2000, help="records per set (by source hash)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sets = {}
    for name, spec in args.set:
        corpus, _, split = spec.rpartition(":")
        sets[name] = eval_subset(load_split(corpus, split), args.limit)
    systems = dict(args.system)
    unknown = [n for n in args.int8 if n not in systems]
    if unknown:
        parser.error(f"--int8 names no --system: {unknown}")
    result = score(sets, systems, int8=args.int8)
    result["command"] = "python -m model.train.score " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
