"""Waiting for engine results on behalf of one client, without knowing about HTTP.

A non-streaming request watches its client while it waits: if the client goes away the
request is aborted and its slot freed at the next engine step. The client is seen only
through ``client_gone``, an async callable that returns once the client has disconnected (a
route passes ``service.routes.streaming.client_gone(request)``, which waits on the
connection's receive channel: no polling). Streaming requests are
cancelled by the web server when the client disconnects; the ``finally`` in the route's
chunk generator aborts them the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from service.engines.errors import ClientDisconnectedError, RequestFailedError
from service.engines.generative import EngineEvent, RequestStream

T = TypeVar("T")
ClientGone = Callable[[], Awaitable[None]]  # returns once the client has disconnected


async def _drain(stream: RequestStream) -> list[EngineEvent]:
    events = []
    async for event in stream:
        if event.error:
            raise RequestFailedError(event.error, f"request failed: {event.message}")
        events.append(event)
    return events


async def unless_disconnected(client_gone: ClientGone, work: Awaitable[T]) -> T:
    """Await ``work`` while watching the client; a client that leaves cancels it."""
    consumer = asyncio.ensure_future(work)
    # Once the client is gone nobody awaits the result: mark its outcome retrieved so a late
    # failure is not reported as "exception was never retrieved".
    consumer.add_done_callback(lambda f: f.cancelled() or f.exception())
    watcher = asyncio.ensure_future(client_gone())
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            return consumer.result()
        raise ClientDisconnectedError("the client closed the connection; the request was aborted")
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()


async def collect(client_gone: ClientGone, streams: list[RequestStream]) -> list[list[EngineEvent]]:
    """All events of every stream; aborts them all if the client disconnects or one fails."""
    try:
        return await unless_disconnected(client_gone, asyncio.gather(*(_drain(s) for s in streams)))
    finally:
        for s in streams:
            s.abort()
