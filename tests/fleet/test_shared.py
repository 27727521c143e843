"""The shared-state pieces in process: the digest-keyed index, the store URL, the
store's buffer and its behaviour with no Redis at all (no server needed)."""

from __future__ import annotations

import array
import asyncio
import itertools
import math

import hiredis
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute._native import PrefixIndex, block_digest_keys
from kvroute.config import ConfigError, Settings, StoreURL
from kvroute.eval.procs import free_port
from kvroute.fleet.registry import Registry
from kvroute.fleet.shared import BLOCK_SIZE, DigestIndex, StateStore, block_digests, wire
from kvroute.fleet.shared.heartbeat import oldest_scale
from kvroute.fleet.shared.loads import pack


def prompt(seed: int, n: int) -> array.array[int]:
    rng = np.random.default_rng(seed)
    return array.array("I", rng.integers(0, 150_000, n).astype(np.uint32).tobytes())


def test_digests_are_the_same_for_every_input_type_and_ignore_a_partial_block() -> None:
    t = prompt(0, 3 * BLOCK_SIZE + 5)
    d = block_digests(t)
    assert len(d) == 3
    assert (block_digests(list(t)) == d).all()
    assert (block_digests(np.frombuffer(t, dtype=np.uint32)) == d).all()
    assert (block_digests(t[: 3 * BLOCK_SIZE]) == d).all()
    other = array.array("I", t)
    other[BLOCK_SIZE] += 1  # block 1 differs: its digest changes, block 0's does not
    e = block_digests(other)
    assert e[0] == d[0] and e[1] != d[1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=12 * BLOCK_SIZE + 7))
def test_the_native_digests_equal_the_numpy_reference(ids: list[int]) -> None:
    """The index's keys come from the extension; every router must compute the same
    digests, whatever its build: equal to ``block_digests`` bit for bit, for every input
    type the index is given."""
    expected = block_digests(np.array(ids, dtype=np.uint32)).view(np.uint32).tobytes()
    t = array.array("I", ids)
    assert block_digest_keys(t).tobytes() == expected
    assert block_digest_keys(ids).tobytes() == expected
    assert block_digest_keys(np.array(ids, dtype=np.uint32)).tobytes() == expected
    assert DigestIndex().keys(t).tobytes() == expected


def test_a_prefix_routed_by_one_router_is_matched_by_another() -> None:
    a, b = DigestIndex(), DigestIndex()
    published: list[tuple[str, bytes]] = []
    a.on_insert = lambda w, d: published.append((w, d))
    shared = prompt(1, 20 * BLOCK_SIZE)
    a.insert("w1", shared + prompt(2, 40))
    assert len(published) == 1 and len(published[0][1]) == 8 * 22  # 8 bytes per block
    b.insert_digests(*published[0])
    query = shared + prompt(3, 40)  # same prefix, another question
    assert b.longest_match(query) == (20 * BLOCK_SIZE, ["w1"])
    assert b.match(query) == {"w1": 20 * BLOCK_SIZE}
    assert b.longest_match(prompt(4, 400)) == (0, [])


def replay_alternating(local: DigestIndex, peer: DigestIndex, n: int) -> list[array.array[int]]:
    """``n`` distinct 12-block prompts inserted into ``local`` for w0 and w1 in turn, its
    published decisions applied to ``peer``; the prompts."""
    sent: list[tuple[str, bytes]] = []
    local.on_insert = lambda w, d: sent.append((w, d))
    prompts = [prompt(s, 12 * BLOCK_SIZE) for s in range(n)]
    for i, p in enumerate(prompts):
        local.insert(f"w{i % 2}", p)
    for w, d in sent:
        peer.insert_digests(w, d)
    return prompts


def test_per_worker_budgets_in_tokens_evict_each_worker_alike_on_every_replica() -> None:
    local, peer = DigestIndex(1_000 * BLOCK_SIZE), DigestIndex(1_000 * BLOCK_SIZE)
    for ix in (local, peer):
        ix.set_worker_budget("w0", 30 * BLOCK_SIZE + 5)  # whole blocks count
        assert ix.worker_budget("w0") == 30 * BLOCK_SIZE
        assert ix.worker_budget("w1") == 1_000 * BLOCK_SIZE  # the index's own
    prompts = replay_alternating(local, peer, 8)
    assert local.cached_tokens("w0") == peer.cached_tokens("w0") <= 30 * BLOCK_SIZE
    assert local.cached_tokens("w1") == peer.cached_tokens("w1") == 4 * 12 * BLOCK_SIZE
    assert local.match(prompts[0]) == peer.match(prompts[0]) == {}  # w0's oldest went
    assert local.match(prompts[1]) == {"w1": 12 * BLOCK_SIZE}  # w1 kept everything
    # A smaller budget evicts at once; None gives the worker the index's budget back.
    assert local.set_worker_budget("w1", 12 * BLOCK_SIZE) > 0
    assert local.cached_tokens("w1") <= 12 * BLOCK_SIZE
    local.set_worker_budget("w1", None)
    assert local.worker_budget("w1") == 1_000 * BLOCK_SIZE
    local.check_invariants()
    peer.check_invariants()


def test_same_inserts_under_the_same_budget_evict_the_same() -> None:
    budget = 50 * BLOCK_SIZE
    local, peer = DigestIndex(budget), DigestIndex(budget)
    prompts = replay_alternating(local, peer, 12)
    for w in ("w0", "w1"):
        assert local.cached_tokens(w) == peer.cached_tokens(w) <= budget
    assert local.stats()["evicted_tokens"] > 0
    for p in prompts:
        assert local.match(p) == peer.match(p)
    assert local.match(prompts[0]) == {}  # the oldest went, on both
    local.check_invariants()
    peer.check_invariants()


def test_digest_index_agrees_with_the_token_index_on_whole_blocks() -> None:
    digest, tokens = DigestIndex(), PrefixIndex()
    for s in range(20):
        p = prompt(s % 7, (5 + s) * BLOCK_SIZE)
        digest.insert(f"w{s % 3}", p)
        tokens.insert(f"w{s % 3}", p)
    for s in range(30):
        q = prompt(s % 9, 200) + prompt(100 + s, 50)
        want = {w: (n // BLOCK_SIZE) * BLOCK_SIZE for w, n in tokens.match(q).items()}
        assert digest.match(q) == {w: n for w, n in want.items() if n}
        assert digest.lookup(q) == (digest.match(q), *digest.longest_match(q), q)


def test_digest_lookup_is_match_and_longest_match_when_half_a_digest_matches() -> None:
    digest = DigestIndex()
    keys = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint32)
    digest.insert_digests("a", keys.tobytes())
    digest.insert_digests("b", keys[:4].tobytes())
    digest.insert_digests("c", keys[:2].tobytes())
    for query in ([1, 2, 3, 4, 5, 9], [1, 2, 3, 9], [1, 9], [1, 2, 3, 4, 5, 6], [7, 8]):
        q = prompt(0, 3 * BLOCK_SIZE)
        digest._last, digest._last_keys = q, np.array(query, dtype=np.uint32)
        got = digest.lookup(q)
        assert got == (digest.match(q), *digest.longest_match(q), q), query


def test_store_url_is_checked_and_redacted() -> None:
    url = StoreURL("redis://:hunter2@127.0.0.1:6379/3")
    assert "hunter2" not in url.redacted and "hunter2" not in repr(url)
    assert url.redacted == "redis://:***@127.0.0.1:6379/3"
    assert StoreURL("rediss://cache:6380/0").redacted == "rediss://cache:6380/0"
    for bad in ("http://h:1/0", "redis://:pw@:1/0", "redis://h:x/0", "redis://h:1/db"):
        with pytest.raises(ConfigError) as e:
            StoreURL(bad)
        assert "pw" not in str(e.value)
    s = Settings(state_store="redis://:hunter2@h:1/0")
    assert "hunter2" not in repr(s)
    # A Redis on the router's host, through its Unix socket (password in either place).
    assert StoreURL("unix:///run/redis.sock?db=2").redacted == "unix:///run/redis.sock?db=2"
    assert StoreURL("unix://:hunter2@/run/r.sock?db=1").redacted == "unix://:***@/run/r.sock?db=1"
    url = StoreURL("unix:///run/r.sock?db=0&password=hunter2")
    assert url.redacted == "unix:///run/r.sock?db=0&password=***"
    # Through sentinels: the primary's password, the sentinels' own, both redacted.
    url = StoreURL("redis+sentinel://:hunter2@s1:26379,[::1]:26380,s3/mymaster/2")
    hosts = [("s1", 26379), ("::1", 26380), ("s3", 26379)]
    assert url.sentinel() == (hosts, "mymaster", 2, "hunter2")
    assert url.redacted == "redis+sentinel://:***@s1:26379,[::1]:26380,s3/mymaster/2"
    url = StoreURL("redis+sentinel://s1/mymaster?sentinel_password=hunter2")
    assert url.sentinel()[1:] == ("mymaster", 0, None) and "hunter2" not in url.redacted
    for bad in ("redis+sentinel://s1/", "redis+sentinel://s1:x/m", "redis+sentinel://:pw@s1/m/db"):
        with pytest.raises(ConfigError) as e:
            StoreURL(bad)
        assert "pw" not in str(e.value)
    # redis-py reads ?password= on any scheme.
    url = StoreURL("rediss://cache:6380/0?ssl_ca_certs=/ca.pem&password=hunter2")
    assert url.redacted == "rediss://cache:6380/0?ssl_ca_certs=/ca.pem&password=***"
    assert "hunter2" not in repr(url)
    for bad in ("unix://", "unix:///", "unix://host/run/r.sock", "unix:///r.sock?db=x&password=pw"):
        with pytest.raises(ConfigError) as e:
            StoreURL(bad)
        assert "pw" not in str(e.value)


async def test_no_redis_never_blocks_and_the_buffer_stays_bounded() -> None:
    settings = Settings(worker_urls=["http://127.0.0.1:1"]).validate()
    registry = Registry(settings)
    registry.add("http://127.0.0.1:1")
    index = DigestIndex()
    store = StateStore(
        StoreURL(f"redis://127.0.0.1:{free_port()}/0"),  # nothing listens there
        registry,
        index,
        router_url="http://127.0.0.1:2",
        version="test",
        buffer_len=100,
    )
    await store.start()
    try:
        for s in range(300):
            index.insert("http://127.0.0.1:1", prompt(s, 64))
        await asyncio.sleep(0.3)  # the background task tries, fails, backs off
        assert not store.connected and store.counters.errors >= 1
        assert len(store._buf) == 100  # the newest 100 wait for Redis
        assert store.counters.dropped == 200
        assert index.match(prompt(299, 64)) == {"http://127.0.0.1:1": 64}  # local state
    finally:
        await store.stop()


def test_decisions_pack_into_one_entry_and_bad_blobs_are_refused() -> None:
    decisions = [("http://w1:8000", b"\x01" * 16), ("http://w2:8000", b"\x02" * 8)]
    blob = wire.pack_inserts(decisions)
    assert [(u.decode(), d) for u, d in wire.unpack_inserts(blob)] == decisions
    for bad in (blob[:-1], blob[:3], wire.pack_inserts([("http://w:1", b"\x00" * 7)])):
        with pytest.raises(ValueError):
            list(wire.unpack_inserts(bad))


def test_load_reaches_the_other_routers_as_it_changes() -> None:
    from kvroute.fleet.shared.loads import SharedLoad, pack
    from kvroute.routing.load import LoadModel

    mine, theirs = LoadModel(), LoadModel()
    woken: list[int] = []
    pub = SharedLoad(mine, lambda: woken.append(1))
    sub = SharedLoad(theirs, lambda: None)
    for m in (mine, theirs):
        m.add_worker("http://a")
        m.add_worker("http://b")
    before = theirs.ahead("http://a")
    t1 = mine.reserve("http://a", 5000, 10, 0.0)
    t2 = mine.reserve("http://a", 3000, 10, 0.0)
    assert woken and pub.dirty
    sub.apply(b"r1", pub.take()[0])
    assert not pub.dirty
    assert (sub.flight, sub.pending, sub.tokens) == (
        {"http://a": 2},
        {"http://a": 2},
        {"http://a": 8000},
    )
    # The other router counts them as taken slots, and predicts the queue ahead on a
    # from the shared tokens.
    assert theirs.peer == {"http://a": 2}
    assert theirs.ahead("http://a") > before + 7000 / 15_000
    assert theirs.ahead("http://b") == 0.0
    # Their queued requests are the ones a new prefill would delay, too: the work
    # guard weighs the fleet's queue, not a third of it (2 waiting over 2 workers).
    assert theirs.queued_per_worker(["http://a", "http://b"]) == 1.0
    t1.first_byte(0.1)  # decoding: still in flight, no longer queued for prefill
    sub.apply(b"r1", pub.take()[0])
    assert (sub.flight, sub.pending, sub.tokens) == (
        {"http://a": 2},
        {"http://a": 1},
        {"http://a": 3000},
    )
    t1.end(0.2)
    t2.end(0.2)
    sub.apply(b"r1", pub.take()[0])  # absolute values: back to nothing
    assert (sub.flight, sub.pending, sub.tokens) == ({}, {}, {})
    # Known only from its heartbeat until it publishes; an expired router stops counting.
    mine.reserve("http://b", 100, 10, 0.3)
    sub.apply(b"r1", pub.take()[0])
    sub.beat(b"r2", {"http://b": 5})
    sub.beat(b"r1", {"http://b": 9})  # r1 published: its records win over its beat
    assert sub.flight == {"http://b": 6}
    sub.apply(b"r2", pack([("http://b", 3, 3, 16)]))
    sub.beat(b"r2", {"http://b": 5})  # r2 published too: its beat no longer counts
    assert (sub.flight, sub.pending, sub.tokens) == (
        {"http://b": 4},
        {"http://b": 4},
        {"http://b": 116},
    )
    sub.keep({b"r2"})
    assert (sub.flight, sub.pending, sub.tokens) == (
        {"http://b": 3},
        {"http://b": 3},
        {"http://b": 16},
    )
    with pytest.raises(ValueError):
        sub.apply(b"r3", b"\x08\x00\x03\x00")


def test_the_prefill_another_router_started_is_timed_from_when_it_was_heard() -> None:
    """A router hears another's request reserved on a worker with nothing else of
    theirs waiting: its prefill begins about then, and the worker's queue is what is
    left of it; when it has its first byte, the next of theirs begins."""
    from kvroute.fleet.shared.loads import SharedLoad
    from kvroute.routing.load import PRIOR_OVERHEAD_S, PRIOR_PREFILL_TPS, LoadModel

    clock = [50.0]
    mine, theirs = LoadModel(), LoadModel()
    theirs.clock = lambda: clock[0]
    pub = SharedLoad(mine, lambda: None)
    sub = SharedLoad(theirs, lambda: None)
    theirs.add_worker("http://a")
    t1 = mine.reserve("http://a", 15_000, 10, 0.0)
    t2 = mine.reserve("http://a", 15_000, 10, 0.0)
    sub.apply(b"r1", pub.take()[0])
    assert theirs.peer_head == {"http://a": 50.0}
    one = PRIOR_OVERHEAD_S + 15_000 / PRIOR_PREFILL_TPS
    clock[0] = 50.5
    assert theirs.ahead("http://a") == pytest.approx(2 * one - 0.5)
    t1.first_byte(0.9)
    clock[0] = 51.0
    sub.apply(b"r1", pub.take()[0])
    assert theirs.peer_head == {"http://a": 51.0}
    assert theirs.ahead("http://a") == pytest.approx(one)
    # A first byte and a new request in one record: as many waiting, not the same ones.
    t2.first_byte(1.5)
    mine.reserve("http://a", 6000, 10, 1.5)
    clock[0] = 52.0
    sub.apply(b"r1", pub.take()[0])
    assert theirs.peer_head == {"http://a": 52.0}
    clock[0] = 52.25
    assert theirs.ahead("http://a") == pytest.approx(
        PRIOR_OVERHEAD_S + 6000 / PRIOR_PREFILL_TPS - 0.25
    )
    sub.keep(set())  # the router left: nothing of theirs waits
    assert theirs.peer_head == {} and theirs.ahead("http://a") == 0.0


def test_decoding_requests_ends_reach_the_other_routers_on_their_own_clocks() -> None:
    """With a worker's load go its decoding requests' expected ends, in seconds from the
    write: the other router reads them on its own clock (no clocks need agree), merges
    them over routers, and drops them when they end or their router leaves."""
    from kvroute.fleet.shared.loads import SharedLoad, pack_ends, unpack_ends
    from kvroute.routing.load import ENDS_SHARED, LoadModel

    mine, theirs, third = LoadModel(), LoadModel(), LoadModel()
    mine.clock = lambda: 100.0  # the publisher's clock ...
    theirs.clock = lambda: 5.0  # ... and the receiver's: unrelated
    third.clock = lambda: 0.0
    pub = SharedLoad(mine, lambda: None)
    other = SharedLoad(third, lambda: None)
    sub = SharedLoad(theirs, lambda: None)
    for m in (mine, theirs, third):
        m.add_worker("http://a")
    t1 = mine.reserve("http://a", 100, 11, 100.0)
    t2 = mine.reserve("http://a", 100, 51, 100.0)
    load, ends = pub.take()
    assert ends == b""  # none decoding yet
    t1.first_byte(100.0)
    t2.first_byte(100.0)
    load, ends = pub.take()
    sub.apply(b"r1", load)
    sub.apply_ends(b"r1", ends)
    st = mine.workers["http://a"]
    expected = [5.0 + e[0] - 100.0 for e in st.ends]
    assert [e[0] for e in sub.ends["http://a"]] == pytest.approx(expected, rel=1e-6)
    assert theirs.peer_ends is sub.ends
    # A second router's, merged in time order.
    t3 = third.reserve("http://a", 100, 31, 0.0)
    t3.first_byte(0.0)
    sub.apply_ends(b"r3", other.take()[1])
    merged = [e[0] for e in sub.ends["http://a"]]
    assert merged == sorted(merged) and len(merged) == 3
    # Ended: the publisher sends an empty list once, and the receiver drops its ends.
    t1.end(100.1)
    t2.end(100.1)
    load, ends = pub.take()
    assert ends != b""
    sub.apply_ends(b"r1", ends)
    assert len(sub.ends["http://a"]) == 1
    mine.reserve("http://a", 100, 11, 100.2)
    assert pub.take()[1] == b""  # nothing was sent since: nothing to clear
    sub.keep({b"r1"})  # the third router's heartbeat expired
    assert sub.ends == {}
    # The wire: at most ENDS_SHARED per worker, non-finite values dropped, sorted; a
    # truncated blob is refused.
    many = [float(i) for i in range(ENDS_SHARED + 10, 0, -1)]
    ((url, got),) = list(unpack_ends(pack_ends([("http://a", many)])))
    assert url == "http://a" and len(got) == ENDS_SHARED and got == sorted(got)
    ((_, got),) = list(unpack_ends(pack_ends([("http://a", [1.0, math.nan, math.inf, 0.5])])))
    assert got == [0.5, 1.0]
    with pytest.raises(ValueError):
        sub.apply_ends(b"r1", pack_ends([("http://a", [1.0, 2.0])])[:-3])


def test_xadd_is_the_command_redis_py_would_send() -> None:
    from redis.connection import Connection

    key = wire.stream_of(b"abc")
    entry = wire.insert_entry(b"abc", [("http://w:1", b"\x01" * 16)], b"\x02" * 30)
    args: list[bytes | int] = [b"XADD", key, b"MAXLEN", b"~", 2000, b"*"]
    for k, v in entry.items():
        args += [k, v]
    assert wire.xadd(key, entry, 2000) == b"".join(Connection().pack_command(*args))
    # Field names and heads are cached: a second entry of another shape still encodes right.
    entry = wire.hello_entry(b"abc")
    args = [b"XADD", key, b"MAXLEN", b"~", 7, b"*"]
    for k, v in entry.items():
        args += [k, v]
    assert wire.xadd(key, entry, 7) == b"".join(Connection().pack_command(*args))
    # The publisher's own encoder makes the same commands, whatever an entry carries,
    # with or without what its decisions are keyed on, with ids of its own counting
    # 1, 2, 3..., each XADD followed by a PUBLISH of its bytes to the router's channel.
    decisions = [("http://w:1", b"\x01" * 16), ("http://w:2", b"\x03" * 8)]
    for x in (b"", b"tokens:0123abcd"):
        commands = wire.Commands(key, b"abc", 2000, x)
        ids: list[bytes] = []
        for made, entry in (
            (
                commands.inserts(wire.pack_inserts(decisions)),
                wire.insert_entry(b"abc", decisions, keying=x),
            ),
            (
                commands.inserts(wire.pack_inserts(decisions), b"\x02" * 30),
                wire.insert_entry(b"abc", decisions, b"\x02" * 30, keying=x),
            ),
            (commands.load(b"\x02" * 30), wire.insert_entry(b"abc", [], b"\x02" * 30, keying=x)),
            (
                commands.load(b"\x02" * 30, b"\x04" * 12),
                wire.insert_entry(b"abc", [], b"\x02" * 30, keying=x, ends=b"\x04" * 12),
            ),
            (
                commands.inserts(wire.pack_inserts(decisions), b"\x02" * 30, b"\x04" * 12),
                wire.insert_entry(b"abc", decisions, b"\x02" * 30, keying=x, ends=b"\x04" * 12),
            ),
        ):
            reader = hiredis.Reader()
            reader.feed(made)
            xadd, publish = reader.gets(), reader.gets()
            assert reader.gets() is False
            assert publish == [b"PUBLISH", wire.channel_of(b"abc"), xadd_bytes(made)]
            assert wire.pushed_entry(publish[2])[:2] == (key, xadd[5])
            ids.append(xadd[5])
            entry[b"t"] = xadd[xadd.index(b"t") + 1]  # the clock, where the encoder put it
            args = [b"XADD", key, b"MAXLEN", b"~", 2000, xadd[5]]
            for k, v in entry.items():
                args += [k, v]
            assert xadd_bytes(made) == b"".join(Connection().pack_command(*args))
            assert wire.pushed_entry(publish[2])[2] == entry
            assert (entry.get(wire.KEYING) == x) if x and entry[b"k"] == wire.INSERT else True
        epoch = ids[0].split(b"-")[0]
        assert ids == [b"%s-%d" % (epoch, n) for n in range(1, 6)]
        assert all(wire.follows(b, a) for a, b in itertools.pairwise(ids))
        assert wire.follows(ids[0], ids[1]) is False and wire.follows(ids[2], ids[0]) is None
        commands.publish = False  # a Redis that refuses PUBLISH: the XADD alone
        alone = commands.load(b"\x02" * 30)
        assert alone == xadd_bytes(alone)


def xadd_bytes(made: bytes) -> bytes:
    """The XADD command at the start of a write (``wire.Commands``)."""
    from redis.connection import Connection

    reader = hiredis.Reader()
    reader.feed(made)
    command = reader.gets()
    assert isinstance(command, list)
    return b"".join(Connection().pack_command(*command))


def test_decisions_of_a_router_keyed_differently_are_refused_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvroute.routing.load import LoadModel

    w = "http://127.0.0.1:1"
    registry = Registry(Settings(worker_urls=[w]).validate())
    registry.add(w)
    index, model = DigestIndex(), LoadModel()
    model.add_worker(w)
    store = StateStore(
        StoreURL("redis://127.0.0.1:1/0"),
        registry,
        index,
        router_url="http://r:1",
        version="t",
        work=model,
        keying="tokens:aaaaaaaaaaaa",
    )
    assert orjson.loads(store.info)["index"] == "tokens:aaaaaaaaaaaa"  # in /routers

    def entry(router: bytes, seed: int, keying: bytes | None) -> dict[bytes, bytes]:
        digests = DigestIndex().keys(prompt(seed, 64)).tobytes()
        fields = wire.insert_entry(router, [(w, digests)], pack([(w, 1, 1, 64)]))
        if keying is not None:
            fields[wire.KEYING] = keying
        return fields

    caplog.set_level("WARNING", "kvroute.fleet.shared")
    for seed in range(3):
        store._apply(entry(b"bytes-router", seed, b"bytes"))
    assert store.counters.refused == 3 and store.counters.applied["insert"] == 0
    assert index.match(prompt(0, 64)) == {}
    assert store.peer_load == {w: 1}  # its load still counts: workers are not keyed
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "bytes-router" in said[0] and "--tokenizer" in said[0]
    store._apply(entry(b"same", 10, b"tokens:aaaaaaaaaaaa"))
    store._apply(entry(b"older", 11, None))  # from a router that does not send it
    assert store.counters.applied["insert"] == 2
    assert index.match(prompt(10, 64)) == {w: 64} and index.match(prompt(11, 64)) == {w: 64}


def test_a_router_reads_the_others_streams_not_its_own_and_drops_the_dead_once_read() -> None:
    from kvroute.fleet.shared.streams import Streams

    a, b, me = (wire.stream_of(r) for r in (b"a", b"b", b"me"))
    s = Streams(me)
    s.follow_routers(["me", "a", b"b"])
    assert s.reading == {wire.STREAM_B, a, b}  # never its own
    assert s.read_args() == {wire.STREAM_B: b"0", a: b"0", b: b"0"}  # replayed from the start
    s.last[b] = b"7-0"
    asked = set(s.reading)
    s.done_reading(asked, full=set(), live=set())  # no heartbeat read yet: keep all
    assert s.reading == asked
    s.done_reading(asked, full={b}, live={a, me})  # b is gone but not read to its end
    assert b in s.reading
    s.done_reading(asked, full=set(), live={a, me})  # now it is
    assert s.reading == {wire.STREAM_B, a}
    s.follow(b)  # b greets again: read on from where it was left, never twice
    assert s.read_args()[b] == b"7-0"
    # A greeting counts as live for its time, whatever the last heartbeat read listed
    # (one that predates the greeting does not list the newcomer).
    c = wire.stream_of(b"c")
    s.greet(c, live_s=2.0)
    s.greet(me, live_s=2.0)  # its own greeting, read back: never followed
    assert c in s.reading and me not in s.reading and me not in s.greeted
    until = s.greeted[c]
    s.done_reading({c}, full=set(), live={a, me}, now=until - 0.1)
    assert c in s.reading
    s.done_reading({c}, full=set(), live={a, me}, now=until)  # its time is over: dropped
    assert c not in s.reading and not s.greeted


def test_the_replicas_scale_is_the_oldest_learned_one_whoever_reads_it() -> None:
    """Every replica reads the same beats and picks the same bytes per token: the oldest
    router's (start time, then id) among those that published one; a router that joins
    later, or one that has not learned yet, changes nothing."""
    routers = {
        "b": {"started": 10.0, "bytes_per_token": 3.0},
        "a": {"started": 10.0, "bytes_per_token": 2.5},  # as old as b: the id decides
        "c": {"started": 5.0},  # older, but learned nothing yet
        "d": {"started": 20.0, "bytes_per_token": 1.0},
        "e": {"bytes_per_token": 1.0},  # no start time: not trusted
    }
    assert oldest_scale(routers) == ("a", 2.5)
    for order in (list(routers), list(reversed(routers))):
        assert oldest_scale({k: routers[k] for k in order}) == ("a", 2.5)
    assert oldest_scale({"c": routers["c"]}) is None
    assert oldest_scale({}) is None


class _Writer:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def write(self, data: bytes) -> None:
        reader = hiredis.Reader()
        reader.feed(data)
        while (command := reader.gets()) is not False:
            self.sent.append(command)


def test_pushes_go_live_only_after_an_xread_sent_after_the_subscription() -> None:
    """``Pushes``' rule, step by step (no Redis): a peer's stream leaves the XREAD only
    once an XREAD sent after its subscription was confirmed has read it to the end; the
    pushes kept meanwhile are applied after what that XREAD read, once each; a push after
    a missing one sends the stream back to the XREAD (and ends the blocked one)."""
    from kvroute.fleet.shared.pushes import Pushes
    from kvroute.fleet.shared.streams import Streams

    peer = b"peer1"
    key, channel = wire.stream_of(peer), wire.channel_of(peer)
    commands = wire.Commands(key, peer, 2000)
    payloads = []  # the peer's entries 1..9 as pushed
    for n in range(9):
        reader = hiredis.Reader()
        reader.feed(commands.load(b"%d" % n))
        reader.gets()
        payloads.append(reader.gets()[2])
    ids = [wire.pushed_entry(p)[1] for p in payloads]

    def message(i: int) -> list[bytes]:
        return [b"message", channel, payloads[i]]

    streams = Streams(wire.stream_of(b"me"))
    streams.follow(key)
    applied: list[bytes] = []
    pushes = Pushes(streams, lambda fields: applied.append(fields[b"p"]))
    writer = _Writer()
    pushes.reset(writer, reader_id=42)  # type: ignore[arg-type]
    pushes.want([peer])
    assert writer.sent == [[b"SUBSCRIBE", channel]]
    in_flight = streams.read_args()  # an XREAD sent before the confirmation
    pushes.pushed([b"subscribe", channel, 1])
    streams.last[key] = ids[3]  # that XREAD read entries 0-3
    pushes.pushed(message(4))  # kept, not applied: the stream is not live
    pushes.caught_up(streams.round, in_flight, set())
    assert key not in streams.live and applied == []
    pushes.pushed(message(5))
    asked = streams.read_args()  # sent after the confirmation: reads entry 4
    assert key in asked
    streams.last[key] = ids[4]
    pushes.caught_up(streams.round, asked, {key})  # a full batch: not at the end yet
    assert key not in streams.live
    asked = streams.read_args()
    pushes.caught_up(streams.round, asked, set())  # read to the end
    assert key in streams.live and key not in streams.read_args()
    assert applied == [b"5"]  # the kept push after what the XREAD read (4 skipped)
    pushes.pushed(message(6))
    pushes.pushed(message(6))  # again: skipped
    assert applied == [b"5", b"6"] and streams.last[key] == ids[6]
    pushes.pushed(message(8))  # 7 never came
    assert key not in streams.live and pushes.gaps == 1 and applied == [b"5", b"6"]
    assert writer.sent[-1] == [b"CLIENT", b"UNBLOCK", b"42"]
    asked = streams.read_args()
    assert asked[key] == ids[6]  # read again from the last applied
    streams.last[key] = ids[8]  # the XREAD read 7 and 8 (applied by the read loop)
    pushes.caught_up(streams.round, asked, set())
    assert key in streams.live and applied == [b"5", b"6"]  # 8 kept, already read
    # A number lost outright (neither in the stream nor pushed): once the stream has
    # been read to its end, what was kept after it is applied, not waited for.
    pushes.pushed(message(8))  # live: 8 was read, skipped
    pushes._arm(peer)  # as after a missing push
    commands.next_id()  # entry 9 never written anywhere; 10 and 11 pushed
    later = []
    for n in (10, 11):
        reader = hiredis.Reader()
        reader.feed(commands.load(b"%d" % n))
        reader.gets()
        later.append(reader.gets()[2])
    for payload in later:
        pushes.pushed([b"message", channel, payload])
    asked = streams.read_args()
    pushes.caught_up(streams.round, asked, set())  # the stream ends at 8
    assert key in streams.live and applied == [b"5", b"6", b"10", b"11"]
    assert streams.last[key] == wire.pushed_entry(later[-1])[1]
    pushes.want([])  # the peer no longer publishes (or is gone)
    assert writer.sent[-1] == [b"UNSUBSCRIBE", channel] and key not in streams.live
