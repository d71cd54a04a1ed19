"""Activation precision: which rounding of the activations entering each projection keeps greedy
answers closest to the float32 reference (transformers reading the same GGUF, ``gguf_file=``).

    python -m benchmarks.studies.activation_precision [--models smollm2-135m-instruct] [--gguf PATH ...]
        [--schemes none shipped int8 int8-32 int16-256 int8-16] [--tokens 48] [--from-divergence] [--json FILE]

The reference already multiplies by the file's dequantized 4-bit weights, so what separates the
native step from it is how the step rounds the activations (``KqActs::quantize`` in
``model/decode/csrc/kquant_blocks.h``) plus summation order. This is a simulation of the first on
the reference itself: a forward pre-hook on every ``nn.Linear`` (the output head included)
replaces its input by the input quantized and dequantized in float32 under a scheme, per block of
the last dimension: ``scale = max|x| / L``, ``r = round_half_even(x * (L / max))`` clamped to
``[-L, L]``, the input becomes ``r * scale``. Schemes:

- ``none``: no rounding (the reference again; a sanity check of this harness: 24 / 24);
- ``shipped``: what the native step does, 14-bit (L = 8191, ``kquant.ACTIVATION_LEVELS``) per the
  block of the weight's GGUF type: 256 for Q4_K / Q5_K / Q6_K, 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0;
- ``int8``: the same blocks at L = 127: ggml's Q8_K / Q8_0, and the native step until 2026-11-29;
- ``int8-32``: int8 per 32 everywhere (llama.cpp's Q8_0 rounding for every projection);
- ``int16-256``: L = 32767, per the weight type's block as ``shipped``;
- ``int8-16``: int8 per 16 everywhere.

Figures against the reference's answers (the fidelity study's prompts, chat template, greedy,
``--tokens`` new tokens, kept in build/fidelity/ as that study keeps them): identical answers,
mean shared prefix (characters), top-1 agreement under teacher forcing (the prompt and the
reference's answer in one forward pass: the share of positions whose argmax is the reference's
next token), perplexity of the held-out text over the reference's.

Greedy answers are generated whole from each prompt, step by step, as the reference's were.
``--from-divergence`` generates them only from where teacher forcing first leaves the reference's
answer (an answer that never leaves it counted as the reference's): much cheaper, but one pass
and step by step differ in summation order, and under int8 rounding that alone flips near ties:
SmolLM2's shipped rounding gave 11 / 24 identical that way against 7 / 24 generated whole. Use
it to screen, not to count. ``forced_vs_generated`` in the JSON counts the answers whose first
token off the reference's is not the teacher-forced choice there.

A simulation in float32, not the kernels: their integer dot products and summation order are not
reproduced, so the ``shipped`` row approximates the native step's counts, it does not equal them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from benchmarks.studies.fidelity import (
    Reference,
    gguf_path,
    heldout_ids,
    nll,
    prompts_for,
    reference_figures,
    shared_prefix,
)
from model.quant.kquant import ACTIVATION_LEVELS

# the activation block the native step's kernels quantize against, per weight type (kquant_blocks.h)
K_QUANTS = frozenset({"Q4_K", "Q5_K", "Q6_K"})
BLOCKS_OF_32 = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})


def kernel_block(qtype: str) -> int:
    if qtype in K_QUANTS:
        return 256
    if qtype in BLOCKS_OF_32:
        return 32
    raise ValueError(f"the native step has no kernel for {qtype} weights")


@dataclass(frozen=True)
class Scheme:
    name: str
    levels: int | None  # L; None: the input left as it is
    block_of: Callable[[str], int]  # the block for a weight of this GGUF type


SCHEMES = {s.name: s for s in (
    Scheme("none", None, kernel_block),
    Scheme("shipped", ACTIVATION_LEVELS, kernel_block),
    Scheme("int8", 127, kernel_block),
    Scheme("int8-32", 127, lambda _: 32),
    Scheme("int16-256", 32767, kernel_block),
    Scheme("int8-16", 127, lambda _: 16),
)}


def fake_quantize(x: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    """``x`` rounded as ``KqActs::quantize`` rounds it (with ``levels`` for its 127), then
    dequantized, in float32: per block of ``block`` values along the last dimension."""
    if x.shape[-1] % block:
        raise ValueError(f"a last dimension of {x.shape[-1]} is not whole blocks of {block}")
    v = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    top = v.abs().amax(-1, keepdim=True)
    # L / max in float32 first, then the product, as the kernel does (127.0f / top, x * inv)
    # (a true division: torch's `number / tensor` multiplies by a rounded reciprocal)
    inv = torch.where(top > 0, torch.full_like(top, levels) / top, torch.zeros_like(top))
    r = torch.round(v * inv).clamp(-levels, levels)  # torch.round: half to even, as nearbyint
    return (r * (top / levels)).reshape(x.shape).to(x.dtype)


# transformers' Llama / Qwen2 module names -> GGUF tensor names (model/formats/gguf_import.py's layout)
LAYER_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_tensor(module: str, tensors: set[str]) -> str:
    """The GGUF tensor whose weights the transformers linear ``module`` holds; the head of a tied
    model (no ``output.weight`` in the file) is ``token_embd.weight``."""
    if module == "lm_head":
        return "output.weight" if "output.weight" in tensors else "token_embd.weight"
    found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if found is None or found.group(2) not in LAYER_PARTS:
        raise ValueError(f"no GGUF tensor known for the linear layer {module!r}")
    name = f"blk.{found.group(1)}.{LAYER_PARTS[found.group(2)]}.weight"
    if name not in tensors:
        raise ValueError(f"{module!r} maps to {name!r}, which the file does not hold")
    return name


def gguf_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def blocks_for(model: nn.Module, types: dict[str, str], scheme: Scheme) -> dict[str, int]:
    """Every linear layer's name -> its activation block under ``scheme``."""
    return {name: scheme.block_of(types[gguf_tensor(name, set(types))])
            for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@contextmanager
def quantized_inputs(model: nn.Module, blocks: dict[str, int], levels: int | None) -> Iterator[None]:
    """While inside: every linear layer of ``model`` named in ``blocks`` sees its input rounded
    per its block (``levels`` None: hooked, left as it is). Every linear layer must be named."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if set(linears) != set(blocks):
        raise ValueError(f"blocks name {sorted(set(blocks) ^ set(linears))[:3]}, not the model's linear layers")

    def hook(block: int):
        def rounded(_module, args):
            return args if levels is None else (fake_quantize(args[0], block, levels), *args[1:])
        return rounded

    handles = [m.register_forward_pre_hook(hook(blocks[name])) for name, m in linears.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# --- the figures -----------------------------------------------------------------------------------

@torch.inference_mode()
def forced(model: nn.Module, prompt: list[int], answer: list[int]) -> list[int]:
    """The argmax after the prompt and after each proper prefix of ``answer``: teacher forcing in
    one pass, one choice per token of ``answer``."""
    return model(torch.tensor([prompt + answer[:-1]])).logits[0, len(prompt) - 1:].argmax(-1).tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def greedy(reference: Reference, prompt: list[int], ref_answer: list[int], choices: list[int], n: int,
           eos: int | None) -> list[int]:
    """The greedy answer under the hooks, generated only from where ``choices`` (``forced`` along
    the reference's answer) first leave it: up to there greedy decoding makes the same choices, so
    an answer that never leaves it is the reference's, and the rest is generated after its prefix."""
    first = first_difference(choices, ref_answer)
    if first is None:
        return ref_answer
    return ref_answer[:first] + reference.generate(prompt + ref_answer[:first], n - first, eos)


def measure(reference: Reference, tokenizer, prompts, ref_answers, heldout, ref_ppl, n, eos, full: bool) -> dict:
    times, cpu = {}, time.process_time()
    t = time.perf_counter()
    choices = [forced(reference.model, p, a) for p, a in zip(prompts, ref_answers)]
    times["top1_s"] = time.perf_counter() - t
    t = time.perf_counter()
    answers = [reference.generate(p, n, eos) if full else greedy(reference, p, a, c, n, eos)
               for p, a, c in zip(prompts, ref_answers, choices)]
    times["answers_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ppl = math.exp(sum(nll(reference.logits(heldout)[:-1], heldout[1:])) / (len(heldout) - 1))
    times["ppl_s"] = time.perf_counter() - t
    times["cpu_s"] = time.process_time() - cpu  # this process's CPU time, all threads: wall time on a quiet host
    texts, ref_texts = [tokenizer.decode(a) for a in answers], [tokenizer.decode(a) for a in ref_answers]
    same = sum(int(c == r) for cs, a in zip(choices, ref_answers) for c, r in zip(cs, a))
    # where an answer leaves the reference's, its token there should be the teacher-forced choice
    # (one pass against step by step: only the summation order differs); those that are not, counted
    firsts = [(first_difference(a, r), a, c) for a, r, c in zip(answers, ref_answers, choices)]
    unsteady = sum(1 for i, a, c in firsts if i is not None and i < len(a) and i < len(c) and a[i] != c[i])
    return {"identical": sum(a == b for a, b in zip(texts, ref_texts)), "prompts": len(prompts),
            "shared_prefix": sum(shared_prefix(a, b) for a, b in zip(texts, ref_texts)) / len(prompts),
            "top1": same / sum(len(a) for a in ref_answers), "ppl_ratio": ppl / ref_ppl,
            "forced_vs_generated": unsteady, "seconds": times, "texts": texts}


def file_inputs(gguf: Path):
    """The prompts' token ids, the held-out text's, the tokenizer and eos id, from the file's
    metadata alone (no tensor read), as the fidelity study builds them."""
    from model.formats.gguf_import import chat_and_stops, open_gguf

    f, cfg, tokenizer = open_gguf(gguf)
    template, _ = chat_and_stops(f, cfg)
    kind, prompts = prompts_for(SimpleNamespace(tokenizer=tokenizer, model=SimpleNamespace(cfg=cfg),
                                                chat_template=template))
    return kind, prompts, heldout_ids(tokenizer), tokenizer, cfg.eos_token_id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.activation_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["smollm2-135m-instruct"])
    parser.add_argument("--gguf", nargs="*", default=[], type=Path)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES)[:4], choices=list(SCHEMES))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--from-divergence", action="store_true",
                        help="generate answers only from where teacher forcing first leaves the reference's "
                             "(cheaper; counts differ by summation order, see above)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    files = [(m, gguf_path(m)) for m in args.models] + [(p.stem, p) for p in args.gguf]
    rows = ["| model | scheme | identical answers | mean shared prefix (chars) | top-1 agreement | perplexity ratio "
            "| wall s (CPU s) |", "|---|---|---|---|---|---|---|"]
    report = {}
    for name, gguf in files:
        kind, prompts, heldout, tokenizer, eos = file_inputs(gguf)
        reference = Reference(gguf)
        t = time.perf_counter()
        ref_answers, ref_ppl = reference_figures(reference, gguf, prompts, heldout, args.tokens, eos)
        print(f"{name}: {kind} prompts, reference perplexity {ref_ppl:.3f} over {len(heldout)} tokens "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        types = gguf_types(gguf)
        report[name] = {"kind": kind, "reference_ppl": ref_ppl, "schemes": {}}
        done: dict[str, tuple] = {}  # scheme -> (levels, blocks): a scheme that rounds as an earlier one is not rerun
        for scheme in (SCHEMES[s] for s in args.schemes):
            blocks = blocks_for(reference.model, types, scheme)
            same = next((s for s, rule in done.items() if rule == (scheme.levels, blocks)), None)
            if same is not None:
                result = dict(report[name]["schemes"][same], same_as=same, seconds={})
            else:
                with quantized_inputs(reference.model, blocks, scheme.levels):
                    result = measure(reference, tokenizer, prompts, ref_answers, heldout, ref_ppl, args.tokens, eos,
                                     not args.from_divergence)
                done[scheme.name] = (scheme.levels, blocks)
            report[name]["schemes"][scheme.name] = result
            label = scheme.name + (f" (rounds as {same})" if same else "")
            wall = sum(v for k, v in result["seconds"].items() if k != "cpu_s")
            seconds = f"{wall:.0f} ({result['seconds']['cpu_s']:.0f} CPU)" if same is None else "-"
            rows.append(f"| {name} | {label} | {result['identical']} / {result['prompts']} | "
                        f"{result['shared_prefix']:.0f} | {result['top1']:.1%} | {result['ppl_ratio']:.4f} | "
                        f"{seconds} |")
            print(rows[-1], flush=True)
            if args.json:  # after each scheme: a long run stopped early keeps what it measured
                args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False))
        del reference
    print("\n".join(rows))


if __name__ == "__main__":
    main()
