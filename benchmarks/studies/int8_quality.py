"""What the served decode step costs in quality: perplexity of held-out text scored one token
per decode step, the service's default step (int8 projections, the native C++ step, a bfloat16
cache) against the float32 reference step of the same weights.

    python -m benchmarks.studies.int8_quality [--models smollm2-135m-instruct gemma3-270m] [--tokens 512]

Where the default step runs a model file's own 4-bit weights (``TSERVE_DECODE_WEIGHTS=auto``,
SmolLM2's Q4_1), a second row gives the same step all int8 (``int8``).

The text is the docstrings of a few standard-library modules (``benchmarks.harness.quality.heldout_text``:
fixed for a Python version, unlike the int8 calibration text); a prompt written through the
native step's ``prefill`` gives bit for bit the rows of one step per token
(tests/model/decode/test_native_prefill.py), so this perplexity is the int8 prefill's too. Also:
greedy agreement, the share of 64 generated tokens equal to the float32 step's, over four
prompts, up to the first difference: prompts through the native step (the default,
``TSERVE_PREFILL=auto``) and through the model's float forward (``model``).
"""

from __future__ import annotations

import argparse

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.quality import decode_perplexity, heldout_text

PROMPTS = ["The history of the printing press begins", "To make bread at home, you need",
           "The capital of France is", "def fibonacci(n):"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.int8_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args(argv)

    from model import SamplingParams, generate, load_model
    from model.decode import DecodeOptions, prepare

    print("| model | float32 perplexity | served step | served perplexity | ratio | greedy agreement, int8 prefill |"
          " greedy agreement, float prefill |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        reference = load_model(REPO_ROOT / "weights" / name)
        ref_step = prepare(reference.model.eval(), DecodeOptions.reference(), reference.tokenizer)
        ids = reference.tokenizer.encode(heldout_text())[: args.tokens]
        p_ref = decode_perplexity(reference.model, ids, ref_step)
        params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
        prompts = [reference.tokenizer.encode(p) for p in PROMPTS]
        a = [r.token_ids for r in generate(reference.model, prompts, params, step=ref_step)]
        # the default step, and where it runs a file's 4-bit weights, the same step all int8
        for weights in ("auto", "int8"):
            served_ckpt = load_model(REPO_ROOT / "weights" / name)
            served = prepare(served_ckpt.model.eval(), DecodeOptions(weights=weights), served_ckpt.tokenizer)
            four = getattr(served, "weights4", 0)
            float_ckpt = load_model(REPO_ROOT / "weights" / name)  # served (auto) let its float weights go
            float_prefill = prepare(float_ckpt.model.eval(), DecodeOptions(prefill="model", weights=weights),
                                    float_ckpt.tokenizer)
            p_served = decode_perplexity(served_ckpt.model, ids, served)
            agreement = []
            for ckpt, step in ((served_ckpt, served), (float_ckpt, float_prefill)):
                b = [r.token_ids for r in generate(ckpt.model, prompts, params, step=step)]
                agree = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / len(x)
                         for x, y in zip(a, b)]
                agreement.append(f"{sum(agree) / len(agree):.0%}")
            label = f"{served.name}, {f'4-bit ({four} projections) + int8' if four else 'int8'}"
            print(f"| {name} | {p_ref:.2f} | {label} | {p_served:.2f} | {p_served / p_ref:.3f} | "
                  f"{' | '.join(agreement)} |", flush=True)
            if not four:  # int8 already: no second row
                break


if __name__ == "__main__":
    main()
