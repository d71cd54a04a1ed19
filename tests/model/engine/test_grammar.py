"""Constrained decoding in the engine: the bitmask is one more input to the batched sampler,
the matcher advances in the update phase, and outputs match their grammar for any seed."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from model import SamplingParams, build_model, generate
from model.engine import EngineCore, EngineRequest, GrammarError, GrammarSpec
from model.engine.grammar import GrammarCompiler, allowed_tokens
from model.engine.sampling import Sampler
from model.tokenization.tokenizer import train_bpe
from tests.service.conftest import CORPUS, _arch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "unit", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return train_bpe(CORPUS, vocab_size=320, template="<s> $A")


@pytest.fixture(scope="module")
def lm(tok):
    cfg = _arch("decoder", tok.vocab_size + 3, bos_token_id=1, eos_token_id=2, norm_placement="pre",
                final_norm=True, positional="learned", activation="gelu_new", max_positions=256)  # a padded vocabulary
    return build_model(cfg).init_weights(5).eval()


def spec(schema=SCHEMA) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def sampled(seed: int | None, n: int = 80, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=kw.pop("temperature", 1.0), seed=seed, **kw)


def constrained(core: EngineCore, request_id: str, ids: list[int], params: SamplingParams,
                grammar: GrammarSpec) -> EngineRequest:
    """A request carrying its grammar compiled, as the engine takes it."""
    return EngineRequest(request_id, ids, params, grammar=core.grammars.compile(grammar))


def prompt(tok, i: int = 0) -> list[int]:
    return tok.encode(CORPUS[i % 4][: 20 + 7 * i])


def test_sampler_never_draws_a_masked_token_and_leaves_free_rows_alone(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    logits = torch.randn(6, 50, generator=g) * 4
    allowed = torch.rand(6, 50, generator=g) < 0.1
    allowed[:, 7] = True  # at least one token per row
    allowed[5] = True  # a free row
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, repetition_penalty=1.3, seed=fresh_seed + i)
              for i, (t, k, p) in enumerate([(0, 0, 1), (1, 0, 1), (2, 5, 1), (0.7, 0, 0.8), (5, 0, 1), (1, 0, 1)])]
    seen = torch.rand(6, 50, generator=g) < 0.2
    for _ in range(50):
        out = Sampler()(logits, params, None, seen, None, allowed)
        assert allowed[torch.arange(6), out.tokens].all()
    gens = [torch.Generator().manual_seed(7) for _ in range(2)]
    free = Sampler()(logits[5:], params[5:], gens[:1], seen[5:], None, None)
    mixed = Sampler()(logits, params, [None] * 5 + gens[1:], seen, None, allowed)
    assert mixed.tokens[5] == free.tokens[0]  # the free row's distribution is the unconstrained one


def test_bitmask_bits_are_tokens():
    mask = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)
    allowed = allowed_tokens(mask, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2] + list(range(32, 64))
    assert allowed[1].nonzero().flatten().tolist() == [63]


@pytest.mark.parametrize("seed", range(12))
def test_outputs_validate_against_the_schema_for_any_seed(lm, tok, seed):
    result = generate(lm, [prompt(tok, seed)], sampled(seed, 120), tokenizer=tok, grammar=spec())[0]
    assert result.finish_reason in ("stop", "eos"), result
    jsonschema.validate(json.loads(result.text), SCHEMA)
    # every token was one the grammar allowed: a fresh matcher accepts the whole sequence
    matcher = GrammarCompiler(tok, lm.cfg.vocab_size, 2).compile(spec()).matcher()
    assert all(matcher.accept(t) for t in result.token_ids) and matcher.accepting
    assert all(t < tok.vocab_size for t in result.token_ids)  # never a padding token of the vocabulary


def test_regex_choice_and_lark(lm, tok):
    kinds = [(GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,5}"), r"^[0-9]{3}-[a-z]{2,5}$"),
             (GrammarSpec("choice", json.dumps(["yes", "no", "it \"depends\""])), r'^(yes|no|it "depends")$'),
             (GrammarSpec("lark", 'start: "(" num ("," num)* ")"\nnum: /[1-9][0-9]?/'),
              r"^\([1-9][0-9]?(,[1-9][0-9]?)*\)$")]
    for seed in range(4):
        for grammar, pattern in kinds:
            r = generate(lm, [prompt(tok, seed)], sampled(seed, 40), tokenizer=tok, grammar=grammar)[0]
            assert r.finish_reason == "length" or re.match(pattern, r.text), (grammar, r)
    obj = generate(lm, [prompt(tok)], sampled(3, 200), tokenizer=tok, grammar=GrammarSpec("json_object"))[0]
    if obj.finish_reason != "length":
        assert isinstance(json.loads(obj.text), dict)


def test_batched_constrained_and_free_rows_equal_one_at_a_time(lm, tok):
    grammars = [spec(), None, GrammarSpec("regex", "[a-z ]{1,30}"), None, spec(), GrammarSpec("json_object")]
    params = [sampled(40 + i, 30, temperature=[0.0, 1.0][i % 2]) for i in range(len(grammars))]
    prompts = [prompt(tok, i) for i in range(len(params))]
    together = generate(lm, prompts, params, tokenizer=tok, grammar=grammars)
    for i, (p, sp, g) in enumerate(zip(prompts, params, grammars)):
        alone = generate(lm, [p], sp, tokenizer=tok, grammar=g)[0]
        assert together[i].token_ids == alone.token_ids, i
    free = [generate(lm, [p], sampled(40 + i, 30, temperature=[0.0, 1.0][i % 2]), tokenizer=tok)[0]
            for i, p in enumerate(prompts) if grammars[i] is None]
    assert [r.token_ids for r in free] == [together[1].token_ids, together[3].token_ids]


def test_max_tokens_inside_a_value_ends_with_length(lm, tok):
    long = {"type": "object", "properties": {"text": {"type": "string", "minLength": 50}}, "required": ["text"]}
    r = generate(lm, [prompt(tok)], sampled(1, 10), tokenizer=tok, grammar=spec(long))[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 10
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_eos_only_where_the_grammar_accepts(lm, tok):
    grammar = GrammarCompiler(tok, lm.cfg.vocab_size, 2).compile(GrammarSpec("regex", "ab?"))
    matcher = grammar.matcher()
    mask = torch.zeros(1, matcher.backend.words, dtype=torch.int32)

    def allowed() -> set[int]:
        matcher.backend.fill([(matcher, 0)], mask)
        return set(allowed_tokens(mask, lm.cfg.vocab_size)[0].nonzero().flatten().tolist())

    assert 2 not in allowed() and tok.token_to_id("a") in allowed()
    assert matcher.accept(tok.token_to_id("a")) and matcher.accepting and not matcher.done
    assert 2 in allowed() and tok.token_to_id("b") in allowed()
    assert matcher.accept(tok.token_to_id("b")) and matcher.done
    assert allowed() == {2}


def test_beam_search_refuses_a_grammar(lm, tok):
    core = EngineCore(lm, tok, n_slots=4, max_len=64)
    with pytest.raises(ValueError, match="beam search cannot follow a grammar"):
        core.add(constrained(core, "b", prompt(tok), SamplingParams(beam_size=4), spec()))
    assert not core.has_work


def test_sampling_params_carry_no_grammar():
    """A grammar travels compiled on the request (``EngineRequest.grammar``), one way only."""
    assert not hasattr(SamplingParams(), "grammar")


def test_bad_grammars_raise_grammar_error_naming_the_problem(lm, tok):
    core = EngineCore(lm, tok, n_slots=2, max_len=64)
    for bad, words in [(GrammarSpec("json_schema", '{"$ref": "#/definitions/none"}'), "none"),
                       (GrammarSpec("json_schema", "{not json"), "JSON"),
                       (GrammarSpec("regex", "(unclosed"), "unclosed"),
                       (GrammarSpec("choice", "[]"), "choice"),
                       (GrammarSpec("lark", "start: missing_rule"), "missing_rule")]:
        with pytest.raises(GrammarError, match=words):
            generate(lm, [prompt(tok), prompt(tok, 1)], sampled(1, 5), tokenizer=tok, grammar=[None, bad])
        with pytest.raises(GrammarError, match=words):
            core.grammars.compile(bad)
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("yaml", "")
    assert not core.has_work


def test_compiled_grammars_are_cached_with_a_bound(tok):
    compiler = GrammarCompiler(tok, tok.vocab_size, 2, cache_size=2)
    a, hit = compiler.lookup(spec())
    assert not hit and compiler.lookup(spec()) == (a, True)
    compiler.compile(GrammarSpec("regex", "a+"))
    compiler.compile(GrammarSpec("regex", "b+"))  # evicts the least recently used: the schema
    assert len(compiler) == 2 and not compiler.lookup(spec())[1]
    assert (compiler.hits, compiler.misses) == (1, 4)


def test_step_counts_constrained_tokens(lm, tok):
    core = EngineCore(lm, tok, n_slots=2, max_len=96)
    core.add(constrained(core, "c", prompt(tok), sampled(1, 8), spec()))
    core.add(EngineRequest("f", prompt(tok, 1), sampled(1, 8)))
    counted = 0
    while core.has_work:
        counted += core.step().constrained_tokens
    assert counted == 8


def test_a_grammar_past_the_engines_limits_fails_its_request_alone(lm, tok):
    core = EngineCore(lm, tok, n_slots=2, max_len=96)
    core.add(constrained(core, "hostile", prompt(tok), sampled(1, 20), GrammarSpec("regex", "(a{1,1000}){1000}")))
    core.add(EngineRequest("free", prompt(tok, 1), sampled(1, 20)))
    events: dict[str, list] = {}
    while core.has_work:
        for e in core.step().events:
            events.setdefault(e.request_id, []).append(e)
    assert events["hostile"][-1].error == "grammar_limit" and "too many" in events["hostile"][-1].message
    assert events["free"][-1].finish_reason == "length" and len(events["free"]) == 20


@pytest.mark.parametrize("kind, value", [("json_schema", json.dumps(SCHEMA)), ("json_object", ""),
                                         ("lark", 'start: "x" obj\nobj: %json {"type": "object"}')])
def test_generated_json_has_no_free_whitespace(tok, kind, value):
    # a small model given free whitespace may write it until max_tokens: separators are fixed,
    # and no whitespace may stand before, between or after the JSON's own tokens
    compiler = GrammarCompiler(tok, tok.vocab_size, eos_id=2)
    grammar = compiler.compile(GrammarSpec(kind, value))
    lead = "x" if kind == "lark" else ""

    def takes(text: str) -> bool:
        m = grammar.matcher()
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and not m.error

    assert takes(lead + '{"name": "a", "unit": "celsius", "days": 3}')
    for loose in (' {"name"', '{ "name"', '{"name" :', '{"name":  "a"', '{"name": "a" ,', '{\n"name"',
                  '{"name":"a"'):
        assert not takes(lead + loose), loose
