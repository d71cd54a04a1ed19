"""The memory budget (``TSERVE_MEMORY_BUDGET``): whether a model fits, and which model to evict if not.

Pure decisions on the registry's entries and byte counts; nothing here unloads, measures or
waits. ``ModelLoader.make_room`` (``service.models.loading``) asks ``choose_eviction`` again
after each eviction until the model fits or this raises ``MemoryBudgetError``.

The rule: the least recently used model that is idle goes first. Never evicted: a model in
use (a request holds it, or its engine has work queued or running), a preloaded model while
start-up is still preloading (start-up would turn ready with models the operator wanted warm
already gone), and a model that another model in use depends on (``pinned_by``).

Threads: called on the event loop by the loader, under its lock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from service.engines.errors import MemoryBudgetError
from service.models.catalogue import ModelEntry


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_fits_alone(name: str, needed: int, budget: int) -> None:
    """Raise when ``needed`` bytes pass the budget even with every other model unloaded."""
    if needed > budget:
        raise MemoryBudgetError(f"model '{name}' needs {mib(needed)} (weights + KV caches), more than "
                                f"TSERVE_MEMORY_BUDGET ({mib(budget)}) allows even with every other model "
                                "unloaded")


def evictable(entry: ModelEntry, loaded: Sequence[ModelEntry], preloading: Collection[str] | None,
              pinned_by: Mapping[str, Collection[str]]) -> bool:
    """Whether ``entry`` (loaded) may be unloaded to make room now.

    ``preloading``: the preloaded models while start-up is still loading them, else None.
    ``pinned_by``: model name -> the names of the models that use it; it stays while any of
    those (among ``loaded``) is in use."""
    if entry.in_use() or (preloading is not None and entry.name in preloading):
        return False
    users = pinned_by.get(entry.name, ())
    return not any(other.name in users and other.in_use() for other in loaded)


def choose_eviction(name: str, needed: int, budget: int, loaded: Sequence[ModelEntry], used: int,
                    preloading: Collection[str] | None = None,
                    pinned_by: Mapping[str, Collection[str]] | None = None) -> ModelEntry | None:
    """The model to unload so that ``name`` (``needed`` more bytes) fits, or None when it fits now.

    ``loaded``: the other loaded models, holding ``used`` bytes together. Raises
    ``MemoryBudgetError`` when it does not fit and nothing may be evicted."""
    if used + needed <= budget:
        return None
    pinned_by = pinned_by or {}
    idle = sorted((e for e in loaded if evictable(e, loaded, preloading, pinned_by)), key=lambda e: e.last_used)
    if idle:
        return idle[0]
    held = ", ".join(e.name for e in loaded)
    if preloading is not None:
        raise MemoryBudgetError(
            f"the preloaded models need more than TSERVE_MEMORY_BUDGET ({mib(budget)}): {mib(used)} loaded "
            f"({held}) and '{name}' needs {mib(needed)}; preload fewer (TSERVE_PRELOAD) or raise the budget")
    raise MemoryBudgetError(
        f"model '{name}' needs {mib(needed)} but TSERVE_MEMORY_BUDGET is {mib(budget)} and "
        f"{mib(used)} is held by models with requests in flight ({held}), "
        "which are never unloaded; retry when they are idle")
