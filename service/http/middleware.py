"""Pure ASGI middlewares (they never buffer a streamed response).

- ``BodyLimitMiddleware``: bodies over ``max_body_bytes`` get 413, whether or not the
  client sent a Content-Length.
- ``ApiKeyFirstMiddleware``: a route that requires the API key answers 401 before anything
  reads the body (no 400 for a malformed body, no 413, to a client without the key).
- ``ModelLeaseMiddleware``: the models a request uses stay in use (never unloaded) until its
  response is done, streams included.
- ``RequestLogMiddleware``: one structured log line and the request metrics per request:
  id, endpoint, status, model, tokens, latency.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.engines.errors import error_body, error_status
from service.http.dependencies import API_KEY_MESSAGE, api_key_ok
from service.metrics import Metrics
from service.models.registry import EngineRegistry
from service.settings import Settings

log = logging.getLogger("tserve.access")
PROBES = {"/health", "/ready", "/metrics", "/v1/loads"}  # scraped every few seconds: logged at debug level only
REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

# keys routes set in the ASGI scope for the log line and the metric labels
MODEL_KEY, USAGE_KEY, ERROR_KEY = "tserve.model", "tserve.usage", "tserve.error"


async def _send_error(send: Send, code: str, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(code, message)).encode()
    await send({"type": "http.response.start", "status": error_status(code),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyFirstMiddleware:
    """FastAPI reads and parses a body before it runs a route's dependencies, so a malformed body
    would get its 400 before the API key is checked. This checks the key first, for the routes
    given (those the app puts behind ``require_api_key``)."""

    def __init__(self, app: ASGIApp, routes: list[BaseRoute], settings: Settings):
        self.app, self.routes, self.settings = app, routes, settings

    def _protected_route(self, scope: Scope) -> bool:
        # PARTIAL: the path with another method (its 405 comes after the key)
        return any(route.matches(scope)[0] is not Match.NONE for route in self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._protected_route(scope):
            authorization = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not api_key_ok(authorization, self.settings):
                return await _send_error(send, "invalid_api_key", API_KEY_MESSAGE, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"request body exceeds the limit of {self.limit} bytes (TSERVE_MAX_BODY_BYTES)"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _send_error(send, "body_too_large", message)
        seen, started, rejected = 0, False, False

        async def limited_receive() -> Message:
            # A chunked body is counted as it arrives. Past the limit we answer 413 ourselves and
            # tell the app the client left (an exception here would be turned into a 400 by FastAPI).
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    rejected = True
                    if not started:
                        await tracking_send_error()
                    return {"type": "http.disconnect"}
            return msg

        async def tracking_send_error() -> None:
            nonlocal started
            started = True
            await _send_error(send, "body_too_large", message)

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if rejected:
                return  # the 413 is already out; drop whatever the app answers to the "disconnect"
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception:
            if not rejected:
                raise


class ModelLeaseMiddleware:
    def __init__(self, app: ASGIApp, registry: EngineRegistry):
        self.app, self.registry = app, registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with self.registry.request_leases():
            await self.app(scope, receive, send)


class RequestLogMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID_OK.match(given) else uuid.uuid4().hex
        scope["tserve.request_id"] = request_id
        status = 500

        async def send_with_id(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg.setdefault("headers", [])
                msg["headers"] = list(msg["headers"]) + [(b"x-request-id", request_id.encode())]
            await send(msg)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            latency = time.perf_counter() - start
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            model = scope.get(MODEL_KEY, "none")
            prompt_tokens, completion_tokens = scope.get(USAGE_KEY, (0, 0))
            self.metrics.requests.labels(model, endpoint, str(status)).inc()
            self.metrics.request_duration.labels(model, endpoint).observe(latency)
            extra = {"request_id": request_id, "method": scope["method"], "path": scope["path"],
                     "endpoint": endpoint, "status": status, "model": model, "prompt_tokens": prompt_tokens,
                     "completion_tokens": completion_tokens, "latency_ms": round(latency * 1000, 2)}
            if ERROR_KEY in scope:  # a stream that ended with an error event (its status was already 200)
                extra["error"] = scope[ERROR_KEY]
            log.log(logging.DEBUG if scope["path"] in PROBES else logging.INFO, "request", extra=extra)
