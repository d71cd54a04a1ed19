"""The HTTP server: uvicorn with the service's header limits and its drain at shutdown.

- Request headers are bounded (``TSERVE_MAX_HEADER_BYTES`` for the request line and headers
  together, ``TSERVE_MAX_HEADERS`` header lines): past either, the connection gets a 431 in the
  OpenAI error shape and is closed, before the app sees anything.
- Shutdown drains the app before uvicorn's own graceful timeout: uvicorn cancels whatever is
  still running when ``timeout_graceful_shutdown`` ends and only then runs the app's lifespan
  shutdown, so a stream outliving it would be cut without a word. Here, on SIGTERM, the
  listening sockets close, the engines stop admitting, in-flight requests get
  ``TSERVE_SHUTDOWN_GRACE_S`` to finish and the rest fail (a stream with an error event and
  ``[DONE]``, any other request with a 503); uvicorn then has ``FLUSH_S`` to send those last
  bytes and close the connections.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.engines.errors import error_body, error_status
from service.settings import Settings

log = logging.getLogger("tserve.http")
FLUSH_S = 5  # after the drain: seconds for the failed requests' last bytes before uvicorn cancels them


def header_limited_protocol(max_bytes: int, max_count: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, refusing a request whose line and headers exceed ``max_bytes``
    or whose headers exceed ``max_count`` lines with 431 (h11 alone bounds only a header that
    arrives in pieces, with a plain-text 400, and never counts headers)."""
    message = (f"request headers too large: at most {max_bytes} bytes (TSERVE_MAX_HEADER_BYTES) in at most "
               f"{max_count} header lines (TSERVE_MAX_HEADERS)")
    body = json.dumps(error_body("headers_too_large", message)).encode()
    response = (f"HTTP/1.1 {error_status('headers_too_large')} Request Header Fields Too Large\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
                ).encode() + body

    class HeaderLimitedH11Protocol(H11Protocol):
        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # reading a request line and its headers
                buffered = self.conn.trailing_data[0] + data
                end = buffered.find(b"\r\n\r\n")
                head = buffered if end < 0 else buffered[:end]
                if len(head) > max_bytes or head.count(b"\r\n") > max_count:
                    log.warning("request headers too large", extra={
                        "status": 431, "header_bytes": len(head), "client": self.client})
                    self.transport.write(response)
                    self.transport.close()
                    return
            super().data_received(data)

    return HeaderLimitedH11Protocol


class Server(uvicorn.Server):
    """uvicorn's server; its shutdown drains the app's engines first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app

    async def on_tick(self, counter: int) -> bool:
        if self.app.state.exit_code is not None:  # the app asked to end (TSERVE_EXIT_ON_LOAD_FAILURE)
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:  # no new connections while in-flight requests finish
            server.close()
        settings: Settings = self.app.state.settings
        await self.app.state.registry.stop(settings.shutdown_grace_s)
        await super().shutdown(sockets)


def build_server(app: FastAPI, settings: Settings, **overrides: Any) -> Server:
    """The server for ``app``: settings give host, port, log level and the header limits."""
    options: dict[str, Any] = dict(
        host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
        http=header_limited_protocol(settings.max_header_bytes, settings.max_headers),
        h11_max_incomplete_event_size=settings.max_header_bytes + 1024,  # a backstop; the check above answers first
        timeout_graceful_shutdown=FLUSH_S)
    options.update(overrides)
    return Server(uvicorn.Config(app, **options), app)
