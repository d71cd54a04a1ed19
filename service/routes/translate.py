"""POST /v1/translate: en->de (or any encoder-decoder checkpoint), beam search or sampling."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from service.dependencies import RegistryDep, SettingsDep
from service.engine import GenerativeEngine, RequestStream, SamplingParams
from service.engine_errors import InvalidRequestError
from service.errors import ERROR_RESPONSES
from service.routes.inputs import input_ids
from service.routes.streaming import check_event, collect, mark, sse_response
from service.schemas import TranslateRequest, TranslateResponse, Translation, Usage

router = APIRouter(tags=["translation"])


@router.post("/v1/translate", response_model=TranslateResponse, responses=ERROR_RESPONSES,
             summary="Translate one text or a list of texts (stream=true streams a single text)")
async def translate(body: TranslateRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = registry.get(body.model, "encoder-decoder", "/v1/translate")
    mark(request, engine.name)
    if body.stream and not isinstance(body.text, str):
        raise InvalidRequestError("stream=true needs a single text, not a list", "stream")
    sources = input_ids(body.text, "text", engine, settings)
    params = SamplingParams(max_new_tokens=body.max_tokens, beam_size=body.beam_size,
                            length_penalty=body.length_penalty, temperature=body.temperature, seed=body.seed)
    streams = engine.submit_all(
        [(ids, params, "text" if len(sources) == 1 else f"text[{i}]") for i, ids in enumerate(sources)], "text")
    rid, created = f"tr-{streams[0].request_id}", int(time.time())
    if body.stream:
        return sse_response(_chunks(engine, streams[0], request, rid, created, sources), streams, request)
    results = await collect(request, streams)
    finals = [events[-1] for events in results]
    usage = engine.usage(sources, finals)
    mark(request, usage=usage)
    return TranslateResponse(
        id=rid, created=created, model=engine.name,
        translations=[Translation(text="".join(e.text for e in events).strip(), finish_reason=events[-1].finish_reason,
                                  tokens=engine.completion_tokens(events[-1])) for events in results],
        usage=Usage(**usage.as_dict()))


async def _chunks(engine: GenerativeEngine, stream: RequestStream, request: Request, rid: str, created: int,
                  sources: list[list[int]]) -> AsyncIterator[dict]:
    async for event in stream:
        check_event(event)
        chunk = {"id": rid, "object": "translation.chunk", "created": created, "model": engine.name,
                 "text": event.text, "finish_reason": event.finish_reason}
        if event.finished:
            usage = engine.usage(sources, [event])
            mark(request, usage=usage)
            chunk["usage"] = usage.as_dict()
        yield chunk
