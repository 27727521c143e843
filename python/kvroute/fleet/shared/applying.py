"""Applying the other routers' stream entries to this router's state (``StateStore``'s
reading half, kept apart from the connection handling in ``store``).

Each entry read off the stream (``wire``) is applied in order: decisions go into the
digest-keyed index (and, for a router without a load model, count as one more request
on their worker until the publisher's next heartbeat); the load an entry carries
replaces what was known of the publisher's (``loads``); membership changes and cache
flushes go to ``members`` and the index.
Entries this router wrote itself were applied when it made them and are skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import kvroute.fleet.shared.wire as wire
from kvroute.config import ConfigError, normalize_worker_url

log = logging.getLogger("kvroute.fleet.shared")

if TYPE_CHECKING:
    from kvroute.fleet.registry import Registry
    from kvroute.fleet.shared.digests import DigestIndex
    from kvroute.fleet.shared.loads import SharedLoad
    from kvroute.fleet.shared.members import Membership
    from kvroute.fleet.shared.streams import Streams


@dataclass
class StoreCounters:
    published: int = 0
    applied: dict[str, int] = field(
        default_factory=lambda: {"insert": 0, "added": 0, "removed": 0, "cleared": 0}
    )
    dropped: int = 0
    refused: int = 0  # decisions of routers whose index is keyed differently
    malformed: int = 0
    errors: int = 0
    gaps: int = 0
    connects: int = 0
    lag_s: float = 0.0  # publish -> apply, of the last peer entry applied


class Applier:
    """The applying methods; ``StateStore`` sets these attributes."""

    _rid: bytes
    _foreign: set[bytes]
    keying: bytes
    ttl_ms: int
    index: DigestIndex | None
    registry: Registry
    members: Membership
    shared_load: SharedLoad | None
    counters: StoreCounters
    peer_load: dict[str, int]
    streams: Streams

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"r") == self._rid:
            return  # our own entry: applied when it was decided
        kind = fields.get(b"k")
        queued = fields.get(b"p")
        if queued and self.shared_load is not None:
            try:
                self.shared_load.apply(fields.get(b"r", b""), queued)
                ends = fields.get(wire.ENDS)
                if ends:
                    self.shared_load.apply_ends(fields.get(b"r", b""), ends)
            except ValueError:
                self.counters.malformed += 1
        if kind == wire.LOAD:
            return
        if kind == wire.HELLO:  # a router connected: read its stream from now on
            self.streams.greet(wire.stream_of(fields.get(b"r", b"")), self.ttl_ms / 1000)
            return
        if kind == wire.INSERT:
            theirs = fields.get(wire.KEYING)
            if theirs is not None and theirs != self.keying and self.keying:
                self._refuse(fields.get(b"r", b""), theirs, fields.get(b"b", b""))
                return
            t = fields.get(b"t", b"")
            lag_ms = max(wire.now_ms() - int(t), 0) if t.isdigit() else self.ttl_ms
            self.counters.lag_s = lag_ms / 1000
            try:
                for url, digests in wire.unpack_inserts(fields.get(b"b", b"")):
                    self._apply_insert(url, digests, recent=lag_ms < self.ttl_ms)
            except ValueError:
                self.counters.malformed += 1
            return
        if kind == wire.CLEARED:
            if self.index is not None:
                self.index.clear()
            self.counters.applied["cleared"] += 1
            return
        worker = self._worker(fields.get(b"w", b""))
        if worker is not None and kind in (wire.ADDED, wire.REMOVED):
            self.members.apply(kind, worker)
        else:
            self.counters.malformed += 1

    def _refuse(self, router: bytes, theirs: bytes, blob: bytes) -> None:
        """Decisions of a router whose index keys are made of something else (another
        tokenizer or chat template, or bytes): their digests never match this router's
        prompts, and inserted they would only crowd out its own entries. Counted, and
        said once per router. (Entries without a keying, from routers before it was
        sent, are applied.)"""
        try:
            self.counters.refused += sum(1 for _ in wire.unpack_inserts(blob))
        except ValueError:
            self.counters.malformed += 1
        if router not in self._foreign:
            self._foreign.add(router)
            log.warning(
                "state store: router %s keys its index on %s, this one on %s: its routing "
                "decisions are not applied here (give every replica the same --tokenizer)",
                router.decode(errors="replace"),
                theirs.decode(errors="replace"),
                self.keying.decode(errors="replace"),
            )

    def _worker(self, raw: bytes) -> str | None:
        """A worker URL from the stream, validated (None if it is not one)."""
        try:
            return normalize_worker_url(raw.decode())
        except (UnicodeDecodeError, ConfigError):
            return None

    def _apply_insert(self, raw: bytes, digests: bytes, *, recent: bool) -> None:
        worker = raw.decode(errors="replace")
        if worker not in self.registry.workers:
            return  # not (or no longer) in this router's fleet: nothing to predict
        if self.index is not None:
            self.index.insert_digests(worker, digests)
        self.counters.applied["insert"] += 1
        if recent and self.shared_load is None:
            # A request the peer just sent there: count it until its next heartbeat
            # reports the peer's exact load (which replaces this estimate). With the
            # load shared as it changes, the reservation rides with the decision.
            self.peer_load[worker] = self.peer_load.get(worker, 0) + 1
