"""The chat turn the three chat doors share (service/chat/turn.py): the same conversation asked
through OpenAI chat, Anthropic Messages and OpenAI Responses is the same prompt and the same
grammar; the turn reads calls out of the output only where tools constrain it. No model: a
stand-in engine renders a conversation as the bytes of its JSON, so equal ids are equal inputs
to the template."""

from __future__ import annotations

import json

import pytest

from model.tokenization.tool_format import GENERIC
from service.chat.turn import chat_turn
from service.engines.errors import InvalidRequestError
from service.routes import chat
from service.routes.compat import anthropic, responses
from service.routes.compat.anthropic_schemas import MessagesRequest
from service.routes.compat.responses_schemas import ResponsesRequest
from service.schemas.chat import ChatCompletionRequest
from service.settings import Settings

SETTINGS = Settings(_env_file=None)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


class Engine:
    """What a turn asks of an engine: the template (as JSON bytes), whether it renders tools, the context."""

    max_len = 100_000
    tool_format = GENERIC  # calls written as the generic prompt's blocks

    def __init__(self, template_takes_tools: bool):
        self.template_takes_tools = template_takes_tools

    def chat_prompt(self, messages, tools=None, continue_final=False):
        return list(json.dumps([messages, tools], sort_keys=True).encode())


def openai_chat(tool_choice=None, response_format=None, tools=True) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": "And in Rome?"}]}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                           "parameters": WEATHER}}]
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if response_format is not None:
        body["response_format"] = response_format
    return ChatCompletionRequest.model_validate(body)


def anthropic_messages(tool_choice=None) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 10, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                     {"type": "text", "text": "And in Rome?"}]}],
        "tools": [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return MessagesRequest.model_validate(body)


def openai_responses(tool_choice=None, text_format=None, tools=True) -> ResponsesRequest:
    body = {"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"role": "user", "content": "And in Rome?"}]}
    if tools:
        body["tools"] = [{"type": "function", "name": "get_weather", "description": "Weather now",
                          "parameters": WEATHER}]
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if text_format is not None:
        body["text"] = {"format": text_format}
    return ResponsesRequest.model_validate(body)


# (OpenAI chat, Anthropic, Responses): the same tool choice in each API's words
CHOICES = [
    (None, None, None),
    ("auto", {"type": "auto"}, "auto"),
    ("required", {"type": "any"}, "required"),
    ({"type": "function", "function": {"name": "get_weather"}}, {"type": "tool", "name": "get_weather"},
     {"type": "function", "name": "get_weather"}),
    ("none", {"type": "none"}, "none"),
]


@pytest.mark.parametrize("takes_tools", [True, False], ids=["template-tools", "generic-prompt"])
@pytest.mark.parametrize("choices", CHOICES, ids=["default", "auto", "required", "named", "none"])
def test_three_doors_make_one_prompt_and_one_grammar(takes_tools, choices):
    engine = Engine(takes_tools)
    chat_choice, anthropic_choice, responses_choice = choices
    turns = [chat.build_turn(openai_chat(chat_choice), engine, SETTINGS),
             anthropic.build_turn(anthropic_messages(anthropic_choice), engine, SETTINGS),
             responses.build_turn(openai_responses(responses_choice), engine, SETTINGS)]
    first = turns[0]
    assert all(t.prompt == first.prompt for t in turns)
    assert all(t.constraint == first.constraint for t in turns)  # the tools' grammar, named "tools", or none
    assert all(t.parse_calls == first.parse_calls for t in turns)
    rendered, tools = json.loads(bytes(first.prompt))
    assert (tools is not None) == (takes_tools and chat_choice != "none")
    assert '"arguments": {"city": "Paris"}' in rendered[2]["content"]  # the earlier call, as a call block
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    if chat_choice == "none":
        assert first.constraint is None and not first.parse_calls
    else:
        assert first.constraint.field == "tools" and first.parse_calls


def test_the_openai_doors_make_one_format_grammar():
    engine = Engine(True)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    a = chat.build_turn(openai_chat(response_format=fmt, tools=False), engine, SETTINGS)
    b = responses.build_turn(openai_responses(text_format={"type": "json_schema", "name": "person",
                                                           "schema": PERSON}, tools=False), engine, SETTINGS)
    assert a.prompt == b.prompt and a.constraint.spec == b.constraint.spec and not a.parse_calls
    # each names its own field in errors
    assert (a.constraint.field, b.constraint.field) == ("response_format.json_schema.schema", "text.format.schema")


def test_a_format_and_forced_tools_are_one_constraint_too_many():
    engine = Engine(True)
    fmt = {"type": "json_object"}
    with pytest.raises(InvalidRequestError, match="'response_format' and 'tools' both constrain"):
        chat.build_turn(openai_chat("required", fmt), engine, SETTINGS)
    with pytest.raises(InvalidRequestError, match="'text.format' and 'tools' both constrain"):
        responses.build_turn(openai_responses("required", fmt), engine, SETTINGS)


def test_tools_are_checked_before_the_format():
    engine = Engine(True)
    with pytest.raises(InvalidRequestError, match="tool_choice needs 'tools'") as caught:
        chat_turn(engine, SETTINGS, openai_chat(tools=False).messages, None, "required",
                  output_format=lambda: pytest.fail("the format is read after the tools"))
    assert caught.value.param == "tool_choice"


def test_the_turn_reads_calls_only_where_tools_constrain():
    engine = Engine(True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    free = chat.build_turn(openai_chat(tools=False), engine, SETTINGS)
    assert free.parse(call) == (call, [])
    assert free.deltas().feed("hi", False) == [{"content": "hi"}] and free.deltas().feed("", True) == []
    tools = chat.build_turn(openai_chat("auto"), engine, SETTINGS)
    content, calls = tools.parse(call)
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    deltas = tools.deltas()
    out = deltas.feed(call[:12], False) + deltas.feed(call[12:], True)
    assert deltas.called and out[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(out[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


def test_the_limit_is_what_was_asked_or_the_room_left():
    turn = chat.build_turn(openai_chat(tools=False), Engine(True), SETTINGS)
    assert turn.max_tokens(7) == 7 and turn.max_tokens(None) == Engine.max_len - len(turn.prompt)
