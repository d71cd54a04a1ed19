"""Waiting for engine results on behalf of one client, without knowing about HTTP.

A non-streaming request watches its client while it waits: if the client goes away the
request is aborted and its slot freed at the next engine step. The client is seen only
through ``is_disconnected``, an async callable answering whether it has gone (a route passes
``request.is_disconnected``), polled every ``POLL_S`` seconds. Streaming requests are
cancelled by the web server when the client disconnects; the ``finally`` in the route's
chunk generator aborts them the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from service.engine import EngineEvent, RequestStream
from service.engine_errors import ClientDisconnectedError, RequestFailedError

T = TypeVar("T")
IsDisconnected = Callable[[], Awaitable[bool]]
POLL_S = 0.1  # how often a waiting request asks whether its client is still there


async def _until_disconnected(is_disconnected: IsDisconnected) -> None:
    while not await is_disconnected():
        await asyncio.sleep(POLL_S)


async def _drain(stream: RequestStream) -> list[EngineEvent]:
    events = []
    async for event in stream:
        if event.error:
            raise RequestFailedError(event.error, f"request failed: {event.message}")
        events.append(event)
    return events


async def unless_disconnected(is_disconnected: IsDisconnected, work: Awaitable[T]) -> T:
    """Await ``work`` while watching the client; a client that leaves cancels it."""
    consumer = asyncio.ensure_future(work)
    # Once the client is gone nobody awaits the result: mark its outcome retrieved so a late
    # failure is not reported as "exception was never retrieved".
    consumer.add_done_callback(lambda f: f.cancelled() or f.exception())
    watcher = asyncio.ensure_future(_until_disconnected(is_disconnected))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            return consumer.result()
        raise ClientDisconnectedError("the client closed the connection; the request was aborted")
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()


async def collect(is_disconnected: IsDisconnected, streams: list[RequestStream]) -> list[list[EngineEvent]]:
    """All events of every stream; aborts them all if the client disconnects or one fails."""
    try:
        return await unless_disconnected(is_disconnected, asyncio.gather(*(_drain(s) for s in streams)))
    finally:
        for s in streams:
            s.abort()
