"""POST /v1/translate: en->de (or any encoder-decoder checkpoint), beam search or sampling.
Placeholders are masked and checked in ``service.translation.translate``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from service.engines.errors import InvalidRequestError
from service.engines.generative import GenerativeEngine, RequestStream, SamplingParams
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import ERROR_RESPONSES
from service.routes.compat.hf_task_doors import HFTaskDoorRoute
from service.routes.inputs import text_list
from service.routes.streaming import check_event, client_gone, mark, sse_response
from service.schemas.common import TranslateRequest, TranslateResponse, Translation, Usage
from service.translation import translate as translation

router = APIRouter(tags=["translation"], route_class=HFTaskDoorRoute)  # also HF's {"inputs", "parameters"}


@router.post("/v1/translate", response_model=TranslateResponse, responses=ERROR_RESPONSES,
             summary="Translate one text or a list of texts (stream=true streams a single text)")
async def translate(body: TranslateRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    found = translation.engine_for(registry) if body.model is None else None
    engine: GenerativeEngine = await registry.acquire(found[1].name if found else body.model, "encoder-decoder",
                                                      "/v1/translate", keep_alive=body.keep_alive)
    mark(request, engine.name)
    if body.stream and not isinstance(body.text, str):
        raise InvalidRequestError("stream=true needs a single text, not a list", "stream")
    texts = text_list(body.text, "text", settings)
    sources = translation.sources(engine, texts)
    ids = translation.source_ids(engine, sources, "text")
    # the default (128) shrinks to a model with fewer positions; a value sent is checked as sent
    max_tokens = body.max_tokens if "max_tokens" in body.model_fields_set else min(body.max_tokens, engine.max_len - 1)
    params = SamplingParams(max_new_tokens=max_tokens, beam_size=body.beam_size,
                            length_penalty=body.length_penalty, temperature=body.temperature, seed=body.seed)
    rid, created = f"tr-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        streamed = translation.StreamedTranslation(engine, sources[0])
        stream = engine.submit_all([(ids[0], streamed.params(params), "text")], "text")[0]
        rid = f"tr-{stream.request_id}"
        return sse_response(_chunks(engine, stream, streamed, request, rid, created, ids), [stream], request)
    fields = ["text" if isinstance(body.text, str) else f"text[{i}]" for i in range(len(texts))]
    results, usage = await translation.translate(client_gone(request), engine, sources, ids, params, fields, "text")
    mark(request, usage=usage)
    return TranslateResponse(
        id=rid, created=created, model=engine.name,
        translations=[Translation(text=r.text, finish_reason=r.finish_reason, tokens=r.tokens,
                                  placeholders_ok=r.placeholders_ok) for r in results],
        usage=Usage(**usage.as_dict()))


async def _chunks(engine: GenerativeEngine, stream: RequestStream, streamed: translation.StreamedTranslation,
                  request: Request, rid: str, created: int, ids: list[list[int]]) -> AsyncIterator[dict]:
    async for event in stream:
        check_event(event)
        chunk = {"id": rid, "object": "translation.chunk", "created": created, "model": engine.name,
                 "text": streamed.feed(event), "finish_reason": event.finish_reason}
        if event.finished:
            usage = engine.usage(ids, [event])
            mark(request, usage=usage)
            chunk["usage"] = usage.as_dict()
            chunk["placeholders_ok"] = streamed.placeholders_ok
        yield chunk
