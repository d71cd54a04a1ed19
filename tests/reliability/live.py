"""``python -m service`` in a subprocess on a free loopback port, its log in a file: for the
tests that need the real process (signals, the HTTP protocol layer, exit status)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, log_path: Path, *args: str, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args, self.env = args, {f"TSERVE_{k.upper()}": str(v) for k, v in env.items()}

    def __enter__(self) -> LiveServer:
        env = {**os.environ, "TSERVE_TORCH_THREADS": "1", **self.env}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(self.port), *self.args],
                                     cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became ready:\n" + self.log()
            time.sleep(0.2)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()

    def log_records(self) -> list[dict]:
        """The JSON log lines (uvicorn's own plain-text lines are skipped)."""
        records = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records
