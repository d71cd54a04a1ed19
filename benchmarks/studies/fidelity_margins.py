"""Where an answer leaves the reference's, and how close the reference itself was to a tie there.

    python -m benchmarks.studies.fidelity_margins MODEL_OR_GGUF [--config stored] [--env K=V ...]
        [--llama-server PATH] [--tokens 48]

For each of ``benchmarks.studies.fidelity``'s prompts whose greedy answer (ours under the
configuration, or llama-server's) differs from the float32 reference's, at the first differing
token: the reference's top-1 margin there (its best logit minus its second, float32), and each
system's own gap between the token it chose and the reference's (ours: the logits of the prompt
path, then one decode step per token of the shared prefix; llama-server: ``/completion`` with
``n_probs``, log-probabilities, whose differences are logit differences). A gap of a few
hundredths at a point where the reference's own margin is as small is rounding choosing between
near-equal tokens; a gap of whole logits where the reference was sure is an error of ours.
The reference's answers come from ``build/fidelity/`` when the study has kept them.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.harness import REPO_ROOT
from benchmarks.studies.fidelity import (
    CONFIGS,
    LLAMA_BIN,
    LlamaServer,
    Ours,
    Reference,
    gguf_path,
    heldout_ids,
    prompts_for,
    reference_figures,
)


def first_difference(a: list[int], b: list[int]) -> int | None:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else i


def top2(logits: torch.Tensor) -> tuple[int, float]:
    v, i = logits.topk(2)
    return int(i[0]), float(v[0] - v[1])


@torch.inference_mode()
def our_logits(ours: Ours, prompt: list[int], prefix: list[int]) -> torch.Tensor:
    """Our logits after ``prompt + prefix``, computed as generation computes them."""
    cache = ours.model.new_cache(1, len(prompt) + len(prefix) + 1, dtype=ours.step.kv_dtype)
    logits = ours._prompt(cache, prompt)[-1]
    for i, tok in enumerate(prefix):
        logits = ours.step(cache, torch.tensor([tok]), [0], [len(prompt) + i])[0]
    return logits.float()


def llama_logprobs(peer: LlamaServer, ids: list[int], k: int = 20) -> dict[int, float]:
    body = {"prompt": ids, "n_predict": 1, "temperature": 0, "top_k": 1, "cache_prompt": True, "n_probs": k,
            "return_tokens": True, "seed": 0}
    r = peer.client.post(peer.server.url + "/completion", json=body)
    r.raise_for_status()
    probs = r.json()["completion_probabilities"][0]["top_logprobs"]
    return {int(p["id"]): float(p["logprob"]) for p in probs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.fidelity_margins", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a weights/ name or a .gguf path")
    parser.add_argument("--config", default="stored", choices=list(CONFIGS))
    parser.add_argument("--env", nargs="*", default=[], help="extra K=V settings for ours")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_BIN / "llama-server")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    source = Path(args.model) if args.model.endswith(".gguf") else REPO_ROOT / "weights" / args.model
    gguf = gguf_path(args.model)
    env = dict(CONFIGS[args.config], **dict(kv.split("=", 1) for kv in args.env))
    ours = Ours(source, env)
    kind, prompts = prompts_for(ours.ckpt)
    eos = ours.model.cfg.eos_token_id
    reference = Reference(gguf)
    ref_answers, _ = reference_figures(reference, gguf, prompts, heldout_ids(ours.ckpt.tokenizer), args.tokens, eos)
    our_answers = ours.generate(prompts, args.tokens, eos)
    peer = LlamaServer(args.llama_server, gguf, REPO_ROOT / "build" / "fidelity" / "margins-llama-server.log",
                       args.threads) if args.llama_server.exists() else None
    rows = []  # (system, prompt, position, reference margin, gap of the system's choice over the reference's)
    with peer or _Null():
        peer_answers = [peer.generate(p, args.tokens, eos) for p in prompts] if peer else [None] * len(prompts)
        for n, (prompt, ref) in enumerate(zip(prompts, ref_answers)):
            for system, answer in (("ours", our_answers[n]), ("llama-server", peer_answers[n])):
                j = None if answer is None else first_difference(answer, ref)
                if j is None or j >= len(ref) or j >= len(answer):
                    continue  # identical, or one stopped early inside the other (counted, no tie to measure)
                ctx = ref[:j]
                ref_logits = reference.logits(prompt + ctx)[-1]
                best, margin = top2(ref_logits)
                ours_l = our_logits(ours, prompt, ctx)
                ours_gap = float(ours_l[answer[j]] - ours_l[ref[j]])
                line = {"system": system, "prompt": n, "position": j, "ref_margin": margin,
                        "ref_gap": float(ref_logits[ref[j]] - ref_logits[answer[j]]), "ours_gap": ours_gap}
                if peer:
                    lp = llama_logprobs(peer, prompt + ctx)
                    line["llama_gap"] = (lp[answer[j]] - lp[ref[j]]) if answer[j] in lp and ref[j] in lp else None
                rows.append(line)
    print(f"{args.model} ({kind}), ours = {args.config} {args.env or ''}; reference: transformers float32")
    print("| system | prompt | token | reference margin (top-1 - top-2) | reference: its token over the system's "
          "| ours: that token over the reference's | llama-server: the same |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        lg = "n/a" if r.get("llama_gap") is None else f"{r['llama_gap']:+.3f}"
        print(f"| {r['system']} | {r['prompt']} | {r['position']} | {r['ref_margin']:.3f} | {r['ref_gap']:.3f} "
              f"| {r['ours_gap']:+.3f} | {lg} |")
    for system in ("ours", "llama-server"):
        m = [r["ref_gap"] for r in rows if r["system"] == system]
        if m:
            print(f"{system}: {len(m)} divergences; reference margin there: median {statistics.median(m):.3f}, "
                  f"max {max(m):.3f}; under 0.25 logits: {sum(x < 0.25 for x in m)}")


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


if __name__ == "__main__":
    main()
