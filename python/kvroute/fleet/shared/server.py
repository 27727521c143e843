"""Which Redis the store can use, and ``kvroute doctor --state-store``'s checks of one.

``client_for``: the client for a store URL, through sentinels for ``redis+sentinel://``.

``unsupported``: a Redis Cluster (a heartbeat's transaction and the ``XREAD`` over every
router's stream span several hash slots) or a Redis older than 5.0 (no streams); the
store refuses either when it connects (``StateStore._check_server``).

``check``: what ``kvroute doctor`` reports of a store before routers use it: reachable
with these credentials, a server the store can use, its round trip, every command the
routers send allowed (run for real on scratch keys, deleted after), ``CLIENT REPLY``
allowed (else each write's reply is read: more router CPU), and the routers already live
in that database.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

import kvroute.fleet.shared.wire as wire
from kvroute.fleet.probe.report import Finding


def client_for(url: wire.StoreURL, **kwargs: Any) -> aioredis.Redis:
    """The redis-py client for ``url`` (``kwargs``: connection options). With
    ``redis+sentinel://`` each new connection goes to the primary the sentinels name at
    that moment, so after a failover the store's next session finds the new one."""
    parts = urlsplit(url.url)
    if parts.scheme != "redis+sentinel":
        return aioredis.from_url(url.url, **kwargs)
    from redis.asyncio.sentinel import Sentinel

    sentinels, service, db, password = url.sentinel()
    sentinel_kwargs = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    if given := dict(parse_qsl(parts.query)).get("sentinel_password"):
        sentinel_kwargs["password"] = given
    manager = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call,unused-ignore]
    client: aioredis.Redis = manager.master_for(service, db=db, password=password, **kwargs)
    return client


async def close(client: aioredis.Redis) -> None:
    """Close ``client``, and its connections to the sentinels if it has any."""
    await client.aclose()
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        await sentinel.aclose()


def unsupported(server: dict[str, Any], cluster: dict[str, Any]) -> str | None:
    """Why the store cannot use this server (``INFO server`` and ``INFO cluster``), or
    None."""
    if cluster.get("cluster_enabled") in (1, "1"):
        return "a Redis Cluster, which --state-store does not support (use a standalone Redis)"
    version = str(server.get("redis_version", ""))
    if _version(version) < (5, 0):
        return f"Redis {version}, older than 5.0 (streams)"
    return None


def _version(text: str) -> tuple[int, ...]:
    """``7.0.15`` -> (7, 0); what does not parse counts as new enough (a server
    speaking Redis's protocol under another version scheme)."""
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return (99,)


async def check(url: wire.StoreURL, timeout_s: float = 5.0) -> list[Finding]:
    """``kvroute doctor``'s findings on the store at ``url`` (never raises)."""
    client = client_for(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return await _check(client, url)
    except (TimeoutError, RedisError, OSError) as e:
        fix = "check the URL's host, port, password and TLS (rediss://), and that Redis runs"
        return [Finding("connect", "fail", f"{url.redacted}: {type(e).__name__}: {e}", fix)]
    finally:
        await close(client)


async def _check(client: aioredis.Redis, url: wire.StoreURL) -> list[Finding]:
    out: list[Finding] = []
    server: Any = await client.info("server")
    cluster: Any = await client.info("cluster")
    why = unsupported(server, cluster)
    version = server.get("redis_version", "?")
    if why is not None:
        fix = "give --state-store a standalone Redis 5.0 or later (or its primary endpoint)"
        return [Finding("server", "fail", f"{url.redacted} is {why}", fix)]
    out.append(Finding("server", "ok", f"{url.redacted}: Redis {version}, standalone"))
    rtts = []
    for _ in range(10):
        t0 = time.perf_counter()
        await client.ping()
        rtts.append((time.perf_counter() - t0) * 1000)
    rtt = statistics.median(rtts)
    if rtt > 5:
        out.append(
            Finding(
                "round trip",
                "warn",
                f"{rtt:.1f} ms median PING: the routers learn each other's decisions that late",
                "keep Redis close to the routers (same zone); a few ms of delay costs hit rate",
            )
        )
    else:
        out.append(Finding("round trip", "ok", f"{rtt:.2f} ms median PING"))
    out.append(await _commands(client))
    out.append(await _client_reply(client))
    out.append(await _pushes(client))
    out.append(await _routers(client))
    return out


async def _commands(client: aioredis.Redis) -> Finding:
    """Every command the routers send, run on scratch keys (deleted after)."""
    scratch = wire.PREFIX + "doctor:" + os.urandom(4).hex()
    keys = [scratch + ":hash", scratch + ":set", scratch + ":stream"]
    try:
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys[0])
        pipe.hset(keys[0], mapping={"info": "{}"})
        pipe.pexpire(keys[0], 10_000)
        pipe.zadd(keys[1], {"doctor": 1})
        pipe.zrange(keys[1], 0, -1, withscores=True)
        pipe.zremrangebyscore(keys[1], "-inf", 0)
        pipe.hgetall(keys[0])
        await pipe.execute()
        await client.xadd(keys[2], {"k": "doctor"}, maxlen=10, approximate=True)
        await client.xread({keys[2]: "0"}, count=1, block=10)
        await client.xrange(keys[2], count=1)
        await client.xrevrange(keys[2], count=1)
        await client.pexpire(keys[2], 10_000)
        async for _ in client.scan_iter(match=wire.STREAM + ":*", count=1000):
            break
    except ResponseError as e:
        fix = "allow the router's Redis user the hash, sorted-set, stream and key commands"
        return Finding("commands", "fail", f"a command the routers send was refused: {e}", fix)
    finally:
        try:
            await client.delete(*keys)
        except RedisError:
            pass
    return Finding("commands", "ok", "every command the routers send is allowed")


async def _client_reply(client: aioredis.Redis) -> Finding:
    try:  # a no-op, refused only where the CLIENT command is not allowed
        await client.execute_command("CLIENT", "REPLY", "ON")  # type: ignore[no-untyped-call]
    except ResponseError as e:
        return Finding(
            "client reply",
            "warn",
            f"CLIENT REPLY refused ({e}): routers will read a reply per write (more CPU)",
            "allow the router's Redis user the CLIENT command",
        )
    return Finding("client reply", "ok", "CLIENT REPLY allowed: writes go out unanswered")


async def _pushes(client: aioredis.Redis) -> Finding:
    """Can routers push their entries to each other (``pushes``): ``PUBLISH`` on their
    channels, and a RESP3 connection that subscribes to them?"""
    from kvroute.fleet.shared.direct import Direct

    channel = wire.channel_of(b"doctor-" + os.urandom(4).hex().encode())
    fix = "allow the router's Redis user PUBLISH and SUBSCRIBE on &kvroute:live:* (Redis 6+)"
    try:
        await client.publish(channel, b"")
        async with await Direct.open(client, 5.0) as conn:
            await conn.call([("HELLO", "3")])
            (got,) = await conn.call([("SUBSCRIBE", channel)])
    except ResponseError as e:
        detail = f"{e}: each router reads the others' entries by XREAD, a command per entry"
        return Finding("pushes", "warn", detail, fix)
    if not isinstance(got, list) or got[:1] != [b"subscribe"]:
        return Finding("pushes", "warn", f"SUBSCRIBE answered {got!r}", fix)
    return Finding("pushes", "ok", "routers push their entries to each other (pub/sub)")


async def _routers(client: aioredis.Redis) -> Finding:
    listed: Any = await client.zrange(wire.ROUTERS, 0, -1)
    ids = [raw.decode(errors="replace") for raw in listed]
    pipe = client.pipeline(transaction=False)
    for rid in ids:
        pipe.exists(wire.ROUTER + rid)
    live = [rid for rid, n in zip(ids, await pipe.execute(), strict=True) if n]
    keys = await client.dbsize()
    detail = f"{len(live)} router(s) live in this database"
    if live:
        detail += f" ({', '.join(live)})"
    return Finding("routers", "info", f"{detail}; {keys} key(s) in it")
