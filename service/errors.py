"""Every error leaves the service in the OpenAI shape:
``{"error": {"message", "type", "code", "param"}}`` with a meaningful status code."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.engine_errors import EngineError, QueueFullError

log = logging.getLogger("tserve.http")

HTTP_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
              413: "invalid_request_error", 429: "overloaded_error", 503: "unavailable_error"}


def error_response(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "code": code, "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-\w+\[.*\]|literal\[.*\])$")


def _location(loc: tuple) -> tuple[str, str | None]:
    """('body', 'stop', 'list[str]', 5) -> ('stop[5]', 'stop'): pydantic's union-branch
    names are dropped so the message names the client's field."""
    parts = [p for p in loc if p != "body" and not (isinstance(p, str) and _UNION_BRANCH.match(p))]
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    first = next((p for p in parts if isinstance(p, str)), None)
    return text, first


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None
    where, param = _location(tuple(err.get("loc", ())))
    if err.get("type") == "missing":
        return (f"{where}: field required" if where else "request body required (a JSON object)"), param
    msg = err["msg"].removeprefix("Value error, ")
    return (f"{where}: {msg}" if where else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, QueueFullError) else None
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", "invalid_value", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = HTTP_TYPES.get(exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), kind,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error", "server_error")
