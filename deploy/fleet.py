"""N replicas of ``python -m service`` behind the SGLang model gateway (SMG), on one machine.

    python -m deploy.fleet --replicas 3 --policy cache_aware        # the gateway on 127.0.0.1:8080
    curl 127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'

For trying cache-aware routing and for the routing benchmark (docs/deployment.md, "Several
replicas behind a cache-aware gateway"). SMG is a maintained Rust gateway (``pip install
smg``; ``make gateway`` puts the pinned one in .venv-gateway/): it routes each request to the
replica whose prefix cache most likely holds the request's prefix (an approximate tree of the
text it sent each replica), balances by the load each replica reports (GET /v1/loads), checks
/ready, and retries a request a replica failed before answering. Nothing here routes.

The replicas share one native build: it is compiled (or found in torch's cache) once, before
any replica starts, and each replica loads that library (TSERVE_NATIVE_LIBRARY) instead of
compiling or queueing on the build lock. Every process listens on 127.0.0.1 and ends with the
fleet (Ctrl-C); ``Fleet`` is what the tests and benchmarks/studies/gateway_routing.py start.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from benchmarks.harness.server_process import ServerProcess, free_port, service_command

ROOT = Path(__file__).resolve().parents[1]
SMG_VERSION = "1.13.0"  # what `make gateway` installs; the flags below are this version's
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "prefix_hash")
DEFAULT_MODEL = "smollm2-135m-instruct"
BUILD_NATIVE = ("from model.decode import native; "
                "print(native.compile_library(native.library_name(), native.NATIVE_FLAGS))")


def find_smg() -> str | None:
    """The ``smg`` executable: $SMG_BINARY, else .venv-gateway/bin/smg (``make gateway``), else PATH."""
    for candidate in (os.environ.get("SMG_BINARY"), ROOT / ".venv-gateway" / "bin" / "smg", shutil.which("smg")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def native_library(python: str = sys.executable, timeout_s: float = 900) -> str | None:
    """Builds the native decode library once (torch's extension cache: a later run finds it) and
    returns its path; None where it cannot be built here (each replica then says why and decodes
    through the Python step)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([python, "-c", BUILD_NATIVE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    path = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    return path if path and Path(path).is_file() else None


# Cache-aware routing for a few long shared prefixes (docs/deployment.md, "Why these flags"):
# a replica holding a tenant's prompt keeps it unless it carries over 3x the fleet's mean of
# requests in flight (SMG's default 1.5x, with its margin capped at a few requests, moved
# ~1 request in 50 to a replica that then recomputed the whole 1,000+-token prompt whenever
# queues swung). Overload is still handled by SMG's worker overload protection (8 waiting
# requests or 80% KV in use).
CACHE_AWARE_ARGS = ("--cache-threshold", "0.3", "--balance-abs-threshold", "8", "--balance-rel-threshold", "3",
                    "--worker-warmup-divert-every", "32")


def gateway_command(smg: str, port: int, metrics_port: int, workers: Sequence[str], policy: str,
                    extra: Sequence[str] = ()) -> list[str]:
    """``smg launch`` over static HTTP workers, with the probes and retries a fleet of ours wants:
    /ready as the health check every 2 s (a replica loading or draining is out within ~4 s, back
    after one good probe); a request its replica failed before answering retried up to 5 times
    over ~5 s (200 ms doubling to 2 s: longer than the ~4 s a dead replica takes to fail its
    probes); a replica's circuit opened after 3 failures in a row (a killed replica fails every
    request it held at once, so it leaves routing before a retry can pick it again) and tried
    again after 5 s; worker detection checked every second for up to 10 minutes (a busy host's
    replicas may answer slowly). The cache-aware flags are CACHE_AWARE_ARGS."""
    return [smg, "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-urls", *workers, "--policy", policy, *CACHE_AWARE_ARGS,
            "--health-check-endpoint", "/ready", "--health-check-interval-secs", "2",
            "--health-check-timeout-secs", "5", "--health-failure-threshold", "2", "--health-success-threshold", "1",
            "--retry-max-retries", "5", "--retry-initial-backoff-ms", "200", "--retry-max-backoff-ms", "2000",
            "--retry-backoff-multiplier", "2", "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "5",
            "--worker-startup-timeout-secs", "600", "--worker-startup-check-interval", "1",
            "--load-monitor-interval", "2", "--disable-tokenizer-autoload", "--shutdown-grace-period-secs", "5",
            "--log-level", "warn", *extra]


class Replica(ServerProcess):
    """One ``python -m service`` on a fixed loopback port (a restart keeps its URL, as the gateway
    knows it)."""

    def __init__(self, name: str, port: int, log_dir: Path, env: Mapping[str, str], python: str = sys.executable):
        self.name = name
        argv, full = service_command(port=port, env=env, cwd=ROOT, python=(python,))
        super().__init__(argv, log_dir / f"{name}.log", port=port, env=full, cwd=ROOT, stop_grace_s=20)

    def _name(self) -> str:
        return f"{self.name} ({self.url})"

    def ready(self) -> bool:
        """One /ready probe; raises (quoting the log) once loading failed: no point waiting."""
        if super().ready():
            return True
        try:
            error = httpx.get(self.url + "/ready", timeout=2).json().get("error")
        except (httpx.HTTPError, ValueError):
            return False
        if error:
            raise RuntimeError(f"{self.name} failed to load: {error}; its log ({self.log_path}) ends:\n"
                               f"{self.log_tail()}")
        return False

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def serves(self, model: str) -> bool:
        """Whether GET /v1/models lists ``model``: what SMG's worker detection reads first."""
        try:
            return model in {m["id"] for m in httpx.get(self.url + "/v1/models", timeout=10).json()["data"]}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False

    def running(self) -> int:
        """Requests holding a row now (GET /v1/loads)."""
        return int(httpx.get(self.url + "/v1/loads", timeout=5).json()["loads"][0]["num_running_reqs"])


class Gateway(ServerProcess):
    def __init__(self, smg: str, workers: Sequence[str], policy: str, log_dir: Path, port: int | None = None,
                 extra: Sequence[str] = ()):
        self.policy, self.workers = policy, list(workers)
        port, self.metrics_port = port or free_port(), free_port()
        argv = gateway_command(smg, port, self.metrics_port, workers, policy, extra)
        super().__init__(argv, log_dir / f"gateway-{policy}.log", port=port, ready_path="/liveness",
                         stop_grace_s=10)

    def healthy_workers(self, polled: bool = False) -> set[str]:
        """The worker URLs SMG would route to now; with ``polled``, only those whose load
        (GET /v1/loads) SMG has read at least once."""
        try:
            listed = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {w["url"] for w in listed if w.get("is_healthy") and (not polled or w.get("engine_load"))}

    def wait_healthy(self, urls: Sequence[str] | set[str], timeout_s: float = 180) -> None:
        """Until SMG lists every one of ``urls`` as healthy and has read each one's load; else
        raises, naming those it does not. Before its first poll of a replica SMG prices that
        replica's requests above a polled one's, so a burst would pile onto the replica polled
        first (docs/deployment.md, "Start-up")."""
        deadline = time.monotonic() + timeout_s
        while not set(urls) <= (ready := self.healthy_workers(polled=True)):
            if not self.alive() or time.monotonic() > deadline:
                state = ("exited" if not self.alive() else
                         f"did not list them as healthy with a polled load within {timeout_s:g} s")
                raise TimeoutError(f"the gateway ({self.url}) cannot reach {sorted(set(urls) - ready)}: it {state}; "
                                   f"its log ({self.log_path}) ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def policy_branches(self) -> dict[str, float]:
        """SMG's count of each cache-aware decision (tree_match, spill, expected_wait_fallback, ...)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return {line.split('branch="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("smg_cache_aware_policy_branch_total{")}


class Fleet:
    """``replicas`` services (one model, one native build) and an SMG gateway in front of them.
    ``settings``: TSERVE_* values for every replica (names without the prefix, lower case)."""

    def __init__(self, log_dir: Path, replicas: int = 3, policy: str = "cache_aware", model: str = DEFAULT_MODEL,
                 threads: int = 1, gateway_port: int | None = None, smg: str | None = None,
                 python: str = sys.executable, gateway_args: Sequence[str] = (), **settings: str):
        self.smg = smg or find_smg()
        if self.smg is None:
            raise FileNotFoundError(f"no smg executable: `make gateway` (pip install smg=={SMG_VERSION} into "
                                    f".venv-gateway/), or SMG_BINARY=/path/to/smg")
        self.log_dir, self.policy, self.python, self.model = Path(log_dir), policy, python, model
        self.gateway_port, self.gateway_args = gateway_port, list(gateway_args)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {"TSERVE_MODELS": model, "TSERVE_WEIGHTS_DIR": str(ROOT / "weights"),
                    "TSERVE_TORCH_THREADS": str(threads), "TSERVE_LOG_LEVEL": "warning", "OMP_WAIT_POLICY": "PASSIVE",
                    **{f"TSERVE_{k.upper()}": str(v) for k, v in settings.items()}}
        self.replicas = [Replica(f"replica{i}", free_port(), self.log_dir, self.env, python) for i in range(replicas)]
        self.gateway: Gateway | None = None
        self.native: str | None = None

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def worker_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start(self, ready_timeout_s: float = 600) -> Fleet:
        if "TSERVE_NATIVE_LIBRARY" not in self.env:
            self.native = native_library(self.python)
            if self.native:
                self.env["TSERVE_NATIVE_LIBRARY"] = self.native
                for r in self.replicas:
                    r.env["TSERVE_NATIVE_LIBRARY"] = self.native
        for r in self.replicas:
            r.start()
        for r in self.replicas:  # raises naming the replica (and quoting its log) that is not ready
            r.wait_ready(ready_timeout_s)
        # SMG's detection starts with GET /v1/models: the gateway starts once every replica answers it.
        deadline = time.monotonic() + 120
        while missing := [r for r in self.replicas if not r.serves(self.model)]:
            if time.monotonic() > deadline:
                raise TimeoutError("ready, but GET /v1/models does not list the model within 120 s: "
                                   + ", ".join(f"{r.name} ({r.url}, log {r.log_path})" for r in missing))
            time.sleep(0.5)
        self.use_policy(self.policy)
        return self

    def use_policy(self, policy: str) -> Gateway:
        """A fresh gateway with ``policy`` (its routing state empty) over the same replicas."""
        if self.gateway is not None:
            self.gateway.stop()
        self.policy = policy
        self.gateway = Gateway(self.smg, self.worker_urls, policy, self.log_dir, self.gateway_port,
                               self.gateway_args)
        self.gateway.start()
        self.gateway.wait_ready(120)
        self.gateway.wait_healthy([r.url for r in self.replicas if r.alive()], timeout_s=180)
        return self.gateway

    def restart(self, index: int, ready_timeout_s: float = 300) -> Replica:
        """A new process for replica ``index`` on its old port (the gateway's worker URL)."""
        old = self.replicas[index]
        old.stop()
        new = Replica(old.name, old.port, self.log_dir, self.env, self.python)
        new.log_path = self.log_dir / f"{old.name}-restarted.log"
        self.replicas[index] = new.start()
        new.wait_ready(ready_timeout_s)
        return new

    def stop(self) -> None:
        for process in [self.gateway, *self.replicas]:
            if process is not None:
                process.stop()

    def __enter__(self) -> Fleet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware", help="SMG's routing policy")
    parser.add_argument("--port", type=int, default=8080, help="the gateway's port on 127.0.0.1")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="TSERVE_MODELS of every replica")
    parser.add_argument("--threads", type=int, default=1, help="TSERVE_TORCH_THREADS of every replica")
    parser.add_argument("--logs", type=Path, default=ROOT / "build" / "fleet", help="one log per process")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a TSERVE_ setting for every replica, e.g. --set max_batch=8 (repeatable)")
    args = parser.parse_args(argv)
    settings = dict(item.split("=", 1) for item in args.set)
    fleet = Fleet(args.logs, args.replicas, args.policy, args.model, args.threads, args.port, **settings)
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: the fleet stops what it started, then exits
    try:
        with fleet:
            for r in fleet.replicas:
                print(f"{r.name}: {r.url} (log {r.log_path})")
            print(f"native decode library: {fleet.native or 'none (each replica built or fell back on its own)'}")
            print(f"gateway ({fleet.policy}): {fleet.url} (log {fleet.gateway.log_path}); Ctrl-C stops everything",
                  flush=True)
            while not (dead := [p for p in [fleet.gateway, *fleet.replicas] if not p.alive()]):
                time.sleep(1.0)
            print(f"{dead[0].log_path} ended; stopping the fleet", file=sys.stderr)
    except KeyboardInterrupt:
        pass


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
