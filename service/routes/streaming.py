"""Answering one HTTP request from engine events: Server-Sent Events, the request log's marks.

Waiting for a whole result while watching the client (``collect``, ``unless_disconnected``)
lives below the routes, in ``service.engines.waiting``; a route passes it ``client_gone(request)``.
Streaming requests are cancelled by Starlette when the client disconnects; the ``finally`` in
the chunk generator aborts them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from service.engines.errors import RequestFailedError
from service.engines.generative import EngineEvent, RequestStream, TokenUsage
from service.http.middleware import ERROR_KEY, MODEL_KEY, USAGE_KEY


def client_gone(request: Request) -> Callable[[], Awaitable[None]]:
    """An async callable that returns once ``request``'s client has disconnected: it waits on
    the connection's receive channel (the body has been read by then), so a waiting request
    costs no polling."""
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    return wait

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def mark(request: Request, model: str | None = None, usage: TokenUsage | None = None,
         error: str | None = None) -> None:
    """Record the model, token usage and (for a stream that ended in an error) the error code
    for the request log and metrics."""
    if model is not None:
        request.scope[MODEL_KEY] = model
    if usage is not None:
        request.scope[USAGE_KEY] = (usage.prompt_tokens, usage.completion_tokens)
    if error is not None:
        request.scope[ERROR_KEY] = error


def sse_event(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event; ``event`` adds an ``event:`` line (Anthropic's and OpenAI's Responses
    streams name every event after its ``type``)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


def sse_response(chunks: AsyncIterator[dict[str, Any]], streams: list[RequestStream],
                 request: Request | None = None, done: bool = True,
                 error_chunk: Callable[[RequestFailedError], dict[str, Any]] | None = None,
                 named: bool = False) -> StreamingResponse:
    """One ``data: {json}`` per chunk, then ``data: [DONE]`` (unless ``done`` is false: TGI sends
    none). An error (timeout, shutdown) becomes a final error chunk (OpenAI's shape unless
    ``error_chunk`` gives another); with ``request`` its code goes into the request's log line.
    ``named``: each event also carries ``event: <the chunk's type>``."""

    def event(chunk: dict[str, Any]) -> bytes:
        return sse_event(chunk, chunk.get("type") if named else None)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield event(chunk)
        except RequestFailedError as exc:
            if request is not None:
                mark(request, error=exc.code)
            yield event(error_chunk(exc) if error_chunk else exc.body())
        finally:
            for s in streams:
                s.abort()
        if done:
            yield sse_event("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


def check_event(event: EngineEvent) -> EngineEvent:
    if event.error:
        raise RequestFailedError(event.error, f"request failed: {event.message}")
    return event


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, EngineEvent]]:
    """(choice index, event) from every stream, in the order the events arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for event in stream:
            await queue.put((index, event))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, event = await queue.get()
            remaining -= event.finished
            yield index, event
    finally:
        for p in pumps:
            p.cancel()
