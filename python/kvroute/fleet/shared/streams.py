"""Which streams a router reads, and from where (``StateStore``'s reading half).

Each router writes its decisions and load changes to a stream of its own,
``kvroute:stream:<id>``, and reads the others' (plus the shared ``kvroute:stream``, where
membership changes, cache flushes and routers' greetings go) with one ``XREAD BLOCK``
over all of them. Why not one stream for everything: every reader wakes for every entry,
its own included, and with requests arriving one at a time reading back its own three
entries per request (decision, first byte, end) cost a router more CPU than writing
them (``bench/shared_state_overhead.py``). A router's own stream is never in its read
set, so it reads only what others wrote.

Which peers: at each (re)connection every router's stream the registry lists
(``heartbeat``) and every ``kvroute:stream:*`` found (``SCAN``), so a new router replays
the decisions of every router that wrote recently, live or not; then each router
another one greets (kind ``h`` on the shared stream, written when it connects, so the
others follow it at once) or that a heartbeat shows live. A stream whose
router is no longer live is dropped from the read set once read to its end; its last id
is remembered, so a router that comes back is read on from there, never twice. A router
that greeted counts as live for a heartbeat TTL (``greet``) whether or not the last
heartbeat read listed it: that read may predate the greeting, and a stream dropped then
was only followed again at the next heartbeat and read once the ``XREAD`` already
blocked had returned (up to ``READ_BLOCK_MS`` when the other streams were quiet), so the
new router's first decisions went unseen for seconds. A stream followed at a heartbeat
(a router that never greeted, or one whose heartbeat had lapsed) ends the blocked
``XREAD`` (``unasked``, ``Pushes.reread``), so it is read at once. Each router's stream
expires ``STREAM_TTL_MS`` after its last heartbeat.

A followed router that publishes its entries (``pushes``) leaves the ``XREAD`` once
its pushes are known to carry everything after what was read (``live``), and comes back
to it whenever they are not.

After a reconnection (``check``): a stream whose newest entry is older than the last
one read was recreated (Redis restarted empty) and is read from its start; one whose
oldest entry is newer than the last one read was trimmed past it (this router fell more
than ``--state-store-stream-len`` entries behind): counted as a gap.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import Any

import redis.asyncio as aioredis

import kvroute.fleet.shared.wire as wire

STREAM_TTL_MS = 3_600_000  # a router's stream outlives it by an hour: replayed by new routers


class Streams:
    def __init__(self, own: bytes) -> None:
        self.own = own
        self.last: dict[bytes, bytes] = {wire.STREAM_B: b"0"}  # every stream seen -> last id
        self.reading: set[bytes] = {wire.STREAM_B}
        self.greeted: dict[bytes, float] = {}  # stream key -> live until (monotonic s)
        # Followed streams whose entries come pushed (``pushes``): left out of the XREAD.
        self.live: set[bytes] = set()
        self.round = 0  # XREADs sent so far (``pushes``: which one came after what)
        self.asked: Collection[bytes] = ()  # the streams of the last XREAD sent

    def follow(self, key: bytes) -> None:
        """Read ``key`` (from where it was left, or its start)."""
        if key != self.own:
            self.last.setdefault(key, b"0")
            self.reading.add(key)

    def greet(self, key: bytes, live_s: float) -> None:
        """A router greeted (``key``, its stream): read it, and keep reading it for
        ``live_s`` even while no heartbeat read lists it yet."""
        if key != self.own:
            self.follow(key)
            self.greeted[key] = time.monotonic() + live_s

    def follow_routers(self, ids: Iterable[str | bytes]) -> None:
        for rid in ids:
            self.follow(wire.stream_of(rid if isinstance(rid, bytes) else rid.encode()))

    def routers(self) -> list[str]:
        """The ids of the routers whose streams are read."""
        skip = len(wire.STREAM_B) + 1
        return [key[skip:].decode(errors="replace") for key in self.reading if key != wire.STREAM_B]

    def read_args(self) -> dict[bytes, bytes]:
        """The streams to ``XREAD`` next and from where; counts the read (``round``)."""
        self.round += 1
        live = self.live
        asked = {key: self.last[key] for key in self.reading if key not in live}
        self.asked = asked.keys()
        return asked

    def unasked(self) -> bool:
        """Is a stream followed since the last ``XREAD`` was sent, and not pushed? That
        ``XREAD`` does not hold it, and may block for ``READ_BLOCK_MS`` on quiet streams
        (with pushes, the shared stream alone) before the next one does."""
        asked, live = self.asked, self.live
        return any(key not in asked and key not in live for key in self.reading)

    def done_reading(
        self,
        asked: Iterable[bytes],
        full: set[bytes],
        live: set[bytes],
        now: float | None = None,
    ) -> None:
        """After an ``XREAD`` of ``asked``: drop the streams of routers not ``live`` (by
        stream key) nor greeted within their ``greet`` time that are read to their end
        (not in ``full``: no batch came back whole). With ``live`` empty (no heartbeat
        read yet) nothing is dropped."""
        if not live:
            return
        greeted = self.greeted
        if greeted:
            now = time.monotonic() if now is None else now
            for key in [k for k, until in greeted.items() if until <= now]:
                del greeted[key]
        for key in asked:
            if key != wire.STREAM_B and key not in live and key not in full and key not in greeted:
                self.reading.discard(key)
        for key in [k for k in self.live if k not in live and k not in greeted]:  # pushed, gone
            self.reading.discard(key)

    async def discover(self, client: aioredis.Redis) -> None:
        """At (re)connection: every router's stream the registry lists (``heartbeat``),
        and every one a ``SCAN`` finds (streams written by routers that do not stamp
        the registry; once per connection, not per heartbeat)."""
        ids: Any = await client.zrange(wire.ROUTERS, 0, -1)
        self.follow_routers(ids)
        async for key in client.scan_iter(match=wire.STREAM + ":*", count=1000):
            self.follow(key)

    async def check(self, client: aioredis.Redis) -> int:
        """After reconnecting: restart recreated streams, count gaps (module doc)."""
        gaps = 0
        for key, last_id in list(self.last.items()):
            if last_id == b"0" or key not in self.reading:
                continue
            latest: Any = await client.xrevrange(key, count=1)
            first: Any = await client.xrange(key, count=1)
            last = wire.parse_id(last_id)
            if not latest or wire.parse_id(latest[0][0]) < last:
                self.last[key] = b"0"  # a new stream: read it from the start
            elif first and wire.parse_id(first[0][0]) > last:
                gaps += 1
        return gaps
