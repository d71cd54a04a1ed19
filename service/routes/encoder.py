"""POST /v1/fill-mask (Hugging Face shape) and POST /v1/embeddings (OpenAI shape)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request

from service.dependencies import RegistryDep, SettingsDep
from service.encoder_engine import EncoderEngine
from service.engine_errors import InvalidRequestError
from service.openai_schemas import EmbeddingItem, EmbeddingRequest, EmbeddingResponse
from service.routes.generate import ERRORS
from service.routes.inputs import text_list
from service.routes.streaming import mark, unless_disconnected
from service.schemas import FillMaskRequest, FillMaskResponse, Usage

router = APIRouter(tags=["encoder"])


@router.post("/v1/fill-mask", response_model=FillMaskResponse, responses=ERRORS,
             summary="Fill the mask token(s) in a text; returns the Hugging Face fill-mask shape")
async def fill_mask(body: FillMaskRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: EncoderEngine = registry.get(body.model, "encoder", "/v1/fill-mask")
    mark(request, engine.name)
    texts = text_list(body.text, "text", settings)
    rows = engine.tokenize(texts, "text")
    results = await unless_disconnected(request, engine.fill_mask(rows, body.top_k))
    mark(request, usage=(sum(map(len, rows)), 0))
    shaped = [per_text[0] if len(per_text) == 1 else per_text for per_text in results]
    return shaped[0] if isinstance(body.text, str) else shaped


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS,
             summary="OpenAI-compatible sentence embeddings (L2-normalised)")
async def embeddings(body: EmbeddingRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: EncoderEngine = registry.get(body.model, "encoder", "/v1/embeddings")
    mark(request, engine.name)
    if body.dimensions is not None and body.dimensions != engine.cfg.d_model:
        raise InvalidRequestError(f"dimensions must be {engine.cfg.d_model} for this model (no truncation)",
                                  "dimensions")
    inp = body.input
    if isinstance(inp, str) or (isinstance(inp, list) and inp and isinstance(inp[0], str)):
        rows = engine.tokenize(text_list(inp, "input", settings), "input")
    else:
        if not inp:
            raise InvalidRequestError("input must not be empty", "input")
        rows = [list(inp)] if isinstance(inp[0], int) else [list(r) for r in inp]
        if len(rows) > settings.max_texts:
            raise InvalidRequestError(f"input has {len(rows)} items; at most {settings.max_texts}", "input")
        engine.check_token_ids(rows, "input")
    vectors = await unless_disconnected(request, engine.embed(rows))
    tokens = sum(map(len, rows))
    mark(request, usage=(tokens, 0))
    if body.encoding_format == "base64":
        data = [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() for v in vectors]
    else:
        data = vectors
    return EmbeddingResponse(data=[EmbeddingItem(index=i, embedding=e) for i, e in enumerate(data)],
                             model=engine.name, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))
