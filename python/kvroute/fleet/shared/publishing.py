"""Writing this router's decisions and load changes to its stream (``StateStore``'s
publishing half, kept apart from the connection handling in ``store``).

Nothing on the request path waits for Redis: a decision or a load change is queued
(``publish_insert``, ``loads.SharedLoad.changed``). A decision goes out once the current
event-loop turn is over (``call_soon``), with everything else queued by then, as
``XADD``s in one socket write (``_write``: a decision and its reservation ride in one
entry), on a connection of its own that has told Redis not to reply (``unanswered``:
``CLIENT REPLY OFF``). A load change alone (a first byte, an end) waits for company: the
next decision takes it along; so does the first change made ``LOAD_LINGER_S`` or more after
it (written at the end of that change's turn, with every change made meanwhile); and when
no change comes, the next heartbeat writes it (``flush_lingering``, every
``--state-store-heartbeat-secs``). No timer of its own: a timer's wake-up, with the
event loop otherwise idle, cost more than the write it carried (a 50 ms timer did,
until December 2026: ``docs/several-routers.md``). Why wait at all: with requests
arriving one at a time, each cost three writes (its decision and reservation, its first
byte, its end), and on loopback the writer's ``send`` also runs Redis's side of TCP and
wakes it: most of what publishing cost per request end to end (``docs/several-routers.md``).
Waking a task, awaiting, reading and parsing a reply per write was most of the rest
(``bench/shared_state_overhead.py``). What the wait costs the other routers: they see a
prefill end or a request end late (a reservation never: it rides with its decision), by
about ``LOAD_LINGER_S`` plus the gap to the next change under steady traffic, by up to a
heartbeat when traffic is sparse, while engine readings come every few seconds and a request's
first byte takes hundreds of milliseconds. The price of unanswered writes: Redis's
errors on them are not seen; a lost connection is (``_watch``, and the other tasks'
commands fail). The
publishing task (``_publish_loop``) writes membership changes (kept until Redis has
them) and, while Redis is slow to read (over ``WRITE_BUFFER`` bytes unsent), takes over
the writes and waits for Redis; the request path's buffer stays bounded meanwhile.

A Redis that refuses ``CLIENT REPLY OFF`` (an ACL without the ``CLIENT`` command, as on
some managed services) answers every write instead: publishing goes on the same way and
``_watch`` reads the replies and drops them (a task wake per write: more CPU per request,
logged once, ``answered``), counting any write Redis refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import TYPE_CHECKING

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError

import kvroute.fleet.shared.wire as wire
from kvroute.fleet.shared.direct import READ_CHUNK, pack

if TYPE_CHECKING:
    from kvroute.fleet.shared.applying import StoreCounters
    from kvroute.fleet.shared.loads import SharedLoad
    from kvroute.fleet.shared.members import Membership
    from kvroute.fleet.shared.pushes import Pushes
    from kvroute.fleet.shared.streams import Streams

log = logging.getLogger("kvroute.fleet.shared")

WRITE_BUFFER = 1 << 20  # bytes not yet taken by Redis beyond which the request path stops writing
LOAD_LINGER_S = 0.05  # a load change this old is written with the next change made


class Publisher:
    """The publishing methods; ``StateStore`` sets these attributes."""

    _rid: bytes
    _buf: deque[tuple[str, bytes]]
    _commands: wire.Commands
    _soon: bool
    _lingering: float | None  # loop time of the oldest load change not yet written
    _writer: asyncio.StreamWriter | None
    _wake: asyncio.Event
    answered: bool  # Redis refused CLIENT REPLY OFF: the writes' replies are read (_watch)
    stream_len: int
    streams: Streams
    members: Membership
    pushes: Pushes
    shared_load: SharedLoad | None
    counters: StoreCounters

    def _queued(self) -> None:
        """A decision was queued: write it once this event-loop turn is over, so that
        every change made in the turn (a decision and its reservation, a burst of
        requests) rides in one write, with the load changes lingering."""
        if self._writer is not None and not self._soon:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _load_changed(self) -> None:
        """A load change was queued: written with the next decision, with the first
        change made ``LOAD_LINGER_S`` or more after the oldest one waiting, or by the
        next heartbeat (``flush_lingering``)."""
        if self._writer is None or self._soon:
            return
        loop = asyncio.get_running_loop()
        now, since = loop.time(), self._lingering
        if since is None:
            self._lingering = now
        elif now - since >= LOAD_LINGER_S:
            self._soon = True
            loop.call_soon(self._flush)

    def flush_lingering(self) -> None:
        """Write the load changes still waiting for company (the heartbeat's turn)."""
        shared = self.shared_load
        if shared is not None and shared.dirty and not self._soon:
            self._flush()

    def _flush(self) -> None:
        self._soon = False
        writer = self._writer
        if writer is None:
            return  # disconnected since: the session's next start publishes it
        if self.members.pending or writer.transport.get_write_buffer_size() > WRITE_BUFFER:
            self._wake.set()  # membership first, or Redis is slow: the task waits for it
            return
        self._write(writer)

    async def _publish_loop(self, client: aioredis.Redis, writer: asyncio.StreamWriter) -> None:
        """Membership changes (awaited: kept until Redis has them), and what the
        request path queued while Redis was slow or a membership change was pending."""
        while True:
            self._wake.clear()
            await self.members.flush(client, self._rid, self.stream_len)
            if (task := asyncio.current_task()) is not None and task.cancelling():
                # redis-py can swallow a cancellation that lands while it reads a reply
                # (seen with a blocked XREAD, redis-py 8.1): the loop would never end.
                raise asyncio.CancelledError
            await writer.drain()  # Redis slow to read: wait here, the buffer stays bounded
            self._write(writer)
            if not self.members.pending and writer.transport.get_write_buffer_size() == 0:
                await self._wake.wait()

    def _write(self, writer: asyncio.StreamWriter) -> None:
        """Everything queued, as ``XADD``s in one write; no reply comes back."""
        shared = self.shared_load
        load, ends = shared.take() if shared is not None and shared.dirty else (b"", b"")
        self._lingering = None
        buf = self._buf
        n = len(buf)
        if n == 0:
            if load:
                writer.write(self._commands.load(load, ends))
            return
        if n <= wire.PER_ENTRY:  # the usual case: one entry
            data = self._commands.inserts(wire.pack_inserts(buf), load, ends)
            buf.clear()
        else:
            batch = [buf.popleft() for _ in range(n)]
            commands = []
            for i in range(0, n, wire.PER_ENTRY):
                blob = wire.pack_inserts(batch[i : i + wire.PER_ENTRY])
                commands.append(self._commands.inserts(blob, load, ends))
                load = ends = b""  # ride with the first entry
            data = b"".join(commands)
        writer.write(data)
        self.counters.published += n

    async def _watch(self, pub: Connection) -> None:
        """Reads what Redis sends on the publishing connection, and ends the session
        when Redis closes it (what is written meanwhile is lost, as with any
        fire-and-forget write to a dead peer). The peers' pushed entries and the
        confirmations of subscriptions go to ``pushes``. Nothing else normally comes:
        Redis was told not to reply. If it refused that (the first reply is an error
        to ``CLIENT REPLY OFF``), every write's reply follows: read and dropped here,
        and a write Redis refused (an error reply) is counted as dropped."""
        reader = pub._reader
        if reader is None:
            raise RedisConnectionError("the store's publishing connection is closed")
        parser = hiredis.Reader()
        first, refused = True, 0
        while True:
            chunk = await reader.read(READ_CHUNK)
            if not chunk:
                raise RedisConnectionError("the store closed the publishing connection")
            parser.feed(chunk)
            while (got := parser.gets()) is not False:
                if isinstance(got, hiredis.PushNotification):
                    self.pushes.pushed(got)
                    continue
                if not isinstance(got, hiredis.ReplyError):
                    first = False
                    continue
                if first:  # the answer to CLIENT REPLY OFF, the connection's first command
                    first = False
                    if not self.answered:
                        log.warning(
                            "state store refused CLIENT REPLY OFF (%s); publishing with "
                            "replies (more CPU per request): allow the CLIENT command",
                            got,
                        )
                    self.answered = True
                    continue
                self.counters.dropped += 1
                refused += 1
                if refused == 1:  # once a session: Redis refusing writes (ACL, OOM)
                    log.warning("state store refused a write: %s", got)


async def unanswered(client: aioredis.Redis, timeout_s: float) -> tuple[Connection, bool]:
    """A connection of its own for publishing, on which Redis sends no replies (same
    address, credentials, TLS and database as ``client``'s), and whether it speaks
    RESP3 (Redis 6 and later: it then also carries the peers' pushes, ``pushes``). The
    store writes to its stream writer directly (redis-py's ``_writer``: a write is then
    one ``transport.write``, no coroutine, no reply to read and parse)."""
    pub: Connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    pub.socket_timeout = None  # ``_watch`` waits for a reply that normally never comes
    try:
        await pub.connect()  # type: ignore[no-untyped-call]
        resp3 = await _hello3(pub, timeout_s)
        await pub.send_command("CLIENT", "REPLY", "OFF")  # no reply to this one either
    except BaseException:
        with contextlib.suppress(Exception):
            await pub.disconnect()
        raise
    return pub, resp3


async def _hello3(pub: Connection, timeout_s: float) -> bool:
    """Switch ``pub`` to RESP3 (``HELLO 3``); False where Redis does not know it (5.x)."""
    writer, reader = pub._writer, pub._reader
    if writer is None or reader is None:
        raise RedisConnectionError("the store's publishing connection is closed")
    writer.write(pack(("HELLO", "3")))
    parser = hiredis.Reader()
    async with asyncio.timeout(timeout_s):
        while (got := parser.gets()) is False:
            chunk = await reader.read(READ_CHUNK)
            if not chunk:
                raise RedisConnectionError("the store closed the publishing connection")
            parser.feed(chunk)
    return not isinstance(got, hiredis.ReplyError)
