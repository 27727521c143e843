"""Precise mode against real vLLM (CPU build, tiny random model): the slow suite.

Run with ``.venv/bin/pytest -m slow tests/e2e/test_vllm_engine.py`` after installing the
engine (docs/real-engine.md) and building the model (``bench/engine/make_tiny_model.py``).

Two replicas, 40 KV blocks of 32 tokens each, bind their event PUB sockets on ipc://
(so several subscribers can connect: this test's own and the router's). Replica A also
has a replay endpoint; B does not. Both serve a prompt before anyone subscribes, so both
streams start with a gap: A recovers it by replay, B goes stale. Then the BlockIndex
must agree with what vLLM itself reports as cached
(``usage.prompt_tokens_details.cached_tokens``), before and after evictions; and
``kvroute serve --kv-events`` must stop sending a prefix to the replica that evicted it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_support import engine_or_skip
from kvroute import BlockIndex
from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.events import EventTracker, KvEventSubscriber, PreciseView, parse_kv_events
from kvroute.events.auto import source_for, vllm_config
from support import wait_for

# Starting two replicas takes 1-3 minutes (more on a busy machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32


serve = engine_or_skip()


def prompt(seed: int, n: int = 300) -> list[int]:
    """Token IDs unique to ``seed`` (a fixed pseudo-random walk over the vocabulary)."""
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(10 + x % 8000)
    return out


def post(url: str, tokens: list[int]) -> httpx.Response:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0},
        timeout=120,
        trust_env=False,
    )
    r.raise_for_status()
    return r


def cached(r: httpx.Response) -> int:
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def complete(server: Server, tokens: list[int]) -> int:
    """Send token IDs to vLLM; return how many prompt tokens it served from its cache."""
    return cached(post(server.url, tokens))


@dataclass
class Fleet:
    a: Server
    b: Server
    specs: list[str]  # --kv-events values for a and b
    tracker: EventTracker
    subscriber: KvEventSubscriber
    warmup: list[int]

    def held(self, server: Server, tokens: list[int]) -> int:
        return self.tracker.index.match(tokens).get(server.url, 0)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # Not pytest's tmp_path: concurrent pytest runs prune old basetemp folders, and the
    # replicas keep TMPDIR, sockets and their compile cache here for minutes.
    scratch = tempfile.mkdtemp(prefix="kvroute-vllm-")
    ports = [free_port(), free_port()]
    events = [f"ipc://{scratch}/events-{i}.sock" for i in range(2)]
    replay = f"tcp://127.0.0.1:{free_port()}"
    servers: dict[int, Server] = {}
    errors: list[BaseException] = []
    ncpu = os.cpu_count() or 1

    def start(i: int) -> None:
        try:
            servers[i] = serve.start_replica(
                ports[i],
                i % ncpu,
                events_endpoint=events[i],
                replay_endpoint=replay if i == 0 else None,
                scratch=os.path.join(scratch, f"vllm{i}"),
            )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sub: KvEventSubscriber | None = None
    try:
        assert not errors, f"replica failed to start (logs in {scratch}): {errors}"
        a, b = servers[0], servers[1]
        warmup = prompt(0)
        for s in (a, b):  # nobody subscribes yet: these events are lost
            complete(s, warmup)
        specs = [f"{a.url}={events[0]};replay={replay}", f"{b.url}={events[1]}"]
        tracker = EventTracker(BlockIndex())
        sub = KvEventSubscriber(parse_kv_events(specs), tracker)
        sub.start()
        time.sleep(1.0)  # our subscription reaches both engines' PUB sockets
        yield Fleet(a, b, specs, tracker, sub, warmup)
    finally:
        if sub is not None:
            assert sub.stop(timeout_s=5)
        for s in servers.values():
            s.stop(grace_s=10)
        if not errors:
            shutil.rmtree(scratch, ignore_errors=True)


def test_late_join_recovers_by_replay_or_goes_stale(fleet: Fleet) -> None:
    a, b, tracker = fleet.a, fleet.b, fleet.tracker
    x = prompt(1)
    complete(a, x)
    complete(b, x)
    wait_for(lambda: int(tracker.snapshot().get(b.url, {}).get("batches", 0)) >= 1, what="B")
    wait_for(lambda: fleet.held(a, x) == 288, what="A events")
    snap = tracker.snapshot()
    print({w: {k: v for k, v in row.items() if v} for w, row in snap.items()})
    assert snap[a.url]["gaps"] == 1 and snap[a.url]["replays"] == 1
    assert snap[a.url]["mode"] == "precise"
    assert fleet.held(a, fleet.warmup) == 288, "the warm-up prompt came back by replay"
    assert snap[b.url]["gaps"] == 1 and snap[b.url]["replays"] == 0
    assert snap[b.url]["mode"] == "stale"
    assert fleet.held(b, fleet.warmup) == 0 and fleet.held(b, x) == 288
    exact, precise = PreciseView(tracker).match(x)
    assert precise == {a.url} and exact == {a.url: 288}


def test_index_agrees_with_engine_then_eviction_removes(fleet: Fleet) -> None:
    a, tracker = fleet.a, fleet.tracker
    p = prompt(2)  # 300 tokens: 9 full blocks of 32 are cached, the tail is not
    assert complete(a, p) == 0
    wait_for(lambda: fleet.held(a, p) == 9 * BLOCK, what="stored events for p")
    assert complete(a, p) == fleet.held(a, p) == 288, "vLLM reports what the index holds"
    applied_before = tracker.snapshot()[a.url]["events_applied"]
    # 40 blocks in the engine: six more 10-block prompts must evict p's blocks.
    for seed in range(10, 16):
        complete(a, prompt(seed))
    wait_for(lambda: fleet.held(a, p) < 288, what="BlockRemoved for p")
    time.sleep(0.5)  # let the last batch land
    held = fleet.held(a, p)
    snap = tracker.snapshot()[a.url]
    print(f"after eviction: index holds {held} of p; {snap}")
    assert int(snap["events_applied"]) > int(applied_before) and snap["mode"] == "precise"
    assert int(snap["cached_blocks"]) <= 40
    assert complete(a, p) == held, "the engine recomputed exactly what the index lost"


def clear_cache(server: Server) -> None:
    """Reset the replica's prefix cache; vLLM publishes the AllBlocksCleared event only
    with its next engine step, so run one (a prompt shorter than a block stores nothing)."""
    r = httpx.post(server.url + "/reset_prefix_cache", timeout=30, trust_env=False)
    r.raise_for_status()
    complete(server, [1, 2, 3])


def _router_workers(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/workers", timeout=5, trust_env=False)
    r.raise_for_status()
    return {w["url"]: w for w in r.json()}


def _router(fleet: Fleet, logs: str, *flags: str) -> Server:
    """``kvroute serve`` in front of both replicas, prompts as token IDs."""
    port = free_port()
    argv = kvroute_argv(
        "serve",
        *("--worker-urls", fleet.a.url, fleet.b.url),
        *("--port", str(port)),
        *flags,
        "--token-id-prompts",
    )
    return start_server("router", argv, port, timeout_s=60, log_dir=logs)


def test_router_stops_sending_a_prefix_where_it_was_evicted(fleet: Fleet) -> None:
    """``kvroute serve --kv-events``: p goes to X through the router, and to Y directly
    (the router never saw that). X then evicts p under other traffic. The router must
    now send p to Y, where vLLM serves it from cache."""
    a, b = fleet.a, fleet.b
    for s in (a, b):  # AllBlocksCleared: both streams fully known (B was stale)
        clear_cache(s)
    logs = tempfile.mkdtemp(prefix="kvroute-router-")
    router = _router(
        fleet,
        logs,
        "--policy",
        "cache_aware",
        *("--kv-events", fleet.specs[0]),
        *("--kv-events", fleet.specs[1]),
    )
    try:
        time.sleep(1.0)  # the router's SUB sockets reach both engines
        for s in (a, b):  # a batch each so both streams start (precise after the clear)
            clear_cache(s)
        try:
            wait_for(
                lambda: {w["mode"] for w in _router_workers(router.url).values()} == {"precise"},
                what="both workers precise in the router",
            )
        except AssertionError:
            print(_router_workers(router.url), router.log_tail())
            raise
        p = prompt(3, 600)
        r = post(router.url, p)
        x_url = r.headers["x-kvroute-worker"]
        x, y = (a, b) if x_url == a.url else (b, a)
        assert complete(y, p) == 0  # y gets p behind the router's back
        wait_for(lambda: fleet.held(y, p) == 576 and fleet.held(x, p) == 576, what="both hold p")
        # x evicts p under traffic that bypasses the router.
        for seed in range(20, 26):
            complete(x, prompt(seed))
        wait_for(lambda: fleet.held(x, p) == 0, what="x evicted p")
        time.sleep(0.5)  # the router's subscriber sees the same batches
        r = post(router.url, p)
        assert r.headers["x-kvroute-worker"] == y.url, _router_workers(router.url)
        assert cached(r) == 576, "y served p from its cache"
        workers = _router_workers(router.url)
        print(workers)
        assert workers[x.url]["mode"] == workers[y.url]["mode"] == "precise"
    finally:
        router.stop()
    shutil.rmtree(logs, ignore_errors=True)


def test_router_finds_each_replicas_events_itself(fleet: Fleet) -> None:
    """``kvroute serve --kv-events auto``: no endpoint given; each replica's
    ``GET /kv_event_sources`` says where it publishes, and both become precise."""
    a, b = fleet.a, fleet.b
    for s, spec in zip((a, b), fleet.specs, strict=True):
        config = vllm_config(httpx.get(s.url + "/kv_event_sources", timeout=10).content)
        assert config is not None, "vLLM tells where it publishes"
        source = source_for(s.url, config)
        assert source is not None
        wanted = parse_kv_events([spec])[0]
        assert (source.endpoint, source.replay_endpoint) == (
            wanted.endpoint,
            wanted.replay_endpoint,
        )
    logs = tempfile.mkdtemp(prefix="kvroute-router-")
    router = _router(fleet, logs, "--kv-events", "auto")
    try:
        time.sleep(1.0)  # the router's SUB sockets reach both engines
        for s in (a, b):  # a batch each so both streams start
            clear_cache(s)
        wait_for(
            lambda: {w["mode"] for w in _router_workers(router.url).values()} == {"precise"},
            what="both workers precise in the router",
        )
        p = prompt(5, 600)
        r = post(router.url, p)
        x = r.headers["x-kvroute-worker"]
        wait_for(lambda: fleet.held(a if x == a.url else b, p) == 576, what="x holds p")
        time.sleep(0.5)  # the router's subscriber sees the same batches
        again = post(router.url, p)
        assert again.headers["x-kvroute-worker"] == x and cached(again) == 576
    finally:
        router.stop()
    shutil.rmtree(logs, ignore_errors=True)
