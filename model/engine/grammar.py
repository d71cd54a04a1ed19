"""Constrained decoding: what a request's output must match, compiled once, matched per step.

    compiler = GrammarCompiler(tokenizer, vocab_size=model.cfg.vocab_size, eos_id=model.cfg.eos_token_id)
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))   # cached
    matcher = grammar.matcher()          # one per request: fills its row of the step's bitmask,
    matcher.accept(token)                # advances in the update phase

As in vLLM's ``v1/structured_output``: a grammar per request, one token bitmask per step
(bit ``t`` of row ``r``: token ``t`` is allowed for row ``r``), applied by the batched sampler,
compiled grammars cached. The backend is llguidance (why: ``benchmarks/studies/grammar.py``); it sits
behind ``GrammarBackend`` so another engine (xgrammar) would be one class. Compilation is
thread-safe and meant to run off the engine thread (the service runs it in a thread pool
with a deadline); llguidance also bounds its own work per mask (``LLParserLimits``), so a
hostile grammar cannot stall a step. The end-of-sequence token is allowed only where the
grammar accepts; a matcher that has nothing more to match is ``done``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from model.tokenization.tokenizer import Tokenizer

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
DEFAULT_CACHE_SIZE = 256
# Compact, deterministic JSON: a small model given free whitespace may emit it forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. ``value``: a JSON Schema (JSON text) for ``json_schema``,
    ignored for ``json_object`` (any JSON object), a regular expression (Rust ``regex``
    syntax, whole output) for ``regex``, a JSON list of strings for ``choice``, a Lark grammar
    (llguidance's dialect, ``start`` rule; ``%json {schema}`` embeds a JSON Schema) or a GBNF
    grammar (``root ::= ...``, translated to Lark) for ``lark``."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")


class GrammarMatcher(Protocol):
    backend: GrammarBackend  # fills the step's bitmask for all its matchers at once

    def accept(self, token: int) -> bool: ...  # False: the token broke the grammar (the mask was not applied)
    @property
    def done(self) -> bool: ...  # the grammar matched whole and allows nothing more (but the end)
    @property
    def accepting(self) -> bool: ...  # the output so far is a complete match
    @property
    def error(self) -> str: ...  # why the matcher stopped accepting ("" while it has not)


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    words: int  # int32 words per bitmask row

    def compile(self, spec: GrammarSpec) -> CompiledGrammar: ...
    def fill(self, matchers: list[tuple[GrammarMatcher, int]], bitmask: Tensor) -> None:
        """Write each matcher's allowed tokens into row ``index`` of ``bitmask`` (int32, on the CPU)."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """(B, ceil(V/32)) int32 bitmask -> (B, V) bool: bit ``t % 32`` of word ``t // 32``."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]  # (B, V)


def _choice_grammar(value: str) -> str:
    try:
        choices = json.loads(value)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    # Lark string literals take JSON's escapes
    return "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))


def compact_json(lark: str) -> str:
    """A Lark grammar whose embedded JSON Schemas (``%json {...}``) that say nothing of their
    own layout get ``JSON_OPTIONS``: llguidance's default lets whitespace run free there."""
    out, at, decoder = [], 0, json.JSONDecoder()
    while (i := lark.find("%json", at)) >= 0:
        start = i + len("%json")
        while start < len(lark) and lark[start] in " \t":
            start += 1
        try:
            schema, end = decoder.raw_decode(lark, start)
        except json.JSONDecodeError:
            out.append(lark[at:start])
            at = start
            continue
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": JSON_OPTIONS}
        out.append(lark[at:start] + json.dumps(schema, ensure_ascii=False))
        at = end
    return "".join(out) + lark[at:]


class LLGuidanceMatcher:
    def __init__(self, m, backend: LLGuidanceBackend):
        self.m, self.backend = m, backend

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    @property
    def done(self) -> bool:
        return self.m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()

    @property
    def error(self) -> str:
        return _short(self.m.get_error().replace("<non-verbose/>", "")) if self.m.is_error() else ""


class LLGuidanceGrammar:
    """A validated grammar: a matcher built once, copied for each request (its lexer and
    parser tables are shared)."""

    def __init__(self, template, backend: LLGuidanceBackend):
        self.template, self.backend = template, backend

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.backend)


class LLGuidanceBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_id: int):
        import llguidance
        import llguidance.torch

        self.llg, self.fill_par = llguidance, llguidance.torch.fill_next_token_bitmask_par
        # the model's vocabulary may be padded past the tokenizer's: those tokens are never allowed
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=max(vocab_size, tokenizer.vocab_size),
                                                eos_token=eos_id)
        # masks are filled between forward passes, when the cores the forward pass used are free
        self.executor = llguidance.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        self.words = bitmask_words(self.tokenizer.vocab_size)

    def grammar_text(self, spec: GrammarSpec) -> str:
        M = self.llg.LLMatcher
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
            try:
                return M.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            except (ValueError, TypeError) as exc:
                raise GrammarError(f"not a JSON schema: {exc}") from None
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return M.grammar_from_lark(_choice_grammar(spec.value))
        if "::=" in spec.value:  # GBNF (llama.cpp's, vLLM's EBNF under xgrammar): llguidance translates it
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                return M.grammar_from_lark(gbnf_to_lark(spec.value))
            except Exception as exc:  # noqa: BLE001 - the converter's errors are the grammar's fault
                raise GrammarError(f"GBNF grammar: {_short(str(exc))}") from None
        return M.grammar_from_lark(compact_json(spec.value))

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        text = self.grammar_text(spec)
        m = self.llg.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(_short(m.get_error()))
        # build the lexer's first state now (llguidance is lazy), so errors and cost land here
        probe = torch.zeros(1, bitmask_words(self.tokenizer.vocab_size), dtype=torch.int32)
        self.fill_par(self.executor, [(m, 0)], probe)
        if m.is_error():
            raise GrammarError(_short(m.get_error()))
        if not probe.any():
            raise GrammarError("the grammar allows no output at all")
        return LLGuidanceGrammar(m, self)

    def fill(self, matchers: list[tuple[LLGuidanceMatcher, int]], bitmask: Tensor) -> None:
        """``bitmask`` (B, words) int32, contiguous, on the CPU."""
        self.fill_par(self.executor, [(m.m, row) for m, row in matchers], bitmask)


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 1] + "…"


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer, through an LRU cache of ``cache_size`` grammars
    keyed by (tokenizer, kind, text). Thread-safe; the backend is built on first use (about
    half a second for a 49k vocabulary), so models never asked for a grammar never pay for it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_id: int | None,
                 cache_size: int = DEFAULT_CACHE_SIZE):
        if eos_id is None:
            raise GrammarError("constrained decoding needs a model with an end-of-sequence token")
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.cache_size = cache_size
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_key = ""
        self.hits = self.misses = 0

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = LLGuidanceBackend(self.tokenizer, self.vocab_size, self.eos_id)
                self._tokenizer_key = hashlib.blake2b(self.tokenizer.tk.to_str().encode(), digest_size=16).hexdigest()
            return self._backend

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self.lookup(spec)[0]

    def lookup(self, spec: GrammarSpec) -> tuple[CompiledGrammar, bool]:
        """The compiled grammar and whether it came from the cache."""
        backend = self.backend
        key = (self._tokenizer_key, spec.kind, spec.value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key], True
        grammar = backend.compile(spec)  # outside the lock: compiles run in parallel
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar, False

    def __len__(self) -> int:
        return len(self._cache)
