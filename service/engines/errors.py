"""Every error the service returns, in one table, and the exceptions the engines raise.

An error leaves the service in the OpenAI shape, ``{"error": {"message", "type", "code",
"param"}}``. Its ``code`` picks the row of ``ERRORS`` that gives the HTTP status and the
OpenAI ``type``; the HTTP handlers (``service.http.errors``), the 413 middleware and the error
chunk of a stream all read this table, so one code always means one status.
No web imports here: the engines raise these without knowing about HTTP.
"""

from __future__ import annotations

from typing import Any

# code -> (HTTP status, OpenAI error type)
ERRORS: dict[str, tuple[int, str]] = {
    "invalid_value": (400, "invalid_request_error"),  # a field out of range, a bad combination
    "invalid_json": (400, "invalid_request_error"),  # the body is not JSON, or not sent as JSON
    "empty_input": (400, "invalid_request_error"),  # an empty text, list of texts or list of token ids
    "input_too_long": (400, "invalid_request_error"),  # an input past the model's token limit
    "invalid_api_key": (401, "authentication_error"),
    "model_not_found": (404, "invalid_request_error"),  # OpenAI's type for an unknown model
    "not_found": (404, "not_found_error"),  # no such path
    "method_not_allowed": (405, "invalid_request_error"),
    "model_not_loaded": (409, "invalid_request_error"),  # unloading a model that is not loaded (its state)
    "body_too_large": (413, "invalid_request_error"),
    "headers_too_large": (431, "invalid_request_error"),  # TSERVE_MAX_HEADER_BYTES / TSERVE_MAX_HEADERS
    "queue_full": (429, "overloaded_error"),  # with Retry-After
    "client_disconnected": (499, "client_disconnected"),  # nginx's "client closed request": logs only
    "grammar_limit": (400, "invalid_request_error"),  # a grammar past the grammar engine's limits while decoding
    "internal": (500, "server_error"),
    "not_ready": (503, "unavailable_error"),  # loading, or stopped admitting
    "shutdown": (503, "unavailable_error"),  # admitted, then failed by the shutdown
    "grammar_busy": (503, "unavailable_error"),  # a grammar not compiled within its deadline (a busy host); Retry-After
    "memory_budget": (503, "unavailable_error"),  # loading the model would pass TSERVE_MEMORY_BUDGET; Retry-After
    "timeout": (504, "timeout_error"),  # TSERVE_REQUEST_TIMEOUT_S
}

# Starlette's own HTTP errors (routing, auth) -> our code
HTTP_STATUS_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

# What the OpenAPI schema lists for every inference endpoint (499 reaches nobody).
DOCUMENTED_STATUSES = sorted({status for status, _ in ERRORS.values()} - {405, 409, 499})


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI-shaped error object for ``code`` (a key of ``ERRORS``)."""
    return {"error": {"message": message, "type": ERRORS[code][1], "code": code, "param": param}}


def error_status(code: str) -> int:
    return ERRORS[code][0]


class EngineError(Exception):
    code = "internal"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        self.code = code if code in ERRORS else self.code
        self.status, self.type = ERRORS[self.code]

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.param)


class InvalidRequestError(EngineError):
    code = "invalid_value"


class EmptyInputError(InvalidRequestError):
    """An empty input (TEI answers these with its own status, 400 ``Empty``)."""

    code = "empty_input"


class InputTooLongError(InvalidRequestError):
    """An input with more tokens than the model accepts (TEI: 413 ``Validation``)."""

    code = "input_too_long"


class ModelNotFoundError(EngineError):
    code = "model_not_found"


class QueueFullError(EngineError):
    code = "queue_full"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class GrammarBusyError(EngineError):
    """A grammar that did not compile within its deadline. Its compile goes on and lands in the
    grammar cache, so a retry after ``retry_after`` seconds finds it there."""

    code = "grammar_busy"

    def __init__(self, message: str, param: str | None, retry_after: int):
        super().__init__(message, param)
        self.retry_after = retry_after


class EngineStoppedError(EngineError):
    code = "not_ready"


class MemoryBudgetError(EngineError):
    """A model cannot be loaded within TSERVE_MEMORY_BUDGET because every loaded model is busy
    (in flight models are never evicted): retry once one is idle."""

    code = "memory_budget"

    def __init__(self, message: str, param: str | None = "model", retry_after: int = 5):
        super().__init__(message, param)
        self.retry_after = retry_after


class ClientDisconnectedError(EngineError):
    """The client closed the connection before the answer was ready; its work is aborted.
    Nobody reads the 499, but logs and metrics show it apart from server errors."""

    code = "client_disconnected"


class RequestFailedError(EngineError):
    """A request that was admitted but ended without a result: ``reason`` is the engine's
    error (``timeout``, ``shutdown``, ``internal``; anything else counts as internal)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message, code=reason)
