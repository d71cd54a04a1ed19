"""Text Embeddings Inference: POST /embed (``inputs``, ``normalize``, ``truncate``).

As TEI serves it (https://huggingface.github.io/text-embeddings-inference/): the answer is one
vector per input, always a list of lists; errors are ``{"error", "error_type"}`` with 413
(Validation: an input too long without ``truncate``), 422 (Tokenizer), 424 (Backend),
429 (Overloaded), 400 (Empty). ``GET /info`` and ``POST /`` live in ``hf_inference``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from service.engines.encoder import EncoderEngine
from service.engines.errors import EngineError, InvalidRequestError
from service.engines.waiting import unless_disconnected
from service.http.dependencies import RegistryDep, SettingsDep
from service.routes.compat.common import error_route
from service.routes.inputs import text_list
from service.routes.streaming import client_gone, mark
from service.schemas.common import RequestModel

TEI_ERROR_TYPES = {400: "Empty", 413: "Validation", 422: "Tokenizer", 424: "Backend", 429: "Overloaded",
                   503: "Unhealthy"}


# Codes of the error table (service.engines.errors) TEI answers with a status of its own;
# every other client error is a Tokenizer error (422).
TEI_STATUSES = {"empty_input": 400, "input_too_long": 413}


def render(exc: EngineError) -> JSONResponse:
    if exc.status in (400, 404):
        status = TEI_STATUSES.get(exc.code, 422)
    else:
        status = exc.status if exc.status in TEI_ERROR_TYPES else 424
    headers = ({"Retry-After": str(getattr(exc, "retry_after", 1))}
               if status == 429 or hasattr(exc, "retry_after") else None)
    return JSONResponse({"error": exc.message, "error_type": TEI_ERROR_TYPES[status]}, status_code=status,
                        headers=headers)


router = APIRouter(tags=["Text Embeddings Inference"], route_class=error_route(render))


class EmbedRequest(RequestModel):
    model_config = ConfigDict(extra="ignore")  # strict JSON types, as TEI (serde) reads them

    model: str | None = Field(None, description="extension: which loaded model (TEI serves one)")
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False
    truncation_direction: str = Field("Right", pattern="^(Right|right|Left|left)$")
    prompt_name: str | None = None
    dimensions: int | None = Field(None, ge=1)


async def embed(body: EmbedRequest, request: Request, registry, settings) -> list[list[float]]:
    engine: EncoderEngine = await registry.acquire(body.model, "encoder", request.url.path, "feature-extraction",
                                           only_one=True)
    mark(request, engine.name)
    if body.truncation_direction.lower() == "left":
        raise InvalidRequestError("truncation_direction Left is not supported (inputs are cut on the right)",
                                  "truncation_direction")
    if body.prompt_name is not None:
        raise InvalidRequestError("prompt_name is not supported: this model defines no prompts", "prompt_name")
    engine.check_dimensions(body.dimensions)
    rows = engine.tokenize(text_list(body.inputs, "inputs", settings), "inputs", truncate=body.truncate)
    vectors = await unless_disconnected(client_gone(request), engine.embed(rows, normalize=body.normalize))
    mark(request, usage=engine.usage(rows))
    return vectors


@router.post("/embed", summary="TEI: sentence embeddings, one vector per input")
async def embed_route(body: EmbedRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    return await embed(body, request, registry, settings)
