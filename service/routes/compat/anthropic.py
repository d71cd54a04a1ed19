"""Anthropic's Messages API: ``POST /v1/messages`` (plain and streamed), ``POST /v1/messages/count_tokens``.

As Anthropic documents it (https://docs.anthropic.com/en/api/messages): ``system``, ``messages``
of text / ``tool_use`` / ``tool_result`` blocks, ``max_tokens`` (required), ``temperature``,
``top_p``, ``top_k``, ``stop_sequences``, ``tools`` and ``tool_choice``. A thin adapter over the
chat turn (``service/chat/turn.py``) the chat route also runs: the conversation becomes chat
messages (tool calls and results as ``service/chat/tool_calls.py`` renders them), the model's
template makes the prompt, tools become the same grammar, and the output comes back as ``text``
and ``tool_use`` blocks; a final assistant message is a prefill the reply continues.
``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` (with ``stop_sequence``) or ``tool_use``.
The stream sends ``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``
(``text_delta`` / ``input_json_delta``), ``content_block_stop``, ``message_delta`` and
``message_stop``, each with its ``event:`` line. Errors are ``{"type": "error", "error": {"type",
"message"}}``; a busy or loading server is 529 ``overloaded_error``. The key is ``x-api-key``
(or ``Authorization: Bearer``); ``anthropic-version`` is read by nobody.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request

from service.chat.turn import ChatTurn, chat_turn
from service.engines.errors import EngineError, InvalidRequestError
from service.engines.generative import EngineEvent, GenerativeEngine, RequestStream
from service.engines.waiting import collect
from service.http.dependencies import RegistryDep, SettingsDep, require_api_key_or_x_api_key
from service.http.errors import ErrorJSONResponse
from service.routes.compat.anthropic_schemas import CountTokensRequest, MessagesRequest, ToolParam
from service.routes.compat.common import error_route
from service.routes.streaming import check_event, client_gone, mark, sse_response
from service.schemas.chat import ChatMessage
from service.schemas.structured import FunctionCall, FunctionDefinition, MessageToolCall, NamedToolChoice, Tool

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               504: "timeout_error", 529: "overloaded_error"}
OVERLOADED = {"queue_full", "not_ready", "shutdown"}  # Anthropic answers a busy server with 529


def error_status(exc: EngineError) -> int:
    if exc.code in OVERLOADED:
        return 529
    if exc.status in ERROR_TYPES:
        return exc.status
    return 400 if exc.status < 500 else 500


def error_body(exc: EngineError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES[error_status(exc)], "message": exc.message}}


def render(exc: EngineError) -> ErrorJSONResponse:
    status = error_status(exc)
    headers = {"Retry-After": str(getattr(exc, "retry_after", 1))} if status in (429, 529) else None
    return ErrorJSONResponse(error_body(exc), status_code=status, headers=headers)


router = APIRouter(tags=["Anthropic Messages"], route_class=error_route(render),
                   dependencies=[Depends(require_api_key_or_x_api_key)])


# --- the request, as the chat route's engine calls take it ------------------------------------

def _message(role: str, text: str, calls: list[MessageToolCall] | None = None) -> ChatMessage:
    return ChatMessage.model_construct(role=role, content=text, tool_calls=calls or None, name=None,
                                       tool_call_id=None, function_call=None, audio=None, refusal=None)


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    """``system`` + ``messages`` as chat messages: ``tool_use`` blocks become the assistant's
    tool calls, each ``tool_result`` a ``tool`` message (before the user's text, as sent)."""
    out = [_message("system", body.system_text())] if body.system_text().strip() else []
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            texts, calls = [m.content], []
        else:
            texts, calls = [], []
            for block in m.content:
                if block.type == "text":
                    texts.append(block.text)
                elif block.type == "tool_use":
                    calls.append(MessageToolCall(id=block.id, function=FunctionCall(
                        name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
                else:
                    out.append(_message("tool", block.text()))
        text = "".join(texts)
        if m.role == "assistant":  # the final one is a prefill: the reply continues it
            out.append(_message("assistant", text, calls))
        elif text.strip():
            out.append(_message("user", text))
        elif isinstance(m.content, str) or not any(b.type == "tool_result" for b in m.content):
            raise InvalidRequestError(f"{where}: must not be empty or blank", "messages")
    return out


def _tools(tools: list[ToolParam] | None) -> list[Tool] | None:
    if not tools:
        return None
    return [Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                             parameters=t.input_schema)) for t in tools]


def build_turn(body: CountTokensRequest, engine: GenerativeEngine, settings) -> ChatTurn:
    """The body as a chat turn: ``tool_choice`` ``any`` is OpenAI's ``required``, a ``tool``
    choice a named function; no output format (Anthropic has none)."""
    choice, parallel = None, True
    if body.tool_choice is not None:
        kind = body.tool_choice.type
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or NamedToolChoice(
            type="function", function={"name": body.tool_choice.name})
        parallel = not body.tool_choice.disable_parallel_tool_use
    tools = _tools(body.tools)
    return chat_turn(engine, settings, chat_messages(body), tools, choice, parallel, continue_final=True)


# --- the reply ---------------------------------------------------------------------------------

@dataclass
class _Reply:
    turn: ChatTurn
    id: str
    stops: list[str]

    @property
    def engine(self) -> GenerativeEngine:
        return self.turn.engine


def _stop(reply: _Reply, events: list[EngineEvent], text: str, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). The engine says ``stop`` for a stop string, a stop token
    and a finished grammar alike; a stop string is the one found where the text was cut."""
    reason = events[-1].finish_reason
    if called:
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if reason == "stop" and reply.stops:
        full = reply.engine.detokenize([t for e in events for t in e.token_ids])
        found = [(full.find(s, max(0, len(text) - len(s))), s) for s in reply.stops]
        found = [(at, s) for at, s in found if at != -1]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def _usage(reply: _Reply, final: EngineEvent) -> dict:
    return {"input_tokens": len(reply.turn.prompt), "output_tokens": reply.engine.completion_tokens(final)}


def _tool_block(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.function.name,
            "input": json.loads(call.function.arguments)}


@router.post("/v1/messages", summary="Anthropic Messages: a reply of text and tool_use blocks (stream=true for SSE)")
async def messages(body: MessagesRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = await registry.acquire(body.model, "decoder", "/v1/messages")
    mark(request, engine.name)
    turn = build_turn(body, engine, settings)
    params = engine.sampling(max_new_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                             top_k=body.top_k, stop=list(body.stop_sequences))
    streams = await turn.submit([params], "messages", "max_tokens")
    reply = _Reply(turn, f"msg_{streams[0].request_id}", list(body.stop_sequences))
    if body.stream:
        return sse_response(_events(reply, streams[0], request), streams, request, done=False,
                            error_chunk=error_body, named=True)
    (events,) = await collect(client_gone(request), streams)
    usage = engine.usage([turn.prompt], [events[-1]])
    mark(request, usage=usage)
    text, calls = turn.parse("".join(e.text for e in events))
    content = ([{"type": "text", "text": text}] if text or not calls else []) + [_tool_block(c) for c in calls]
    stop_reason, stop_sequence = _stop(reply, events, text or "", bool(calls))
    return {"id": reply.id, "type": "message", "role": "assistant", "model": engine.name, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(reply, events[-1])}


class _Blocks:
    """Content blocks as stream events: one open block at a time, indexed in order."""

    def __init__(self):
        self.index, self.open = -1, None

    def start(self, block: dict) -> list[dict]:
        out = self.stop()
        self.index, self.open = self.index + 1, block["type"]
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def stop(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


async def _events(reply: _Reply, stream: RequestStream, request: Request) -> AsyncIterator[dict]:
    engine, prompt = reply.engine, reply.turn.prompt
    yield {"type": "message_start", "message": {
        "id": reply.id, "type": "message", "role": "assistant", "model": engine.name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(prompt), "output_tokens": 0}}}
    yield {"type": "ping"}
    blocks, deltas, events, text = _Blocks(), reply.turn.deltas(), [], ""
    async for event in stream:
        check_event(event)
        events.append(event)
        for delta in deltas.feed(event.text, event.finished):
            if "content" in delta:
                if blocks.open != "text":
                    for e in blocks.start({"type": "text", "text": ""}):
                        yield e
                text += delta["content"]
                yield blocks.delta({"type": "text_delta", "text": delta["content"]})
                continue
            call = delta["tool_calls"][0]
            if "id" in call:  # a call starts: its block, then its arguments as one JSON delta
                for e in blocks.start({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                       "name": call["function"]["name"], "input": {}}):
                    yield e
            else:
                yield blocks.delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
    if blocks.index == -1:  # nothing at all: one empty text block, as the plain reply has
        for e in blocks.start({"type": "text", "text": ""}):
            yield e
    for e in blocks.stop():
        yield e
    final = events[-1]
    mark(request, usage=engine.usage([prompt], [final]))
    stop_reason, stop_sequence = _stop(reply, events, text, deltas.called)
    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
           "usage": _usage(reply, final)}
    yield {"type": "message_stop"}


@router.post("/v1/messages/count_tokens", summary="Anthropic: the input tokens a Messages request would have")
async def count_tokens(body: CountTokensRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = await registry.acquire(body.model, "decoder", "/v1/messages/count_tokens")
    mark(request, engine.name)
    return {"input_tokens": len(build_turn(body, engine, settings).prompt)}

