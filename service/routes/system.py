"""GET /health, /ready, /metrics, /v1/loads, /v1/models; POST /models/load, /models/unload."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.http.dependencies import RegistryDep
from service.http.errors import ERROR_RESPONSES
from service.schemas.common import ErrorResponse
from service.schemas.gateway import WorkerLoads, worker_loads
from service.schemas.openai import ModelAction, ModelActionResult, ModelCard, ModelList

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


@probes.get("/v1/loads", response_model=WorkerLoads,
            summary="Load for a routing gateway (SMG's shape): requests running and waiting, KV-cache use, "
                    "prefix-cache hit rate, over the loaded generative models")
async def loads(registry: RegistryDep):
    return worker_loads(registry.loads())


@models.get("/v1/models", response_model=ModelList,
            summary="Every model served: loaded or not, with its state and memory (OpenAI list shape)")
async def list_models(registry: RegistryDep):
    return ModelList(data=[ModelCard(**card) for card in registry.cards()])


@models.get("/v1/models/{model_id}", response_model=ModelCard, summary="One model, loaded or not")
async def get_model(model_id: str, registry: RegistryDep):
    return ModelCard(**registry.card(model_id))


@models.post("/models/load", response_model=ModelActionResult, responses=ERROR_RESPONSES,
             summary="Load a model now (llama.cpp router's shape); evicts idle models past the memory budget")
async def load_model(body: ModelAction, registry: RegistryDep):
    await registry.load_within_deadline(body.model)
    return ModelActionResult(model=body.model, state=registry.card(body.model)["state"])


@models.post("/models/unload", response_model=ModelActionResult, responses={**ERROR_RESPONSES, 409: {
    "model": ErrorResponse, "description": "the model is not loaded (its state says why: available, loading)"}},
             summary="Unload a model now; its in-flight requests get TSERVE_SHUTDOWN_GRACE_S to finish")
async def unload_model(body: ModelAction, registry: RegistryDep):
    await registry.unload(body.model)
    return ModelActionResult(model=body.model, state=registry.card(body.model)["state"])
