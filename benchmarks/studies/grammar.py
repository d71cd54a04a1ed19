"""Grammar engines for constrained decoding: xgrammar 0.2.8 against llguidance 1.9, on our tokenizers.

    python -m benchmarks.studies.grammar [--steps 40] [--repeat 5]      # the two engines, in-process
    python -m benchmarks.studies.grammar --throughput [--tokens 64]     # constrained vs free decoding, SmolLM2

Measured in-process (no model, no HTTP), on the tokenizers we serve: SmolLM2-135M-Instruct's
(49 152 byte-level BPE tokens, rebuilt from its GGUF as the service does) and the 320-token BPE
of the test models. For each engine and tokenizer:
- tokenizer set-up (once per model: the vocabulary preprocessed for masks);
- compile: a typical tool schema (``TOOL_SCHEMA``) from nothing to a matcher ready for its
  first mask, no cache (each engine's own cache off or a fresh compiler);
- mask: filling the token bitmask of a batch of 1, 8 and 32 matchers, per step, while each
  matcher walks the tokens of a valid instance (the tokenizer's own encoding of it), i.e. the
  work the engine adds to one decode step; and the time to advance them (consume a token).

``--throughput``: SmolLM2-135M-Instruct through the engine core with the service's decode step
(``model.decode.prepare`` with the default options: int8 + the native C++ step on this CPU),
batch 1, 8 and 32, ``--tokens`` greedy tokens per request after one shared prompt; free rows
(``ignore_eos``) against rows constrained to ``LIST_SCHEMA`` (a list of 100+ tool-call
argument objects, so they never finish early). tokens/s = generated tokens / wall time of the
steps after the first token (prefill excluded), best of ``--repeat`` runs (the machine is shared: the
best run is the one least disturbed), free and
constrained alternated after a warm-up run.

The choice: llguidance (``model/engine/grammar.py``). Numbers in docs/structured-outputs.md
(2 shared cores, in-process); why:
- compile is what a request waits for before its first token, and what a hostile schema
  attacks: llguidance builds its parser lazily (~0.5 ms to the first mask for the tool
  schema on SmolLM2's vocabulary), xgrammar precomputes its token cache up front (~6-15 ms,
  growing with the schema; its native compile cannot be interrupted);
- llguidance never raises on a bad grammar or token (the matcher enters an error state we
  report) and bounds its own work per mask (``LLParserLimits``), which is what an engine
  thread shared by every request needs; its executor fills a whole batch's masks in native
  code from one Python call;
- per mask xgrammar is faster once compiled (~5-8x: 0.05 ms against 0.4 ms median for 32
  rows), but both are far below one decode step of the 135M model (several ms at batch 1,
  tens of ms at batch 32), so the mask is not what bounds constrained throughput;
- llguidance is one Rust wheel without dependencies; xgrammar brings transformers and a TVM
  FFI runtime into the service.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string", "enum": ["temp", "wind", "rain", "uv"]}},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
INSTANCE = {"location": "Paris, France", "unit": "celsius", "days": 3, "include_hourly": False,
            "fields": ["temp", "wind"]}
SMOLLM2 = Path("weights/smollm2-135m-instruct")


def smollm2_tokenizer():
    from model.formats.gguf_import import GGUFFile
    from model.formats.manifest import locate, read_manifest
    from model.tokenization.gguf_vocab import byte_level_tokenizer
    return byte_level_tokenizer(GGUFFile(locate(read_manifest(SMOLLM2))).get)


def tiny_tokenizer():
    from model.tokenization.tokenizer import train_bpe
    from tests.service.conftest import CORPUS
    return train_bpe(CORPUS, vocab_size=320, template="<s> $A")


def _ms(xs: list[float]) -> str:
    """median / mean / max in milliseconds"""
    return f"{statistics.median(xs) * 1e3:.3f} / {statistics.fmean(xs) * 1e3:.3f} / {max(xs) * 1e3:.3f} ms"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, eos: int):
        import llguidance
        import llguidance.torch as lt
        self.llg, self.lt = llguidance, lt
        t0 = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok.tk.to_str(), eos_token=eos)
        self.setup = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor()
        self.vocab = tok.vocab_size

    def compile(self, schema: str):
        m = self.llg.LLMatcher(self.tokenizer, self.llg.LLMatcher.grammar_from_json_schema(schema))
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, batch: int):
        return self.lt.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, mask) -> None:
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def advance(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.consume_token(token), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, eos: int):
        import xgrammar
        self.xgr = xgrammar
        t0 = time.perf_counter()
        vocab = tok.tk.get_vocab(with_added_tokens=True)
        encoded = [""] * len(vocab)
        for piece, i in vocab.items():
            encoded[i] = piece
        self.info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
        self.setup = time.perf_counter() - t0
        self.vocab = tok.vocab_size

    def compile(self, schema: str):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return self.xgr.GrammarMatcher(compiler.compile_json_schema(schema))

    def bitmask(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, mask) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def advance(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)


def measure(engine, tok, eos: int, steps: int, repeat: int) -> dict:
    schema = json.dumps(TOOL_SCHEMA)
    compile_s = []
    for _ in range(repeat):  # to the first mask: llguidance builds lazily, so its first mask pays for it
        t0 = time.perf_counter()
        engine.fill([engine.compile(schema)], engine.bitmask(1))
        compile_s.append(time.perf_counter() - t0)
    tokens = tok.encode(json.dumps(INSTANCE), add_special_tokens=False)[:steps]
    out = {"setup": f"{engine.setup * 1e3:.0f} ms", "compile+first mask": _ms(compile_s)}
    for batch in (1, 8, 32):
        fill_s, advance_s = [], []
        for _ in range(max(1, repeat // 2)):
            matchers = [engine.compile(schema) for _ in range(batch)]
            mask = engine.bitmask(batch)
            for t in tokens:
                t0 = time.perf_counter()
                engine.fill(matchers, mask)
                t1 = time.perf_counter()
                engine.advance(matchers, t)
                fill_s.append(t1 - t0)
                advance_s.append(time.perf_counter() - t1)
        out[f"mask b={batch}"] = _ms(fill_s)
        out[f"advance b={batch}"] = _ms(advance_s)
    return out


LIST_SCHEMA = {"type": "array", "items": TOOL_SCHEMA, "minItems": 100}


def throughput(tokens: int, repeat: int, batches: list[int]) -> None:
    import torch

    from model import SamplingParams, load_model
    from model.decode import DecodeOptions, prepare
    from model.engine import EngineCore, EngineRequest, GrammarSpec

    torch.set_grad_enabled(False)
    ckpt = load_model(SMOLLM2)
    step = prepare(ckpt.model, DecodeOptions(), ckpt.tokenizer)
    prompt = ckpt.tokenizer.encode("<|im_start|>user\nList the weather for ten cities as JSON.<|im_end|>\n"
                                   "<|im_start|>assistant\n", add_special_tokens=False)
    spec = GrammarSpec("json_schema", json.dumps(LIST_SCHEMA))
    print(f"## throughput: SmolLM2-135M-Instruct, {type(step).__name__}, {torch.get_num_threads()} threads, "
          f"{tokens} tokens per request (best of {repeat})")
    for batch in batches:
        core = EngineCore(ckpt.model, ckpt.tokenizer, n_slots=batch, max_len=len(prompt) + tokens + 1,
                          max_prefill_tokens=batch * len(prompt), step=step)
        row = {"free": 0.0, "constrained": 0.0}
        compiled = core.grammars.compile(spec)
        for r in range(repeat + 1):  # alternated, so both see the same machine; run 0 warms up
            for label, grammar in (("free", None), ("constrained", compiled)):
                for i in range(batch):
                    core.add(EngineRequest(f"{label}{r}-{i}", prompt, SamplingParams(
                        max_new_tokens=tokens, temperature=0.0, ignore_eos=grammar is None), grammar=grammar))
                core.step()  # the prompts and the first tokens
                t0, n = time.perf_counter(), 0
                while core.has_work:
                    n += sum(len(e.token_ids) for e in core.step().events)
                if r:
                    row[label] = max(row[label], n / (time.perf_counter() - t0))
        print(f"batch {batch:>2}: free {row['free']:7.1f} tok/s, constrained {row['constrained']:7.1f} tok/s "
              f"({(row['constrained'] / row['free'] - 1) * 100:+.1f} %)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="tokens of the instance walked per run")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--throughput", action="store_true", help="constrained vs free decoding on SmolLM2")
    ap.add_argument("--tokens", type=int, default=64, help="--throughput: tokens per request")
    ap.add_argument("--batches", default="1,8,32", help="--throughput: batch sizes, comma-separated")
    args = ap.parse_args(argv)
    if args.throughput:
        return throughput(args.tokens, args.repeat, [int(b) for b in args.batches.split(",")])
    tokenizers = [("tiny BPE (320)", tiny_tokenizer, 2)]
    try:
        tokenizers.insert(0, ("SmolLM2 (49152)", smollm2_tokenizer, 2))
    except Exception:  # noqa: BLE001 - the chat model's package is optional
        pass
    for label, load, eos in tokenizers:
        tok = load()
        n = len(tok.encode(json.dumps(INSTANCE), add_special_tokens=False))
        print(f"## {label} (median / mean / max): {n} tokens in the instance")
        for cls in (LLGuidance, XGrammar):
            print(f"{cls.name:>11}:", json.dumps(measure(cls(tok, eos), tok, eos, args.steps, args.repeat)))


if __name__ == "__main__":
    main()
