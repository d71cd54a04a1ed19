"""Real replicas (three ready, one never ready) behind a real HAProxy (deploy/lb/haproxy.cfg), on 127.0.0.1.

Shows what README "Load balancing" promises: requests spread over the ready replicas (a
fourth one, whose /ready is 503, gets none), SSE streams arrive token by token through the
balancer, and a replica that hangs (stops answering /ready) or shuts down (SIGTERM) stops
getting requests while no client request fails: requests already on a terminating replica
finish there, new ones go elsewhere.
The tests share one set of processes and run in file order; the last one ends a replica.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.deploy.cluster import Balancer, Replica, wait_until

pytestmark = pytest.mark.slow

HAPROXY = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/sbin"))
SHORT = {"prompt": "To be, or not to be", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if HAPROXY is None:
        pytest.skip("haproxy is not installed (Debian package `haproxy`; .ci/run installs it)")
    work = tmp_path_factory.mktemp("lb")
    processes: list = []
    try:
        replicas = []
        for i in range(3):
            # A long grace, so the stream cut by SIGTERM below can finish even on a host so
            # busy that 300 tokens take more than the default 10 s.
            replicas.append(Replica(f"replica{i}", work, shutdown_grace_s="60"))
            processes.append(replicas[-1])
        # A fourth replica that never turns ready: its TSERVE_MODELS names no shipped checkpoint,
        # so /ready answers 503 (and says why) for as long as it runs.
        unready = Replica("unready", work, model="not-a-shipped-model")
        processes.append(unready)
        wait_until(lambda: all(r.ready() for r in replicas), 120, "every replica ready", every_s=0.5)
        wait_until(lambda: _status(unready.url + "/ready") == 503, 60, "the unready replica answering 503")
        balancer = Balancer(HAPROXY, replicas + [unready], work)
        processes.insert(0, balancer)
        expected = {**{r.name: "UP" for r in replicas}, unready.name: "DOWN"}
        wait_until(lambda: balancer.alive() and _states_or_empty(balancer) == expected, 30,
                   f"haproxy server states {expected}")
        yield balancer, replicas, unready
    finally:
        for process in processes:
            process.stop()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _states_or_empty(balancer: Balancer) -> dict[str, str]:
    try:
        return balancer.server_states()
    except httpx.HTTPError:
        return {}


def post(url: str, body: dict = SHORT) -> int:
    return httpx.post(url + "/v1/generate", json=body, timeout=60).status_code


def test_requests_are_spread_over_the_ready_replicas(cluster):
    balancer, replicas, unready = cluster
    before = [r.generate_requests() for r in replicas]
    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(lambda _: post(balancer.url), range(30)))
    assert statuses == [200] * 30
    served = [r.generate_requests() - b for r, b in zip(replicas, before)]
    assert sum(served) == 30
    assert min(served) >= 5, f"uneven spread over the replicas: {served}"
    # The replica whose /ready is 503 got none, whatever the status would have been.
    assert unready.metric("tserve_requests_total", endpoint="/v1/generate") == 0


def test_sse_streams_token_by_token_through_haproxy(cluster):
    balancer, replicas, _ = cluster
    body = {"prompt": "ROMEO:", "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    tokens = 0
    running_at_first_token = None
    start = time.monotonic()
    with httpx.stream("POST", balancer.url + "/v1/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            token_ids = json.loads(line[len("data: "):]).get("token_ids")
            if token_ids:  # one token per event, or several when a step kept speculative drafts
                arrivals.append(time.monotonic())
                tokens += len(token_ids)
                if running_at_first_token is None:  # is the replica still generating?
                    running_at_first_token = sum(r.metric("tserve_running_requests") for r in replicas)
    assert tokens == 120 and len(arrivals) >= 20
    # A buffered response would arrive in one piece after generation ended (running = 0 then).
    assert running_at_first_token >= 1
    assert arrivals[-1] - arrivals[0] > 0.3 * (arrivals[-1] - start), "tokens arrived in a burst, not streamed"


def test_a_replica_that_stops_answering_ready_is_taken_out_and_back(cluster):
    balancer, replicas, _ = cluster
    frozen = replicas[2]
    before = frozen.generate_requests()
    frozen.signal(signal.SIGSTOP)  # hung: its /ready check times out
    try:
        balancer.wait_state(frozen.name, "DOWN", timeout_s=40)  # two 5 s check timeouts
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda _: post(balancer.url), range(12)))
        assert statuses == [200] * 12  # nothing was sent to the frozen replica, or it would hang here
    finally:
        frozen.signal(signal.SIGCONT)
    balancer.wait_state(frozen.name, "UP", timeout_s=30)
    assert frozen.generate_requests() == before


def test_sigterm_drains_a_replica_without_failing_a_request(cluster):
    balancer, replicas, _ = cluster
    # A long stream is in flight when its replica gets SIGTERM; short requests keep arriving.
    stream_body = {"prompt": "HAMLET:", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
    stream_tokens: list[int] = []
    stream_done = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", balancer.url + "/v1/generate", json=stream_body, timeout=60) as resp:
            stream_tokens.append(resp.status_code)
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    stream_done.set()
                elif line.startswith("data: "):
                    stream_tokens.extend(json.loads(line[len("data: "):]).get("token_ids") or [])

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    target = wait_until(lambda: next((r for r in replicas if r.metric("tserve_running_requests") >= 1), None),
                        20, "the stream to start on a replica", every_s=0.05)
    others = [r for r in replicas if r is not target]
    before = [r.generate_requests() for r in others]

    statuses: list[int] = []
    stop_sending = threading.Event()

    def keep_sending() -> None:
        while not stop_sending.is_set() and len(statuses) < 200:
            try:
                statuses.append(post(balancer.url))
            except httpx.HTTPError as exc:  # a transport error is a failed request too
                statuses.append(type(exc).__name__)

    senders = [threading.Thread(target=keep_sending, daemon=True) for _ in range(3)]
    for s in senders:
        s.start()
    time.sleep(0.5)
    target.signal(signal.SIGTERM)
    try:
        balancer.wait_state(target.name, "DOWN", timeout_s=20)
        wait_until(lambda: not target.alive(), 90, f"{target.name} to exit after SIGTERM")
        time.sleep(1.0)  # a little traffic after the replica is gone
    finally:
        stop_sending.set()
        for s in senders:
            s.join(timeout=70)
        streamer.join(timeout=90)
    # uvicorn re-raises the SIGTERM it caught once its graceful shutdown is done.
    assert target.proc.returncode in (0, -signal.SIGTERM), target.log_tail()
    assert stream_done.is_set() and stream_tokens[0] == 200 and len(stream_tokens) == 1 + 300, \
        f"the in-flight stream did not complete on the terminating replica\n{balancer.diagnostics()}"
    failed = [s for s in statuses if s != 200]
    assert len(statuses) >= 10 and not failed, \
        f"{len(failed)} of {len(statuses)} requests failed: {failed[:5]}\n{balancer.diagnostics()}"
    assert sum(r.generate_requests() - b for r, b in zip(others, before)) > 0
