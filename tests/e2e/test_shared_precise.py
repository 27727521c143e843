"""Router replicas in precise mode (``--kv-events``) that also share state through Redis
(``--state-store``): what the combination does, end to end.

Real processes: a ``redis-server``, two ``kvroute sim-worker``s each publishing vLLM-format
KV events on its own ZMQ PUB socket (``ipc://``: local only, and every router connects
to it), two ``kvroute serve`` replicas subscribed to both streams and sharing one Redis.
What is asserted: the replicas route on the engines' events (a prefix is a precise hit
through the router that never saw it routed, a worker's dropped cache is a miss whatever
the shared index predicted); the load one replica sends is seen by the other, down to
the prefill still queued; the worker list is shared (a worker removed on one router
leaves the other).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from support import NEEDS_REDIS, RedisServer, metric, start_router, wait_until

pytestmark = NEEDS_REDIS


def decisions(router: Server, reason: str) -> float:
    return metric(
        router, "kvroute_routing_decisions_total", f'reason="{reason}"', 'source="precise"'
    )


def rows(router: Server) -> dict[str, dict[str, object]]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers", timeout=5).json()}


def ask(router: Server, prompt: list[int], max_tokens: int = 1) -> httpx.Response:
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=60)


def test_precise_replicas_sharing_a_store(tmp_path: Path, processes: list[Server]) -> None:
    redis_server = RedisServer(tmp_path)
    try:
        run(tmp_path, processes, redis_server)
    finally:
        redis_server.stop()


def run(tmp_path: Path, processes: list[Server], redis_server: RedisServer) -> None:
    workers: list[Server] = []
    flags = ["--token-id-prompts", "--state-store", redis_server.url]
    flags += ["--state-store-heartbeat-secs", "0.1"]
    for i in range(2):
        port = free_port()
        endpoint = f"ipc://{tmp_path}/kv-{i}.ipc"  # the worker binds, every router connects
        argv = kvroute_argv(
            "sim-worker",
            "--port",
            str(port),
            "--block-size",
            "16",
            "--time-scale",
            "5",
            "--kv-events-endpoint",
            endpoint,
            "--kv-events-topic",
            f"kv@{i}",
        )
        w = start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path))
        processes.append(w)
        workers.append(w)
        flags += ["--kv-events", f"{w.url}={endpoint};topic=kv@{i}"]
    urls = [w.url for w in workers]
    r1, r2 = (start_router(urls, tmp_path, *flags) for _ in range(2))
    processes += [r1, r2]

    # ZMQ drops what is published before a subscription arrives: a cache reset
    # (AllBlocksCleared) brings each stream up as a full state, once both routers listen.
    def primed() -> bool:
        if all(rows(r)[u]["mode"] == "precise" for r in (r1, r2) for u in urls):
            return True
        for w in workers:
            httpx.post(w.url + "/flush_cache", timeout=5).raise_for_status()
        time.sleep(0.2)
        return False

    assert wait_until(primed, 20.0), [rows(r) for r in (r1, r2)]
    assert wait_until(lambda: len(httpx.get(r1.url + "/routers", timeout=5).json()) == 2)

    # Decisions from events: a prefix routed by router 1 is a precise hit on router 2.
    prompt = list(range(1000, 1320))  # 20 blocks of 16
    first = ask(r1, prompt)
    assert first.status_code == 200
    home = first.headers["x-kvroute-worker"]
    assert wait_until(lambda: event_blocks(r2, home) >= 20)
    second = ask(r2, prompt)
    assert second.headers["x-kvroute-worker"] == home
    assert decisions(r2, "cache_hit") == 1
    # The engine drops its cache: the events say so, and router 2 counts a miss there
    # although the shared (predicted) index still holds the prefix for ``home``.
    httpx.post(home + "/flush_cache", timeout=5).raise_for_status()
    assert wait_until(lambda: event_blocks(r2, home) == 0)
    assert rows(r2)[home]["cached_tokens"] > 0, "the shared index still predicts it"
    third = ask(r2, prompt)
    assert third.status_code == 200
    assert decisions(r2, "cache_hit") == 1 and decisions(r2, "cache_miss") >= 1

    # Load: router 1's requests in flight, and their queued prefill, are seen by router 2.
    answers: list[httpx.Response] = []
    long_ones = [
        threading.Thread(
            target=lambda i=i: answers.append(
                ask(r1, [5000 + 700 * i + k for k in range(600)], 200)
            )
        )
        for i in range(4)
    ]
    for t in long_ones:
        t.start()
    assert wait_until(
        lambda: sum(int(str(w["peer_in_flight"])) for w in rows(r2).values()) == 4, 20.0
    ), rows(r2)
    for t in long_ones:
        t.join(timeout=60)
    assert len(answers) == 4 and all(a.status_code == 200 for a in answers)
    assert wait_until(lambda: all(w["peer_in_flight"] == 0 for w in rows(r2).values()))
    assert all(w["peer_prefill_requests"] == 0 for w in rows(r2).values())

    # Membership: a worker removed through router 1 leaves router 2's fleet too.
    gone = urls[1]
    assert httpx.delete(r1.url + "/workers/" + gone, timeout=5).status_code in (200, 204)
    assert wait_until(lambda: gone not in rows(r2)), list(rows(r2))


def event_blocks(router: Server, worker: str) -> float:
    """Blocks ``worker`` holds per its KV events, as ``router`` tracks them."""
    return metric(router, "kvroute_kv_events_cached_blocks", f'worker="{worker}"')
