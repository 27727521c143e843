"""The store's own connection (``kvroute.fleet.shared.direct``) against a real
``redis-server``: batches and their replies over RESP2 and RESP3, an error reply raised
with the connection still usable, and a batch that cannot complete (no reply in time, the
server gone) failing with the connection closed for good."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kvroute.fleet.shared.direct import Direct, stream_entries
from support import NEEDS_REDIS, RedisServer

pytestmark = NEEDS_REDIS


@pytest.mark.parametrize("protocol", [2, 3])
def test_batches_and_their_replies(redis_server: RedisServer, protocol: int) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_server.url, protocol=protocol)
        try:
            async with await Direct.open(client, 2.0) as conn:
                got = await conn.call([("SET", "k", 5), ("INCRBY", "k", 2), ("GET", "k")])
                assert got == [b"OK", 7, b"7"]
                got = await conn.transaction([("HSET", "h", "a", b"1", "b", 2), ("HGETALL", "h")])
                assert got[0] == 2
                raw = got[1]  # a map over RESP3, names and values in a list over RESP2
                if isinstance(raw, list):
                    raw = dict(zip(raw[::2], raw[1::2], strict=True))
                assert raw == {b"a": b"1", b"b": b"2"}

                # An error reply fails the batch; its replies were all read, so the
                # connection goes on answering in step.
                with pytest.raises(ResponseError, match="WRONGTYPE"):
                    await conn.call([("SET", "x", 1), ("LPUSH", "h", "v"), ("SET", "y", 2)])
                assert await conn.call([("GET", "y")]) == [b"2"]
                assert await client.get("x") == b"1"  # the others in the batch were applied
                with pytest.raises(ResponseError):
                    await conn.transaction([("SET", "z", 1), ("LPUSH", "h", "v")])
                assert await conn.call([("PING",)]) == [b"PONG"]

                # XREAD's reply, whatever the protocol: nil when nothing came in time.
                await client.xadd("s", {"f": "v"})
                (reply,) = await conn.call([("XREAD", "COUNT", 5, "STREAMS", "s", "0")])
                ((key, entries),) = stream_entries(reply)
                assert key == b"s" and len(entries) == 1 and entries[0][1] == [b"f", b"v"]
                (reply,) = await conn.call([("XREAD", "BLOCK", 10, "STREAMS", "s", "$")])
                assert stream_entries(reply) == []
        finally:
            await client.aclose()

    asyncio.run(run())


def test_a_batch_that_cannot_complete_closes_the_connection(redis_server: RedisServer) -> None:
    async def run() -> None:
        client = aioredis.from_url(redis_server.url)
        try:
            conn = await Direct.open(client, 0.2)
            # No reply within the bound (a blocked read of 2 s): the batch fails, and the
            # connection, with a reply still to come on it, is not used again.
            with pytest.raises(TimeoutError):
                await conn.call([("XREAD", "BLOCK", 2000, "STREAMS", "nothing", "$")])
            assert conn.closed
            with pytest.raises(RedisConnectionError):
                await conn.call([("PING",)])
            await conn.close()

            conn = await Direct.open(client, 2.0)
            assert await conn.call([("PING",)]) == [b"PONG"]
            redis_server.stop()  # the server goes: the next batch fails, never hangs
            with pytest.raises((RedisConnectionError, ConnectionError)):
                await conn.call([("PING",)])
            assert conn.closed
            await conn.close()
        finally:
            await client.aclose()

    asyncio.run(run())
