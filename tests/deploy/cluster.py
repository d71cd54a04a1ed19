"""Real replicas behind a real HAProxy, on 127.0.0.1: processes the deploy tests start and stop.

``Replica`` is ``python -m service`` in a subprocess; ``Balancer`` is Debian's ``haproxy``
running deploy/lb/haproxy.cfg with its server block replaced by the replicas' addresses
and its listeners moved to free loopback ports. Both are the benchmarks' ``ServerProcess``
(started at once, waited for by the test). Every wait is bounded; ``stop()`` ends only the
process this object started.
"""

from __future__ import annotations

import csv
import io
import re
import subprocess
import time
from pathlib import Path

import httpx

from benchmarks.harness.server_process import ServerProcess, free_port, service_command

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_CFG = ROOT / "deploy" / "lb" / "haproxy.cfg"
SERVERS_BLOCK = re.compile(r"^ *# servers: begin.*?^ *# servers: end[^\n]*\n", re.M | re.S)


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what} not within {timeout_s:g} s")


class Replica(ServerProcess):
    """One ``python -m service`` serving one small shipped checkpoint on 127.0.0.1; ``ready()``
    raises, quoting its log, once it has exited."""

    def __init__(self, name: str, log_dir: Path, model: str = "generate-en", **settings: str):
        self.name, port = name, free_port()
        env = {"TSERVE_WEIGHTS_DIR": str(ROOT / "weights"), "TSERVE_MODELS": model, "TSERVE_TORCH_THREADS": "1",
               "TSERVE_MAX_BATCH": "8", "TSERVE_SHUTDOWN_GRACE_S": "10", "TSERVE_LOG_LEVEL": "warning",
               "OMP_WAIT_POLICY": "PASSIVE", **{f"TSERVE_{k.upper()}": v for k, v in settings.items()}}
        argv, full = service_command(port=port, env=env, cwd=ROOT)
        super().__init__(argv, log_dir / f"{name}.log", port=port, env=full, cwd=ROOT, stop_grace_s=20)
        self.start()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the series of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def generate_requests(self) -> float:
        return self.metric("tserve_requests_total", endpoint="/v1/generate", status="200")


def render_haproxy_config(replicas: list[Replica], port: int, stats_port: int) -> str:
    """deploy/lb/haproxy.cfg with static 127.0.0.1 servers and loopback listeners."""
    text = HAPROXY_CFG.read_text()
    servers = "".join(f"    server {r.name} 127.0.0.1:{r.port}\n" for r in replicas)
    text, n = SERVERS_BLOCK.subn(lambda _: servers, text)
    assert n == 1, "deploy/lb/haproxy.cfg lost its '# servers: begin/end' markers"
    for old, new in (("bind :8080", f"bind 127.0.0.1:{port}"), ("bind :8404", f"bind 127.0.0.1:{stats_port}")):
        assert old in text, f"deploy/lb/haproxy.cfg has no '{old}'"
        text = text.replace(old, new)
    return text


class Balancer(ServerProcess):
    def __init__(self, haproxy: str, replicas: list[Replica], work_dir: Path):
        port, self.stats_port = free_port(), free_port()
        self.config = work_dir / "haproxy.cfg"
        self.config.write_text(render_haproxy_config(replicas, port, self.stats_port))
        check = subprocess.run([haproxy, "-dW", "-c", "-f", str(self.config)], capture_output=True, text=True,
                               timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        super().__init__([haproxy, "-db", "-f", str(self.config)], work_dir / "haproxy.log", port=port, cwd=ROOT,
                         stop_grace_s=20)
        self.start()

    def server_states(self) -> dict[str, str]:
        """Server name -> status (UP, DOWN, "UP 1/2", ...) from the stats page's CSV."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text.lstrip("# ")
        return {row["svname"]: row["status"] for row in csv.DictReader(io.StringIO(text))
                if row["pxname"] == "tserve" and row["svname"] not in ("FRONTEND", "BACKEND")}

    def diagnostics(self) -> str:
        """Server state changes and the requests that did not end in 200, from HAProxy's log."""
        lines = [line for line in self.log_tail(200_000).splitlines() if not line.startswith("[")]
        changes = [line.split(", check duration")[0] for line in lines if " is DOWN" in line or " is UP" in line]
        failed = [line for line in lines if '"POST ' in line and " 200 " not in line]
        return "\n".join(["haproxy state changes:", *changes, f"non-200 requests ({len(failed)}):", *failed[:10]])

    def wait_state(self, server: str, state: str, timeout_s: float = 20) -> None:
        wait_until(lambda: self.server_states().get(server) == state, timeout_s, f"haproxy: {server} {state}")
