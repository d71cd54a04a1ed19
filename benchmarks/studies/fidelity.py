"""Fidelity: how far the served answers are from the model's own, for each decode configuration,
against transformers in float32 reading the same GGUF file (``gguf_file=``) as the reference.

    python -m benchmarks.studies.fidelity [--models smollm2-135m-instruct gemma3-270m] [--gguf PATH ...]
        [--configs default prefill-model quantize-none] [--llama-server PATH] [--tokens 48] [--json FILE]

Prompts: ``benchmarks/data/fidelity.json``, 24 everyday chat questions (rendered with the model's
chat template) for a model that has one, else 24 completion openings; greedy, up to ``--tokens``
new tokens, stopping at the end-of-sequence token. Per configuration:
- identical answers: generated text equal to the reference's;
- mean shared prefix: characters the text shares with the reference's from its start;
- top-1 agreement: the prompt through the configuration's prompt path, then the reference's
  tokens fed one decode step at a time (teacher forcing); the share of steps whose argmax is the
  reference's next token;
- perplexity ratio: ``benchmarks/data/fidelity_heldout.txt`` (plain English written for this)
  through the configuration's prompt path in one call, every row scored, over the reference's.

Ours is measured in-process, through the very path the service takes: ``service.settings.Settings``
read with the configuration's environment (``default``: none; ``prefill-model``:
``TSERVE_PREFILL=model``; ``quantize-none``: ``TSERVE_QUANTIZE=none``; ``stored``:
``TSERVE_GGUF_WEIGHTS=stored``, the file's blocks read as stored) gives the ``DecodeOptions``,
``model.decode.prepare`` the step, and ``model.generate`` runs the engine's loop with it.

llama-server (``--llama-server``, default /work/tools/llama.cpp/build/bin/llama-server, skipped
when absent) serves the same file: answers through HTTP ``/completion`` with the same prompt token
ids, temperature 0, ``n_predict`` tokens; top-1 agreement one ``n_predict=1`` request per prefix of
the reference's answer (its prompt cache keeps that one step each). Its perplexity comes from
``llama-perplexity`` beside it (if built): that tool scores the second half of each window of
``--ppl-ctx`` tokens, so the reference is scored that way too for that row's ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.server_process import ServerProcess, free_port

DATA = REPO_ROOT / "benchmarks" / "data"
# the last two: the default with the native step's int8 activations quantized per row throughout (as before)
# or per run in decode steps only (NativeStep's ``activations``), for comparisons
CONFIGS = {"default": {}, "prefill-model": {"TSERVE_PREFILL": "model"}, "quantize-none": {"TSERVE_QUANTIZE": "none"},
           "stored": {"TSERVE_GGUF_WEIGHTS": "stored"}, "rows": {}, "runs-decode": {}}
LLAMA_BIN = Path("/work/tools/llama.cpp/build/bin")


def gguf_path(name: str) -> Path:
    from model.formats.manifest import locate, read_manifest

    path = Path(name)
    return path if path.suffix == ".gguf" else locate(read_manifest(REPO_ROOT / "weights" / name))


def prompts_for(ckpt) -> tuple[str, list[list[int]]]:
    """("chat" | "completion", the prompts' token ids as the service would build them)."""
    from model.tokenization.chat_template import ChatTemplate

    data = json.loads((DATA / "fidelity.json").read_text(encoding="utf-8"))
    tok, cfg = ckpt.tokenizer, ckpt.model.cfg
    if ckpt.chat_template is None:
        return "completion", [tok.encode(p) for p in data["completion"]]
    special = {k: None if i is None else tok.id_to_token(i)
               for k, i in (("bos_token", cfg.bos_token_id), ("eos_token", cfg.eos_token_id))}
    template = ChatTemplate(ckpt.chat_template, **special)
    return "chat", [tok.encode(template.render([{"role": "user", "content": q}]), add_special_tokens=False)
                    for q in data["chat"]]


def heldout_ids(tokenizer) -> list[int]:
    return tokenizer.encode((DATA / "fidelity_heldout.txt").read_text(encoding="utf-8"))


def shared_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def until_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos is not None and eos in ids else ids


# --- the reference: transformers, float32, the same file ---------------------------------------------

class Reference:
    def __init__(self, path: Path):
        self.path, self._model = path, None

    @property
    def model(self):
        if self._model is None:
            import transformers

            self._model = transformers.AutoModelForCausalLM.from_pretrained(
                self.path.parent, gguf_file=self.path.name, dtype=torch.float32).eval()
        return self._model

    @torch.inference_mode()
    def generate(self, prompt: list[int], n: int, eos: int | None) -> list[int]:
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos if eos is not None else 0)
        return until_eos(out[0, len(prompt):].tolist(), eos)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0].float()


def reference_figures(reference: Reference, gguf: Path, prompts, heldout, n: int, eos) -> tuple[list, float]:
    """The reference's answers and perplexity, kept in build/fidelity/ under a digest of the file's
    size and name, the prompts, the text and ``n`` (a 2-core run of transformers takes minutes)."""
    import hashlib

    key = json.dumps([gguf.name, gguf.stat().st_size, prompts, heldout, n, eos, transformers_version()])
    kept = REPO_ROOT / "build" / "fidelity" / f"reference-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if kept.is_file():
        data = json.loads(kept.read_text())
        return data["answers"], data["ppl"]
    answers = [reference.generate(p, n, eos) for p in prompts]
    ppl = math.exp(sum(nll(reference.logits(heldout)[:-1], heldout[1:])) / (len(heldout) - 1))
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"answers": answers, "ppl": ppl}))
    return answers, ppl


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def nll(logits: torch.Tensor, targets: list[int]) -> list[float]:
    """-log p of each target under the row of ``logits`` before it."""
    lp = logits.log_softmax(-1)
    return [-float(lp[i, t]) for i, t in enumerate(targets)]


def windowed_ppl(logits_of, ids: list[int], ctx: int) -> float:
    """llama-perplexity's protocol: windows of ``ctx`` tokens, the second half of each scored."""
    losses = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        window = ids[start: start + ctx]
        lg = logits_of(window)
        losses += nll(lg[ctx // 2 - 1: ctx - 1], window[ctx // 2:])
    return math.exp(sum(losses) / len(losses))


# --- ours, in-process ------------------------------------------------------------------------------

@contextmanager
def environment(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Ours:
    """One configuration: a fresh load of the model, the step the service's settings choose."""

    def __init__(self, source: Path, env: dict[str, str], activations: str = "runs"):
        from model import load_model
        from model.decode import prepare
        from model.decode.native import NativeStep
        from model.decode.step import kv_cache_dtype, prepare_weights
        from service.settings import Settings

        with environment(env):  # (the load reads TSERVE_GGUF_WEIGHTS)
            options = Settings().decode_options()
            self.ckpt = load_model(source)
        self.model = self.ckpt.model.eval()
        if activations == "runs":
            self.step = prepare(self.model, options, self.ckpt.tokenizer)
        else:  # what prepare builds by default, with the native step's int8 activations as asked
            prepare_weights(self.model, options, self.ckpt.tokenizer)
            auto, kv = options.prefill == "auto", kv_cache_dtype(options.kv_dtype, self.model, True)
            self.step = NativeStep(self.model, options.native_library, kv, prefills=auto,
                                   weights4=options.weights == "auto", lean=auto, activations=activations)
        self.options = options

    def _prompt(self, cache, ids: list[int], logit_rows: list[int] | None = None) -> torch.Tensor:
        """The prompt through the configuration's prompt path (the native step's, or the model's
        float forward), written into slot 0; the logits of ``logit_rows`` (default: the last)."""
        native_prompts = getattr(self.step, "prefills", False)
        if native_prompts:
            return self.step.prefill_rows(cache, [ids], [0], logit_rows or [len(ids) - 1])
        if logit_rows is None:
            return self.model.prefill(cache, [ids], [0])
        return self.model(torch.tensor([ids]))[0, logit_rows].float()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int, eos: int | None) -> list[list[int]]:
        from model import SamplingParams, generate

        params = SamplingParams(max_new_tokens=n, temperature=0.0)
        return [until_eos(r.token_ids, eos)
                for r in generate(self.model, prompts, params, self.ckpt.tokenizer, step=self.step)]

    @torch.inference_mode()
    def agreement(self, prompt: list[int], answer: list[int]) -> tuple[int, int]:
        """(steps whose argmax is the answer's next token, steps): teacher forcing."""
        cache = self.model.new_cache(1, len(prompt) + len(answer) + 1, dtype=self.step.kv_dtype)
        logits = self._prompt(cache, prompt)
        same = int(int(logits[-1].argmax()) == answer[0])
        for i, tok in enumerate(answer[:-1]):
            logits = self.step(cache, torch.tensor([tok]), [0], [len(prompt) + i])
            same += int(int(logits[0].argmax()) == answer[i + 1])
        return same, len(answer)

    @torch.inference_mode()
    def perplexity(self, ids: list[int]) -> float:
        cache = self.model.new_cache(1, len(ids) + 1, dtype=self.step.kv_dtype)
        logits = self._prompt(cache, ids, list(range(len(ids) - 1)))
        return math.exp(sum(nll(logits, ids[1:])) / (len(ids) - 1))


# --- llama-server ----------------------------------------------------------------------------------

class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, log: Path, threads: int):
        port = free_port()
        argv = [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
                "--parallel", "1", "-c", "4096", "--no-webui"]
        self.server = ServerProcess(argv, log, port=port, ready_path="/health", ready_timeout_s=600)
        self.client = httpx.Client(timeout=600)

    def __enter__(self) -> LlamaServer:
        self.server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.server.__exit__(*exc)

    def complete(self, prompt: list[int], n: int) -> list[int]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": True,
                "return_tokens": True, "seed": 0}
        r = self.client.post(self.server.url + "/completion", json=body)
        r.raise_for_status()
        return list(r.json()["tokens"])

    def generate(self, prompt: list[int], n: int, eos: int | None) -> list[int]:
        ids = self.complete(prompt, n)
        # llama-server stops at end-of-generation tokens without returning them; keep the reference's form
        return until_eos(ids + ([eos] if eos is not None and len(ids) < n else []), eos)

    def agreement(self, prompt: list[int], answer: list[int]) -> tuple[int, int]:
        same = sum(int((self.complete(prompt + answer[:i], 1) or [None])[0] == answer[i]) for i in range(len(answer)))
        return same, len(answer)


def llama_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, threads: int) -> float | None:
    if not binary.exists():
        return None
    run = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                          "-t", str(threads)], capture_output=True, text=True, timeout=1800)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    return float(found.group(1)) if found else None


def speed(models: list[str], reps: int) -> None:
    """Tokens/s of the default step built with each int8 activation mode, in one process, alternated:
    a 256-token prompt through its prefill, 20 decode steps at batch 1 and 10 at batch 8."""
    import statistics
    import time

    modes = ("rows", "runs-decode", "runs")
    print("| model | int8 activations | prompt tok/s (256) | decode tok/s, batch 1 | decode tok/s, batch 8 |")
    print("|---|---|---|---|---|")
    for name in models:
        built = {m: Ours(REPO_ROOT / "weights" / name, {}, m) for m in modes}
        ids = list(range(100, 356))
        got: dict[str, dict[str, list[float]]] = {m: {"prompt": [], "b1": [], "b8": []} for m in modes}
        with torch.inference_mode():
            for _ in range(reps):
                for m, ours in built.items():
                    step, cache = ours.step, ours.model.new_cache(8, 400, dtype=ours.step.kv_dtype)
                    t = time.perf_counter()
                    step.prefill(cache, [ids], [0])
                    got[m]["prompt"].append(len(ids) / (time.perf_counter() - t))
                    step.prefill(cache, [ids[:40]] * 7, list(range(1, 8)))
                    t = time.perf_counter()
                    for i in range(20):
                        step(cache, torch.tensor([5]), [0], [256 + i])
                    got[m]["b1"].append(20 / (time.perf_counter() - t))
                    t = time.perf_counter()
                    for i in range(10):
                        step(cache, torch.tensor([5] * 8), list(range(8)), [276 + i] + [40 + i] * 7)
                    got[m]["b8"].append(80 / (time.perf_counter() - t))
        for m in modes:
            med = {k: statistics.median(v) for k, v in got[m].items()}
            print(f"| {name} | {m} | {med['prompt']:.0f} | {med['b1']:.1f} | {med['b8']:.1f} |", flush=True)


# --- the report ------------------------------------------------------------------------------------

def measure(system, prompts, reference_answers, tokenizer, eos, n) -> dict:
    answers = system.generate(prompts, n, eos) if isinstance(system, Ours) else \
        [system.generate(p, n, eos) for p in prompts]
    ref_texts = [tokenizer.decode(a) for a in reference_answers]
    texts = [tokenizer.decode(a) for a in answers]
    agree = [system.agreement(p, a) for p, a in zip(prompts, reference_answers)]
    return {"identical": sum(a == b for a, b in zip(texts, ref_texts)), "prompts": len(prompts),
            "shared_prefix": sum(shared_prefix(a, b) for a, b in zip(texts, ref_texts)) / len(prompts),
            "top1": sum(s for s, _ in agree) / sum(t for _, t in agree), "texts": texts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--gguf", nargs="*", default=[], type=Path, help="GGUF files by path, served as they are")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS)[:3], choices=list(CONFIGS))
    parser.add_argument("--speed", action="store_true",
                        help="instead: prompt and decode tokens/s of the default step under each int8 activation mode")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_BIN / "llama-server")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--ppl-ctx", type=int, default=256, help="llama-perplexity's window (-c)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--reps", type=int, default=3, help="--speed: repetitions, modes alternated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.speed:
        return speed(args.models, args.reps)
    sources = [(m, REPO_ROOT / "weights" / m, gguf_path(m)) for m in args.models]
    sources += [(p.stem, p, p) for p in args.gguf]
    print("ours: in-process, the step service.settings.Settings chooses under each configuration's environment, "
          "run by model.generate (the engine's loop)", flush=True)
    report = {}
    header = ("| model | system | identical answers | mean shared prefix (chars) | top-1 agreement "
              "| perplexity ratio |")
    rows = [header, "|---|---|---|---|---|---|"]
    for name, source, gguf in sources:
        reference = Reference(gguf)  # loaded lazily: its figures may be kept from an earlier run
        for i, config in enumerate(args.configs):
            activations = config if config in ("rows", "runs-decode") else "runs"
            system = Ours(source, CONFIGS[config], activations)  # one configuration loaded at a time
            if i == 0:
                ckpt = system.ckpt
                kind, prompts = prompts_for(ckpt)
                eos = ckpt.model.cfg.eos_token_id
                heldout = heldout_ids(ckpt.tokenizer)
                ref_answers, ref_ppl = reference_figures(reference, gguf, prompts, heldout, args.tokens, eos)
                print(f"{name}: {kind} prompts, reference perplexity {ref_ppl:.3f} over {len(heldout)} tokens",
                      flush=True)
                report[name] = {"kind": kind, "reference_ppl": ref_ppl,
                                "reference": [ckpt.tokenizer.decode(a) for a in ref_answers], "systems": {}}
            result = measure(system, prompts, ref_answers, ckpt.tokenizer, eos, args.tokens)
            result["ppl_ratio"] = system.perplexity(heldout) / ref_ppl
            label = f"ours, {config}" + (f" ({system.step.name} step)" if config == "default" else "")
            report[name]["systems"][label] = result
            rows.append(f"| {name} | {label} | {result['identical']} / {result['prompts']} | "
                        f"{result['shared_prefix']:.0f} | {result['top1']:.1%} | {result['ppl_ratio']:.4f} |")
            print(rows[-1], flush=True)
            del system
        if args.llama_server.exists():
            log = REPO_ROOT / "build" / "fidelity" / f"{name}-llama-server.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with LlamaServer(args.llama_server, gguf, log, args.threads) as peer:
                result = measure(peer, prompts, ref_answers, ckpt.tokenizer, eos, args.tokens)
            with tempfile.NamedTemporaryFile("w", suffix=".txt") as text:
                text.write((DATA / "fidelity_heldout.txt").read_text(encoding="utf-8"))
                text.flush()
                ppl = llama_perplexity(args.llama_server.with_name("llama-perplexity"), gguf, Path(text.name),
                                       args.ppl_ctx, args.threads)
            if ppl is not None:
                ref_windowed = windowed_ppl(reference.logits, heldout, args.ppl_ctx)
                result["ppl_ratio"] = ppl / ref_windowed
            ratio = f"{result['ppl_ratio']:.4f} (llama-perplexity, -c {args.ppl_ctx})" if ppl is not None else "n/a"
            report[name]["systems"]["llama-server"] = result
            rows.append(f"| {name} | llama-server | {result['identical']} / {result['prompts']} | "
                        f"{result['shared_prefix']:.0f} | {result['top1']:.1%} | {ratio} |")
            print(rows[-1], flush=True)
        else:
            print(f"no llama-server at {args.llama_server}: its row is left out", flush=True)
    print("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
