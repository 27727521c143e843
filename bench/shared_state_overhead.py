"""CPU cost per request of sharing routing state through Redis (``--state-store``).

1. Request path, in process, interleaved in one run: ``longest_match`` + ``insert`` on
   the token-keyed ``PrefixIndex`` (no store) against the same on a ``DigestIndex``
   whose inserts are queued for publishing (``StateStore.publish_insert``). The
   difference is what the store adds to routing a request.
2. Background, with a real ``redis-server`` on loopback: one store publishes N decisions
   (pipelined ``XADD``) alone, then again with another store in the same process reading
   and applying them (``XREAD``, ``insert_digests``); the process's CPU time over N is
   the publishing cost, then publish + apply (Redis's own CPU is another process's).
3. Queued prefill (``fleet.shared.loads``), with the same redis-server: requests one
   at a time as a router sees them (decision, work reserved, first byte, end, the event
   loop running the store's tasks in between): without a store, with decisions shared,
   and with the work model's queued prefill shared too; the process's CPU per request,
   the three interleaved in one run.

Usage:
    python bench/shared_state_overhead.py --tokens 2000,8000 --n 2000
"""

from __future__ import annotations

import argparse
import array
import asyncio
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvroute._native import PrefixIndex
from kvroute.config import Settings, StoreURL
from kvroute.fleet.registry import Registry
from kvroute.fleet.shared import DigestIndex, StateStore
from kvroute.routing.load import LoadModel

WORKERS = [f"http://10.0.0.{i}:8000" for i in range(8)]


def prompts(n: int, tokens: int, groups: int = 64) -> list[array.array[int]]:
    rng = np.random.default_rng(0)
    heads = [rng.integers(0, 150_000, tokens - 64).astype(np.uint32) for _ in range(groups)]
    return [
        array.array(
            "I",
            np.concatenate([heads[i % groups], rng.integers(0, 150_000, 64)])
            .astype(np.uint32)
            .tobytes(),
        )
        for i in range(n)
    ]


def make_store(url: str, index: DigestIndex | None, work: LoadModel | None = None) -> StateStore:
    registry = Registry(Settings(worker_urls=WORKERS).validate())
    for w in WORKERS:
        registry.add(w)
    return StateStore(
        StoreURL(url), registry, index, router_url="http://x:1", version="bench", work=work
    )


async def one_at_a_time(url: str, tokens: int, n: int, *, mode: str) -> float:
    """CPU µs per request routed one at a time, publishing included. ``mode``: ``none``
    (no store: the token-keyed index), ``decisions``, ``prefill`` (decisions and queued
    prefill shared)."""
    ps = prompts(n, tokens)
    model = LoadModel()
    for w in WORKERS:
        model.add_worker(w)
    index: DigestIndex | PrefixIndex = PrefixIndex(None)
    store = None
    deadline = time.monotonic() + 30
    if mode != "none":
        index = DigestIndex(None)
        store = make_store(url, index, model if mode == "prefill" else None)
        store._buf_len = n + 1
        await store.start()
        while not store.connected and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    t0 = time.process_time_ns()
    for i, p in enumerate(ps):
        w = WORKERS[i % 8]
        index.longest_match(p)
        index.insert(w, p)
        ticket = model.reserve(w, len(p), 100, 0.0)
        await asyncio.sleep(0)  # the store's tasks run between requests
        ticket.first_byte(0.1)
        await asyncio.sleep(0)
        ticket.end(0.2)
        await asyncio.sleep(0)
    while store is not None and time.monotonic() < deadline + 120:
        if store.counters.published >= n and not (store.shared_load and store.shared_load.dirty):
            break
        await asyncio.sleep(0.01)
    spent = time.process_time_ns() - t0
    if store is not None:
        await store.stop()
    return spent / n / 1000


def request_path(tokens: int, n: int, rounds: int = 5) -> tuple[float, float]:
    ps = prompts(n, tokens)
    plain_ns = shared_ns = 0
    for _ in range(rounds):  # interleaved: the machine's noise hits both alike
        plain = PrefixIndex(None)
        t0 = time.process_time_ns()
        for i, p in enumerate(ps):
            plain.longest_match(p)
            plain.insert(WORKERS[i % 8], p)
        plain_ns += time.process_time_ns() - t0
        index = DigestIndex(None)
        store = make_store("redis://127.0.0.1:1/0", index)  # never started: queue only
        store._buf_len = n + 1
        t0 = time.process_time_ns()
        for i, p in enumerate(ps):
            index.longest_match(p)
            index.insert(WORKERS[i % 8], p)
        shared_ns += time.process_time_ns() - t0
    return plain_ns / rounds / n / 1000, shared_ns / rounds / n / 1000


async def background(url: str, tokens: int, n: int, *, apply: bool) -> float:
    """CPU µs per decision: publishing alone, or publishing and applying (``apply``)."""
    ps = prompts(n, tokens)
    a_index, b_index = DigestIndex(None), DigestIndex(None)
    a = make_store(url, a_index)
    a._buf_len = n + 1
    stores = [a]
    if apply:
        stores.append(make_store(url, b_index))
    for s in stores:
        await s.start()
    deadline = time.monotonic() + 30
    while not all(s.connected for s in stores) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    for i, p in enumerate(ps):  # decided up front: only publish/apply is timed
        a_index.insert(WORKERS[i % 8], p)

    def done() -> bool:
        if apply:
            return stores[-1].counters.applied["insert"] >= n
        return a.counters.published >= n

    t0 = time.process_time_ns()
    deadline = time.monotonic() + 120
    while not done() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    spent = time.process_time_ns() - t0
    assert done(), [s.counters for s in stores]
    for s in stores:
        await s.stop()
    return spent / n / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="2000,8000")
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    print("| prompt tokens | match+insert, no store (µs) | with store (µs) | added (µs) |")
    print("|---|---|---|---|")
    for t in sizes:
        plain, shared = request_path(t, args.n)
        print(f"| {t:,} | {plain:.1f} | {shared:.1f} | {shared - plain:+.1f} |", flush=True)
    server = shutil.which("redis-server")
    if server is None:
        print("\nredis-server not installed: background cost not measured")
        return 0
    import tempfile

    from support import RedisServer

    with tempfile.TemporaryDirectory() as d:
        redis = RedisServer(Path(d))
        try:
            print("\n| prompt tokens | publish (µs/request) | publish + apply (µs/request) |")
            print("|---|---|---|")
            for t in sizes:
                row = []
                for apply in (False, True):
                    with redis.client() as c:
                        c.flushdb()  # a fresh stream: the reader must not replay a past run
                    row.append(asyncio.run(background(redis.url, t, args.n, apply=apply)))
                print(f"| {t:,} | {row[0]:.1f} | {row[1]:.1f} |", flush=True)
            print(
                "\n| prompt tokens | no store (µs/request) | decisions shared "
                "| decisions + queued prefill |"
            )
            print("|---|---|---|---|")
            modes = ("none", "decisions", "prefill")
            for t in sizes:
                sums = dict.fromkeys(modes, 0.0)
                for _ in range(3):  # interleaved rounds
                    for mode in modes:
                        with redis.client() as c:
                            c.flushdb()
                        coro = one_at_a_time(redis.url, t, args.n, mode=mode)
                        sums[mode] += asyncio.run(coro) / 3
                base = sums["none"]
                cells = " | ".join(f"{sums[m]:.1f} ({sums[m] - base:+.1f})" for m in modes[1:])
                print(f"| {t:,} | {base:.1f} | {cells} |", flush=True)
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
