"""The HTTP side of errors: handlers that turn every failure into the OpenAI shape,
``{"error": {"message", "type", "code", "param"}}``, with the status of its row in the one
error table (``service.engines.errors.ERRORS``)."""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from service.engines.errors import (
    DOCUMENTED_STATUSES,
    HTTP_STATUS_CODES,
    EngineError,
    error_body,
    error_status,
)
from service.schemas.common import ErrorResponse

log = logging.getLogger("tserve.http")

BODY_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's detail for a body json.loads could not read

# the `responses=` of every inference route, for the OpenAPI schema
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in DOCUMENTED_STATUSES}


class ErrorJSONResponse(JSONResponse):
    """A JSON error that always encodes: a lone surrogate that reached a message (a client's
    text) is written as its JSON escape instead of failing the response with a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace")


def error_response(code: str, message: str, param: str | None = None, status: int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_body(code, message, param)
    return ErrorJSONResponse(body, status_code=status or error_status(code), headers=headers)


UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-\w+\[.*\]|literal\[.*\])$")


def _location(loc: tuple) -> tuple[str, str | None]:
    """('body', 'stop', 'list[str]', 5) -> ('stop[5]', 'stop'): pydantic's union-branch
    names are dropped so the message names the client's field."""
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and UNION_BRANCH.match(p))]
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    first = next((p for p in parts if isinstance(p, str)), None)
    return text, first


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _validation_error(exc: RequestValidationError, content_type: str | None) -> tuple[str, str, str | None]:
    """(code, message, param) for the first problem pydantic found."""
    errors = exc.errors()
    err = errors[0]
    where, param = _location(tuple(err.get("loc", ())))
    if err.get("type") == "json_invalid":
        return "invalid_json", f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
    if err.get("type") == "extra_forbidden":  # OpenAI's own words for an unknown field
        return "invalid_value", f"Unrecognized request argument supplied: {where}", param
    if err.get("type") == "missing":
        return "invalid_value", (f"{where}: field required" if where else "request body required (a JSON object)"), \
            param
    if not where and not _is_json(content_type or ""):
        # FastAPI parses a body as JSON only when it is declared so (no header: not at all);
        # anything else reaches validation as raw bytes, "not a valid dictionary".
        sent = f"sent Content-Type: {content_type}" if content_type else "sent no Content-Type"
        return "invalid_json", (f"the request body must be JSON, sent with the header Content-Type: "
                                f"application/json (this request {sent})"), "Content-Type"
    if not where and err.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return "invalid_value", "the request body must be a JSON object", None
    branches = _union_branches(errors, param)
    if len(branches) > 1 and not err["type"].startswith(("value_error", "assertion_error")):
        return "invalid_value", f"{param} must be one of: {', '.join(branches)} (strict JSON types)", param
    msg = err["msg"].removeprefix("Value error, ")
    return "invalid_value", (f"{where}: {msg}" if where else msg), param


def _union_branches(errors: list[dict], param: str | None) -> list[str]:
    """The types a union field accepts, from pydantic's per-branch errors on it."""
    branches: list[str] = []
    for e in errors:
        loc = [p for p in e.get("loc", ()) if p != "body"]
        if len(loc) > 1 and loc[0] == param and isinstance(loc[1], str) and UNION_BRANCH.match(loc[1]):
            if loc[1] not in branches:
                branches.append(loc[1])
    return [b.replace("list[int]", "list[token id]").replace("none", "null") for b in branches]


def _allowed_methods(request: Request) -> str:
    """Every documented method the path answers. Starlette's 405 names only the first route that matched
    the path, but a path may have one route per method (``GET /`` and ``POST /``)."""
    def answers(method: str) -> bool:
        scope = {**request.scope, "method": method}
        return any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes)

    # a method the schema leaves out of a path it lists (the playground's GET /) is not advertised
    documented = request.app.openapi()["paths"].get(request.scope.get("path", ""))
    return ", ".join(m for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
                     if answers(m) and (documented is None or m.lower() in documented))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        retry_after = getattr(exc, "retry_after", None)  # queue full, memory budget
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return ErrorJSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        code, message, param = _validation_error(exc, request.headers.get("content-type"))
        return error_response(code, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_STATUS_CODES.get(exc.status_code, "invalid_value")
        message = str(exc.detail)
        if exc.status_code == 400 and message == BODY_PARSE_ERROR:  # not UTF-8, or nested too deep to parse
            code, message = "invalid_json", "request body is not valid JSON: it must be UTF-8 text of bounded depth"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return error_response(code, message, status=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response("internal", "internal server error")
