"""How a router publishes to the shared store, against a real ``redis-server``: the
writes go out on a connection Redis does not answer (``CLIENT REPLY OFF``), every
change made in one event-loop turn rides in one entry of the router's own stream, a
decision goes out at once with the load changes waiting, load changes alone made in
separate turns wait for a later change or the heartbeat and ride together, and the
router does not read its own entries back."""

from __future__ import annotations

import array
import asyncio
from pathlib import Path

import numpy as np
import pytest
import redis

from kvroute.config import Settings, StoreURL
from kvroute.fleet.registry import Registry
from kvroute.fleet.shared import DigestIndex, StateStore, publishing, wire
from kvroute.routing.load import LoadModel
from support import NEEDS_REDIS, RedisServer, cluster_flags, until

pytestmark = NEEDS_REDIS

W = "http://127.0.0.1:1"


def prompt(seed: int, n: int = 64) -> array.array[int]:
    rng = np.random.default_rng(seed)
    return array.array("I", rng.integers(0, 150_000, n).astype(np.uint32).tobytes())


def entries(c: redis.Redis, store: StateStore) -> list[dict[bytes, bytes]]:
    """What ``store`` published to its own stream."""
    return [f for _, f in c.xrange(store.streams.own) if f[b"k"] in (wire.INSERT, wire.LOAD)]


def commands(c: redis.Redis, name: str) -> int:
    return int(c.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


async def test_changes_of_one_loop_turn_ride_in_one_unanswered_write(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry(Settings(worker_urls=[W]).validate())
    registry.add(W)
    index, model = DigestIndex(), LoadModel()
    model.add_worker(W)
    store = StateStore(
        StoreURL(redis_server.url),
        registry,
        index,
        router_url="http://r:1",
        version="t",
        work=model,
        heartbeat_s=30.0,  # no beat writes the lingering changes during the test
    )
    await store.start()
    c = redis_server.client()
    try:
        assert await until(lambda: store.connected, within=10)
        await asyncio.sleep(1.2)  # start-up load published, read set settled
        before = len(entries(c, store))
        assert commands(c, "client|reply") == 1  # the publishing connection asked for no replies

        # One turn: three decisions and their reservations -> one entry.
        tickets = []
        for s in range(3):
            index.insert(W, prompt(s))
            tickets.append(model.reserve(W, 64, 10, 0.0))
        assert await until(lambda: len(entries(c, store)) == before + 1, within=5)
        one = entries(c, store)[-1]
        assert one[b"k"] == wire.INSERT and len(list(wire.unpack_inserts(one[b"b"]))) == 3
        assert b"p" in one  # the load change rides with the decisions

        # Load changes alone (first bytes) in separate turns: no write of their own and
        # no timer (the heartbeat is 30 s away); the first change made LOAD_LINGER_S
        # after the oldest takes them all along in one entry. The store's blocked XREAD
        # does not wake for them (not its stream).
        monkeypatch.setattr(publishing, "LOAD_LINGER_S", 0.3)
        xreads = commands(c, "xread")
        tickets[0].first_byte(0.1)
        await asyncio.sleep(0)
        tickets[1].first_byte(0.1)
        await asyncio.sleep(0.6)
        assert len(entries(c, store)) == before + 1  # still waiting for company
        assert store.shared_load is not None and store.shared_load.dirty
        tickets[2].first_byte(0.1)
        assert await until(lambda: len(entries(c, store)) == before + 2, within=5)
        last = entries(c, store)[-1]
        assert last[b"k"] == wire.LOAD and not store.shared_load.dirty
        assert store.counters.published == 3  # decisions
        assert commands(c, "xread") - xreads <= 1  # a 3 s block may end meanwhile

        # A decision takes the waiting load along.
        monkeypatch.setattr(publishing, "LOAD_LINGER_S", 30.0)
        tickets[0].end(0.2)
        await asyncio.sleep(0.5)
        assert len(entries(c, store)) == before + 2  # the end waits
        index.insert(W, prompt(9))
        assert await until(lambda: len(entries(c, store)) == before + 3, within=5)
        both = entries(c, store)[-1]
        assert both[b"k"] == wire.INSERT and b"p" in both
    finally:
        c.close()
        await store.stop()


async def test_a_lone_load_change_goes_out_with_the_next_heartbeat(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No decision and no later change: the heartbeat writes the change, so the other
    routers learn of a request's end within a heartbeat even when traffic stops."""
    monkeypatch.setattr(publishing, "LOAD_LINGER_S", 30.0)  # only the heartbeat can
    registry = Registry(Settings(worker_urls=[W]).validate())
    registry.add(W)
    model = LoadModel()
    model.add_worker(W)
    store = StateStore(
        StoreURL(redis_server.url),
        registry,
        DigestIndex(),
        router_url="http://r:1",
        version="t",
        work=model,
        heartbeat_s=0.3,
    )
    await store.start()
    c = redis_server.client()
    try:
        assert await until(lambda: store.connected, within=10)
        await asyncio.sleep(0.8)  # start-up load published
        assert store.shared_load is not None
        assert await until(lambda: not store.shared_load.dirty, within=5)
        before = len(entries(c, store))
        ticket = model.reserve(W, 64, 10, 0.0)  # a reservation alone: a load change
        assert store.shared_load.dirty
        assert await until(lambda: len(entries(c, store)) == before + 1, within=5)
        assert entries(c, store)[-1][b"k"] == wire.LOAD and not store.shared_load.dirty
        ticket.end(0.1)
        assert await until(lambda: len(entries(c, store)) == before + 2, within=5)
    finally:
        c.close()
        await store.stop()


async def test_a_redis_that_refuses_client_reply_gets_answered_writes_and_sharing_goes_on(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL without the CLIENT command (as some managed services have): publishing
    goes on with Redis's replies read and dropped, said once in the log; the session
    stays up (no reconnect loop) and the password never reaches the log."""
    c = redis_server.client()
    c.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "&*", "+@all", "-client")
    registry = Registry(Settings(worker_urls=[W]).validate())
    registry.add(W)
    index = DigestIndex()
    url = f"redis://kv:pw@127.0.0.1:{redis_server.port}/0"
    store = StateStore(StoreURL(url), registry, index, router_url="http://r:1", version="t")
    await store.start()
    try:
        assert await until(lambda: store.connected and store.answered, within=10)
        for s in range(40):  # one decision per loop turn: forty answered writes
            index.insert(W, prompt(s))
            await asyncio.sleep(0)
        assert await until(lambda: len(entries(c, store)) >= 40, within=10)
        assert index.match(prompt(1)) == {W: 64}
        await asyncio.sleep(0.5)  # the replies read meanwhile; nothing refused
        assert store.connected and store.counters.errors == 0
        assert store.counters.dropped == 0
        assert caplog.text.count("refused CLIENT REPLY OFF") == 1
        assert "NOPERM" in caplog.text or "no permissions" in caplog.text
        assert "pw@" not in caplog.text and ">pw" not in caplog.text
    finally:
        c.close()
        await store.stop()


async def test_a_redis_cluster_is_refused_once_and_routing_stays_local(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis in cluster mode cannot hold the store (its transactions and reads span
    hash slots): the store says so once, keeps retrying with backoff, and the router
    routes on its own index."""
    server = RedisServer(tmp_path, extra=cluster_flags(tmp_path))
    try:
        registry = Registry(Settings(worker_urls=[W]).validate())
        registry.add(W)
        index = DigestIndex()
        url = StoreURL(server.url)
        store = StateStore(url, registry, index, router_url="http://r:1", version="t")
        caplog.set_level("ERROR", "kvroute.fleet.shared")
        await store.start()
        try:
            assert await until(lambda: store.counters.errors >= 3, within=10)
            assert not store.connected
            said = [r.getMessage() for r in caplog.records if "Redis Cluster" in r.getMessage()]
            assert len(said) == 1 and "routing on local state" in said[0]
            index.insert(W, prompt(1))
            assert index.match(prompt(1)) == {W: 64}
            with server.client() as c:
                assert c.dbsize() == 0  # nothing was written there
        finally:
            await store.stop()
    finally:
        server.stop()  # also when the store fails to start


async def test_a_router_that_joins_is_read_at_once_not_at_the_next_heartbeat(
    redis_server: RedisServer,
) -> None:
    """A router reads a new router's stream from its greeting on, though its own last
    heartbeat read (here 30 s old) does not list it yet: the stream is not dropped as a
    dead router's once read to its end, so the newcomer's decisions are applied as they
    come, not after this router's next heartbeat."""
    stores, indexes = [], []
    for name in ("a", "b"):
        registry = Registry(Settings(worker_urls=[W]).validate())
        registry.add(W)
        model = LoadModel()
        model.add_worker(W)
        index = DigestIndex()
        stores.append(
            StateStore(
                StoreURL(redis_server.url),
                registry,
                index,
                router_url=f"http://{name}:1",
                version="t",
                work=model,
                heartbeat_s=30.0,  # no second heartbeat read during the test
            )
        )
        indexes.append(index)
    a, b = stores
    await a.start()
    try:
        assert await until(lambda: a.connected and bool(a.routers), within=10)
        await b.start()
        assert await until(lambda: b.connected, within=10)
        theirs = b.streams.own
        # a read b's greeting, then b's stream to its end (b's start-up load): the point
        # at which a stream of a router no heartbeat listed used to be dropped.
        assert await until(lambda: a.streams.last.get(theirs, b"0") != b"0", within=10)
        await asyncio.sleep(0.3)
        assert b.id not in a.routers  # a's heartbeat read predates b
        assert theirs in a.streams.reading
        indexes[1].insert(W, prompt(7))  # b routes a prefix
        assert await until(lambda: indexes[0].match(prompt(7)) == {W: 64}, within=5)
    finally:
        for s in (b, a):
            await s.stop()
