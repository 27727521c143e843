"""Heartbeats against a real ``redis-server``: each router finds the live ones through
the registry (``kvroute:routers``), in one round trip while nobody joins, whatever else
the database holds (no ``SCAN``); a router that stops drops out, one that comes back or
whose clock is far off is still found."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from kvroute.fleet.shared import wire
from kvroute.fleet.shared.direct import Direct
from kvroute.fleet.shared.heartbeat import Heartbeat
from support import NEEDS_REDIS, RedisServer

pytestmark = NEEDS_REDIS

W = "http://127.0.0.1:1"


def calls(c: redis.Redis, name: str) -> int:
    return int(c.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


def beat_of(rid: str) -> Heartbeat:
    info = b'{"id": "%s", "url": "http://router-%s"}' % (rid.encode(), rid.encode())
    return Heartbeat(rid, info, 2000)


@pytest.mark.parametrize("protocol", [2, 3])
def test_routers_find_each_other_without_scanning_the_database(
    redis_server: RedisServer, protocol: int
) -> None:
    """Over RESP2 and RESP3 alike (``?protocol=3`` in the store's URL): the beat's
    replies are parsed by the store itself (``direct``), in either shape."""
    sync = redis_server.client()
    sync.mset({f"app:{i}": b"x" for i in range(5000)})  # a Redis shared with other data

    async def run() -> None:
        client = aioredis.from_url(redis_server.url, protocol=protocol)
        conn = await Direct.open(client, 2.0)
        a, b, c = beat_of("a"), beat_of("b"), beat_of("c")
        try:
            await b.beat(conn, {W: 2})
            await c.beat(conn, {W: 5})
            routers, load = await a.beat(conn, {W: 1})
            assert sorted(routers) == ["a", "b", "c"]
            assert routers["b"]["url"] == "http://router-b"
            assert load == {"b": {W: 2}, "c": {W: 5}}

            # Nobody joins: every beat is one transaction, and nothing scans.
            execs, hgetalls = calls(sync, "exec"), calls(sync, "hgetall")
            for n in range(5):
                await b.beat(conn, {W: n})
                routers, load = await a.beat(conn, {W: 1})
            assert load["b"] == {W: 4}
            assert calls(sync, "exec") - execs == 10
            assert calls(sync, "hgetall") - hgetalls == 10 * 2  # the two others, each beat
            assert calls(sync, "scan") == 0

            # One stops (its hash goes, as StateStore.stop deletes it): no longer live.
            await client.delete(wire.ROUTER + "c")
            routers, load = await a.beat(conn, {})
            assert sorted(routers) == ["a", "b"] and "c" not in load
            hgetalls = calls(sync, "hgetall")
            await a.beat(conn, {})
            assert calls(sync, "hgetall") - hgetalls == 1  # the dead one is not read again

            # It comes back (a partition healed): its new stamp gets it read again.
            await c.beat(conn, {W: 7})
            routers, load = await a.beat(conn, {})
            assert sorted(routers) == ["a", "b", "c"] and load["c"] == {W: 7}
        finally:
            await conn.close()
            await client.aclose()

    asyncio.run(run())


def test_a_router_whose_clock_is_hours_off_is_still_found(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_server.url)
        conn = await Direct.open(client, 2.0)
        a, b = beat_of("a"), beat_of("b")
        real = wire.now_ms
        try:
            monkeypatch.setattr(wire, "now_ms", lambda: real() - 3 * 3_600_000)
            await b.beat(conn, {W: 3})  # stamps three hours in the past
            monkeypatch.setattr(wire, "now_ms", real)
            for _ in range(3):  # a trims b's stamp as over an hour old every time
                monkeypatch.setattr(wire, "now_ms", lambda: real() - 3 * 3_600_000)
                await b.beat(conn, {W: 3})
                monkeypatch.setattr(wire, "now_ms", real)
                routers, load = await a.beat(conn, {})
                assert sorted(routers) == ["a", "b"] and load == {"b": {W: 3}}
        finally:
            await conn.close()
            await client.aclose()

    asyncio.run(run())


def test_a_router_followed_by_its_stream_is_read_though_not_listed(
    redis_server: RedisServer,
) -> None:
    """A router that never stamps the registry (an earlier kvroute, found by its stream
    at connection) still counts while its hash lives."""
    sync = redis_server.client()
    sync.hset(wire.ROUTER + "old", mapping={"info": b'{"id": "old"}', wire.LOAD_FIELD + W: 4})
    sync.pexpire(wire.ROUTER + "old", 2000)

    async def run() -> None:
        client = aioredis.from_url(redis_server.url)
        conn = await Direct.open(client, 2.0)
        a = beat_of("a")
        try:
            routers, load = await a.beat(conn, {}, also=["old"])
            assert sorted(routers) == ["a", "old"] and load == {"old": {W: 4}}
            routers, load = await a.beat(conn, {})  # live at the last beat: read again
            assert load == {"old": {W: 4}}
            sync.delete(wire.ROUTER + "old")
            routers, load = await a.beat(conn, {})
            assert sorted(routers) == ["a"] and load == {}
        finally:
            await conn.close()
            await client.aclose()

    asyncio.run(run())
