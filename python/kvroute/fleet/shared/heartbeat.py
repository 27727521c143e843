"""One heartbeat: announce this router with its load, read the live routers' loads.

Each router owns one hash, ``kvroute:router:<id>``, rewritten whole every heartbeat in a
transaction (``DEL``, ``HSET``, ``PEXPIRE``), so it never mixes two beats and disappears
by itself ``ttl_ms`` after the router's last beat (its stream, ``streams``, an hour
after): a crashed or partitioned router's load stops counting without anyone having
to notice it died. The live set is read with ``SCAN`` over the few router keys and one
pipelined ``HGETALL`` each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import redis.asyncio as aioredis

import kvroute.fleet.shared.wire as wire
from kvroute.fleet.shared.streams import STREAM_TTL_MS


async def heartbeat(
    client: aioredis.Redis, router_id: str, info: bytes, mine: Mapping[str, int], ttl_ms: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, int]]]:
    """Write this router's beat; return (live routers by id, each other router's
    in-flight requests per worker, by id)."""
    key = wire.ROUTER + router_id
    fields: dict[Any, Any] = {"info": info}  # redis-py types its keys invariantly
    for url, n in mine.items():
        fields[wire.LOAD_FIELD + url] = n
    pipe = client.pipeline(transaction=True)
    pipe.delete(key)
    pipe.hset(key, mapping=fields)
    pipe.pexpire(key, ttl_ms)
    pipe.pexpire(wire.stream_of(router_id.encode()), STREAM_TTL_MS)
    await pipe.execute()
    keys = [k async for k in client.scan_iter(match=wire.ROUTER + "*", count=100)]
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hgetall(k)
    rows = await pipe.execute()
    routers: dict[str, dict[str, Any]] = {}
    load: dict[str, dict[str, int]] = {}
    for k, row in zip(keys, rows, strict=True):
        if not row:
            continue  # expired between SCAN and HGETALL
        rid = k.decode()[len(wire.ROUTER) :]
        try:
            routers[rid] = orjson.loads(row.get(b"info", b"{}"))
        except orjson.JSONDecodeError:
            routers[rid] = {"id": rid}
        if rid == router_id:
            continue
        mine = load[rid] = {}
        for f, v in row.items():
            if f.startswith(b"l:") and v.isdigit():
                mine[f[2:].decode()] = int(v)
    return routers, load
