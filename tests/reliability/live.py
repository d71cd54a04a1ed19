"""``python -m service`` in a subprocess on a free loopback port, its log in a file: for the
tests that need the real process (signals, the HTTP protocol layer, exit status). The process
handling is the benchmarks' ``ServerProcess`` (it depends on no benchmark)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from benchmarks.harness.server_process import ServerProcess, free_port, service_command


class LiveServer(ServerProcess):
    """``python -m service *args`` with ``TSERVE_<NAME>`` = each keyword, on one torch thread;
    ready on entry, killed on exit if the test left it running."""

    def __init__(self, log_path: Path, *args: str, **settings: str):
        port = free_port()
        env = {"TSERVE_TORCH_THREADS": "1", **{f"TSERVE_{k.upper()}": str(v) for k, v in settings.items()}}
        argv, full = service_command(*args, port=port, env=env)
        super().__init__(argv, log_path, port=port, env=full, ready_timeout_s=120, stop_grace_s=0)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text()

    def log_records(self) -> list[dict]:
        """The JSON log lines (uvicorn's own plain-text lines are skipped)."""
        records = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records
