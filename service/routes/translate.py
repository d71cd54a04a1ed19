"""POST /v1/translate: en->de (or any encoder-decoder checkpoint), beam search or sampling."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from service.dependencies import RegistryDep, SettingsDep
from service.engine import GenerativeEngine, RequestStream, SamplingParams
from service.engine_errors import InvalidRequestError
from service.routes.generate import ERRORS
from service.routes.inputs import text_list
from service.routes.streaming import check_event, collect, mark, sse_response
from service.schemas import TranslateRequest, TranslateResponse, Translation, Usage

router = APIRouter(tags=["translation"])


@router.post("/v1/translate", response_model=TranslateResponse, responses=ERRORS,
             summary="Translate one text or a list of texts (stream=true streams a single text)")
async def translate(body: TranslateRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = registry.get(body.model, "encoder-decoder", "/v1/translate")
    mark(request, engine.name)
    texts = text_list(body.text, "text", settings)
    if body.stream and (len(texts) != 1 or not isinstance(body.text, str)):
        raise InvalidRequestError("stream=true needs a single text, not a list", "stream")
    params = SamplingParams(max_new_tokens=body.max_tokens, beam_size=body.beam_size,
                            length_penalty=body.length_penalty, temperature=body.temperature, seed=body.seed)
    sources = engine.tokenizer.encode_batch(texts)
    streams = engine.submit_all(
        [(ids, params, "text" if len(texts) == 1 else f"text[{i}]") for i, ids in enumerate(sources)], "text")
    rid, created = f"tr-{streams[0].request_id}", int(time.time())
    prompt_tokens = sum(map(len, sources))
    if body.stream:
        return sse_response(_chunks(engine, streams[0], request, rid, created, prompt_tokens), streams)
    results = await collect(request, streams)
    completion_tokens = sum(events[-1].completion_tokens for events in results)
    mark(request, usage=(prompt_tokens, completion_tokens))
    return TranslateResponse(
        id=rid, created=created, model=engine.name,
        translations=[Translation(text="".join(e.text for e in events).strip(), finish_reason=events[-1].finish_reason,
                                  tokens=events[-1].completion_tokens) for events in results],
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens))


async def _chunks(engine: GenerativeEngine, stream: RequestStream, request: Request, rid: str, created: int,
                  prompt_tokens: int) -> AsyncIterator[dict]:
    async for event in stream:
        check_event(event)
        chunk = {"id": rid, "object": "translation.chunk", "created": created, "model": engine.name,
                 "text": event.text, "finish_reason": event.finish_reason}
        if event.finished:
            mark(request, usage=(prompt_tokens, event.completion_tokens))
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": event.completion_tokens,
                              "total_tokens": prompt_tokens + event.completion_tokens}
        yield chunk
