"""POST /v1/fill-mask (Hugging Face shape) and POST /v1/embeddings (OpenAI shape)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request

from service.engines.encoder import EncoderEngine
from service.engines.waiting import unless_disconnected
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import ERROR_RESPONSES
from service.routes.compat.hf_task_doors import HFTaskDoorRoute
from service.routes.inputs import input_ids
from service.routes.streaming import client_gone, mark
from service.schemas.common import FillMaskRequest, FillMaskResponse, Usage
from service.schemas.openai import EmbeddingItem, EmbeddingRequest, EmbeddingResponse

router = APIRouter(tags=["encoder"], route_class=HFTaskDoorRoute)  # also HF's {"inputs", "parameters"}


@router.post("/v1/fill-mask", response_model=FillMaskResponse, responses=ERROR_RESPONSES,
             summary="Fill the mask token(s) in a text; returns the Hugging Face fill-mask shape")
async def fill_mask(body: FillMaskRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: EncoderEngine = await registry.acquire(body.model, "encoder", "/v1/fill-mask", "fill-mask",
                                                   keep_alive=body.keep_alive)
    mark(request, engine.name)
    rows = input_ids(body.text, "text", engine, settings)
    texts = [body.text] if isinstance(body.text, str) else list(body.text)
    results = await unless_disconnected(client_gone(request), engine.fill_mask(rows, body.top_k, texts))
    mark(request, usage=engine.usage(rows))
    shaped = [per_text[0] if len(per_text) == 1 else per_text for per_text in results]
    return shaped[0] if isinstance(body.text, str) else shaped


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES,
             summary="OpenAI-compatible sentence embeddings (L2-normalised)")
async def embeddings(body: EmbeddingRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: EncoderEngine = await registry.acquire(body.model, "encoder", "/v1/embeddings", "feature-extraction",
                                                   keep_alive=body.keep_alive)
    mark(request, engine.name)
    engine.check_dimensions(body.dimensions)
    rows = input_ids(body.input, "input", engine, settings)
    vectors = await unless_disconnected(client_gone(request), engine.embed(rows))
    usage = engine.usage(rows)
    mark(request, usage=usage)
    if body.encoding_format == "base64":
        vectors = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    return EmbeddingResponse(data=[EmbeddingItem(index=i, embedding=e) for i, e in enumerate(vectors)],
                             model=engine.name, usage=Usage(**usage.as_dict()))
