"""GET /docs (Swagger UI), /redoc, /openapi.json, served without any CDN.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so they are blank offline or
behind a firewall. These pages load the same assets from the ``fastapi-offline`` package
(Swagger UI: Apache-2.0; ReDoc: MIT; the package: MIT) under /docs/assets/, and every
route here has its own ``endpoint`` label in the request metrics.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from service.engines.errors import error_body
from service.http.openapi import contract

router = APIRouter(include_in_schema=False)

ASSETS_DIR = files("fastapi_offline") / "static"
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "redoc.standalone.js": "text/javascript", "favicon.png": "image/png"}
OPENAPI, OAUTH2_REDIRECT = "/openapi.json", "/docs/oauth2-redirect"


def _root(request: Request) -> str:
    return request.scope.get("root_path", "").rstrip("/")  # behind a proxy that mounts us under a prefix


@router.get(OPENAPI)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(contract(request.app))


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_swagger_ui_html(
        openapi_url=root + OPENAPI, title=f"{request.app.title} - Swagger UI", oauth2_redirect_url=OAUTH2_REDIRECT,
        swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js", swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
        swagger_favicon_url=f"{root}/docs/assets/favicon.png",
        swagger_ui_parameters={"validatorUrl": None})  # no badge fetched from swagger.io


@router.get(OAUTH2_REDIRECT)
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_redoc_html(openapi_url=root + OPENAPI, title=f"{request.app.title} - ReDoc",
                          redoc_js_url=f"{root}/docs/assets/redoc.standalone.js",
                          redoc_favicon_url=f"{root}/docs/assets/favicon.png", with_google_fonts=False)


@router.get("/docs/assets/{name}")
async def asset(name: str):
    if name not in ASSETS:
        return JSONResponse(error_body("not_found", f"no documentation asset '{name}'"), status_code=404)
    return FileResponse(str(ASSETS_DIR / name), media_type=ASSETS[name],
                        headers={"Cache-Control": "public, max-age=86400"})
