"""POST /v1/chat/completions: the OpenAI chat API on a decoder model with a chat template.

The body becomes a chat turn (``service/chat/turn.py``, shared with the Anthropic and
Responses doors): the messages rendered by the model's own template (in a sandbox) into one
prompt, ``response_format`` / ``structured_outputs`` / ``guided_*`` or the tools
(``service/chat/structured.py``, ``service/chat/tool_calls.py``) as the one grammar on the
output. Each of the ``n`` choices is one engine request. Streaming sends a first chunk with the
role, then content deltas, a final chunk with ``finish_reason``, an optional usage chunk, and
``data: [DONE]``; tool calls come back as ``message.tool_calls`` (streamed: ``delta.tool_calls``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Request

from service.chat.structured import request_constraint
from service.chat.turn import ChatTurn, OutputDeltas, chat_turn
from service.engines.generative import EngineEvent, GenerativeEngine, RequestStream, SamplingParams
from service.engines.waiting import collect
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import ERROR_RESPONSES
from service.models.lookup import is_placeholder
from service.routes.streaming import check_event, client_gone, mark, merged, sse_response
from service.schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    LogprobEntry,
    TopLogprobEntry,
)
from service.schemas.common import Usage

router = APIRouter(tags=["openai"])

STREAM_RESPONSES = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                          "description": "a chat completion, or with stream=true a stream of "
                                         "chat.completion.chunk events"}}


@dataclass
class _Reply:
    turn: ChatTurn
    rid: str
    created: int
    deltas: list[OutputDeltas] = field(default_factory=list)  # one per choice

    @property
    def engine(self) -> GenerativeEngine:
        return self.turn.engine


def _finish(reason: str | None, called: bool = False) -> str | None:
    if called and reason in ("eos", "stop"):
        return "tool_calls"
    return "stop" if reason in ("eos", "stop") else reason  # OpenAI: stop / length / tool_calls


def _params(engine: GenerativeEngine, body: ChatCompletionRequest, max_tokens: int, j: int) -> SamplingParams:
    return engine.sampling(
        max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=body.stop,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        seed=None if body.seed is None else body.seed + j)


def _entry(engine: GenerativeEngine, token: int, logprob: float) -> dict:
    text = engine.token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _logprobs(engine: GenerativeEngine, events: list[EngineEvent]) -> ChoiceLogprobs:
    content = []
    for e in events:
        for i, (tok, lp) in enumerate(zip(e.token_ids, e.logprobs)):
            top = e.top_logprobs[i] if i < len(e.top_logprobs) else {}
            content.append(LogprobEntry(**_entry(engine, tok, lp),
                                        top_logprobs=[TopLogprobEntry(**_entry(engine, t, v)) for t, v in top.items()]))
    return ChoiceLogprobs(content=content)


def build_turn(body: ChatCompletionRequest, engine: GenerativeEngine, settings) -> ChatTurn:
    """The body as a chat turn: its messages and tools, and response_format / structured_outputs /
    guided_* as the output's format."""
    return chat_turn(engine, settings, body.messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                     output_format=lambda: request_constraint(body, settings))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, response_model_exclude_none=True,
             responses={**ERROR_RESPONSES, **STREAM_RESPONSES},
             summary="OpenAI-compatible chat completion (stream=true for SSE)")
async def chat_completions(body: ChatCompletionRequest, request: Request, registry: RegistryDep,
                           settings: SettingsDep):
    # huggingface_hub's InferenceClient(base_url=...) sends "dummy", as a drop-in client would: a
    # placeholder that names no model here means the default generation model (TGI answers any name)
    placeholder = is_placeholder(body.model) and body.model not in registry.entries
    engine: GenerativeEngine = await registry.acquire(None if placeholder else body.model, "decoder",
                                                      "/v1/chat/completions", "text-generation", only_one=placeholder,
                                                      keep_alive=body.keep_alive)
    mark(request, engine.name)
    turn = build_turn(body, engine, settings)
    limit = turn.max_tokens(body.token_limit)
    limit_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    streams = await turn.submit([_params(engine, body, limit, j) for j in range(body.n)], "messages", limit_field,
                                group_field="n" if body.n > 1 else "messages")
    reply = _Reply(turn, f"chatcmpl-{streams[0].request_id}", int(time.time()), [turn.deltas() for _ in streams])
    if body.stream:
        return sse_response(_chunks(reply, streams, request, body), streams, request)
    results = await collect(client_gone(request), streams)
    usage = engine.usage([turn.prompt], [events[-1] for events in results])
    mark(request, usage=usage)
    choices = []
    for i, events in enumerate(results):
        content, calls = turn.parse("".join(e.text for e in events))
        choices.append(ChatChoice(index=i, message=AssistantMessage(content=content, tool_calls=calls or None),
                                  finish_reason=_finish(events[-1].finish_reason, bool(calls)),
                                  logprobs=_logprobs(engine, events) if body.logprobs else None))
    return ChatCompletionResponse(id=reply.rid, created=reply.created, model=engine.name, choices=choices,
                                  usage=Usage(**usage.as_dict()))


def _chunk(reply: _Reply, choices: list[dict]) -> dict:
    return {"id": reply.rid, "object": "chat.completion.chunk", "created": reply.created, "model": reply.engine.name,
            "choices": choices}


async def _chunks(reply: _Reply, streams: list[RequestStream], request: Request,
                  body: ChatCompletionRequest) -> AsyncIterator[dict]:
    engine, finals = reply.engine, []
    for i in range(len(streams)):
        yield _chunk(reply, [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    async with aclosing(merged(streams)) as events:  # closed at once on an error: the pumps stop
        async for index, event in events:
            check_event(event)
            if reply.turn.parse_calls:  # content or tool-call deltas, as the call parser decides them
                deltas = reply.deltas[index]
                for delta in deltas.feed(event.text, event.finished):
                    yield _chunk(reply, [{"index": index, "delta": delta, "finish_reason": None}])
                if event.finished:
                    finals.append(event)
                    yield _chunk(reply, [{"index": index, "delta": {},
                                          "finish_reason": _finish(event.finish_reason, deltas.called)}])
                continue
            choice = {"index": index, "delta": {"content": event.text} if event.text else {},
                      "finish_reason": _finish(event.finish_reason)}
            if body.logprobs:
                choice["logprobs"] = _logprobs(engine, [event]).model_dump()
            if event.finished:
                finals.append(event)
            if event.text or event.finished or body.logprobs:
                yield _chunk(reply, [choice])
    usage = engine.usage([reply.turn.prompt], finals)
    mark(request, usage=usage)
    if body.stream_options and body.stream_options.include_usage:
        yield {**_chunk(reply, []), "usage": usage.as_dict()}
