"""CPU cost per request of sharing routing state through Redis (``--state-store``).

1. Request path, in process, interleaved in one run: ``longest_match`` + ``insert`` on
   the token-keyed ``PrefixIndex`` (no store) against the same on a ``DigestIndex``
   whose inserts are queued for publishing (``StateStore.publish_insert``). The
   difference is what the store adds to routing a request.
2. Background, with a real ``redis-server`` on loopback: one store publishes N decisions
   queued up front (``XADD`` on a connection Redis does not answer) alone, then again
   with another store in the same process reading and applying them (``XREAD``,
   ``insert_digests``); the process's CPU time over N is the publishing cost, then
   publish + apply (Redis's own CPU is another process's).
3. Per request as a router sees it, with the same redis-server: each request's decision
   (match, insert, work reserved), then its first byte, then its end, ``--concurrency``
   requests changing in one event-loop turn (1: one at a time, every change published
   by itself; 16: as under load) and the loop idling in between (``--gap-ms``).
   Without a store (token index; digest index), with the store as it publishes now,
   the same with its reading task idle (publishing alone), and with ``--before-store``
   an earlier version of the store (the same requests, same process: a before/after
   from one run); per reply parser (``--parser``: redis-py's pure-Python one or
   hiredis). All interleaved in one run (``--rounds``) so the shared machine's noise
   hits them alike. uvloop by default, as ``kvroute serve`` runs.

Usage:
    python bench/shared_state_overhead.py --tokens 2000,8000 --n 1000
    python bench/shared_state_overhead.py --skip-background --concurrency 1,16 --n 1000
"""

from __future__ import annotations

import argparse
import array
import asyncio
import itertools
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.utils import HIREDIS_AVAILABLE

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


KINDS: dict[str, type] = {}  # filled below: mode -> store class
PARSERS: dict[str, Any] = {"python": _AsyncRESP2Parser}
if HIREDIS_AVAILABLE:
    PARSERS["hiredis"] = _AsyncHiredisParser


class Unread(StateStore):
    """Publishing only: the reading task idles (what reading back the store's own
    entries costs is the difference to ``StateStore``)."""

    async def _read_loop(self, client: Any) -> None:
        await asyncio.Event().wait()


KINDS.update(store=StateStore, unread=Unread)


def load_before(spec: str) -> None:
    """``--before-store``: an earlier store, run as mode ``before`` in the same process,
    for a before/after in one run. Either ``git:REF``, the whole ``fleet/shared``
    package at that commit (imported under another name, beside today's), or a path to
    an earlier ``fleet/shared/store.py`` alone (e.g. ``git show
    a7687a3:python/kvroute/fleet/shared/store.py``), run against today's other modules."""
    import importlib
    import importlib.util
    import subprocess
    import tempfile

    if spec.startswith("git:"):
        ref, root = spec[4:], Path(__file__).resolve().parents[1]
        folder = "python/kvroute/fleet/shared/"
        names = subprocess.run(
            ["git", "ls-tree", "--name-only", ref, folder],
            cwd=root,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        where = Path(tempfile.mkdtemp()) / "kvroute_shared_before"
        where.mkdir()
        for name in names:
            text = subprocess.run(
                ["git", "show", f"{ref}:{name}"],
                cwd=root,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            where.joinpath(Path(name).name).write_text(
                text.replace("kvroute.fleet.shared", "kvroute_shared_before")
            )
        sys.path.insert(0, str(where.parent))
        KINDS["before"] = importlib.import_module("kvroute_shared_before.store").StateStore
        return
    loaded = importlib.util.spec_from_file_location("kvroute.fleet.shared._before", spec)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    KINDS["before"] = module.StateStore


async def stop(store: StateStore) -> None:
    """``store.stop()``, cancelling the store's tasks again while it hangs: a store
    before ``363f2ec`` (``--before-store``) could miss a cancellation that landed while
    redis-py read a reply, and go on."""
    stopping = asyncio.ensure_future(store.stop())
    for _ in range(20):
        done, _ = await asyncio.wait({stopping}, timeout=0.5)
        if done:
            return
        for task in asyncio.all_tasks():  # the store's (this process runs nothing else)
            if task is not stopping and task is not asyncio.current_task():
                task.cancel()
    raise RuntimeError("the store did not stop")


def make_store(
    url: str, index: DigestIndex | None, work: LoadModel | None = None, cls: type = StateStore
) -> StateStore:
    registry = Registry(Settings(worker_urls=WORKERS).validate())
    for w in WORKERS:
        registry.add(w)
    return cls(  # type: ignore[no-any-return]
        StoreURL(url), registry, index, router_url="http://x:1", version="bench", work=work
    )


async def requests(
    url: str,
    tokens: int,
    n: int,
    *,
    mode: str,
    concurrency: int,
    parser: str = "hiredis",
    gap: float = 0.0005,
) -> tuple[float, float]:
    """CPU µs per request, and of it in the kernel (system calls; on loopback also the
    receiving side's TCP work and Redis's wake-up, which the sender pays), publishing
    included, as a router sees requests: each one's
    decision (match, insert, work reserved), then its first byte, then its end;
    ``concurrency`` requests change in one event-loop turn (1: one at a time, every
    change published alone; more: as under load, changes of many requests together).
    Between turns the loop sleeps ``gap`` seconds, then until the store has written
    what was queued, so nothing coalesces by accident (uvloop's timers count whole
    milliseconds: a gap under 1 ms, the default 0.5, returns at the loop's next turn,
    while Redis may still be busy with the last write; ``--gap-ms 1`` or more leaves
    Redis idle between writes, as requests seconds apart do). ``mode``: ``token`` (no store:
    the token-keyed index), ``digest`` (no store: the digest index a store uses),
    ``store`` (decisions and load shared through Redis), ``unread`` (the same, the
    reading task idle: publishing alone), ``before`` (``--before-store``)."""
    ps = prompts(n, tokens)
    model = LoadModel()
    model.clock = time.monotonic  # as serve's: requests' ends are timed on it
    for w in WORKERS:
        model.add_worker(w)
    index: DigestIndex | PrefixIndex = PrefixIndex(None) if mode == "token" else DigestIndex(None)
    store = None
    deadline = time.monotonic() + 30
    if mode in KINDS:
        assert isinstance(index, DigestIndex)
        store = make_store(url, index, model, KINDS[mode])
        store._buf_len = n + 1
        await store.start()  # connects in a task: the parser is set before it runs
        assert store._client is not None
        store._client.connection_pool.connection_kwargs["parser_class"] = PARSERS[parser]
        while not store.connected and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    async def idle() -> None:
        # Decisions go out at the end of their loop turn. A lone load change waits
        # for company (``publishing.LOAD_LINGER_S``): a later decision, a change made
        # the linger after it, or the heartbeat, as in ``serve``; not waited for here
        # (polling for it counted a busy wait per change).
        await asyncio.sleep(gap)
        while store is not None and store._buf:  # noqa: ASYNC110
            await asyncio.sleep(0.0005)

    t0 = time.process_time_ns()
    sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    for start in range(0, n, concurrency):
        tickets = []
        for i in range(start, min(start + concurrency, n)):
            p, w = ps[i], WORKERS[i % 8]
            index.longest_match(p)
            index.insert(w, p)
            tickets.append(model.reserve(w, len(p), 100, time.monotonic()))
        await idle()
        for t in tickets:
            t.first_byte(time.monotonic())  # decoding: its expected end is published
        await idle()
        for t in tickets:
            t.end(time.monotonic())
        await idle()
    if store is not None:  # the last lingering change's write (the heartbeat's), inside the span
        await asyncio.sleep(store.heartbeat_s + gap)
    spent = time.process_time_ns() - t0
    kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0
    if store is not None:
        assert store.counters.published == n, store.counters
        shared = getattr(store, "shared_load", None)
        assert shared is None or not shared.dirty, "a load change never written"
        await stop(store)
    return spent / n / 1000, kernel / n * 1e6


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
        await stop(s)
    return spent / n / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="2000,8000")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument(
        "--concurrency",
        default="1,16",
        help="requests whose changes fall in one event-loop turn (1: one at a time)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds to average")
    ap.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="serve runs uvloop"
    )
    ap.add_argument(
        "--parser",
        default="hiredis,python",
        help="redis-py's reply parser(s) to measure: hiredis (when installed), python",
    )
    ap.add_argument(
        "--before-store",
        default="",
        help="an earlier store to measure in the same run (column 'before'): git:REF (the "
        "fleet/shared package at REF) or the path of an earlier fleet/shared/store.py",
    )
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.5,
        help="sleep between a request's changes in the third table (under 1 ms: none with "
        "uvloop; 1 or more: Redis idles between writes)",
    )
    ap.add_argument("--skip-background", action="store_true", help="only the third table")
    ap.add_argument(
        "--transports",
        default="tcp",
        help="how the third table's stores reach Redis: tcp (loopback), unix (its Unix "
        "socket, unix://), or both, comma-separated",
    )
    args = ap.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    run = uvloop.run if args.loop == "uvloop" else asyncio.run
    sizes = [int(t) for t in args.tokens.split(",")]
    if not args.skip_background:
        print("| prompt tokens | match+insert, no store (µs) | with store (µs) | added (µs) |")
        print("|---|---|---|---|")
    for t in sizes if not args.skip_background else ():
        plain, shared = request_path(t, args.n)
        print(f"| {t:,} | {plain:.1f} | {shared:.1f} | {shared - plain:+.1f} |", flush=True)
    server = shutil.which("redis-server")
    if server is None:
        print("\nredis-server not installed: background cost not measured")
        return 0
    import tempfile

    from support import RedisServer

    with tempfile.TemporaryDirectory() as d:
        transports = args.transports.split(",")
        redis = RedisServer(Path(d), unix_socket="unix" in transports)
        try:
            if not args.skip_background:
                print("\n| prompt tokens | publish (µs/request) | publish + apply (µs/request) |")
                print("|---|---|---|")
            for t in sizes if not args.skip_background else ():
                row = []
                for apply in (False, True):
                    with redis.client() as c:
                        c.flushdb()  # a fresh stream: the reader must not replay a past run
                    row.append(run(background(redis.url, t, args.n, apply=apply)))
                print(f"| {t:,} | {row[0]:.1f} | {row[1]:.1f} |", flush=True)
            print(
                "\n| prompt tokens | requests per loop turn | reply parser | transport "
                "| no store, token index (µs/request) | no store, digest index "
                "| store before | store | store, reading idle "
                "| store − digest: before / now | publishing alone (reading idle − digest) "
                "| of it in the kernel |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            if args.before_store:
                load_before(args.before_store)
            modes = tuple(
                m
                for m in ("token", "digest", "before", "store", "unread")
                if m in KINDS or m in ("token", "digest")
            )
            for t, c, parser in itertools.product(sizes, concurrency, args.parser.split(",")):
                rows = [(tr, m) for tr in transports for m in modes]
                sums = dict.fromkeys(rows, 0.0)
                kernel = dict.fromkeys(rows, 0.0)
                for _ in range(args.rounds):  # interleaved rounds: transports and modes
                    for transport, mode in rows:
                        url = redis.unix_url if transport == "unix" else redis.url
                        with redis.client() as cl:
                            cl.flushdb()
                        coro = requests(
                            url,
                            t,
                            args.n,
                            mode=mode,
                            concurrency=c,
                            parser=parser,
                            gap=args.gap_ms / 1000,
                        )
                        cpu, sys_us = run(coro)
                        sums[transport, mode] += cpu / args.rounds
                        kernel[transport, mode] += sys_us / args.rounds
                for transport in transports:
                    tok, dig, sto, unr = (
                        sums[transport, m] for m in ("token", "digest", "store", "unread")
                    )
                    rep = sums.get((transport, "before"), float("nan"))
                    k_pub = kernel[transport, "unread"] - kernel[transport, "digest"]
                    print(
                        f"| {t:,} | {c} | {parser} | {transport} | {tok:.1f} | {dig:.1f} "
                        f"| {rep:.1f} | {sto:.1f} | {unr:.1f} "
                        f"| {rep - dig:+.1f} / {sto - dig:+.1f} | {unr - dig:+.1f} "
                        f"| {k_pub:+.1f} |",
                        flush=True,
                    )
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
