"""GET /health, /ready, /metrics, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.dependencies import RegistryDep
from service.engine_errors import ModelNotFoundError
from service.openai_schemas import ModelCard, ModelList
from service.schemas import printable

probes = APIRouter(tags=["operations"])
models = APIRouter(tags=["openai"])


@probes.get("/health", summary="Liveness: 200 while the process serves HTTP")
async def health(registry: RegistryDep):
    if registry.error is not None:  # loading failed: let the orchestrator restart us
        return JSONResponse({"status": "error", "error": registry.error}, status_code=503)
    return {"status": "ok"}


@probes.get("/ready", summary="Readiness: 503 until every model is loaded and warmed up")
async def ready(registry: RegistryDep):
    status = registry.status()
    return JSONResponse(status, status_code=200 if status["ready"] else 503)


@probes.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@models.get("/v1/models", response_model=ModelList, summary="Loaded models (OpenAI list shape)")
async def list_models(registry: RegistryDep):
    return ModelList(data=[ModelCard(**e.info()) for e in registry.engines.values()])


@models.get("/v1/models/{model_id}", response_model=ModelCard, summary="One loaded model")
async def get_model(model_id: str, registry: RegistryDep):
    engine = registry.engines.get(model_id)
    if engine is None:
        raise ModelNotFoundError(f"model '{printable(model_id)}' not found; loaded: {sorted(registry.engines)}",
                                 "model")
    return ModelCard(**engine.info())
