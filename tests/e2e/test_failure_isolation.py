"""Failure isolation with real processes on loopback: a query of death, a request that
makes workers drop its connection, a worker answering 503 while its health check says
200, a worker frozen with SIGSTOP under load, bad worker URLs, and idle connections
past the default open-file limit."""

from __future__ import annotations

import math
import os
import resource
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from support import control, metric, records, start_router, start_sim_worker, wait_until

Fleet = Callable[..., tuple[Server, list[Server]]]
POISON = "POISON-7f3a"


def workers_state(router: Server) -> dict[str, dict[str, object]]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=5).json()}


def sim_fleet(
    tmp_path: Path, processes: list[Server], action: str, *router_flags: str
) -> tuple[Server, list[Server]]:
    workers = [
        start_sim_worker(tmp_path, "--poison-marker", POISON, "--poison-action", action)
        for _ in range(3)
    ]
    processes.extend(workers)
    router = start_router([w.url for w in workers], tmp_path, *router_flags)
    processes.append(router)
    return router, workers


def normal_requests(router: Server, n: int) -> list[int]:
    with httpx.Client(base_url=router.url, timeout=30) as c:
        return [
            c.post(
                "/v1/completions", json={"prompt": f"normal question {i}", "max_tokens": 4}
            ).status_code
            for i in range(n)
        ]


def test_query_of_death_kills_at_most_two_workers(tmp_path: Path, processes: list[Server]) -> None:
    router, workers = sim_fleet(tmp_path, processes, "crash")
    poison = {"prompt": f"bad input {POISON}", "max_tokens": 4}
    r = httpx.post(
        router.url + "/v1/completions", json=poison, headers={"x-request-id": "qod-1"}, timeout=30
    )
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "request_failed_on_workers" and "qod-1" in err["message"]
    # A crashing worker's sockets close before its process is reaped: the router can
    # answer before the second one is seen gone.
    wait_until(lambda: sum(not w.alive() for w in workers) >= 2, 10)
    assert sum(not w.alive() for w in workers) == 2, "one retry elsewhere, then no more"
    # The next normal requests all succeed: the dead workers are found out on the way.
    assert normal_requests(router, 20) == [200] * 20
    # A copy is refused at once and reaches no worker.
    r = httpx.post(router.url + "/v1/completions", json=poison, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "request_quarantined"
    assert sum(w.alive() for w in workers) == 1
    assert metric(router, "kvroute_quarantined_total") == 1
    assert metric(router, "kvroute_quarantine_refused_total") == 1


def test_dropped_connection_marks_no_worker_down(tmp_path: Path, processes: list[Server]) -> None:
    router, workers = sim_fleet(tmp_path, processes, "drop")
    poison = {"prompt": f"bad input {POISON}", "max_tokens": 4}
    r = httpx.post(router.url + "/v1/completions", json=poison, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "request_failed_on_workers"
    state = workers_state(router)
    assert all(w["healthy"] is True for w in state.values()), state
    assert all(w.alive() for w in workers)
    codes = normal_requests(router, 20)
    assert codes == [200] * 20
    assert metric(router, "kvroute_retries_total") == 1, "the poison retried once"


def test_worker_answering_503_costs_no_client_error(fleet: Fleet) -> None:
    """/health says 200, inference says 503: every 503 is retried elsewhere, and once the
    circuit opened the worker sees one probe request per cooldown, not a burst."""
    cooldown = 0.5
    router, workers = fleet(
        3,
        "--policy",
        "round_robin",
        "--circuit-breaker-failures",
        "3",
        "--circuit-breaker-cooldown-secs",
        str(cooldown),
    )
    bad = workers[0]
    control(bad, mode="error", status=503)
    statuses: Counter[int] = Counter()
    start = time.monotonic()
    with httpx.Client(base_url=router.url, timeout=30) as c:
        for i in range(3000):  # for 3 s: several cooldowns
            statuses[c.post("/v1/completions", json={"prompt": f"q{i}"}).status_code] += 1
            if time.monotonic() - start > 3.0:
                break
    elapsed = time.monotonic() - start
    assert list(statuses) == [200], statuses
    hits = len(records(bad))
    # 3 to open the circuit, then at most one half-open probe per cooldown.
    assert 3 < hits <= 3 + math.ceil(elapsed / cooldown) + 1, (hits, elapsed)
    assert metric(router, "kvroute_retries_total") == hits
    # Its health checks still pass: only the circuit (open or half-open at this moment,
    # depending on timing) keeps it out, it was never marked down.
    assert workers_state(router)[bad.url]["down_reason"] is None, "/health still answers"


def test_stuck_requests_move_when_a_worker_freezes(fleet: Fleet) -> None:
    """SIGSTOP one of three workers under load (TCP still accepted, nothing answered):
    every request still succeeds with a 30 s client timeout, those stuck on the frozen
    worker served elsewhere once it is marked down; SIGCONT brings it back."""
    interval, check_timeout = 0.3, 0.5
    bound = interval + check_timeout + 3.0
    router, workers = fleet(
        3,
        "--policy",
        "round_robin",
        "--health-check-interval-secs",
        str(interval),
        "--health-check-timeout-secs",
        str(check_timeout),
    )
    for w in workers:
        control(w, delay_s=0.05)
    frozen = workers[1]
    results: list[tuple[int, float, str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(base_url=router.url, timeout=30) as c:
            i = 0
            while not stop.is_set() and i < 400:
                t = time.monotonic()
                try:
                    r = c.post("/v1/completions", json={"prompt": f"c{k} q{i}"})
                    row = (
                        r.status_code,
                        time.monotonic() - t,
                        r.headers.get("x-kvroute-worker", ""),
                    )
                except httpx.HTTPError as e:
                    row = (0, time.monotonic() - t, type(e).__name__)
                with lock:
                    results.append(row)
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while workers_state(router)[frozen.url]["healthy"] is not False:
            assert time.monotonic() < deadline, "the frozen worker never left rotation"
            time.sleep(0.05)
        # Frozen for longer than the bound below: a request left waiting on it would
        # take longer than that (or time out).
        time.sleep(bound + 0.5)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while workers_state(router)[frozen.url]["healthy"] is not True:
        assert time.monotonic() < deadline, "the worker did not rejoin after SIGCONT"
        time.sleep(0.05)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    codes = Counter(code for code, _, _ in results)
    assert codes == {200: len(results)}, codes
    # Stuck requests were moved, not left to wait: none took longer than the detection
    # (health interval + check timeout) and a small bound.
    assert metric(router, "kvroute_retries_total") >= 1
    slowest = max(secs for _, secs, _ in results)
    assert slowest < bound, slowest
    after = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert after.status_code == 200
    assert all(w["in_flight"] == 0 for w in workers_state(router).values())
    served = Counter(w for _, _, w in results[-12:])
    assert frozen.url in served or len(records(frozen)) > 0


def test_bad_worker_urls_are_refused_and_cost_no_request(fleet: Fleet) -> None:
    router, workers = fleet(2)
    for url in ("http://[::1]x:80", "http://127.0.0.1:70000", "http://[zz]:1", "ftp://h"):
        r = httpx.post(router.url + "/workers", json={"url": url}, timeout=5)
        assert r.status_code == 422, r.text
        r = httpx.delete(router.url + "/workers/" + url, timeout=5)
        assert r.status_code == 404, r.text
    assert normal_requests(router, 12) == [200] * 12
    assert sorted(workers_state(router)) == sorted(w.url for w in workers)
    assert "unhandled error" not in router.log_tail(400)


def _idle_connections(url: str, n: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    out = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        out.append(s)
    return out


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4096, reason="hard open-file limit too low"
)
def test_1100_idle_connections_with_the_default_limit(
    fleet: Fleet, processes: list[Server], tmp_path: Path
) -> None:
    """A router started with the usual soft limit of 1,024 open files raises it, so 1,100
    idle client connections do not lock new clients out; and past --max-connections a
    new request gets a clean 503, not a reset."""
    _, workers = fleet(1)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    port = free_port()
    argv = [
        "prlimit",
        f"--nofile=1024:{hard}",
        "--",
        *kvroute_argv(
            "serve", "--port", str(port), "--worker-urls", workers[0].url, "--log-level", "info"
        ),
    ]
    router = start_server(f"router-{port}", argv, port, log_dir=str(tmp_path))
    processes.append(router)
    held = _idle_connections(router.url, 1100)
    try:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 200, r.text
    finally:
        for s in held:
            s.close()
    assert f"open-file limit {hard}" in router.log_tail(200)

    capped = start_router([workers[0].url], tmp_path, "--max-connections", "50")
    processes.append(capped)
    held = _idle_connections(capped.url, 60)
    try:
        time.sleep(0.3)  # let the server accept them all
        r = httpx.post(capped.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "too_many_connections"
        assert r.headers["retry-after"] == "1"
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    r = httpx.post(capped.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 200
