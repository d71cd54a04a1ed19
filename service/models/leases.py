"""Models in use and models idle: leases held by HTTP requests, and keep-alive (unload after idle).

A request takes a lease on each model it is handed (``lease``, from ``EngineRegistry.get``) and
gives them back when its response is done (``request_leases``, entered per request by
``service.http.middleware.ModelLeaseMiddleware``): a model is in use from the lookup to the
last byte, grammar compilation and streaming included. A model in use is never unloaded.

``KeepAlive`` unloads a loaded model once it has been idle for its keep-alive, Ollama style:
the last request's ``keep_alive`` (seconds, -1 forever), else ``TSERVE_KEEP_ALIVE``.

Threads: everything here runs on the event loop. ``request_leases`` and ``lease`` run in the
request's own context (the lease list is a ContextVar, so concurrent requests never share it);
``KeepAlive`` is one task on the loop, unloading under the loader's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar

from service.models.catalogue import ModelEntry
from service.settings import Settings

log = logging.getLogger("tserve.registry")

EXPIRY_TICK_S = 0.25  # how often idle models are checked against their keep-alive
# The models the current HTTP request was handed; None outside a request.
_LEASES: ContextVar[list[ModelEntry] | None] = ContextVar("tserve_model_leases", default=None)


@contextlib.contextmanager
def request_leases() -> Iterator[None]:
    """The scope of one HTTP request: the models it is handed stay in use until it ends."""
    token = _LEASES.set([])
    try:
        yield
    finally:
        held = _LEASES.get() or []
        _LEASES.reset(token)
        now = time.monotonic()
        for entry in held:
            entry.leases -= 1
            entry.last_used = now


def lease(entry: ModelEntry) -> None:
    """``entry`` is in use until the current HTTP request ends (outside one: just touched)."""
    entry.last_used = time.monotonic()
    held = _LEASES.get()
    if held is not None:
        entry.leases += 1
        held.append(entry)


class KeepAlive:
    """The task that unloads models idle past their keep-alive; the idle time counts from the
    last request in flight. ``unload(entry, reason)`` must be called with ``lock`` held."""

    def __init__(self, entries: Mapping[str, ModelEntry], settings: Settings, lock: asyncio.Lock,
                 unload: Callable[[ModelEntry, str], Awaitable[None]]):
        self.entries, self.settings, self.lock, self.unload = entries, settings, lock, unload
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self._run())

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_TICK_S)
            try:
                await self.expire_once(time.monotonic())
            except Exception:  # a bug here must not end expiry for good
                log.exception("keep-alive check failed")

    async def expire_once(self, now: float) -> None:
        for entry in list(self.entries.values()):
            if entry.engine is None:
                continue
            if entry.engine.in_flight:
                entry.last_used = now
                continue
            keep = entry.keep_alive_s(self.settings.keep_alive)
            if keep >= 0 and now - entry.last_used >= keep and not entry.in_use():
                async with self.lock:
                    if entry.engine is not None and not entry.in_use():
                        await self.unload(entry, "keep_alive")
