"""Our task routes as Hugging Face Inference Endpoints: a user given ``.../v1/fill-mask`` (or
``/v1/generate``, ``/v1/translate``, ``/v1/embeddings``) as an endpoint URL calls
``InferenceClient(base_url=that URL)``, which posts the HF task shape ``{"inputs", "parameters"}``
there and reads ``GET <URL>/info``.

``HFTaskDoorRoute`` is the route class of those four routes: a body with ``inputs`` and without the
route's own input field (``text``, ``prompt``, ``input``) is answered as ``POST /`` answers that task
(``hf_inference.answer``: HF's shapes, errors in TGI's shape, TEI's for embeddings); any other body
goes to the route itself, unchanged. On ``/v1/fill-mask``, whose own body already takes ``inputs``
as a name for ``text``, only a body with ``parameters`` is the HF shape. ``info_router`` adds
``GET <route>/info``: TEI's /info for the embedding model on ``/v1/embeddings``, TGI's for the
task's default model on the others.
"""

from __future__ import annotations

import json
from json import JSONDecodeError
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

import service.routes.compat.tei as tei
import service.routes.compat.tgi as tgi
from service.engines.errors import EngineError, InvalidRequestError
from service.http.dependencies import RegistryDep, SettingsDep
from service.http.errors import BODY_PARSE_ERROR
from service.routes.compat.hf_inference import answer, tei_info, tgi_info

# path -> (HF task, the route's own input field)
DOORS = {"/v1/fill-mask": ("fill-mask", "text"), "/v1/generate": ("text-generation", "prompt"),
         "/v1/translate": ("translation", "text"), "/v1/embeddings": ("feature-extraction", "input")}


async def _json_object(request: Request) -> dict[str, Any] | None:
    if request.method != "POST" or "json" not in request.headers.get("content-type", "json"):
        return None
    try:
        raw = await request.body()  # cached on the request: the route reads it again
    except Exception as exc:  # noqa: BLE001 - a cut or refused body: answered as the route itself answers it
        raise HTTPException(400, BODY_PARSE_ERROR) from exc
    try:
        body = json.loads(raw)
    except (JSONDecodeError, UnicodeDecodeError, RecursionError):  # the route's own parse answers these
        return None
    return body if isinstance(body, dict) else None


def hf_shaped(path: str, body: dict[str, Any] | None) -> bool:
    if path not in DOORS or body is None or "inputs" not in body:
        return False
    task, own = DOORS[path]
    return own not in body and (task != "fill-mask" or "parameters" in body)


class HFTaskDoorRoute(APIRoute):
    """The route, or ``POST /``'s answer for its task when the body is the HF task shape."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        if self.path not in DOORS:
            return handler
        task = DOORS[self.path][0]
        render = tei.render if task == "feature-extraction" else tgi.render

        async def door(request: Request) -> Response:
            body = await _json_object(request)
            if not hf_shaped(self.path, body):
                return await handler(request)
            try:
                result = await answer(task, _hf_body(task, body), request, request.app.state.registry,
                                      request.app.state.settings)
            except EngineError as exc:
                return render(exc)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err.get("loc", ()))
                return render(InvalidRequestError(f"{where}: {err['msg']}" if where else err["msg"], where or None))
            return result if isinstance(result, Response) else JSONResponse(result)

        return door


def _hf_body(task: str, body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequestError("parameters: must be an object", "parameters")
    if task == "feature-extraction" and params:  # TEI reads its options at the top level
        return {**{k: v for k, v in body.items() if k != "parameters"}, **params}
    return body


info_router = APIRouter(tags=["Hugging Face Inference (TGI / TEI)"], route_class=tgi.router.route_class)


@info_router.get("/v1/embeddings/info", summary="TEI's /info for the default embedding model")
async def embeddings_info(registry: RegistryDep, settings: SettingsDep):
    engine = registry.default("feature-extraction")
    return tei_info(engine, settings) if engine else _none("feature-extraction")


@info_router.get("/v1/generate/info", summary="TGI's /info for the default generation model")
async def generate_info(registry: RegistryDep, settings: SettingsDep):
    return _tgi(registry, settings, "text-generation")


@info_router.get("/v1/fill-mask/info", summary="TGI's /info shape for the default fill-mask model")
async def fill_mask_info(registry: RegistryDep, settings: SettingsDep):
    return _tgi(registry, settings, "fill-mask")


@info_router.get("/v1/translate/info", summary="TGI's /info shape for the default translation model")
async def translate_info(registry: RegistryDep, settings: SettingsDep):
    return _tgi(registry, settings, "translation")


def _tgi(registry, settings, task: str):
    engine = registry.default(task)
    return tgi_info(engine, settings) if engine else _none(task)


def _none(task: str) -> JSONResponse:
    # 404: this endpoint has no model behind it (a URL nobody serves), in HF's error shape
    return JSONResponse({"error": f"no {task} model is loaded", "error_type": "validation"}, status_code=404)
