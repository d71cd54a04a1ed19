"""A real uvicorn server on 127.0.0.1 in a background thread, for tests that need sockets."""

from __future__ import annotations

import threading
import time

import httpx

from service.http.app import create_app
from service.http.server import build_server
from service.settings import Settings


class ServerThread:
    # ready_timeout only bounds the wait: three tiny models load in ~10 s on a quiet 2-core machine
    # and took 65 s with the machine busy; a test never passes by waiting longer.
    def __init__(self, settings: Settings, ready_timeout: float = 300.0):
        self.app, self.ready_timeout = create_app(settings), ready_timeout
        # the server `python -m service` runs (header limits, drain at shutdown), on a free port
        self.server = build_server(self.app, settings, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        while httpx.get(self.url + "/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("service never became ready")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def __exit__(self, *exc) -> None:
        self.stop()

    def metric(self, name: str, **labels) -> float:
        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total
