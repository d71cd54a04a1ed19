"""`python -m service` behaves like uvicorn's command line: flags over TSERVE_* variables,
--help and --version, unknown or bad flags fail with exit status 2 and a message."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.server_process import ServerProcess, free_port, service_process
from service.__main__ import FLAGS, settings_from_args


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_help_lists_every_flag_with_its_variable_and_default():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines anywhere
    for flag, (name, _) in FLAGS.items():
        assert re.search(rf"{flag}\b.*?\[env TSERVE_{name.upper()}; default: [^\]]+\]", text), flag
    for flag in ("--host", "--port", "--weights-dir", "--models", "--device", "--dtype", "--log-level", "--version"):
        assert flag in text
    assert re.search(r"--models .*path to a model directory, or a path to a \.gguf file", text)
    assert "--workers" in text and "replicas" in text  # says why there is none and what to do instead


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("transformer-serve ")


@pytest.mark.parametrize("args,needle", [
    (["--workers", "4"], "unrecognized arguments: --workers 4"),
    (["--port", "70000"], "--port: Input should be less than or equal to 65535"),
    (["--port", "eighty"], "argument --port: invalid int value"),
    (["--dtype", "int4"], "argument --dtype: invalid choice"),
])
def test_bad_flags_exit_2_with_a_message(args, needle):
    result = run_cli(*args)
    assert result.returncode == 2 and needle in result.stderr, result.stderr


def test_a_bad_variable_is_named():
    result = run_cli("--port", "9000", env={"TSERVE_MAX_BATCH": "0"})
    assert result.returncode == 2 and "TSERVE_MAX_BATCH: Input should be greater than or equal to 1" in result.stderr


def test_flags_override_variables(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no .env
    monkeypatch.setenv("TSERVE_PORT", "1234")
    monkeypatch.setenv("TSERVE_MODELS", "from-env")
    monkeypatch.setenv("TSERVE_LOG_LEVEL", "debug")
    plain = settings_from_args([])
    assert (plain.port, plain.models, plain.log_level) == (1234, "from-env", "debug")
    flagged = settings_from_args(["--port", "9000", "--models", "a,b", "--host", "0.0.0.0"])
    assert (flagged.port, flagged.models, flagged.host, flagged.log_level) == (9000, "a,b", "0.0.0.0", "debug")


@pytest.mark.slow
def test_python_m_service_serves_on_the_given_port(weights_dir, tmp_path):
    port = free_port()
    env = {"TSERVE_PORT": str(free_port()), "TSERVE_MODELS": "translate-tiny", "TSERVE_WARMUP": "false"}
    server = service_process(tmp_path / "server.log", "--port", str(port), "--weights-dir", str(weights_dir),
                             "--models", "generate-tiny", "--log-level", "warning", port=port, env=env,
                             ready_timeout_s=90)
    with server:  # ready on the --port given, not on TSERVE_PORT
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["generate-tiny"]  # --models won over TSERVE_MODELS
    out = server.log_path.read_text()
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught, as it should
    assert server.proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in out, out


def _broken_weights(root: Path) -> Path:
    broken = root / "broken-model"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text('{"family": "decoder"}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    return root


def _serve_broken(tmp_path: Path, *flags: str) -> ServerProcess:
    """The service on a model that cannot load, started (it never becomes ready)."""
    env = {"TSERVE_LOG_JSON": "false", "TSERVE_WARMUP": "false", "TSERVE_EXIT_ON_LOAD_FAILURE": None}
    return service_process(tmp_path / "server.log", "--weights-dir", str(_broken_weights(tmp_path)),
                           "--log-level", "warning", *flags, env=env).start()


def test_a_model_that_fails_to_load_is_logged_and_the_process_stays_up_unready(tmp_path):
    server = _serve_broken(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.alive(), server.log_tail()
            try:
                health = httpx.get(server.url + "/health", timeout=2)
                if health.status_code == 503:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "loading never failed"
            time.sleep(0.2)
        assert "error" in health.json() and httpx.get(server.url + "/ready").status_code == 503
        time.sleep(0.5)
        assert server.alive()  # still up: Kubernetes restarts it after its liveness probe fails
    finally:
        server.stop()
    out = server.log_path.read_text()
    line = next(ln for ln in out.splitlines() if "failed to load" in ln)
    assert "ERROR" in line and "'broken-model'" in line and "/ready answers 503" in line, out
    assert "--exit-on-load-failure" in line


def test_exit_on_load_failure_ends_the_process_with_status_1(tmp_path):
    server = _serve_broken(tmp_path, "--exit-on-load-failure")
    try:
        assert server.proc.wait(timeout=60) == 1, server.log_tail()
    finally:
        server.stop()
    out = server.log_path.read_text()
    line = next(ln for ln in out.splitlines() if "failed to load" in ln)
    assert "ERROR" in line and "'broken-model'" in line and "exiting with status 1" in line, out
