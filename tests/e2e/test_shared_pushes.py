"""The other routers' entries pushed (Redis pub/sub) once their streams are read to the
end (``kvroute.fleet.shared.pushes``), against a real ``redis-server``: each entry is
applied once, whether it came by ``XREAD`` or pushed; a router whose Redis refuses
``PUBLISH`` (as an earlier version, which does not publish) stays read by ``XREAD``; a
push that never came sends the reader back to the stream, and nothing is lost."""

from __future__ import annotations

import array
import asyncio
import logging

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

import kvroute.fleet.shared.store as store_module
from kvroute.config import Settings, StoreURL
from kvroute.fleet.registry import Registry
from kvroute.fleet.shared import DigestIndex, StateStore, wire
from kvroute.fleet.shared.direct import Direct
from kvroute.fleet.shared.heartbeat import Heartbeat
from support import NEEDS_REDIS, RedisServer, until

pytestmark = NEEDS_REDIS

W = "http://127.0.0.1:1"


def prompt(seed: int, n: int = 64) -> array.array[int]:
    rng = np.random.default_rng(seed)
    return array.array("I", rng.integers(0, 150_000, n).astype(np.uint32).tobytes())


def xreads(c: redis.Redis) -> int:
    return int(c.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))


def make(url: str) -> tuple[StateStore, DigestIndex]:
    registry = Registry(Settings(worker_urls=[W]).validate())
    registry.add(W)
    index = DigestIndex()
    store = StateStore(
        StoreURL(url), registry, index, router_url="http://r:1", version="t", heartbeat_s=0.2
    )
    return store, index


def applied(store: StateStore) -> int:
    return store.counters.applied["insert"]


async def test_a_peers_entries_come_pushed_once_its_stream_is_read_to_the_end(
    redis_server: RedisServer,
) -> None:
    a, a_index = make(redis_server.url)
    b, b_index = make(redis_server.url)
    c = redis_server.client()
    await a.start()
    await b.start()
    try:
        assert await until(lambda: a.connected and b.connected, within=10)
        for s in range(5):  # before B follows A: read by XREAD (replayed)
            a_index.insert(W, prompt(s))
            await asyncio.sleep(0)
        key = a.streams.own
        assert await until(lambda: key in b.streams.live, within=10)
        assert await until(lambda: applied(b) == 5, within=5)
        before, pushed = xreads(c), b.pushes.received
        for s in range(5, 55):  # one write per loop turn: fifty pushes
            a_index.insert(W, prompt(s))
            await asyncio.sleep(0.002)
        assert await until(lambda: applied(b) == 55, within=10)
        assert b.pushes.received - pushed == 50 and b.pushes.gaps == 0
        # No XREAD per entry: the blocked one over the shared stream may end once.
        assert xreads(c) - before <= 2
        assert all(b_index.match(prompt(s)) == {W: 64} for s in range(55))
        assert b.streams.last[key] == c.xrevrange(key, count=1)[0][0]
        await asyncio.sleep(0.5)
        assert applied(b) == 55  # and nothing twice
    finally:
        c.close()
        await a.stop()
        await b.stop()


async def test_entries_written_while_the_reader_subscribes_are_applied_once_each(
    redis_server: RedisServer,
) -> None:
    """A writes without pause while B starts, replays A's stream, subscribes and goes
    live: every decision is applied exactly once, across the XREAD and the pushes."""
    a, a_index = make(redis_server.url)
    b, _ = make(redis_server.url)
    await a.start()
    try:
        assert await until(lambda: a.connected, within=10)

        async def write(n: int) -> None:
            for s in range(n):
                a_index.insert(W, prompt(s))
                await asyncio.sleep(0.003)

        writing = asyncio.create_task(write(600))
        await asyncio.sleep(0.2)
        await b.start()
        await writing
        assert a.streams.own in b.streams.live  # live before the writing ended
        assert await until(lambda: applied(b) == 600, within=10)
        await asyncio.sleep(0.5)
        assert applied(b) == 600
        assert b.pushes.received > 0 and b.pushes.gaps == 0
    finally:
        await a.stop()
        await b.stop()


async def test_a_push_that_never_came_sends_the_reader_back_to_the_stream(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "kvroute.fleet.shared")
    a, a_index = make(redis_server.url)
    b, b_index = make(redis_server.url)
    await a.start()
    await b.start()
    try:
        key = a.streams.own
        assert await until(lambda: key in b.streams.live, within=10)
        a_index.insert(W, prompt(0))
        assert await until(lambda: applied(b) == 1, within=5)
        # One write whose PUBLISH is lost (as when a write is cut between the two).
        a._commands.publish = False
        a_index.insert(W, prompt(1))
        await asyncio.sleep(0.05)
        a._commands.publish = True
        for s in range(2, 6):
            a_index.insert(W, prompt(s))
            await asyncio.sleep(0.01)
        assert await until(lambda: applied(b) == 6, within=10)
        assert b.pushes.gaps == 1 and "push from router" in caplog.text
        assert b_index.match(prompt(1)) == {W: 64}
        assert await until(lambda: key in b.streams.live, within=10)  # live again
        a_index.insert(W, prompt(6))
        assert await until(lambda: applied(b) == 7, within=5)
        await asyncio.sleep(0.5)
        assert applied(b) == 7
    finally:
        await a.stop()
        await b.stop()


async def test_a_router_whose_redis_refuses_publish_is_read_by_xread(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL without PUBLISH for one router: it says so once and does not claim to
    publish; the other reads its stream by XREAD, every entry."""
    c = redis_server.client()
    c.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "&*", "+@all", "-publish")
    a, a_index = make(f"redis://kv:pw@127.0.0.1:{redis_server.port}/0")
    b, _ = make(redis_server.url)
    await a.start()
    await b.start()
    try:
        assert await until(lambda: a.connected and b.connected, within=10)
        assert await until(lambda: a.id in b.routers, within=5)
        assert "pushes" not in b.routers[a.id] and a._commands.publish is False
        for s in range(20):
            a_index.insert(W, prompt(s))
            await asyncio.sleep(0.002)
        assert await until(lambda: applied(b) == 20, within=10)
        assert a.streams.own not in b.streams.live and b.pushes.received == 0
        # The other way round, pushed (once an XREAD sent after the subscription ends:
        # B writes nothing, so at the end of a 3 s block).
        assert await until(lambda: b.streams.own in a.streams.live, within=10)
        assert caplog.text.count("refused PUBLISH") == 1 and "pw@" not in caplog.text
    finally:
        c.close()
        await a.stop()
        await b.stop()


async def test_a_router_found_live_again_by_the_heartbeat_is_read_at_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router known only from the registry (it never greeted, or this router stopped
    reading it while its heartbeat lapsed) is followed at this router's next heartbeat;
    the blocked XREAD, which holds only the quiet shared stream, is ended so that its
    stream is read at once, not when the block runs out (20 s here)."""
    monkeypatch.setattr(store_module, "READ_BLOCK_MS", 20_000)
    a, a_index = make(redis_server.url)
    c = redis_server.client()
    await a.start()
    client = aioredis.from_url(redis_server.url)
    conn = await Direct.open(client, 2.0)
    try:
        assert await until(lambda: a.connected and a.pushes.unblock is not None, within=10)
        await asyncio.sleep(0.5)  # a's XREAD blocked on the shared stream alone
        theirs = wire.stream_of(b"quiet")
        c.xadd(theirs, wire.insert_entry(b"quiet", [(W, a_index.keys(prompt(3)).tobytes())]))
        info = b'{"id": "quiet", "url": "http://quiet:1"}'
        await Heartbeat("quiet", info, 20_000).beat(conn, {})  # listed, never greeted
        assert await until(lambda: a_index.match(prompt(3)) == {W: 64}, within=10)
        assert "quiet" in a.routers
    finally:
        await conn.close()
        await client.aclose()
        c.close()
        await a.stop()
