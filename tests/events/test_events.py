"""KV cache events (precise mode): decoder, stream state machine, replay, ZMQ subscriber.

Payloads are built with msgpack the way vLLM (msgspec, maps tagged with "type" or
positional tag-first arrays, trailing defaults omitted) and SGLang (positional, signed
i64 hashes) encode them; one recorded real vLLM 0.32 CPU stream is in tests/data.
The replay and subscriber tests run a fake engine on loopback: an XPUB socket (a PUB
that also tells us when the subscriber's subscription has arrived, so no message is
lost to ZMQ's slow-joiner window) and a ROUTER replay socket served by a thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from kvroute import BlockIndex
from kvroute.eval.procs import free_port
from kvroute.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventTracker,
    KvEventDecodeError,
    KvEventSource,
    KvEventsSpecError,
    KvEventSubscriber,
    PreciseView,
    ZmqReplayer,
    decode_batch,
    parse_kv_events,
    parse_kv_events_spec,
    parse_seq,
    register_kv_event_metrics,
)
from support import wait_for

DATA = Path(__file__).resolve().parents[1] / "data"
BS = 4  # block size of the synthetic streams


def toks(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def stored(
    hashes: list[Any], parent: Any, tokens: list[Any], bs: int = BS, **kw: Any
) -> dict[str, Any]:
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent}
    ev.update(token_ids=tokens, block_size=bs, lora_id=None, medium="GPU", lora_name=None)
    ev.update(kw)
    return ev


def removed(hashes: Any, **kw: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **kw}


def payload(events: list[Any], rank: int | None = 0) -> bytes:
    batch: list[Any] = [time.time(), events]
    if rank is not None:
        batch.append(rank)
    return bytes(msgpack.packb(batch))


# -- decoder -------------------------------------------------------------------------


def test_decode_map_events_current_vllm() -> None:
    big = 2**64 - 5  # u64 above 2**63, as vLLM's sha256-derived hashes often are
    events = [
        stored([big, 7], None, toks(8), extra_keys=[None, None], group_idx=0, novel=1),
        removed([big], group_idx=0, locality="LOCAL"),
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNew", "x": 1},
    ]
    batch = decode_batch(payload(events))
    assert batch.data_parallel_rank == 0 and batch.unknown == 1
    s, r, c = batch.events
    assert isinstance(s, BlockStored) and s.block_hashes == [big, 7]
    assert s.parent_block_hash is None and s.token_ids == toks(8) and s.block_size == BS
    assert s.medium == "GPU" and s.group_idx == 0 and s.extra_keys == [None, None]
    assert isinstance(r, BlockRemoved) and r.block_hashes == [big] and r.medium == "GPU"
    assert isinstance(c, AllBlocksCleared)


def test_decode_positional_events_sglang_and_old_vllm() -> None:
    sha = bytes(range(32))  # vLLM with bytes hashes: the raw sha256 digest
    events = [
        ["BlockStored", [-(2**63), -1], None, toks(8), BS, None, "GPU", None, [None, None], 0],
        ["BlockStored", [sha], -1, toks(4, 500), BS],  # trailing defaults omitted
        ["BlockRemoved", [-1, sha], "GPU"],
        ["BlockRemoved", [-(2**63)]],
        ["AllBlocksCleared"],
        ["Unheard", 1, 2],
    ]
    batch = decode_batch(payload(events, rank=None))  # [ts, events]: SGLang, old vLLM
    assert batch.data_parallel_rank is None and batch.unknown == 1 and len(batch.events) == 5
    a, b, r1, r2, c = batch.events
    assert isinstance(a, BlockStored) and a.block_hashes == [-(2**63), -1]
    assert a.medium == "GPU" and a.group_idx is None  # fields past lora_name ignored
    sha_int = int.from_bytes(sha[-8:], "big")
    assert isinstance(b, BlockStored) and b.block_hashes == [sha_int]
    assert b.parent_block_hash == -1 and b.medium is None and b.lora_id is None
    assert isinstance(r1, BlockRemoved) and r1.block_hashes == [-1, sha_int]
    assert isinstance(r2, BlockRemoved) and r2.medium is None
    assert isinstance(c, AllBlocksCleared)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0]),
        msgpack.packb([True, []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3, 4]]]]),
        msgpack.packb([1.0, [stored([1.5], None, toks(4))]]),
        msgpack.packb([1.0, [stored([1], None, toks(4), bs=0)]]),
        msgpack.packb([1.0, [stored([1], None, ["a"] * 4)]]),
        msgpack.packb([1.0, [removed("notalist")]]),
        msgpack.packb([1.0, [42]]),
        msgpack.packb([1.0, [[]]]),
        msgpack.packb([1.0, [{"no": "type"}]]),
    ],
)
def test_decode_rejects_malformed(raw: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_batch(raw)


def test_parse_seq() -> None:
    assert parse_seq((2**64 - 1).to_bytes(8, "big")) == 2**64 - 1
    with pytest.raises(KvEventDecodeError):
        parse_seq(b"\x00\x01")


def load_recorded() -> list[tuple[str, int, bytes]]:
    frames = msgpack.unpackb((DATA / "vllm_kv_events.msgpack").read_bytes())
    return [(t.decode(), parse_seq(s), p) for t, s, p in frames]


def test_recorded_vllm_stream_decodes_and_applies() -> None:
    """A real stream from vLLM 0.32 CPU (tiny model, 40 blocks of 32 tokens)."""
    recorded = load_recorded()
    assert [seq for _, seq, _ in recorded] == list(range(len(recorded)))
    tracker = EventTracker(BlockIndex())
    prompts: list[list[int]] = []
    n_removed = 0
    for topic, seq, raw in recorded:
        assert topic.startswith("kv@")
        batch = decode_batch(raw)
        assert batch.data_parallel_rank == 0 and batch.unknown == 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == 32 and ev.kv_cache_spec_kind == "full_attention"
                assert len(ev.token_ids) == 32 * len(ev.block_hashes)
                if ev.parent_block_hash is None:
                    prompts.append(ev.token_ids)
            elif isinstance(ev, BlockRemoved):
                n_removed += len(ev.block_hashes)
        tracker.feed("w", seq, raw)
    assert n_removed > 0, "the recording should include evictions"
    snap = tracker.snapshot()["w"]
    assert snap["mode"] == "precise" and snap["events_dropped"] == 0
    assert int(snap["cached_blocks"]) <= 40
    # The first prompt lost its blocks to eviction; the last one is whole.
    last = prompts[-1]
    assert tracker.index.match(last) == {"w": len(last)}
    assert tracker.index.match(prompts[0]).get("w", 0) < len(prompts[0])


# -- --kv-events syntax --------------------------------------------------------------


def test_spec_parsing() -> None:
    s = parse_kv_events_spec("http://h:8001/=tcp://h:5557")
    assert s == KvEventSource("http://h:8001", "tcp://h:5557", None, None, False)
    s = parse_kv_events_spec("http://a:1=tcp://127.0.0.1:5557;bind;topic=kv@1;replay=tcp://a:5558")
    assert s.bind and s.topic == "kv@1" and s.replay_endpoint == "tcp://a:5558"
    assert parse_kv_events_spec("http://a:1=tcp://*:5557").bind
    assert parse_kv_events_spec("http://a:1=ipc:///tmp/x;topic=").topic == ""
    for bad in (
        "tcp://h:5557",
        "h:1=tcp://h:5557",
        "http://a:1=udp://h:1",
        "http://a:1=tcp://h",
        "http://a:1=tcp://h:1;color=red",
        "http://a:1=tcp://h:1;bind;connect",
        "http://a:1=tcp://*:1;connect",
    ):
        with pytest.raises(KvEventsSpecError):
            parse_kv_events_spec(bad)
    shared = [
        "http://a:1=tcp://127.0.0.1:9;bind;topic=a",
        "http://b:1=tcp://127.0.0.1:9;bind;topic=b",
    ]
    assert len(parse_kv_events(shared, ["http://a:1", "http://b:1/"])) == 2
    with pytest.raises(KvEventsSpecError, match="distinct topics"):
        parse_kv_events([shared[0], "http://b:1=tcp://127.0.0.1:9;bind;topic=a"])
    with pytest.raises(KvEventsSpecError, match="distinct topics"):
        parse_kv_events([shared[0], "http://b:1=tcp://127.0.0.1:9;bind"])
    with pytest.raises(KvEventsSpecError, match="two sources"):
        parse_kv_events([shared[0], "http://a:1=tcp://x:1"])
    with pytest.raises(KvEventsSpecError, match="not in --worker-urls"):
        parse_kv_events(shared, ["http://a:1"])


# -- the state machine ---------------------------------------------------------------


class Stream:
    """A synthetic engine stream: prompts of whole blocks, hashes = a counter."""

    def __init__(self, tracker: EventTracker, worker: str = "w") -> None:
        self.tracker, self.worker, self.seq, self.next_hash = tracker, worker, 0, 1

    def blocks(
        self, tokens: list[int], parent: int | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        n = len(tokens) // BS
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        return stored(hashes, parent, tokens), hashes

    def send(self, events: list[Any], *, lose: bool = False) -> None:
        if not lose:
            self.tracker.feed(self.worker, self.seq, payload(events))
        self.seq += 1


def test_in_order_stream_is_precise() -> None:
    tracker = EventTracker(BlockIndex())
    tracker.add_worker("w")
    assert tracker.mode("w") == "approximate" and tracker.mode("other") == "approximate"
    st = Stream(tracker)
    a, ha = st.blocks(toks(12))
    st.send([a])
    b, _ = st.blocks(toks(8, 112), parent=ha[-1])
    st.send([b])
    assert tracker.mode("w") == "precise"
    assert tracker.index.match(toks(24)) == {"w": 20}
    st.send([removed([ha[1]])])
    assert tracker.index.match(toks(24)) == {"w": 4}
    snap = tracker.snapshot()["w"]
    assert snap["batches"] == 3 and snap["events_applied"] == 3 and snap["gaps"] == 0
    assert snap["last_seq"] == 2 and snap["cached_blocks"] == 4


def test_gap_without_replay_goes_stale_then_rebuilds() -> None:
    tracker = EventTracker(BlockIndex(), rebuild_batches=3)
    st = Stream(tracker)
    a, ha = st.blocks(toks(8))
    st.send([a])
    st.send([removed(ha)], lose=True)  # lost: the index would keep evicted blocks
    b, _ = st.blocks(toks(8, 300))
    st.send([b])
    assert tracker.mode("w") == "stale"
    assert tracker.index.match(toks(8)) == {}, "state from before the loss is dropped"
    assert tracker.index.match(toks(8, 300)) == {"w": 8}, "new events still apply"
    assert PreciseView(tracker).match(toks(8, 300)) == ({}, set())
    # A child of a block we never saw cannot be keyed while stale: skipped, no new loss.
    c = stored([999], 998, toks(4, 700))
    st.send([c])
    st.send([])
    assert tracker.mode("w") == "precise", "rebuilt after 3 in-order batches"
    snap = tracker.snapshot()["w"]
    assert snap["gaps"] == 1 and snap["stale_transitions"] == 1 and snap["events_dropped"] == 1
    assert snap["replays"] == 0 and snap["restarts"] == 0


def test_all_blocks_cleared_rebuilds_at_once() -> None:
    tracker = EventTracker(BlockIndex(), rebuild_batches=100)
    st = Stream(tracker)
    st.seq = 5  # joined mid-stream: batches 0..4 are unknown
    a, _ = st.blocks(toks(8))
    st.send([a])
    assert tracker.mode("w") == "stale" and tracker.snapshot()["w"]["gaps"] == 1
    b, _ = st.blocks(toks(4, 50))
    st.send([{"type": "AllBlocksCleared"}, b])
    assert tracker.mode("w") == "precise"
    assert tracker.index.match(toks(8)) == {} and tracker.index.match(toks(4, 50)) == {"w": 4}


def test_restart_drops_state() -> None:
    tracker = EventTracker(BlockIndex())
    st = Stream(tracker)
    for i in range(3):
        ev, _ = st.blocks(toks(8, 1000 * i))
        st.send([ev])
    assert tracker.index.cached_blocks("w") == 6
    st.seq = 0  # the engine restarted: its cache is empty, seq starts again
    ev, _ = st.blocks(toks(4, 5000))
    st.send([ev])
    snap = tracker.snapshot()["w"]
    assert snap["restarts"] == 1 and snap["mode"] == "precise" and snap["last_seq"] == 0
    assert tracker.index.match(toks(8)) == {} and tracker.index.cached_blocks("w") == 1
    st.send([])
    st.send([])
    st.seq = 0  # restarted again, and its first batch was lost
    st.send([], lose=True)
    st.send([])
    snap = tracker.snapshot()["w"]
    assert snap["restarts"] == 2 and snap["mode"] == "stale" and snap["gaps"] == 1
    assert tracker.index.cached_blocks("w") == 0


def test_reset_when_the_router_sees_the_worker_go_down() -> None:
    """A restart whose new seq overtakes the last one seen cannot be told from the
    seq alone; the health checker's verdict (worker dead) resets the stream instead."""
    tracker = EventTracker(BlockIndex())
    st = Stream(tracker)
    ev, _ = st.blocks(toks(8))
    st.send([ev])
    tracker.reset("w")
    assert tracker.mode("w") == "approximate" and tracker.index.cached_blocks("w") == 0
    st.seq = 0
    ev, _ = st.blocks(toks(4, 50))
    st.send([ev])
    assert tracker.mode("w") == "precise" and tracker.index.match(toks(4, 50)) == {"w": 4}


def test_reset_during_replay_discards_the_batch_in_flight() -> None:
    tracker = EventTracker(BlockIndex())

    def replayer(endpoint: str, start: int) -> list[tuple[int, bytes]]:
        assert tracker.mode("w") == "stale", "not trusted while the replay runs"
        assert tracker.precise_workers() == set()
        tracker.reset("w")  # as the health checker would, from the event loop
        return [(1, payload([stored([2], 1, toks(4, 104))]))]

    tracker.replayer = replayer
    tracker.add_worker("w", "tcp://127.0.0.1:1")
    tracker.feed("w", 0, payload([stored([1], None, toks(4))]))
    tracker.feed("w", 2, payload([stored([3], 2, toks(4, 108))]))
    snap = tracker.snapshot()["w"]
    assert snap["mode"] == "approximate" and snap["last_seq"] == -1
    assert snap["cached_blocks"] == 0 and snap["replays"] == 0


def test_unknown_parent_and_malformed_batch_go_stale() -> None:
    tracker = EventTracker(BlockIndex())
    st = Stream(tracker)
    a, _ = st.blocks(toks(8))
    st.send([a])
    st.send([stored([77], 12345, toks(4, 900))])  # parent never reported
    snap = tracker.snapshot()["w"]
    assert snap["mode"] == "stale" and snap["unknown_parents"] == 1
    assert tracker.index.cached_blocks("w") == 0
    tracker2 = EventTracker(BlockIndex())
    tracker2.feed("v", 0, payload([stored([1], None, toks(4))]))
    tracker2.feed("v", 1, b"\xc1 not msgpack")
    snap = tracker2.snapshot()["v"]
    assert snap["mode"] == "stale" and snap["batches_dropped"] == 1 and snap["last_seq"] == 1
    assert tracker2.index.cached_blocks("v") == 0
    tracker2.feed("v", 2, payload([]))  # continues in order from the dropped batch
    assert tracker2.snapshot()["v"]["gaps"] == 0


def test_unkeyable_blocks_are_ignored_with_descendants() -> None:
    tracker = EventTracker(BlockIndex())
    t = toks(16)
    events = [
        stored([1, 2], None, t[:8], lora_id=3, lora_name="ad"),  # LoRA: other hashes
        stored([3], 2, t[8:12]),  # child of a LoRA block: ignored, not a loss
        stored([10, 11, 12], None, t[:12], extra_keys=[None, ["salt"], None]),
        stored([13], 12, t[12:16]),
        stored([20], None, t[:4], medium="CPU"),
        stored([30], None, t[:4], group_idx=1, kv_cache_spec_kind="sliding_window"),
        stored([31], None, t[:4], group_idx=0, kv_cache_spec_kind="full_attention"),
        stored([32], None, toks(4, 900), group_idx=2, kv_cache_spec_kind="full_attention"),
    ]
    tracker.feed("w", 0, payload(events))
    assert tracker.mode("w") == "precise"
    assert tracker.index.match(t) == {"w": 4}, "only block 10 / 31 is plain text"
    assert tracker.index.match(toks(4, 900)) == {}, "second full-attention group ignored"
    tracker.feed("w", 1, payload([removed([31], group_idx=1), removed([31], medium="CPU")]))
    assert tracker.index.match(t) == {"w": 4}, "removals in other groups/media ignored"
    tracker.feed("w", 2, payload([stored([14], 12, t[12:16]), removed([12])]))
    snap = tracker.snapshot()["w"]
    assert snap["mode"] == "precise" and snap["events_dropped"] == 0
    assert snap["events_ignored"] == 9 and snap["events_applied"] == 3


def test_sglang_partial_last_page_is_trimmed() -> None:
    tracker = EventTracker(BlockIndex())
    ev = ["BlockStored", [-1, -2, -3], None, toks(10), BS]  # 2 full pages + 2 tokens
    tracker.feed("s", 0, payload([ev], rank=None))
    tracker.feed("s", 1, payload([["BlockStored", [-4], -3, toks(4, 500), BS]], rank=None))
    assert tracker.index.match(toks(12)) == {"s": 8}
    snap = tracker.snapshot()["s"]
    assert snap["mode"] == "precise" and snap["events_ignored"] == 1


def test_precise_view_matches_only_precise_workers() -> None:
    tracker = EventTracker(BlockIndex())
    t = toks(16)
    tracker.feed("p", 0, payload([stored([1, 2], None, t[:8])]))
    tracker.add_worker("a")
    view = PreciseView(tracker)
    assert view.match(t) == ({"p": 8}, {"p"})
    assert view.mode("a") == "approximate" and view.mode("p") == "precise"


# -- a fake engine on loopback -------------------------------------------------------


class FakeEngine:
    """PUB (as XPUB) + ROUTER replay socket, speaking vLLM's wire format."""

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool,
        topic: str,
        replay: bool = True,
        old_replay_format: bool = False,
    ) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.topic = topic.encode()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if bind:
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.old_format = old_replay_format
        self.replay_endpoint: str | None = None
        self.replay_requests = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
            router.bind(self.replay_endpoint)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        assert self.pub.poll(int(timeout * 1000)), "no subscriber arrived"
        assert self.pub.recv()[:1] == b"\x01"

    def publish(self, events: list[Any], *, lose: bool = False) -> int:
        raw = payload(events)
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, raw))
        if not lose:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), raw])
        return seq

    def restart(self) -> None:
        with self.lock:
            self.seq = 0
            self.buffer.clear()

    def forget_before(self, seq: int) -> None:
        """Drop old batches from the replay buffer (vLLM keeps a bounded deque)."""
        with self.lock:
            self.buffer = [(q, p) for q, p in self.buffer if q >= seq]

    def _serve(self, router: zmq.Socket[bytes]) -> None:
        while not self._stop.is_set():
            if not router.poll(20):
                continue
            client, empty, start = router.recv_multipart()
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            with self.lock:
                batches = [(q, p) for q, p in self.buffer if q >= first]
            head = [client, empty] if self.old_format else [client, empty, self.topic]
            for q, p in batches:
                router.send_multipart([*head, q.to_bytes(8, "big"), p])
            end_head = [client, empty] if self.old_format else [client, empty, b""]
            router.send_multipart([*end_head, b"\xff" * 8, b""])
        router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        self.pub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    made: list[FakeEngine] = []
    yield made
    for e in made:
        e.close()


@pytest.mark.parametrize("old_format", [False, True])
def test_gap_with_replay_recovers_exactly(engines: list[FakeEngine], old_format: bool) -> None:
    eng = FakeEngine("tcp://127.0.0.1:*", bind=True, topic="t", old_replay_format=old_format)
    engines.append(eng)
    assert eng.replay_endpoint is not None
    tracker = EventTracker(BlockIndex(), replayer=ZmqReplayer(timeout_s=2.0))
    tracker.add_worker("w", eng.replay_endpoint)
    t = toks(16)

    def feed_last() -> None:
        seq, raw = eng.buffer[-1]
        tracker.feed("w", seq, raw)

    eng.publish([stored([1, 2], None, t[:8])])
    feed_last()
    eng.publish([stored([3], 2, t[8:12])], lose=True)
    eng.publish([removed([1])], lose=True)
    eng.publish([stored([1], None, t[:4]), stored([4], 3, t[12:16])])
    feed_last()
    snap = tracker.snapshot()["w"]
    assert snap["mode"] == "precise" and snap["gaps"] == 1 and snap["replays"] == 1
    assert snap["last_seq"] == 3 and snap["batches"] == 4 and eng.replay_requests == 1
    assert tracker.index.match(t) == {"w": 16}
    assert tracker.index.cached_blocks("w") == 4

    # The engine's buffer no longer holds the lost batch: incomplete replay -> stale.
    eng.publish([removed([4])], lose=True)
    eng.forget_before(eng.seq)
    eng.publish([])
    feed_last()
    snap = tracker.snapshot()["w"]
    assert snap["mode"] == "stale" and snap["replay_failures"] == 1 and snap["gaps"] == 2
    assert tracker.index.cached_blocks("w") == 0


def test_replay_timeout_goes_stale() -> None:
    silent = f"tcp://127.0.0.1:{free_port()}"  # nobody answers there
    tracker = EventTracker(BlockIndex(), replayer=ZmqReplayer(timeout_s=0.2))
    tracker.add_worker("w", silent)
    tracker.feed("w", 0, payload([stored([1], None, toks(4))]))
    t0 = time.monotonic()
    tracker.feed("w", 2, payload([]))
    assert time.monotonic() - t0 < 2
    snap = tracker.snapshot()["w"]
    assert snap["mode"] == "stale" and snap["replay_failures"] == 1


# -- the subscriber over real sockets ------------------------------------------------


def stop_within(sub: KvEventSubscriber, bound: float = 2.0) -> None:
    t0 = time.monotonic()
    assert sub.stop(timeout_s=bound)
    assert time.monotonic() - t0 < bound and not sub.running


def test_subscriber_binds_for_many_engines(engines: list[FakeEngine]) -> None:
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    specs = [f"http://127.0.0.1:{8000 + i}={ep};bind;topic=kv@{i}" for i in range(2)]
    sources = parse_kv_events(specs)
    tracker = EventTracker(BlockIndex())
    sub = KvEventSubscriber(sources, tracker, poll_interval_s=0.05)
    registry = CollectorRegistry()
    register_kv_event_metrics(registry, tracker, sub)
    sub.start()
    try:
        assert set(sub.endpoints().values()) == {ep}
        for i in range(2):
            engines.append(FakeEngine(ep, bind=False, topic=f"kv@{i}", replay=False))
            engines[-1].wait_subscribed()
        # Subscriptions are prefixes: "kv@1x" reaches us, exact topic routing drops it.
        stray = FakeEngine(ep, bind=False, topic="kv@1x", replay=False)
        engines.append(stray)
        stray.wait_subscribed()
        w0, w1 = (s.worker for s in sources)
        assert tracker.mode(w0) == "approximate"
        t = toks(12)
        engines[0].publish([stored([1, 2, 3], None, t)])
        engines[1].publish([stored([-9], None, t[:4])])
        engines[1].publish([stored([-8], -9, t[4:8])])
        stray.publish([stored([5], None, t)])
        wait_for(lambda: tracker.index.match(t) == {w0: 12, w1: 8}, what="both engines")
        assert tracker.mode(w0) == tracker.mode(w1) == "precise"
        wait_for(lambda: sub.unrouted == 1, what="stray topic counted")
        # A lost message (no replay endpoint) makes that worker alone stale.
        engines[1].publish([removed([-8])], lose=True)
        engines[1].publish([])
        wait_for(lambda: tracker.mode(w1) == "stale", what="stale")
        assert tracker.mode(w0) == "precise"
        assert PreciseView(tracker).match(t) == ({w0: 12}, {w0})
        text = generate_latest(registry).decode()
        assert f'kvroute_kv_events_gaps_total{{worker="{w1}"}} 1.0' in text
        assert f'kvroute_kv_events_batches_total{{worker="{w0}"}} 1.0' in text
        assert f'kvroute_kv_events_worker_mode{{mode="stale",worker="{w1}"}} 1.0' in text
        assert "kvroute_kv_events_unrouted_messages_total 1.0" in text
        assert f'kvroute_kv_events_received_total{{worker="{w1}"}} 2.0' in text
    finally:
        stop_within(sub)


def test_subscriber_connects_to_engines_with_replay_and_restart(
    engines: list[FakeEngine],
) -> None:
    eng = FakeEngine(f"tcp://127.0.0.1:{free_port()}", bind=True, topic="kv@x")
    engines.append(eng)
    worker = "http://127.0.0.1:9001"
    source = parse_kv_events_spec(f"{worker}={eng.endpoint};replay={eng.replay_endpoint}")
    assert not source.bind and source.topic is None
    tracker = EventTracker(BlockIndex())
    sub = KvEventSubscriber([source], tracker, poll_interval_s=0.05)
    sub.start()
    try:
        eng.wait_subscribed()
        t = toks(16)
        eng.publish([stored([1, 2], None, t[:8])])
        eng.publish([stored([3], 2, t[8:12])], lose=True)
        eng.publish([stored([4], 3, t[12:16])])
        wait_for(lambda: tracker.index.match(t) == {worker: 16}, what="replayed state")
        snap = tracker.snapshot()[worker]
        assert snap["replays"] == 1 and snap["mode"] == "precise" and eng.replay_requests == 1
        eng.restart()
        eng.publish([stored([50], None, toks(4, 7000))])
        wait_for(lambda: tracker.snapshot()[worker]["restarts"] == 1, what="restart")
        assert tracker.index.match(t) == {} and tracker.mode(worker) == "precise"
        assert tracker.index.match(toks(4, 7000)) == {worker: 4}
        # Workers can be added and removed while it runs (admin API).
        other = FakeEngine(f"tcp://127.0.0.1:{free_port()}", bind=True, topic="", replay=False)
        engines.append(other)
        sub.add_source(KvEventSource("http://127.0.0.1:9002", other.endpoint))
        other.wait_subscribed()
        other.publish([stored([1], None, toks(4, 7000))])
        wait_for(lambda: len(tracker.index.match(toks(4, 7000))) == 2, what="added source")
        sub.remove_source("http://127.0.0.1:9002")
        assert tracker.index.match(toks(4, 7000)) == {worker: 4}
        assert "http://127.0.0.1:9002" not in tracker.snapshot()
    finally:
        stop_within(sub)


def test_subscriber_start_fails_cleanly_on_bind_error() -> None:
    blocker: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = blocker.socket(zmq.PUB)
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        src = KvEventSource("http://a:1", f"tcp://127.0.0.1:{port}", bind=True)
        sub = KvEventSubscriber([src], EventTracker(BlockIndex()))
        with pytest.raises(OSError, match="cannot bind"):
            sub.start()
        assert not sub.running
    finally:
        sock.close(linger=0)
        blocker.term()


def test_subscriber_configured_before_start_or_never_started() -> None:
    tracker = EventTracker(BlockIndex())
    sub = KvEventSubscriber([], tracker)
    sub.add_source(KvEventSource("http://a:1", f"tcp://127.0.0.1:{free_port()}"))
    assert tracker.mode("http://a:1") == "approximate" and "http://a:1" in sub.sources
    sub.remove_source("http://a:1")
    assert "http://a:1" not in tracker.snapshot()
    assert sub.stop() and sub.stop()
    with pytest.raises(RuntimeError, match="starts once"):
        sub.start()


def test_lora_blocks_go_to_their_adapter_partition() -> None:
    from kvroute.fleet.models import adapter_partition

    tracker = EventTracker(BlockIndex(), partition_of=adapter_partition)
    view = PreciseView(tracker)
    t = toks(12)
    tracker.feed(
        "w",
        0,
        payload(
            [
                stored([1, 2], None, t[:8], lora_id=1, lora_name="sql"),
                stored([3], 2, t[8:12], lora_id=1, lora_name="sql"),  # child in the partition
                stored([9], None, t[:4]),  # the base model's first block
                stored([50], None, t[:4], lora_id=2),  # an ID without a name: not keyable
            ]
        ),
    )
    sql, chat = adapter_partition("sql"), adapter_partition("chat")
    assert view.match([sql, *t])[0] == {"w": 13}, "partition token + 3 blocks"
    assert view.match(t)[0] == {"w": 4}, "the base model sees only its own block"
    assert view.match([chat, *t])[0] == {}, "another adapter shares nothing"
    assert tracker.snapshot()["w"]["cached_tokens"] == 16
    tracker.feed("w", 1, payload([removed([2])]))
    assert view.match([sql, *t])[0] == {"w": 5}, "a removal reaches the partition"
    tracker.feed("w", 2, payload([{"type": "AllBlocksCleared"}]))
    assert view.match([sql, *t])[0] == {} and view.match(t)[0] == {}
    # Without partitions (the tracker's default) LoRA blocks stay ignored.
    plain = EventTracker(BlockIndex())
    plain.feed("w", 0, payload([stored([1, 2], None, t[:8], lora_id=1, lora_name="sql")]))
    assert plain.partitions == {} and plain.index.match(t) == {}
