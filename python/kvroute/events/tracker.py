"""Per-worker event streams: sequence tracking and recovery, feeding the ``BlockIndex``.

Each worker's stream is a small state machine over the batch sequence numbers:

* ``approximate``: configured, no batch yet. The router uses the approximate index.
* ``precise``: every batch since the state was last known-complete has been applied
  in order. The router trusts the ``BlockIndex`` for this worker.
* ``stale``: events were lost (seq gap without a successful replay, a payload that
  does not decode, a ``BlockStored`` whose parent is unknown) or we joined mid-stream.
  The worker's blocks are cleared at once, so the index never claims a block the
  engine may have evicted in the lost events; the router uses the approximate index
  for it meanwhile. The index rebuilds from the new events (blocks whose parent is
  unknown cannot be keyed and are skipped).

Back to ``precise`` ("rebuilt") when either
  - ``AllBlocksCleared`` arrives (the engine's cache is empty: fully known again), or
  - the engine restarts with seq 0 (same: its cache is empty), or
  - ``rebuild_batches`` (default 64) batches have been applied in order since the
    worker went stale. This is a heuristic: vLLM has no snapshot, and blocks that stay
    cached without being re-reported remain unknown to us until they are evicted and
    recomputed. It only ever under-reports (the state is a subset of the engine's).

Transitions on a batch with seq ``s`` when the last applied seq is ``l``:
  - ``s == l + 1`` (or the first batch has ``s == 0``): apply.
  - ``s > l + 1`` (or first batch with ``s > 0``): a gap. With a replay endpoint the
    missing batches ``l+1 .. s-1`` are fetched and applied first (the worker leaves
    ``precise`` while the replay runs, without clearing); if the replay does not return
    all of them, or without a replay endpoint, the worker goes ``stale``. Then ``s`` is
    applied.
  - ``s <= l``: the engine restarted (seq starts at 0 again). Its state is dropped and
    ``s`` is handled as the first batch of a new stream.
  - A restart whose new seq has passed ``l`` before any of its batches reaches us looks
    in order; the router's health checker covers that case by calling ``reset(worker)``
    when a worker goes down (state dropped, ``approximate`` until its next batch).

Events kvroute cannot key by token IDs alone (multimodal, other media or KV cache
groups; LoRA without partitions) are skipped: see ``kvroute.events.keyable``.

LoRA partitions: with ``partition_of`` (adapter name -> the partition token the router
puts before that adapter's requests, ``kvroute.fleet.models``), a block stored under a
named LoRA adapter goes to that adapter's own ``BlockIndex`` in ``partitions``, keyed by
the partition token, so a request for the adapter (whose tokens start with that token)
is matched against what the engine caches for that adapter and nothing else.
Removals, clears and resets apply to every partition.

Threading: ``feed`` is called by one thread (the subscriber); ``mode``,
``precise_workers`` and ``snapshot`` from any thread (``kvroute.events.view``). A replay
runs without holding the state lock, so readers never wait for the network.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from kvroute._native import BlockIndex, UnknownParentError
from kvroute.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventDecodeError,
    decode_batch,
)
from kvroute.events.keyable import KeyableFilter

log = logging.getLogger("kvroute.events")

Mode = Literal["approximate", "precise", "stale"]
MODES: tuple[Mode, ...] = ("approximate", "precise", "stale")

# (replay endpoint, first seq wanted) -> [(seq, payload), ...] in the order received.
# Raises ReplayError (or OSError / zmq errors) when the engine does not answer in time.
Replayer = Callable[[str, int], Sequence[tuple[int, bytes]]]


@dataclass
class WorkerCounters:
    """Monotonic counters for one worker's stream (exported as ``*_total``)."""

    batches: int = 0  # batches received (live and replayed)
    batches_dropped: int = 0  # payloads that did not decode
    events_received: int = 0
    events_applied: int = 0
    events_ignored: int = 0  # unknown types, LoRA / extra keys, other media or groups
    events_dropped: int = 0  # could not be applied (unknown parent, bad shape)
    gaps: int = 0  # seq jumped forward (or first batch mid-stream)
    replays: int = 0  # gaps fully recovered by replay
    replay_failures: int = 0
    restarts: int = 0  # seq went backwards
    unknown_parents: int = 0  # BlockStored with an unknown parent while precise
    stale_transitions: int = 0


COUNTER_NAMES: tuple[str, ...] = tuple(f.name for f in fields(WorkerCounters))


@dataclass
class _Stream:
    replay_endpoint: str | None
    mode: Mode = "approximate"
    last_seq: int | None = None
    replaying: bool = False
    epoch: int = 0  # bumped by reset / removal: a batch in flight then is discarded
    in_order_since_stale: int = 0
    keys: KeyableFilter = field(default_factory=KeyableFilter)
    counters: WorkerCounters = field(default_factory=WorkerCounters)


class EventTracker:
    """Applies each worker's event stream to a ``BlockIndex`` and tracks its mode."""

    def __init__(
        self,
        index: BlockIndex | None = None,
        *,
        rebuild_batches: int = 64,
        replayer: Replayer | None = None,
        partition_of: Callable[[str], int] | None = None,
    ) -> None:
        if rebuild_batches < 1:
            raise ValueError("rebuild_batches must be >= 1")
        self.index = index if index is not None else BlockIndex()
        self.rebuild_batches = rebuild_batches
        self.replayer = replayer
        self.partition_of = partition_of
        self.partitions: dict[int, BlockIndex] = {}  # partition token -> adapter's blocks
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and every _Stream
        self._feed_lock = threading.Lock()  # one feeder at a time

    # -- configuration ---------------------------------------------------------------

    def add_worker(self, worker: str, replay_endpoint: str | None = None) -> None:
        """Expect events for ``worker`` (mode ``approximate`` until its first batch)."""
        with self._lock:
            s = self._streams.get(worker)
            if s is None:
                self._streams[worker] = _Stream(replay_endpoint)
            else:
                s.replay_endpoint = replay_endpoint

    def remove_worker(self, worker: str) -> None:
        """Forget the worker's stream and blocks (it left the fleet)."""
        with self._lock:
            s = self._streams.pop(worker, None)
            if s is not None:
                s.epoch += 1
            for index in self._indexes():
                index.remove_worker(worker)

    def reset(self, worker: str) -> None:
        """Drop the worker's blocks and sequence: call when the worker went down (it may
        restart, and a restart whose new seq overtakes the last one we saw before any of
        its batches reaches us would not be detected from the seq). ``approximate``
        until its next batch. Never waits for the network (safe on the event loop)."""
        with self._lock:
            s = self._streams.get(worker)
            if s is not None:
                s.epoch += 1
                s.replaying = False
                self._reset(worker, s, "approximate")

    # -- reading (any thread) --------------------------------------------------------

    def mode(self, worker: str) -> Mode:
        """``approximate`` for a worker without (trusted-so-far) events, else its mode."""
        with self._lock:
            s = self._streams.get(worker)
            if s is None:
                return "approximate"
            return "stale" if s.replaying else s.mode

    def precise_workers(self) -> set[str]:
        with self._lock:
            return {w for w, s in self._streams.items() if s.mode == "precise" and not s.replaying}

    def snapshot(self) -> dict[str, dict[str, int | str]]:
        """Per worker: ``mode``, ``last_seq`` (-1 before any), the counters, and
        ``cached_blocks`` / ``cached_tokens`` from the index."""
        with self._lock:
            out: dict[str, dict[str, int | str]] = {}
            for w, s in self._streams.items():
                row: dict[str, int | str] = {
                    "mode": "stale" if s.replaying else s.mode,
                    "last_seq": -1 if s.last_seq is None else s.last_seq,
                }
                row.update(vars(s.counters))
                out[w] = row
        for w, row in out.items():
            row["cached_blocks"] = sum(i.cached_blocks(w) for i in self._indexes())
            row["cached_tokens"] = sum(i.cached_tokens(w) for i in self._indexes())
        return out

    # -- feeding (the subscriber thread) ---------------------------------------------

    def feed(self, worker: str, seq: int, payload: bytes) -> None:
        """One message from ``worker``'s stream: decode it and apply it in order."""
        with self._feed_lock:
            try:
                batch: KvEventBatch | None = decode_batch(payload)
            except KvEventDecodeError as e:
                log.warning("kv events from %s: dropped batch %d: %s", worker, seq, e)
                batch = None
            self._feed(worker, seq, batch)

    def _feed(self, worker: str, seq: int, batch: KvEventBatch | None) -> None:
        with self._lock:
            s = self._streams.get(worker)
            if s is None:
                s = self._streams[worker] = _Stream(None)
            if s.last_seq is not None and seq <= s.last_seq:
                log.warning(
                    "kv events from %s: seq %d after %d, engine restarted", worker, seq, s.last_seq
                )
                s.counters.restarts += 1
                self._reset(worker, s, "approximate")
            expected = 0 if s.last_seq is None else s.last_seq + 1
            gap = seq > expected
            if gap:
                s.counters.gaps += 1
                s.replaying = s.replay_endpoint is not None and self.replayer is not None
            endpoint = s.replay_endpoint
            epoch = s.epoch
        if gap:
            recovered = endpoint is not None and self._replay(
                worker, s, epoch, endpoint, expected, seq
            )
            with self._lock:
                if not self._current(worker, s, epoch):
                    return
                s.replaying = False
                if not recovered:
                    log.warning(
                        "kv events from %s: batches %d..%d lost; stale until rebuilt",
                        worker,
                        expected,
                        seq - 1,
                    )
                    self._go_stale(worker, s)
        with self._lock:
            if self._current(worker, s, epoch):
                self._apply(worker, s, seq, batch)

    def _current(self, worker: str, s: _Stream, epoch: int) -> bool:
        """False if the stream was reset or removed since ``epoch`` was read."""
        return self._streams.get(worker) is s and s.epoch == epoch

    def _replay(
        self, worker: str, s: _Stream, epoch: int, endpoint: str, start: int, stop: int
    ) -> bool:
        """Fetch and apply batches ``start .. stop-1``; True if all of them were applied."""
        if self.replayer is None:
            return False
        try:
            got = self.replayer(endpoint, start)
        except Exception as e:  # network errors of any kind: fall back to stale
            log.warning("kv events from %s: replay from %d failed: %s", worker, start, e)
            with self._lock:
                s.counters.replay_failures += 1
            return False
        wanted = [(q, p) for q, p in got if start <= q < stop]
        if [q for q, _ in wanted] != list(range(start, stop)):
            with self._lock:
                s.counters.replay_failures += 1
            log.warning("kv events from %s: replay from %d incomplete", worker, start)
            return False
        losses = s.counters.stale_transitions
        for q, payload in wanted:
            try:
                batch: KvEventBatch | None = decode_batch(payload)
            except KvEventDecodeError:
                batch = None
            # One batch per lock hold: readers are not kept waiting by a long replay, and
            # see the worker as not precise (replaying) until it is complete.
            with self._lock:
                if not self._current(worker, s, epoch):
                    return False
                self._apply(worker, s, q, batch)
        with self._lock:
            if s.counters.stale_transitions != losses:
                return False  # the replayed events themselves could not be applied
            s.counters.replays += 1
            return True

    # -- under self._lock ------------------------------------------------------------

    def _indexes(self) -> list[BlockIndex]:
        return [self.index, *self.partitions.values()]

    def _index_for(self, ev: BlockStored) -> BlockIndex:
        if ev.lora_name is None or self.partition_of is None:
            return self.index
        token = self.partition_of(ev.lora_name)
        index = self.partitions.get(token)
        if index is None:
            index = self.partitions[token] = BlockIndex()
        return index

    def _reset(self, worker: str, s: _Stream, mode: Mode) -> None:
        for index in self._indexes():
            index.clear_worker(worker)
        s.keys.clear()
        s.last_seq = None
        s.mode = mode
        s.in_order_since_stale = 0

    def _go_stale(self, worker: str, s: _Stream) -> None:
        last = s.last_seq
        if s.mode != "stale":
            s.counters.stale_transitions += 1
        self._reset(worker, s, "stale")
        s.last_seq = last

    def _apply(self, worker: str, s: _Stream, seq: int, batch: KvEventBatch | None) -> None:
        c = s.counters
        c.batches += 1
        s.last_seq = seq
        if batch is None:
            c.batches_dropped += 1
            self._go_stale(worker, s)
            return
        c.events_received += len(batch.events) + batch.unknown
        c.events_ignored += batch.unknown
        if s.mode == "approximate":
            s.mode = "precise"
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(worker, s, ev)
            elif isinstance(ev, BlockRemoved):
                if not s.keys.wanted(ev.medium, ev.group_idx):
                    c.events_ignored += 1
                    continue
                s.keys.removed(ev.block_hashes)
                for index in self._indexes():
                    index.removed(worker, ev.block_hashes)
                c.events_applied += 1
            elif isinstance(ev, AllBlocksCleared):
                for index in self._indexes():
                    index.clear_worker(worker)
                s.keys.clear()
                s.mode = "precise"
                c.events_applied += 1
        if s.mode == "stale":
            s.in_order_since_stale += 1
            if s.in_order_since_stale >= self.rebuild_batches:
                log.info("kv events from %s: rebuilt, precise again", worker)
                s.mode = "precise"

    def _stored(self, worker: str, s: _Stream, ev: BlockStored) -> None:
        c = s.counters
        if not s.keys.wanted(ev.medium, ev.group_idx, ev.kv_cache_spec_kind):
            c.events_ignored += 1
            return
        keep = s.keys.keyable(ev, named_lora=self.partition_of is not None)
        if keep == 0:
            c.events_ignored += 1
            return
        try:
            self._index_for(ev).stored(
                worker,
                ev.parent_block_hash,
                ev.block_hashes[:keep],
                ev.token_ids[: keep * ev.block_size],
                ev.block_size,
            )
        except UnknownParentError:
            c.events_dropped += 1
            if s.mode == "precise":
                c.unknown_parents += 1
                log.warning("kv events from %s: unknown parent block; stale", worker)
                self._go_stale(worker, s)
            return
        except ValueError as e:
            c.events_dropped += 1
            log.warning("kv events from %s: bad BlockStored: %s", worker, e)
            return
        c.events_applied += 1
