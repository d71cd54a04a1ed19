"""``eval``: top-1/top-5 of the masked word on the held-out sentences, the masked LM alone and
re-ranked as served, against always guessing the most frequent words."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from model.train.fill_mask_head.data import WORD, read_jsonl_gz


@torch.inference_mode()
def fill_top_k(ckpt, texts: list[str], k: int = 5, rescorer=None) -> list[list[str]]:
    """Top-``k`` tokens for the (single) [MASK] of each text, special tokens excluded as the
    service does; the tokens as strings. ``rescorer`` (``model.encoder.rescore.FillRescorer``):
    its re-ranking of the masked LM's candidates, as the service serves it."""
    model, tk = ckpt.model.eval(), ckpt.tokenizer
    mask_id = ckpt.config.mask_token_id
    rows = tk.encode_batch(texts)
    hidden, _ = model.encode_rows(rows)
    at = torch.stack([h[r.index(mask_id)] for h, r in zip(hidden, rows)])
    logits = model.lm_head(at).float()
    logits[:, sorted(tk.special_ids)] = float("-inf")
    n = max(k, rescorer.spec.candidates) if rescorer is not None else k
    top_logp, top_ids = logits.log_softmax(-1).topk(n, dim=-1)
    words = [[tk.id_to_token(t) for t in row] for row in top_ids.tolist()]
    if rescorer is None:
        return words
    c = rescorer.spec.candidates
    orders = rescorer.rerank(texts, tk.id_to_token(mask_id), [w[:c] for w in words], top_logp[:, :c].tolist())
    return [([w[i] for i, _ in order] + w[c:])[:k] for w, order in zip(words, orders)]


def evaluate(ckpt, heldout: list[dict], batch: int = 64, rescorer=None) -> dict:
    """Exact-match top-1/top-5 of the masked word. ``in_vocab``: the sentences whose answer is one
    token of this model's vocabulary (the others it cannot get right), and its scores on those.
    ``rescorer``: scored as served with it (``fill_top_k``)."""
    vocab = ckpt.tokenizer.tk.get_vocab()
    top1 = top5 = in1 = in5 = n_in = 0
    started = time.monotonic()
    for b in range(0, len(heldout), batch):
        part = heldout[b:b + batch]
        if rescorer is not None and b and b % (batch * 8) == 0:
            print(f"  {b}/{len(heldout)} sentences, top-1 so far {top1 / b:.4f}, "
                  f"{time.monotonic() - started:.0f} s", flush=True)
        for row, guesses in zip(part, fill_top_k(ckpt, [r["text"] for r in part], rescorer=rescorer)):
            hit1, hit5 = guesses[0] == row["answer"], row["answer"] in guesses
            top1, top5 = top1 + hit1, top5 + hit5
            if row["answer"] in vocab:
                n_in, in1, in5 = n_in + 1, in1 + hit1, in5 + hit5
    n = len(heldout)
    return {"sentences": n, "top1": round(top1 / n, 4), "top5": round(top5 / n, 4),
            "in_vocab": {"sentences": n_in, "top1": round(in1 / max(n_in, 1), 4),
                         "top5": round(in5 / max(n_in, 1), 4)}}


def frequency_baseline(train: list[dict], heldout: list[dict]) -> dict:
    """Always the five most frequent (lower-cased) words of the training sentences."""
    from collections import Counter

    counts = Counter(w.lower() for r in train for w in WORD.findall(r["text"]))
    top = [w for w, _ in counts.most_common(5)]
    n = len(heldout)
    return {"words": top, "top1": round(sum(r["answer"] == top[0] for r in heldout) / n, 4),
            "top5": round(sum(r["answer"] in top for r in heldout) / n, 4)}


EXAMPLES = ("The capital of France is [MASK].", "I drink a cup of [MASK] every morning.",
            "The cat sat on the [MASK].", "She opened the [MASK] and walked into the room.",
            "Paris is the capital of [MASK].", "Where are [MASK] going?", "This [MASK] a book.",
            "It [MASK] raining today.")


def cmd_eval(args) -> None:
    from model import load_model
    from model.encoder.rescore import FillRescorer

    heldout = read_jsonl_gz(Path(args.out) / "heldout.jsonl.gz")
    if args.limit:
        heldout = heldout[:args.limit]
    results = {"baseline": frequency_baseline(read_jsonl_gz(Path(args.out) / "train.jsonl.gz"), heldout)}
    print("baseline", json.dumps(results["baseline"]), flush=True)
    for path in args.model:
        ckpt = load_model(path)
        systems = [(path, None)]
        if ckpt.fill_rescore is not None and not args.no_rescore:  # as served: re-ranked by its causal LM
            systems.append((f"{path}+rescore", FillRescorer.load(ckpt.fill_rescore)))
        for name, rescorer in systems:
            started = time.monotonic()
            res = evaluate(ckpt, heldout, rescorer=rescorer)
            res["seconds"] = round(time.monotonic() - started, 1)
            res["examples"] = dict(zip(EXAMPLES, fill_top_k(ckpt, list(EXAMPLES), rescorer=rescorer)))
            if rescorer is not None:
                spec = rescorer.spec
                res["rescore"] = {"model": str(spec.model), "candidates": spec.candidates,
                                  "mlm_weight": spec.mlm_weight, "context": spec.context}
            results[name] = res
            print(name, json.dumps(res, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
