"""The one helper that runs a server in a child process (benchmarks and tests alike): it waits
for the ready path, fails naming the server and quoting its log, and always ends its process."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from benchmarks.harness.server_process import (
    LOWEST_PORT,
    ServerExited,
    ServerProcess,
    ephemeral_low,
    free_port,
    metric_total,
    service_command,
)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_it_waits_for_the_ready_path_and_stops_the_server_on_exit(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with ServerProcess(argv, tmp_path / "log", port=port, ready_path="/", ready_timeout_s=60) as server:
        assert server.alive() and server.ready() and server.ready_s is not None
    assert not server.alive()
    assert server.proc.returncode in (0, 1, -signal.SIGTERM)  # SIGTERM, not SIGKILL


def test_a_server_that_exits_first_fails_with_its_log_tail(tmp_path):
    server = ServerProcess(python("print('no weights here', flush=True); raise SystemExit(3)"), tmp_path / "log",
                           port=free_port(), ready_timeout_s=60)
    with pytest.raises(ServerExited, match=r"(?s)exited with 3 before /ready.*no weights here"), server:
        pass


def test_a_server_never_ready_times_out_with_its_log_tail_and_is_stopped(tmp_path):
    server = ServerProcess(python("import time; print('still loading', flush=True); time.sleep(120)"),
                           tmp_path / "log", port=free_port(), ready_timeout_s=1)
    with pytest.raises(TimeoutError, match=r"(?s)within 1 s.*still loading"), server:
        pass
    assert not server.alive()


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path):
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(120)")
    server = ServerProcess(python(code), tmp_path / "log", port=free_port()).start()
    deadline = time.monotonic() + 30
    while "up" not in server.log_tail() and time.monotonic() < deadline:  # SIGTERM ignored from here on
        time.sleep(0.05)
    assert server.stop(grace_s=0.5) == -signal.SIGKILL


def test_the_service_command_runs_from_its_checkout_on_the_port_it_names(tmp_path, monkeypatch):
    monkeypatch.setenv("TSERVE_API_KEY", "secret")
    argv, env = service_command("--log-level", "warning", port=8123, cwd=tmp_path,
                                env={"TSERVE_MODELS": "generate-en", "TSERVE_API_KEY": None})
    assert argv == [sys.executable, "-m", "service", "--log-level", "warning"]
    assert (env["TSERVE_HOST"], env["TSERVE_PORT"], env["TSERVE_MODELS"]) == ("127.0.0.1", "8123", "generate-en")
    assert "TSERVE_API_KEY" not in env  # None unsets
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)


def test_metric_total_sums_every_series_of_one_name():
    text = ("# HELP demo_steps_total x\n# TYPE demo_steps_total counter\n"
            'demo_steps_total{model="a"} 3.0\ndemo_steps_total{model="b"} 4.0\ndemo_steps_created 1e9\n'
            "demo_steps_total_other 100\nplain 2\n")
    assert metric_total(text, "demo_steps_total") == 7.0
    assert metric_total(text, "plain") == 2.0


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice():
    low = ephemeral_low()
    if low <= LOWEST_PORT + 1000:
        pytest.skip("this system does not say its ephemeral port range (/proc/sys/net/ipv4/ip_local_port_range)")
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= p < low for p in ports)
    for p in ports[:5]:  # nothing holds them: a server can bind each
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
