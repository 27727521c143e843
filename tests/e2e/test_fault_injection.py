"""Fault injection with real processes on loopback: what the client sees, that requests
another worker could serve never fail, and that every reservation comes back."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from kvroute.eval.procs import Server
from support import control, records

Fleet = Callable[..., tuple[Server, list[Server]]]


def workers_state(router: Server) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=5).json()}


def released(w: dict[str, Any]) -> bool:
    """Nothing of the worker's load is still reserved: requests in flight, and the work
    model's predicted prefill, requests, decode tokens and prompt tokens kept in the KV
    cache (``kvroute.routing.load``)."""
    work = w["work"]
    return w["in_flight"] == 0 and (
        work["prefill_tokens_queued"],
        work["requests"],
        work["decode_tokens"],
        work["kv_tokens_in_flight"],
    ) == (0, 0, 0, 0)


def settle(router: Server, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        ws = workers_state(router)
        if all(released(w) for w in ws.values()) or time.monotonic() > deadline:
            return ws


def test_hanging_worker_is_abandoned_after_first_byte_timeout(fleet: Fleet) -> None:
    router, workers = fleet(2, "--first-byte-timeout-secs", "1", "--policy", "round_robin")
    control(workers[0], mode="hang")
    with httpx.Client(base_url=router.url, timeout=20) as c:
        codes = [c.post("/v1/completions", json={"prompt": f"p{i}"}).status_code for i in range(4)]
    assert codes == [200] * 4
    ws = settle(router)
    assert ws[workers[0].url]["healthy"] is False
    assert all(released(w) for w in ws.values())


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
    assert released(settle(router)[workers[0].url])


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
    assert released(ws[workers[0].url])
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
    # Each 503 is retried on the good worker; the third one opens the circuit.
    assert statuses == [200] * 12
    assert len(records(workers[0])) == 3
    ws = settle(router)
    assert ws[workers[0].url]["circuit_open"] is True
    # Other error answers pass through unchanged and are not retried.
    control(workers[0], mode="ok")
    control(workers[1], mode="error", status=500)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["message"] == "worker says no"


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
    # Health checks (every 0.2 s, two failures) take it out even if no request tried it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and workers_state(router)[late]["healthy"]:
        time.sleep(0.1)
    assert workers_state(router)[late]["healthy"] is False
    # A worker that dies and comes back on the same port rejoins via health checks.
    port = workers[0].url.rsplit(":", 1)[1]
    workers[0].kill()
    time.sleep(0.6)
    assert workers_state(router)[workers[0].url]["healthy"] is False
    import sys

    from kvroute.eval.procs import start_server
    from support import TESTS

    revived = start_server(
        "revived", [sys.executable, str(TESTS / "fake_worker.py"), "--port", port], int(port)
    )
    processes.append(revived)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not workers_state(router)[revived.url]["healthy"]:
        time.sleep(0.1)
    assert workers_state(router)[revived.url]["healthy"] is True
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "z"}).status_code == 200
    assert all(released(w) for w in settle(router).values())


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
    assert all(released(w) for w in settle(router).values())


def test_dead_workers_prefixes_spread_over_survivors_by_load(fleet: Fleet) -> None:
    """SGLang's router moved every prefix of a dead worker onto one survivor. Here the
    dead worker's entries are dropped, so its prefix groups arriving together go to the
    least-loaded survivors (one each), and then stick to their new homes."""
    router, workers = fleet(4)

    def prompt(g: int, q: int) -> str:
        return f"group {g} shared system prompt. " * 40 + f"question {q}?"

    home: dict[int, str] = {}
    with httpx.Client(base_url=router.url, timeout=20) as c:
        for g in range(12):
            r = c.post("/v1/completions", json={"prompt": prompt(g, 0)})
            home[g] = r.headers["x-kvroute-worker"]
        for g in range(12):  # affinity before the failure
            assert (
                c.post("/v1/completions", json={"prompt": prompt(g, 1)}).headers["x-kvroute-worker"]
                == home[g]
            )
    victim = max(workers, key=lambda w: sum(1 for h in home.values() if h == w.url))
    orphans = [g for g, h in home.items() if h == victim.url]
    survivors = [w for w in workers if w is not victim]
    assert len(orphans) >= 2
    victim.kill()
    deadline = time.monotonic() + 5
    while workers_state(router)[victim.url]["healthy"] is not False:
        assert time.monotonic() < deadline, "the dead worker never left rotation"
        time.sleep(0.05)
    assert workers_state(router)[victim.url]["cached_tokens"] == 0, "its prefixes are dropped"
    for w in survivors:
        control(w, delay_s=0.5)  # the orphaned groups overlap in flight
    new_home: dict[int, str] = {}
    lock = threading.Lock()

    def send(g: int) -> None:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": prompt(g, 2)}, timeout=20)
        assert r.status_code == 200
        with lock:
            new_home[g] = r.headers["x-kvroute-worker"]

    threads = [threading.Thread(target=send, args=(g,)) for g in orphans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(new_home) == sorted(orphans)
    per_survivor = Counter(new_home.values())
    assert victim.url not in per_survivor
    assert len(per_survivor) == min(len(orphans), len(survivors)), per_survivor
    assert max(per_survivor.values()) <= -(-len(orphans) // len(survivors))
    with httpx.Client(base_url=router.url, timeout=20) as c:
        for g in orphans:
            r = c.post("/v1/completions", json={"prompt": prompt(g, 3)})
            assert r.headers["x-kvroute-worker"] == new_home[g], "new home keeps the group"
    assert all(released(w) for w in settle(router).values())


def test_request_timeout_bounds_the_whole_request(fleet: Fleet) -> None:
    """--request-timeout-secs: a 504 when the answer is late even though the first-byte
    timeout is longer, an error event when a stream outlives it; the worker is slow, not
    dead, so it stays in rotation."""
    router, workers = fleet(1, "--request-timeout-secs", "1", "--first-byte-timeout-secs", "30")
    control(workers[0], delay_s=3.0)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "late"}, timeout=20)
    # The worker would answer 200 after 3 s: the 504 is the router's deadline.
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    control(workers[0], delay_s=0.0, chunks=40, chunk_delay_s=0.1)
    with httpx.stream(
        "POST", router.url + "/v1/completions", json={"prompt": "long", "stream": True}, timeout=20
    ) as s:
        body = b"".join(s.iter_raw())
    assert b" t0" in body and b"[DONE]" not in body
    assert b'"code":"stream_interrupted"' in body
    ws = settle(router)
    assert ws[workers[0].url]["healthy"] is True and released(ws[workers[0].url])
