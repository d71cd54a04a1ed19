"""Errors the engines raise to the HTTP layer, each with its status code and error type."""

from __future__ import annotations


class EngineError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class InvalidRequestError(EngineError):
    status, type, code = 400, "invalid_request_error", "invalid_value"


class ModelNotFoundError(EngineError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class QueueFullError(EngineError):
    status, type, code = 429, "overloaded_error", "queue_full"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(EngineError):
    status, type, code = 503, "unavailable_error", "not_ready"


class ClientDisconnectedError(EngineError):
    """The client closed the connection before the answer was ready; its work is aborted.
    499 is nginx's "client closed request": nobody reads it, but logs and metrics show it
    apart from server errors."""

    status, type, code = 499, "client_disconnected", "client_disconnected"


class RequestFailedError(EngineError):
    """A request that was admitted but ended without a result (timeout, shutdown, bug)."""

    STATUS = {"timeout": 504, "shutdown": 503, "internal": 500}

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.status = self.STATUS.get(reason, 500)
        self.type = "timeout_error" if reason == "timeout" else "server_error"
        self.code = reason
