"""OpenAI's Responses API, stateless: ``POST /v1/responses`` (plain and streamed).

A thin adapter over the chat turn (``service/chat/turn.py``) the chat route also runs:
``instructions`` + ``input`` become chat messages (``function_call`` items the assistant's tool
calls, ``function_call_output`` items tool results), the model's template makes the prompt,
``text.format`` becomes the same constraint as ``response_format`` (``service/chat/structured.py``)
and function ``tools`` the same tool grammar (``service/chat/tool_calls.py``). The output is a
``message`` item with one ``output_text`` part, or ``function_call`` items.
``max_output_tokens`` reached: ``status: "incomplete"`` with
``incomplete_details.reason: "max_output_tokens"``.

Nothing is stored: ``store`` is accepted and the response says ``store: false``;
``previous_response_id`` is a 400 naming it (send the whole conversation in ``input``).
The stream sends ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for text ``response.content_part.added``,
``response.output_text.delta`` …, ``response.output_text.done``, ``response.content_part.done``
(for a call ``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``,
and ``response.completed`` (or ``response.incomplete``), each with its ``event:`` line and a
``sequence_number``. Errors have OpenAI's shape, as on the other OpenAI routes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request

from service.chat.structured import Constraint, GrammarSpec, schema_text
from service.chat.turn import ChatTurn, chat_turn
from service.engines.errors import InvalidRequestError
from service.engines.generative import EngineEvent, GenerativeEngine, RequestStream
from service.engines.waiting import collect
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import ERROR_RESPONSES
from service.routes.compat.common import SSE_EVENT
from service.routes.compat.responses_schemas import ResponsesRequest
from service.routes.streaming import check_event, client_gone, mark, sse_response
from service.schemas.chat import ChatMessage
from service.schemas.structured import FunctionCall, FunctionDefinition, MessageToolCall, NamedToolChoice, Tool

router = APIRouter(tags=["openai"])
STREAM_RESPONSES = {200: {"content": {"text/event-stream": {"schema": SSE_EVENT}},
                          "description": "a response object, or with stream=true a stream of typed response.* "
                                         "events"}}


def _message(role: str, text: str, calls: list[MessageToolCall] | None = None) -> ChatMessage:
    return ChatMessage.model_construct(role=role, content=text, tool_calls=calls or None, name=None,
                                       tool_call_id=None, function_call=None, audio=None, refusal=None)


def chat_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """``instructions`` and ``input`` as chat messages; consecutive ``function_call`` items join
    the assistant turn before them (one turn, several calls), as the chat API carries them."""
    out = [_message("system", body.instructions)] if body.instructions and body.instructions.strip() else []
    if isinstance(body.input, str):
        if not body.input.strip():
            raise InvalidRequestError("input: must not be empty or blank", "input")
        return [*out, _message("user", body.input)]
    for i, item in enumerate(body.input):
        if item.type == "message":
            if not item.text().strip() and item.role != "assistant":
                raise InvalidRequestError(f"input[{i}].content: must not be empty or blank", "input")
            out.append(_message("system" if item.role == "developer" else item.role, item.text()))
        elif item.type == "function_call":
            call = MessageToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(_message("assistant", "", [call]))
        else:
            out.append(_message("tool", item.text()))
    if not out or all(m.role == "system" for m in out):
        raise InvalidRequestError("input: must hold at least one message", "input")
    return out


def _text_constraint(body: ResponsesRequest, settings) -> Constraint | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(GrammarSpec("json_object"), "text.format")
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format of type 'json_schema' needs a 'schema'", "text.format.schema")
    return Constraint(GrammarSpec("json_schema", schema_text(fmt.schema_, "text.format.schema", settings)),
                      "text.format.schema")


def build_turn(body: ResponsesRequest, engine: GenerativeEngine, settings) -> ChatTurn:
    """The body as a chat turn: function ``tools`` in the chat API's shape, ``text.format`` as
    the output's format."""
    tools = [Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                               parameters=t.parameters)) for t in body.tools or []]
    choice = body.tool_choice
    if not isinstance(choice, str | None):
        choice = NamedToolChoice(type="function", function={"name": choice.name})
    parallel = body.parallel_tool_calls is not False
    return chat_turn(engine, settings, chat_messages(body), tools or None, choice, parallel,
                     output_format=lambda: _text_constraint(body, settings))


@dataclass
class _Reply:
    turn: ChatTurn
    body: ResponsesRequest
    id: str
    created: int
    seq: int = 0
    output: list[dict] = field(default_factory=list)

    @property
    def engine(self) -> GenerativeEngine:
        return self.turn.engine

    def sampled(self, name: str) -> float:
        """The request's value, else the model's default: what the reply ran with."""
        value = getattr(self.body, name)
        return value if value is not None else self.engine.sampling_defaults.values[name]

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def response(self, status: str, final: EngineEvent | None = None) -> dict:
        body = self.body
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
               "incomplete_details": None, "instructions": body.instructions, "max_output_tokens":
               body.max_output_tokens, "model": self.engine.name, "output": self.output,
               "parallel_tool_calls": body.parallel_tool_calls is not False,
               "previous_response_id": None, "store": False, "temperature": self.sampled("temperature"), "top_p":
               self.sampled("top_p"), "text": {"format": fmt},
               "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump")
               else (body.tool_choice or "auto"),
               "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "truncation": "disabled",
               "metadata": body.metadata or {}, "usage": None}
        if final is not None:
            prompt, completion = len(self.turn.prompt), self.engine.completion_tokens(final)
            out["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": prompt + completion}
            if final.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out


def _status(final: EngineEvent) -> str:
    return "incomplete" if final.finish_reason == "length" else "completed"


def _text_item(reply: _Reply, text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{reply.id.removeprefix('resp_')}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


@router.post("/v1/responses", responses={**ERROR_RESPONSES, **STREAM_RESPONSES},
             summary="OpenAI Responses (stateless): a message or function calls (stream=true for typed SSE events)")
async def responses(body: ResponsesRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    if body.previous_response_id is not None:
        raise InvalidRequestError("previous_response_id is not supported: this server stores no responses; send "
                                  "the whole conversation in 'input'", "previous_response_id")
    engine: GenerativeEngine = await registry.acquire(body.model, "decoder", "/v1/responses")
    mark(request, engine.name)
    turn = build_turn(body, engine, settings)
    params = engine.sampling(max_new_tokens=turn.max_tokens(body.max_output_tokens), temperature=body.temperature,
                             top_p=body.top_p, seed=body.seed)
    streams = await turn.submit([params], "input", "max_output_tokens")
    reply = _Reply(turn, body, f"resp_{streams[0].request_id}", int(time.time()))
    if body.stream:
        return sse_response(_events(reply, streams[0], request), streams, request, done=False, named=True)
    (events,) = await collect(client_gone(request), streams)
    final = events[-1]
    mark(request, usage=engine.usage([turn.prompt], [final]))
    text, calls = turn.parse("".join(e.text for e in events))
    status = _status(final)
    reply.output = [_call_item(c.id, c.function.name, c.function.arguments) for c in calls] if calls else \
        [_text_item(reply, text or "", status)]
    return reply.response(status, final)


def _close_call(reply: _Reply, item: dict | None) -> list[dict]:
    """A streamed function call's closing events, once its arguments are whole (none for text)."""
    if item is None or item["type"] != "function_call" or item["status"] == "completed":
        return []
    index = reply.output.index(item)
    item["status"] = "completed"
    return [reply.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"]),
            reply.event("response.output_item.done", output_index=index, item=dict(item))]


async def _events(reply: _Reply, stream: RequestStream, request: Request) -> AsyncIterator[dict]:
    yield reply.event("response.created", response=reply.response("in_progress"))
    yield reply.event("response.in_progress", response=reply.response("in_progress"))
    deltas, events, text, item = reply.turn.deltas(), [], "", None
    async for event in stream:
        check_event(event)
        events.append(event)
        for delta in deltas.feed(event.text, event.finished):
            if "content" in delta:
                if item is None:
                    item = _text_item(reply, "", "in_progress")
                    for e in _open_text(reply, item):
                        yield e
                text += delta["content"]
                yield reply.event("response.output_text.delta", item_id=item["id"], output_index=0,
                                  content_index=0, delta=delta["content"], logprobs=[])
                continue
            call = delta["tool_calls"][0]
            if "id" in call:  # a new call: the one before it is complete
                for e in _close_call(reply, item):
                    yield e
                item = _call_item(call["id"], call["function"]["name"], "", "in_progress")
                reply.output.append(item)
                yield reply.event("response.output_item.added", output_index=len(reply.output) - 1, item=dict(item))
                continue
            piece = call["function"].get("arguments") or ""  # the arguments stream as the model writes them
            if piece:
                item["arguments"] += piece
                yield reply.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=len(reply.output) - 1, delta=piece)
    for e in _close_call(reply, item):
        yield e
    final = events[-1]
    status = _status(final)
    if not reply.output and item is None:  # no text at all: the message item still opens and closes
        item = _text_item(reply, "", "in_progress")
        for e in _open_text(reply, item):
            yield e
    if item is not None and item["type"] == "message":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield reply.event("response.output_text.done", item_id=item["id"], output_index=0, content_index=0,
                          text=text, logprobs=[])
        yield reply.event("response.content_part.done", item_id=item["id"], output_index=0, content_index=0,
                          part=part)
        done = _text_item(reply, text, status)
        reply.output = [done]
        yield reply.event("response.output_item.done", output_index=0, item=done)
    mark(request, usage=reply.engine.usage([reply.turn.prompt], [final]))
    yield reply.event("response.completed" if status == "completed" else "response.incomplete",
                      response=reply.response(status, final))


def _open_text(reply: _Reply, item: dict) -> list[dict]:
    reply.output = [item]
    return [reply.event("response.output_item.added", output_index=0, item={**item, "content": []}),
            reply.event("response.content_part.added", item_id=item["id"], output_index=0, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

