"""Fault injection with real processes on loopback: what the client sees, that requests
another worker could serve never fail, and that every reservation comes back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from conftest import control
from kvroute.procs import Server

Fleet = Callable[..., tuple[Server, list[Server]]]


def workers_state(router: Server) -> dict[str, dict[str, object]]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=5).json()}


def settle(router: Server, timeout_s: float = 10.0) -> dict[str, dict[str, object]]:
    deadline = time.monotonic() + timeout_s
    while True:
        ws = workers_state(router)
        if all(w["in_flight"] == 0 for w in ws.values()) or time.monotonic() > deadline:
            return ws


def test_hanging_worker_is_abandoned_after_first_byte_timeout(fleet: Fleet) -> None:
    router, workers = fleet(2, "--first-byte-timeout-secs", "1", "--policy", "round_robin")
    control(workers[0], mode="hang")
    with httpx.Client(base_url=router.url, timeout=20) as c:
        codes = [c.post("/v1/completions", json={"prompt": f"p{i}"}).status_code for i in range(4)]
    assert codes == [200] * 4
    ws = settle(router)
    assert ws[workers[0].url]["healthy"] is False
    assert all(w["in_flight"] == 0 for w in ws.values())


def test_garbage_and_truncated_answers(fleet: Fleet) -> None:
    router, workers = fleet(1)
    control(workers[0], mode="garbage")
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200 and r.content.startswith(b"\x00not json"), "passed through"
    control(workers[0], mode="truncate")
    with httpx.stream(
        "POST", router.url + "/v1/completions", json={"prompt": "x", "stream": True}
    ) as s:
        body = b"".join(s.iter_raw())
    assert b'data: {"trunc' in body, "what the worker sent reaches the client"
    assert settle(router)[workers[0].url]["in_flight"] == 0


def test_killed_mid_stream_ends_with_an_error_event(fleet: Fleet) -> None:
    router, workers = fleet(1)
    control(workers[0], mode="die_mid_stream")
    with httpx.stream(
        "POST", router.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=20
    ) as s:
        body = b"".join(s.iter_raw())
    assert b" t0" in body and b" t1" in body
    assert b'"code":"stream_interrupted"' in body
    ws = settle(router)
    assert ws[workers[0].url]["in_flight"] == 0
    assert ws[workers[0].url]["healthy"] is False


def test_repeated_5xx_opens_the_circuit(fleet: Fleet) -> None:
    router, workers = fleet(
        2,
        "--circuit-breaker-failures",
        "3",
        "--circuit-breaker-cooldown-secs",
        "30",
        "--policy",
        "round_robin",
    )
    control(workers[0], mode="error", status=503)
    with httpx.Client(base_url=router.url, timeout=10) as c:
        statuses = [
            c.post("/v1/completions", json={"prompt": f"{i}"}).status_code for i in range(12)
        ]
    # 503s pass through until the third one opens the circuit; then only the good worker.
    assert statuses.count(503) == 3
    assert statuses[-4:] == [200] * 4
    ws = settle(router)
    assert ws[workers[0].url]["circuit_open"] is True


def test_worker_refusing_at_startup_then_coming_back(
    fleet: Fleet, processes: list[Server], tmp_path: object
) -> None:
    router, workers = fleet(1)
    late = "http://127.0.0.1:1"  # nothing listens on port 1
    assert httpx.post(router.url + "/workers", json={"url": late}).status_code == 201
    with httpx.Client(base_url=router.url, timeout=10) as c:
        assert all(
            c.post("/v1/completions", json={"prompt": f"q{i}"}).status_code == 200 for i in range(4)
        )
    assert workers_state(router)[late]["healthy"] is False
    # A worker that dies and comes back on the same port rejoins via health checks.
    port = workers[0].url.rsplit(":", 1)[1]
    workers[0].kill()
    time.sleep(0.6)
    assert workers_state(router)[workers[0].url]["healthy"] is False
    import sys

    from conftest import TESTS
    from kvroute.procs import start_server

    revived = start_server(
        "revived", [sys.executable, str(TESTS / "fake_worker.py"), "--port", port], int(port)
    )
    processes.append(revived)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not workers_state(router)[revived.url]["healthy"]:
        time.sleep(0.1)
    assert workers_state(router)[revived.url]["healthy"] is True
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "z"}).status_code == 200


def test_one_worker_killed_under_load_costs_no_request(fleet: Fleet) -> None:
    """Concurrent non-streaming load; one of three workers is killed mid-run. Every
    request must succeed (each failed attempt is retried on a survivor) and the dead
    worker must leave rotation within a second."""
    router, workers = fleet(3)
    for w in workers:
        control(w, delay_s=0.05)
    results: list[int] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        with httpx.Client(base_url=router.url, timeout=30) as c:
            for i in range(n):
                code = c.post("/v1/completions", json={"prompt": f"g{i % 5} " * 50}).status_code
                with lock:
                    results.append(code)

    threads = [threading.Thread(target=client, args=(15,)) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.4)
    killed_at = time.monotonic()
    workers[1].kill()
    seen_down = None
    while time.monotonic() - killed_at < 5:
        if workers_state(router)[workers[1].url]["healthy"] is False:
            seen_down = time.monotonic() - killed_at
            break
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    assert results.count(200) == len(results) == 90
    assert seen_down is not None and seen_down < 1.0
    assert all(w["in_flight"] == 0 for w in settle(router).values())
