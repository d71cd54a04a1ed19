"""POST /v1/generate: text generation with a decoder model (plain JSON or SSE)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from service.dependencies import RegistryDep, SettingsDep
from service.engine import EngineEvent, GenerativeEngine, RequestStream, SamplingParams
from service.routes.inputs import text_list
from service.routes.streaming import check_event, collect, mark, sse_response
from service.schemas import ErrorResponse, GenerateRequest, GenerateResponse, TokenLogprob, TopLogprob, Usage

router = APIRouter(tags=["generation"])
ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 413, 429, 503, 504)}


def token_text(engine: GenerativeEngine, token_id: int) -> str:
    """A token's text; a token holding only part of a UTF-8 character has none, so its raw
    vocabulary entry is used (unique, unlike the replacement character)."""
    text = engine.tokenizer.decode([token_id], skip_special_tokens=False)
    return engine.tokenizer.id_to_token(token_id) or text if "\ufffd" in text else text


def token_logprobs(engine: GenerativeEngine, event: EngineEvent) -> list[TokenLogprob]:
    out = []
    for i, (token_id, lp) in enumerate(zip(event.token_ids, event.logprobs)):
        top = event.top_logprobs[i] if i < len(event.top_logprobs) else None
        alternatives = [TopLogprob(token=token_text(engine, t), token_id=t, logprob=v) for t, v in top.items()] \
            if top else None
        out.append(TokenLogprob(token=token_text(engine, token_id), token_id=token_id, logprob=lp,
                                top_logprobs=alternatives))
    return out


@router.post("/v1/generate", response_model=GenerateResponse, response_model_exclude_none=True, responses=ERRORS,
             summary="Generate text from a prompt (set stream=true for Server-Sent Events)")
async def generate(body: GenerateRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = registry.get(body.model, "decoder", "/v1/generate")
    mark(request, engine.name)
    text_list(body.prompt, "prompt", settings)
    ids = engine.tokenizer.encode(body.prompt)
    params = SamplingParams(max_new_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k,
                            top_p=body.top_p, repetition_penalty=body.repetition_penalty, stop=body.stop,
                            seed=body.seed, logprobs=body.logprobs, ignore_eos=body.ignore_eos)
    stream = engine.submit(ids, params)
    rid, created = f"gen-{stream.request_id}", int(time.time())
    if body.stream:
        return sse_response(_chunks(engine, stream, request, rid, created, len(ids), body.logprobs is not None),
                            [stream])
    (events,) = await collect(request, [stream])
    last = events[-1]
    mark(request, usage=(len(ids), last.completion_tokens))
    merged = EngineEvent(stream.request_id, token_ids=[t for e in events for t in e.token_ids],
                         logprobs=[lp for e in events for lp in e.logprobs],
                         top_logprobs=[t for e in events for t in e.top_logprobs])
    return GenerateResponse(
        id=rid, created=created, model=engine.name, text="".join(e.text for e in events),
        finish_reason=last.finish_reason, usage=Usage(prompt_tokens=len(ids), completion_tokens=last.completion_tokens,
                                                      total_tokens=len(ids) + last.completion_tokens),
        logprobs=token_logprobs(engine, merged) if body.logprobs is not None else None)


async def _chunks(engine: GenerativeEngine, stream: RequestStream, request: Request, rid: str, created: int,
                  prompt_tokens: int, want_logprobs: bool) -> AsyncIterator[dict]:
    async for event in stream:
        check_event(event)
        chunk = {"id": rid, "object": "text_generation.chunk", "created": created, "model": engine.name,
                 "text": event.text, "token_ids": event.token_ids, "finish_reason": event.finish_reason}
        if want_logprobs:
            chunk["logprobs"] = [t.model_dump(exclude_none=True) for t in token_logprobs(engine, event)]
        if event.finished:
            mark(request, usage=(prompt_tokens, event.completion_tokens))
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": event.completion_tokens,
                              "total_tokens": prompt_tokens + event.completion_tokens}
        yield chunk
