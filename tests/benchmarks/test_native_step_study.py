"""The in-process step timer (benchmarks/studies/native_step.py) on the shipped SmolLM2 file."""

from __future__ import annotations

import math

import pytest

from benchmarks.studies.fidelity import gguf_path
from benchmarks.studies.native_step import main, step_times
from model.decode import native


def test_it_times_the_native_step_at_each_batch(capsys):
    try:
        native.build()
    except RuntimeError as exc:
        pytest.skip(f"no native step here: {exc}")
    path = str(gguf_path("smollm2-135m-instruct"))
    times = step_times(path, [1, 3], steps=4, threads=1)
    assert sorted(times) == [1, 3]
    assert all(math.isfinite(t) and t > 0 for t in times.values())
    assert "step: NativeStep" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([path, "--steps", "2"])
