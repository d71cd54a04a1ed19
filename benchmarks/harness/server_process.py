"""A server in a child process on a loopback port, its output in a log file: started, waited
for until it answers, stopped (SIGTERM, then SIGKILL after a grace period; only its own pid).

``service_process`` is ``python -m service``; ``ServerProcess`` takes any command (the
benchmarks run llama-server with it, the deploy tests HAProxy). The benchmarks and the tests
that need the real process (signals, exit status, several replicas) share this one module;
it imports nothing of the benchmarks but ``REPO_ROOT``, so a test importing it depends on no
benchmark.

    with service_process(tmp / "server.log", env={"TSERVE_MODELS": "generate-en"}) as server:
        httpx.get(server.url + "/v1/models")
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
_handed_out: set[int] = set()


def ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux); 0 where unknown."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A loopback port nothing is bound to, for a server about to bind it. Where the kernel's
    ephemeral range is known, from below it: a port inside it can be given to some outgoing
    connection between this check and the server's bind (a replica of the HAProxy tests once
    failed so, "address already in use"), one below it only to another explicit bind. This
    process never hands out the same port twice. Elsewhere, whatever the kernel picks."""
    low = ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200 if low > LOWEST_PORT + 1000 else 0):
        port = rng.randrange(LOWEST_PORT, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """The server's process ended while it was being waited for."""


class ServerProcess:
    """``argv`` run in ``cwd`` with ``env`` (the whole environment), stdout and stderr into
    ``log_path``. ``start()`` launches it, ``wait_ready()`` polls ``url + ready_path`` until a
    200, ``stop()`` ends it. As a context manager: started and ready on entry (or stopped and
    the error raised, with the log's tail), stopped on exit (``stop_grace_s`` to exit after
    SIGTERM)."""

    def __init__(self, argv: Sequence[str], log_path: Path, *, port: int, env: Mapping[str, str] | None = None,
                 cwd: Path = REPO_ROOT, ready_path: str = "/ready", ready_timeout_s: float = 180.0,
                 stop_grace_s: float = 30.0):
        self.argv, self.log_path, self.port = list(argv), Path(log_path), port
        self.url = f"http://127.0.0.1:{port}"
        self.env = dict(os.environ if env is None else env)
        self.cwd, self.ready_path, self.ready_timeout_s = cwd, ready_path, ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None  # seconds from start to the first 200, once waited for

    def start(self) -> ServerProcess:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self._started = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def log_tail(self, chars: int = 3000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def ready(self) -> bool:
        """One probe of the ready path: whether it answered 200. Raises ``ServerExited`` (with
        the log's tail) when the process has ended."""
        if not self.alive():
            raise ServerExited(f"{self._name()} exited with {self.proc.returncode} before {self.ready_path} "
                               f"answered 200; its log ({self.log_path}) ends:\n{self.log_tail()}")
        try:
            return httpx.get(self.url + self.ready_path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Polls until ``ready()``; returns the seconds since ``start()``. A timeout or an exit
        raises, naming the server and quoting its log's tail."""
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._name()} did not answer 200 on {self.ready_path} within {timeout_s:g} s; "
                                   f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            time.sleep(0.2)
        self.ready_s = time.monotonic() - self._started
        return self.ready_s

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM (after SIGCONT, should a test have frozen it), up to ``grace_s`` (default
        ``stop_grace_s``) to exit, then SIGKILL. Returns the exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_grace_s if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _name(self) -> str:
        return " ".join(self.argv[:3])


def service_command(*args: str, port: int, env: Mapping[str, str | None] | None = None, cwd: Path = REPO_ROOT,
                    python: Sequence[str] = (sys.executable,)) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of ``python -m service *args`` run from ``cwd`` (its ``model`` and
    ``service`` first on the path) on 127.0.0.1:``port``, given as ``TSERVE_HOST`` and
    ``TSERVE_PORT`` (every revision reads those; ``compare_revisions`` starts old ones).
    ``env``: settings over this process's environment, applied last; ``None`` unsets one."""
    full = {**os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")])),
            "TSERVE_HOST": "127.0.0.1", "TSERVE_PORT": str(port), **(env or {})}
    return [*python, "-m", "service", *args], {k: v for k, v in full.items() if v is not None}


def service_process(log_path: Path, *args: str, env: Mapping[str, str | None] | None = None, port: int | None = None,
                    cwd: Path = REPO_ROOT, python: Sequence[str] = (sys.executable,), ready_timeout_s: float = 180.0,
                    stop_grace_s: float = 30.0) -> ServerProcess:
    """``python -m service *args`` as a ``ServerProcess`` (not started yet: use it in a
    ``with``, or ``start()`` it), at ``port`` or a free one; see ``service_command``."""
    port = port or free_port()
    argv, full = service_command(*args, port=port, env=env, cwd=cwd, python=python)
    return ServerProcess(argv, log_path, port=port, env=full, cwd=cwd, ready_timeout_s=ready_timeout_s,
                         stop_grace_s=stop_grace_s)


def metric_total(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text exposition (any labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
