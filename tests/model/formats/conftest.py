"""Fixtures shared by the real-model format tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def float_gguf_import():
    """For a module that checks the import (the float weights GGUF blocks decode to) against
    transformers reading the same file; the default serves the blocks as stored
    (tests/model/formats/test_gguf_stored.py, tests/model/engine/test_repeatable.py)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TSERVE_GGUF_WEIGHTS", "float")
        yield
