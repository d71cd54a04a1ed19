"""The eviction choice on its own (``service.models.budget``): plain entries, no model loaded.
The budget as the running service applies it is tested in test_models_on_demand.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from service.engines.errors import MemoryBudgetError
from service.models.budget import check_fits_alone, choose_eviction
from service.models.catalogue import ModelEntry


def loaded(name: str, last_used: float, leases: int = 0, in_flight: bool = False) -> ModelEntry:
    return ModelEntry(name, Path(name), state="loaded", engine=SimpleNamespace(in_flight=in_flight),
                      last_used=last_used, leases=leases)


def test_it_fits_or_the_least_recently_used_idle_model_goes():
    a, b, c = loaded("a", 3.0), loaded("b", 1.0, leases=1), loaded("c", 2.0)
    assert choose_eviction("new", 10, 100, [a, b, c], used=90) is None
    assert choose_eviction("new", 11, 100, [a, b, c], used=90) is c  # b is older but in use


def test_nothing_idle_is_an_error_naming_why():
    busy = [loaded("a", 1.0, leases=1), loaded("b", 2.0, in_flight=True)]
    with pytest.raises(MemoryBudgetError, match="requests in flight"):
        choose_eviction("new", 50, 100, busy, used=60)
    with pytest.raises(MemoryBudgetError, match="even with every other model unloaded"):
        check_fits_alone("new", 101, 100)


def test_preloaded_models_stay_while_start_up_preloads():
    a, b = loaded("a", 1.0), loaded("b", 2.0)
    assert choose_eviction("new", 50, 100, [a, b], used=60, preloading=["a"]) is b
    with pytest.raises(MemoryBudgetError, match="TSERVE_PRELOAD"):
        choose_eviction("new", 50, 100, [a, b], used=60, preloading=["a", "b"])
    assert choose_eviction("new", 50, 100, [a, b], used=60, preloading=None) is a


def test_a_model_pinned_by_one_in_use_stays():
    user, used_model, other = loaded("user", 3.0, leases=1), loaded("dep", 1.0), loaded("other", 2.0)
    pinned = {"dep": {"user"}}
    assert choose_eviction("new", 50, 100, [user, used_model, other], used=60, pinned_by=pinned) is other
    user.leases = 0  # its user idle: the pinned model may go (it is the least recently used)
    assert choose_eviction("new", 50, 100, [user, used_model, other], used=60, pinned_by=pinned) is used_model
