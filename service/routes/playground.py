"""GET / and /playground: the web playground, a static page shipped in the package.

The page (``service/playground/``: HTML, CSS and JavaScript modules, no build step) loads
nothing from another host; the Content-Security-Policy below makes the browser refuse to.
The page itself is public, like /docs: with TSERVE_API_KEY set it asks for the key and sends
it on every API call. ``TSERVE_PLAYGROUND=false`` leaves these routes out (``/playground`` is
then a 404; ``GET /`` a 405, as ``POST /`` is the Hugging Face Inference route).
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from service.engines.errors import error_body

router = APIRouter()  # GET / is in the schema (an HTML page); the rest is not

PAGE_DIR = files("service") / "playground"
ASSETS = {"playground.css": "text/css; charset=utf-8", "main.js": "text/javascript; charset=utf-8",
          "api.js": "text/javascript; charset=utf-8", "tabs.js": "text/javascript; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new version of the service brings a new page
}


def _page() -> Response:
    return Response((PAGE_DIR / "index.html").read_bytes(), media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/", summary="The web playground (an HTML page)", response_class=HTMLResponse,
            responses={200: {"content": {"text/html": {"schema": {"type": "string"}}}}})
async def root() -> Response:
    return _page()


@router.get("/playground", include_in_schema=False)
async def playground() -> Response:
    return _page()


@router.get("/playground/assets/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in ASSETS:
        return JSONResponse(error_body("not_found", f"no playground asset '{name}'"), status_code=404)
    return Response((PAGE_DIR / name).read_bytes(), media_type=ASSETS[name], headers=HEADERS)
