"""``release_memory`` (service/models/memory.py), run after every load and unload: what survives
its collection is frozen, so the collector's later passes skip the loaded models, and a model
dropped afterwards is still collected, reference cycles included."""

from __future__ import annotations

import gc
import weakref

from service.models.memory import release_memory


class _Node:
    def __init__(self) -> None:
        self.partner: _Node | None = None


def test_what_survives_is_frozen_and_a_cycle_dropped_later_is_still_collected():
    try:
        first, second = _Node(), _Node()
        first.partner, second.partner = second, first  # a cycle: only the collector frees it
        gone = weakref.ref(first)
        release_memory()
        assert gc.get_freeze_count() > 0
        assert gc.is_tracked(first)
        # frozen: a plain collection does not look at the pair, even once nothing refers to it
        del first, second
        gc.collect()
        assert gone() is not None
        # the next release (an unload's) unfreezes before it collects: the cycle goes
        release_memory()
        assert gone() is None
    finally:
        gc.unfreeze()
