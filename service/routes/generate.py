"""POST /v1/generate: text generation with a decoder model (plain JSON or SSE)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from service.engines.generative import EngineEvent, GenerativeEngine, RequestStream
from service.engines.waiting import collect
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import ERROR_RESPONSES
from service.routes.compat.hf_task_doors import HFTaskDoorRoute
from service.routes.inputs import input_ids
from service.routes.streaming import check_event, client_gone, mark, sse_response
from service.schemas.common import GenerateRequest, GenerateResponse, TokenLogprob, TopLogprob, Usage

router = APIRouter(tags=["generation"], route_class=HFTaskDoorRoute)  # also HF's {"inputs", "parameters"}


def token_logprobs(engine: GenerativeEngine, events: list[EngineEvent]) -> list[TokenLogprob]:
    out = []
    for event in events:
        for i, (token_id, lp) in enumerate(zip(event.token_ids, event.logprobs)):
            top = event.top_logprobs[i] if i < len(event.top_logprobs) else None
            alternatives = [TopLogprob(token=engine.token_text(t), token_id=t, logprob=v) for t, v in top.items()] \
                if top else None
            out.append(TokenLogprob(token=engine.token_text(token_id), token_id=token_id, logprob=lp,
                                    top_logprobs=alternatives))
    return out


@router.post("/v1/generate", response_model=GenerateResponse, response_model_exclude_none=True,
             responses=ERROR_RESPONSES, summary="Generate text from a prompt (set stream=true for Server-Sent Events)")
async def generate(body: GenerateRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = await registry.acquire(body.model, "decoder", "/v1/generate",
                                                           keep_alive=body.keep_alive)
    mark(request, engine.name)
    prompts = input_ids(body.prompt, "prompt", engine, settings)
    # the default (64) shrinks to a model with fewer positions, as the schema's default does
    max_tokens = body.max_tokens if "max_tokens" in body.model_fields_set else min(body.max_tokens, engine.max_len - 1)
    params = engine.sampling(max_new_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                             top_p=body.top_p, repetition_penalty=body.repetition_penalty, stop=body.stop,
                             seed=body.seed, logprobs=body.logprobs, ignore_eos=body.ignore_eos)
    stream = engine.submit(prompts[0], params)
    rid, created = f"gen-{stream.request_id}", int(time.time())
    if body.stream:
        return sse_response(_chunks(engine, stream, request, rid, created, prompts, body.logprobs is not None),
                            [stream], request)
    (events,) = await collect(client_gone(request), [stream])
    usage = engine.usage(prompts, [events[-1]])
    mark(request, usage=usage)
    return GenerateResponse(
        id=rid, created=created, model=engine.name, text="".join(e.text for e in events),
        finish_reason=events[-1].finish_reason, usage=Usage(**usage.as_dict()),
        logprobs=token_logprobs(engine, events) if body.logprobs is not None else None)


async def _chunks(engine: GenerativeEngine, stream: RequestStream, request: Request, rid: str, created: int,
                  prompts: list[list[int]], want_logprobs: bool) -> AsyncIterator[dict]:
    async for event in stream:
        check_event(event)
        chunk = {"id": rid, "object": "text_generation.chunk", "created": created, "model": engine.name,
                 "text": event.text, "token_ids": event.token_ids, "finish_reason": event.finish_reason}
        if want_logprobs:
            chunk["logprobs"] = [t.model_dump(exclude_none=True) for t in token_logprobs(engine, [event])]
        if event.finished:
            usage = engine.usage(prompts, [event])
            mark(request, usage=usage)
            chunk["usage"] = usage.as_dict()
        yield chunk
