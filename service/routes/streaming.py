"""Waiting for engine events on behalf of one HTTP request.

Non-streaming requests watch the connection while they wait: if the client goes away
the request is aborted and its slot freed at the next engine step. Streaming requests
are cancelled by Starlette when the client disconnects; the ``finally`` in the chunk
generator aborts them the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from service.engine import EngineEvent, RequestStream, TokenUsage
from service.engine_errors import ClientDisconnectedError, RequestFailedError
from service.middleware import MODEL_KEY, USAGE_KEY

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def mark(request: Request, model: str | None = None, usage: TokenUsage | None = None) -> None:
    """Record the model and token usage for the request log and metrics."""
    if model is not None:
        request.scope[MODEL_KEY] = model
    if usage is not None:
        request.scope[USAGE_KEY] = (usage.prompt_tokens, usage.completion_tokens)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _drain(stream: RequestStream) -> list[EngineEvent]:
    events = []
    async for event in stream:
        if event.error:
            raise RequestFailedError(event.error, f"request failed: {event.message}")
        events.append(event)
    return events


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` while watching the connection; a client that leaves cancels it."""
    consumer = asyncio.ensure_future(work)
    # Once the client is gone nobody awaits the result: mark its outcome retrieved so a late
    # failure is not reported as "exception was never retrieved".
    consumer.add_done_callback(lambda f: f.cancelled() or f.exception())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            return consumer.result()
        raise ClientDisconnectedError("the client closed the connection; the request was aborted")
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()


async def collect(request: Request, streams: list[RequestStream]) -> list[list[EngineEvent]]:
    """All events of every stream; aborts them all if the client disconnects or one fails."""
    try:
        return await unless_disconnected(request, asyncio.gather(*(_drain(s) for s in streams)))
    finally:
        for s in streams:
            s.abort()


def sse_event(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def sse_response(chunks: AsyncIterator[dict[str, Any]], streams: list[RequestStream], done: bool = True,
                 error_chunk: Callable[[RequestFailedError], dict[str, Any]] | None = None) -> StreamingResponse:
    """One ``data: {json}`` per chunk, then ``data: [DONE]`` (unless ``done`` is false: TGI sends
    none). Errors become an error chunk (OpenAI's shape unless ``error_chunk`` gives another)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield sse_event(chunk)
        except RequestFailedError as exc:
            yield sse_event(error_chunk(exc) if error_chunk else exc.body())
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
