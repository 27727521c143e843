"""A connection whose replies the store reads and parses itself, for its periodic commands.

redis-py runs every command through its own layers: a connection taken from the pool
and given back, a timeout scope and a parser call per reply, each argument encoded in
Python. For one heartbeat (a transaction of a dozen commands, twice a second) that was
about 0.5 ms of the router's CPU back to back and 1.2 ms after the loop had idled, most
of the store's cost while no requests come (``bench/shared_state_http_cpu.py``,
``docs/several-routers.md``). Here a whole batch of commands is packed by hiredis (C) and
sent in one write, and the replies are parsed by one ``hiredis.Reader`` as they arrive:
one wake-up and no Python per reply.

The connection is made by redis-py from the client's pool (``make_connection``), so the
address, credentials, TLS, database and sentinel lookup are the client's own; the store
then writes to its stream writer and reads its stream reader directly, as the
publishing connection does (``publishing.unanswered``). Both RESP2 and RESP3 replies
parse (hiredis gives a map as a dict, a double as a float); callers accept either shape.

An error reply fails the call (``ResponseError``), as a redis-py pipeline raises. A
connection that closes, a reply that does not come within ``timeout_s`` or one that does
not parse fails it too, and the connection is then closed: the store's session ends and
reconnects with backoff, as with any other failed command.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

Arg = bytes | str | int | float
Command = Sequence[Arg]

_MULTI = hiredis.pack_command(("MULTI",))
_EXEC = hiredis.pack_command(("EXEC",))
READ_CHUNK = 1 << 16


def as_map(reply: Any) -> dict[bytes, bytes]:
    """Names and values (an ``HGETALL`` reply, a stream entry's fields): a map (RESP3) or
    a flat list of names and values (RESP2); anything else, as none."""
    if isinstance(reply, dict):
        return reply
    if not isinstance(reply, list):
        return {}
    return dict(zip(reply[::2], reply[1::2], strict=False))


def stream_entries(reply: Any) -> list[tuple[bytes, list[Any]]]:
    """An ``XREAD`` reply as (stream key, entries): nil (nothing new before the block
    ended), a map of keys to entries (RESP3) or a list of [key, entries] (RESP2)."""
    if reply is None:
        return []
    if isinstance(reply, dict):
        return list(reply.items())
    return [(key, entries) for key, entries in reply]


def pack(command: Command) -> bytes:
    # hiredis's stub types the argument as a one-element tuple; it takes any length.
    packed: bytes = hiredis.pack_command(tuple(command))  # type: ignore[arg-type]
    return packed


class Direct:
    """One connection to the store; ``call`` and ``transaction`` send a batch in one write
    and return its replies. Not shared between tasks: one batch at a time."""

    def __init__(self, conn: Connection, timeout_s: float) -> None:
        self._conn = conn
        self.timeout_s = timeout_s
        self._parser = hiredis.Reader()
        self.closed = False  # no more batches: closed, or broken by a batch half read
        self._released = False

    @classmethod
    async def open(cls, client: aioredis.Redis, timeout_s: float) -> Direct:
        conn: Connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
        conn.socket_timeout = None  # ``timeout_s`` bounds each batch instead
        try:
            await conn.connect()  # type: ignore[no-untyped-call]
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.disconnect()
            raise
        return cls(conn, timeout_s)

    async def close(self) -> None:
        self.closed = True
        if not self._released:  # once, broken or not (redis-py warns of one never closed)
            self._released = True
            with contextlib.suppress(Exception):
                await self._conn.disconnect()

    async def __aenter__(self) -> Direct:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` (a pipeline, each atomic by itself) and return their replies."""
        data = b"".join(pack(c) for c in commands)
        return await self._exchange(data, len(commands))

    async def transaction(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` in ``MULTI``/``EXEC`` (applied at once, none seen half done)
        and return their replies."""
        data = b"".join([_MULTI, *(pack(c) for c in commands), _EXEC])
        replies = await self._exchange(data, len(commands) + 2)
        result = replies[-1]
        if not isinstance(result, list):  # an aborted transaction answers nil
            raise ResponseError(f"transaction not applied: {result!r}")
        if len(result) != len(commands):
            self._broken()
            raise RedisConnectionError("a transaction's reply does not match its commands")
        return result

    async def _exchange(self, data: bytes, expect: int) -> list[Any]:
        if self.closed:
            raise RedisConnectionError("the store's connection is closed")
        writer, reader = self._conn._writer, self._conn._reader
        if writer is None or reader is None:
            self._broken()
            raise RedisConnectionError("the store's connection is closed")
        parser = self._parser
        replies: list[Any] = []
        try:
            writer.write(data)
            async with asyncio.timeout(self.timeout_s):
                while len(replies) < expect:
                    got = parser.gets()
                    if got is False:
                        chunk = await reader.read(READ_CHUNK)
                        if not chunk:
                            raise RedisConnectionError("the store closed the connection")
                        parser.feed(chunk)
                        continue
                    replies.append(got)
        except BaseException:
            # A batch half read (timed out, cancelled, garbled) leaves replies in flight:
            # the connection cannot be used again.
            self._broken()
            raise
        for got in replies:
            if isinstance(got, hiredis.ReplyError):
                raise ResponseError(str(got))
            if isinstance(got, list):
                for item in got:
                    if isinstance(item, hiredis.ReplyError):
                        raise ResponseError(str(item))
        return replies

    def _broken(self) -> None:
        self.closed = True
        writer = self._conn._writer
        if writer is not None:
            writer.transport.abort()
