"""POST /v1/completions: the OpenAI completions API on a decoder model.

Each (prompt, n) pair is one engine request; they run concurrently in the engine's batch.
Choice i*n + j is completion j of prompt i, as in the OpenAI API.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Request

from service.chat.structured import request_constraint
from service.engines.errors import InvalidRequestError
from service.engines.generative import EngineEvent, GenerativeEngine, RequestStream, SamplingParams
from service.engines.waiting import collect
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import ERROR_RESPONSES
from service.routes.inputs import input_ids
from service.routes.streaming import check_event, client_gone, mark, merged, sse_response
from service.schemas.common import Usage
from service.schemas.openai import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse

router = APIRouter(tags=["openai"])


@dataclass
class _Reply:
    """What every chunk or choice of one completions request shares."""

    engine: GenerativeEngine
    rid: str
    created: int
    prompts: list[list[int]]
    echoes: list[str]  # per choice: the prompt text if echo, else ""


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "eos" else reason  # OpenAI knows only stop / length


def _params(engine: GenerativeEngine, body: CompletionRequest, max_tokens: int, j: int) -> SamplingParams:
    return engine.sampling(
        max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=body.stop, logprobs=body.logprobs,
        seed=None if body.seed is None else body.seed + j, ignore_eos=body.ignore_eos)


def _logprobs(engine: GenerativeEngine, events: list[EngineEvent], offset: int) -> CompletionLogprobs:
    tokens, lps, tops, offsets = [], [], [], []
    for e in events:
        for i, (t, lp) in enumerate(zip(e.token_ids, e.logprobs)):
            piece = engine.token_text(t)
            offsets.append(offset)
            offset += len(piece)
            tokens.append(piece)
            lps.append(lp)
            top = e.top_logprobs[i] if i < len(e.top_logprobs) else None
            tops.append({engine.token_text(k): v for k, v in top.items()} if top else None)
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


@router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_none=True,
             responses=ERROR_RESPONSES, summary="OpenAI-compatible text completion (stream=true for SSE)")
async def completions(body: CompletionRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = await registry.acquire(body.model, "decoder", "/v1/completions",
                                                           keep_alive=body.keep_alive)
    mark(request, engine.name)
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo together with logprobs is not supported", "echo")
    prompts = input_ids(body.prompt, "prompt", engine, settings)
    items = []
    for i, ids in enumerate(prompts):
        max_tokens = body.max_tokens if body.max_tokens is not None else max(1, engine.max_len - len(ids))
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        items += [(ids, _params(engine, body, max_tokens, j), field) for j in range(body.n)]
    constraint = request_constraint(body, settings)
    streams = await engine.submit_constrained(items, constraint.spec if constraint else None,
                                              constraint.field if constraint else "",
                                              group_field="n" if body.n > 1 else "prompt")
    echoes = [engine.detokenize(ids) if body.echo else "" for ids in prompts for _ in range(body.n)]
    reply = _Reply(engine, f"cmpl-{streams[0].request_id}", int(time.time()), prompts, echoes)
    if body.stream:
        return sse_response(_chunks(reply, streams, request, body), streams, request)
    results = await collect(client_gone(request), streams)
    usage = engine.usage(prompts, [events[-1] for events in results])
    mark(request, usage=usage)
    choices = [CompletionChoice(
        index=i, text=echoes[i] + "".join(e.text for e in events), finish_reason=_finish(events[-1].finish_reason),
        logprobs=_logprobs(engine, events, len(echoes[i])) if body.logprobs is not None else None)
        for i, events in enumerate(results)]
    return CompletionResponse(id=reply.rid, created=reply.created, model=engine.name, choices=choices,
                              usage=Usage(**usage.as_dict()))


async def _chunks(reply: _Reply, streams: list[RequestStream], request: Request,
                  body: CompletionRequest) -> AsyncIterator[dict]:
    engine, finals = reply.engine, []
    offsets = [len(e) for e in reply.echoes]
    for i, echo in enumerate(reply.echoes):
        if echo:
            yield _chunk(reply, i, echo, None, None)
    async with aclosing(merged(streams)) as events:  # closed at once on an error: the pumps stop
        async for index, event in events:
            check_event(event)
            logprobs = _logprobs(engine, [event], offsets[index]).model_dump() if body.logprobs is not None else None
            offsets[index] += len(event.text)
            chunk = _chunk(reply, index, event.text, _finish(event.finish_reason), logprobs)
            if event.finished:
                finals.append(event)
                if len(streams) == 1:
                    chunk["usage"] = engine.usage(reply.prompts, finals).as_dict()
            yield chunk
    usage = engine.usage(reply.prompts, finals)
    mark(request, usage=usage)
    if len(streams) > 1 or (body.stream_options and body.stream_options.include_usage):
        yield {"id": reply.rid, "object": "text_completion", "created": reply.created, "model": engine.name,
               "choices": [], "usage": usage.as_dict()}


def _chunk(reply: _Reply, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"id": reply.rid, "object": "text_completion", "created": reply.created, "model": reply.engine.name,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
