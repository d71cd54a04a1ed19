"""The app factory: ``create_app(settings)``.

The lifespan starts model loading in the background (so /health answers at once and
/ready reports progress) and, on shutdown, stops admitting and gives in-flight requests
``shutdown_grace_s`` to finish before the engines stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import torch
from fastapi import APIRouter, Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from service.http.dependencies import require_api_key
from service.http.errors import install_error_handlers
from service.http.middleware import (
    ApiKeyFirstMiddleware,
    BodyLimitMiddleware,
    ModelLeaseMiddleware,
    RequestLogMiddleware,
)
from service.logging_config import configure_logging
from service.metrics import Metrics
from service.models.registry import EngineRegistry
from service.routes import (
    chat,
    compat,
    completions,
    docs,
    encoder,
    generate,
    playground,
    system,
    translate,
    translate_po,
)
from service.settings import Settings
from service.translation import language_id

log = logging.getLogger("tserve.app")

DESCRIPTION = """Transformer inference: translation (encoder-decoder), generation (decoder-only),
fill-mask and embeddings (encoder-only), with continuous batching over a paged KV cache.
OpenAI-compatible `/v1/completions`, `/v1/embeddings`, `/v1/models`; streaming via Server-Sent Events."""


async def _load(registry: EngineRegistry, app: FastAPI) -> None:
    """Load the models; a failure is logged loudly and, with TSERVE_EXIT_ON_LOAD_FAILURE, ends the
    process (``app.state.exit_code``, which the server polls and ``python -m service`` exits with)."""
    await registry.start()
    if any(e.family == "encoder-decoder" for e in registry.engines.values()):  # /detect, source "auto": langid
        app.state.langid = asyncio.create_task(asyncio.to_thread(language_id.warm))
    if registry.error is None:
        return
    failed = next((name for name, entry in registry.entries.items() if entry.state == "failed"), None)
    exiting = app.state.settings.exit_on_load_failure
    log.error("model %s failed to load: %s; %s", f"'{failed}'" if failed else "discovery", registry.error,
              "exiting with status 1 (TSERVE_EXIT_ON_LOAD_FAILURE)" if exiting else
              "the process stays up: /ready answers 503 and /health 503 with this error (set "
              "TSERVE_EXIT_ON_LOAD_FAILURE=true or --exit-on-load-failure to exit instead)",
              extra={"model": failed, "error": registry.error})
    if exiting:
        app.state.exit_code = 1


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(settings.log_level, settings.log_json)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    metrics = Metrics()
    registry = EngineRegistry(settings, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(registry, app))
        app.state.loading = loading
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loading
            await registry.stop(settings.shutdown_grace_s)

    # The docs pages and the schema are our own routes (routes/docs.py): offline assets, own metric labels.
    app = FastAPI(title="transformer-serve", version="0.1.0", description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings, app.state.metrics, app.state.registry = settings, metrics, registry
    app.state.exit_code = None  # set when the process should end (a load failure, with the option)
    install_error_handlers(app)

    auth = [Depends(require_api_key)]
    probe_deps = auth if settings.protect_health_and_metrics else []
    app.include_router(system.probes, dependencies=probe_deps)
    app.include_router(docs.router)
    if settings.playground:
        app.include_router(playground.router)
    api = APIRouter(dependencies=auth)
    own = (generate, completions, chat, translate, translate_po, encoder)
    api_routers = [module.router for module in own] + [system.models] + list(compat.OPENAI_SHAPED)
    # TGI, TEI, InferenceClient: Authorization: Bearer like ours, but their own error shapes, so
    # the key-first middleware (OpenAI-shaped 401 before the body is read) covers only ours.
    for router in api_routers + list(compat.BEARER_AUTH):
        api.include_router(router)
    app.include_router(api)
    for router in compat.OWN_AUTH:  # LibreTranslate's api_key field, DeepL's DeepL-Auth-Key header
        app.include_router(router)

    app.add_middleware(ModelLeaseMiddleware, registry=registry)  # innermost: around the route and its stream
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.api_key is not None:  # outside the body limit: no key, no 413 either
        keyed = api_routers + ([system.probes] if settings.protect_health_and_metrics else [])
        app.add_middleware(ApiKeyFirstMiddleware, routes=[r for router in keyed for r in router.routes],
                           settings=settings)
    origins = settings.cors_origin_list()
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
                           expose_headers=["X-Request-ID", "Retry-After"])
    app.add_middleware(RequestLogMiddleware, metrics=metrics)  # outermost: sees every status, incl. 413
    return app
