"""The other routers' entries pushed to this one (Redis pub/sub), instead of read by
``XREAD`` one reply at a time (``StateStore``'s reading half, with ``streams``).

Why: beside a peer, most of what the store cost a router was two sends per request on
loopback (this router's write, and the ``XREAD`` sent again after each peer entry it
read), each waking Redis (``docs/several-routers.md``). Each router publishes every
entry it writes to its stream on its own channel too (``wire.channel_of``, in the same
write). A router subscribes to a peer's channel on its publishing connection (RESP3:
the pushes come on a connection that sends writes Redis does not answer). It reads
the pushes there, and sends nothing per entry.

The streams stay the record. A peer's stream is read by ``XREAD`` until its pushes are
known to carry everything after what was read:

1. The peer says in its heartbeat that it publishes (``pushes`` in its info; routers
   of earlier versions do not, and their streams stay read by ``XREAD``).
2. This router subscribes; Redis confirms. Pushes from then on are kept, in order.
3. The next ``XREAD`` sent after the confirmation that reads the peer's stream to its
   end (fewer entries than asked for) has read everything before those pushes: the
   stream goes *live*. It leaves the ``XREAD`` (``Streams.live``), and the kept pushes
   after its last entry are applied, in order. A number missing among them was in
   neither (a write cut short before Redis had either half): it is not waited for.
4. Live, each push is applied when it comes if its id follows the last one applied
   (``wire.follows``: a router's ids count 1, 2, 3...). One already seen is skipped.
   After a missing one (a peer's write cut between its ``XADD`` and its ``PUBLISH``),
   the stream leaves the live set and is read by ``XREAD`` again from the last id,
   with the pushes kept, as in 2 and 3.

A peer that stops saying it publishes, or is no longer live, is unsubscribed and
read by ``XREAD`` again from its last id. Losing the connection ends the session, as
any store error does. The next session subscribes again and starts again from 2.
Without RESP3 (Redis 5) nothing is subscribed and every stream is read by ``XREAD``,
as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import kvroute.fleet.shared.wire as wire
from kvroute.fleet.shared.direct import pack

if TYPE_CHECKING:
    import asyncio

    from kvroute.fleet.shared.streams import Streams

log = logging.getLogger("kvroute.fleet.shared")

KEPT = 4096  # pushes kept per peer while its stream catches up; more: start again at 2

Entry = tuple[bytes, dict[bytes, bytes]]  # entry id, fields


class Pushes:
    """Subscriptions to the peers' channels, on one session's publishing connection."""

    def __init__(self, streams: Streams, apply: Callable[[dict[bytes, bytes]], None]) -> None:
        self.streams = streams
        self._apply = apply
        self.writer: asyncio.StreamWriter | None = None  # the session's, when it has RESP3
        # ``CLIENT UNBLOCK`` of the session's reading connection (None: Redis refuses
        # CLIENT): ends its blocked XREAD when a stream leaves the live set, so the next
        # one reads it at once instead of up to a block later.
        self.unblock: bytes | None = None
        # Per peer (router id): the read round its subscription was confirmed in (None:
        # asked, not confirmed yet), and the pushes kept until its stream is live.
        self.subscribed: dict[bytes, int | None] = {}
        self.kept: dict[bytes, list[Entry]] = {}
        self.received = 0  # pushes applied
        self.gaps = 0  # pushes that came after a missing one

    def reset(self, writer: asyncio.StreamWriter | None, reader_id: int | None = None) -> None:
        """A new session: nothing subscribed; every stream read by ``XREAD``.
        ``reader_id``: the reading connection's ``CLIENT ID``."""
        self.writer = writer
        self.unblock = None if reader_id is None else pack(("CLIENT", "UNBLOCK", reader_id))
        self.subscribed.clear()
        self.kept.clear()
        self.streams.live.clear()

    def want(self, publishing: Iterable[bytes]) -> None:
        """``publishing``: the peers that say they publish, live at the last heartbeat.
        Subscribe to the ones this router follows; leave the others."""
        writer = self.writer
        if writer is None:
            return
        reading, own = self.streams.reading, self.streams.own
        wanted = {
            rid for rid in publishing if (key := wire.stream_of(rid)) in reading and key != own
        }
        for rid in wanted - self.subscribed.keys():
            self.subscribed[rid] = None
            writer.write(pack(("SUBSCRIBE", wire.channel_of(rid))))
        for rid in self.subscribed.keys() - wanted:
            del self.subscribed[rid]
            self.kept.pop(rid, None)
            self._leave(wire.stream_of(rid))  # read by XREAD from its last id
            writer.write(pack(("UNSUBSCRIBE", wire.channel_of(rid))))

    def pushed(self, push: list[bytes]) -> None:
        """One push from the publishing connection: a message or a confirmation."""
        if len(push) < 3:
            return
        kind, channel = push[0], push[1]
        rid = wire.router_of_channel(channel) if isinstance(channel, bytes) else None
        if rid is None or rid not in self.subscribed:
            return  # unsubscribed since, or not ours
        if kind == b"subscribe":
            self._arm(rid)
        elif kind == b"message" and isinstance(push[2], bytes):
            try:
                key, entry_id, fields = wire.pushed_entry(push[2])
            except ValueError:
                return  # not an entry: counted where it is applied, never here
            if key != wire.stream_of(rid):
                return
            self._entry(rid, key, entry_id, fields)

    def _arm(self, rid: bytes) -> None:
        """Keep ``rid``'s pushes from now until an ``XREAD`` sent after now catches up."""
        self.subscribed[rid] = self.streams.round
        self.kept[rid] = []
        self._leave(wire.stream_of(rid))

    def _leave(self, key: bytes) -> None:
        """``key`` is read by ``XREAD`` again: at once (the one blocked now does not read
        it), unless it was not live."""
        if key in self.streams.live:
            self.streams.live.discard(key)
            self.reread()

    def reread(self) -> None:
        """End the blocked ``XREAD`` (``CLIENT UNBLOCK``), so that the next one, with
        the streams followed since, is sent at once. Nothing is lost: the next one reads
        on from the last ids."""
        if self.unblock is not None and self.writer is not None:
            self.writer.write(self.unblock)

    def _entry(self, rid: bytes, key: bytes, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        if key not in self.streams.live:
            kept = self.kept.get(rid)
            if kept is None:
                return  # not confirmed yet: the stream's XREAD reads it
            kept.append((entry_id, fields))
            if len(kept) > KEPT:  # catching up for long: start again from here
                self._arm(rid)
            return
        after = wire.follows(entry_id, self.streams.last[key])
        if after is None:  # one went missing: XREAD from the last id, keep these
            self.gaps += 1
            log.info(
                "state store: a push from router %s missing; reading its stream",
                rid.decode(errors="replace"),
            )
            self._arm(rid)
            self.kept[rid].append((entry_id, fields))
        elif after:
            self.streams.last[key] = entry_id
            self.received += 1
            self._apply(fields)

    def caught_up(self, asked_round: int, asked: Iterable[bytes], full: set[bytes]) -> None:
        """After an ``XREAD`` of ``asked`` sent in ``asked_round`` has been applied: each
        subscribed peer whose stream it read to the end, sent after the subscription
        was confirmed, goes live, and its kept pushes are applied."""
        for key in asked:
            if key in full or key == wire.STREAM_B:
                continue
            rid = key[len(wire.STREAM_B) + 1 :]
            since = self.subscribed.get(rid)
            if since is None or asked_round <= since:
                continue
            self.streams.live.add(key)
            last = wire.parse_id(self.streams.last[key])
            for entry_id, fields in self.kept.pop(rid, []):
                # After what the XREAD read, in order. A number missing here was neither
                # in the stream when it was read to its end nor pushed since: lost
                # outright (a write cut short), not to be waited for.
                if (at := wire.parse_id(entry_id)) > last:
                    last = at
                    self.streams.last[key] = entry_id
                    self.received += 1
                    self._apply(fields)
