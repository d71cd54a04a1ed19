"""Record what the shipped checkpoints generate, so a refactor of the decode loop can be
checked token for token against the code that came before it.

    python -m tests.golden.record   # rewrites tests/golden/shipped_outputs.json

Run it only when a change is meant to alter outputs (new weights, a fixed bug), and say
so in the commit. ``tests/test_golden.py`` replays every case through today's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model import SamplingParams, beam_search, generate, load, load_model

HERE = Path(__file__).parent
WEIGHTS = HERE.parent.parent / "weights"
OUT = HERE / "shipped_outputs.json"

GEN_PROMPTS = ["ROMEO:", "To be, or not to be", "The king is dead", "O"]
MT_SOURCES = ["Open the file", "File not found", "I love you.", "Could not connect to the server: %s"]
FILL_TEXTS = ["The [MASK] of the king.", "To be or not to [MASK]."]

PARAMS = {
    "greedy": dict(max_new_tokens=24, temperature=0.0),
    "sampled": dict(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234),
    "penalised": dict(max_new_tokens=24, temperature=0.0, repetition_penalty=1.3),
}


def generation_cases() -> dict[str, list[list[int]]]:
    out = {}
    for name, texts in (("generate-en", GEN_PROMPTS), ("translate-en-de", MT_SOURCES)):
        ckpt = load(WEIGHTS / name)
        ckpt.model.eval()
        ids = [ckpt.tokenizer.encode(t) for t in texts]
        for mode, kw in PARAMS.items():
            params = [SamplingParams(**{**kw, "seed": kw["seed"] + i} if "seed" in kw else kw) for i in range(len(ids))]
            out[f"{name}/{mode}"] = [r.token_ids for r in generate(ckpt.model, ids, params)]
        if name == "translate-en-de":
            for k in (2, 4):
                out[f"{name}/beam{k}"] = [r.token_ids for r in beam_search(ckpt.model, ids, beam_size=k,
                                                                           max_new_tokens=24)]
    return out


def fill_mask_cases() -> dict[str, list[list[int]]]:
    ckpt = load_model(WEIGHTS / "fill-mask-en")  # all-MiniLM-L6-v2's package + the head in weights/
    ckpt.model.eval()
    out = []
    for text in FILL_TEXTS:
        ids = ckpt.tokenizer.encode(text)
        at = ids.index(ckpt.config.mask_token_id)
        logits = ckpt.model(torch.tensor([ids]))[0, at]
        out.append(logits.topk(5).indices.tolist())
    return {"fill-mask-en/top5": out}


@torch.inference_mode()
def record() -> dict[str, list[list[int]]]:
    torch.manual_seed(0)
    return {**generation_cases(), **fill_mask_cases()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases = record()
    OUT.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in cases.items()) + "\n}\n")
    print(f"wrote {OUT}")
