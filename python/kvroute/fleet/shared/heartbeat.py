"""Heartbeats: announce this router with its load, read the live routers' loads.

Each router owns one hash, ``kvroute:router:<id>``, rewritten whole every heartbeat in a
transaction (``DEL``, ``HSET``, ``PEXPIRE``), so it never mixes two beats and disappears
by itself ``ttl_ms`` after the router's last beat (its stream, ``streams``, an hour
after): a crashed or partitioned router's load stops counting without anyone having
to notice it died.

Which routers to read: every router also stamps its id in one sorted set,
``kvroute:routers`` (score: the time of its last beat, by its own clock), trimmed of the
ids not stamped for an hour, as long as their streams are kept. A beat is one
transaction: this router's writes, the registry, and the hashes of the routers that
were live at the previous beat (plus any the caller follows). Only when the registry
shows a router whose stamp changed since the last beat (one that started, or came back
after a partition) does a second round trip read it. Why not ``SCAN`` the
``kvroute:router:*`` keys: a scan walks the whole database, and a Redis shared with
other data holding 200,000 keys made each beat take 270 ms and 170 ms of the router's
CPU (twice a second), long enough for the routers' hashes to expire between beats.
Stamps are compared for change only, never against this router's clock, and the registry
is read before this router trims it: a router whose clock is hours behind is trimmed at
every beat of the others, yet each of them has read its fresh stamp first (and a router
that connects later follows it by its greeting or its stream, ``streams``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

import kvroute.fleet.shared.wire as wire
from kvroute.fleet.shared.direct import Arg, Direct, as_map
from kvroute.fleet.shared.streams import STREAM_TTL_MS

_SCALE = wire.SCALE_FIELD.encode()


class Heartbeat:
    """One router's beats, and what it learned of the others at the last one."""

    def __init__(self, router_id: str, info: bytes, ttl_ms: int) -> None:
        self.id = router_id
        self.info = info
        self.ttl_ms = ttl_ms
        self._key = wire.ROUTER + router_id
        self._stream = wire.stream_of(router_id.encode())
        self._mine = _info(router_id, info)
        self._live: set[str] = set()  # the other routers live at the last beat
        self._stamps: dict[bytes, float] = {}  # the registry at the last beat

    def set_info(self, info: bytes) -> None:
        """What this router says of itself from its next beat on."""
        self.info = info
        self._mine = _info(self.id, info)

    def forget(self) -> None:
        """After losing Redis: read every listed router again at the next beat."""
        self._live.clear()
        self._stamps.clear()

    async def beat(
        self,
        conn: Direct,
        mine: Mapping[str, int],
        also: Iterable[str] = (),
        scale: float | None = None,
    ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, int]]]:
        """Write this router's beat (``mine``: its requests in flight per worker;
        ``scale``: the bytes per token its answers show, once learned); return (live
        routers by id, this one included, each with its ``bytes_per_token`` when it
        published one; each other router's in-flight requests per worker, by id).
        ``also``: ids to read whether listed or not (routers this one follows, e.g.
        found by their streams). ``conn``: the store's own connection for it (``direct``:
        a beat's replies are parsed in C, not through redis-py's layers)."""
        now = wire.now_ms()
        fields: list[Arg] = ["info", self.info]
        if scale is not None:
            fields += [wire.SCALE_FIELD, repr(scale)]
        for url, n in mine.items():
            fields += [wire.LOAD_FIELD + url, n]
        read = sorted(self._live.union(also) - {self.id})
        key = self._key
        got = await conn.transaction(
            [
                ("DEL", key),
                ("HSET", key, *fields),
                ("PEXPIRE", key, self.ttl_ms),
                ("PEXPIRE", self._stream, STREAM_TTL_MS),
                ("ZADD", wire.ROUTERS, now, self.id),
                ("ZRANGE", wire.ROUTERS, 0, -1, "WITHSCORES"),  # before the trim: see below
                ("ZREMRANGEBYSCORE", wire.ROUTERS, "-inf", now - STREAM_TTL_MS),
                *(("HGETALL", wire.ROUTER + rid) for rid in read),
            ]
        )
        stamps = _scored(got[5])
        rows: dict[str, dict[bytes, bytes]] = {
            rid: as_map(row) for rid, row in zip(read, got[7:], strict=True)
        }
        changed = [
            rid
            for raw, stamp in stamps.items()
            if (rid := raw.decode(errors="replace")) != self.id
            and rid not in rows
            and self._stamps.get(raw) != stamp
        ]
        self._stamps = stamps
        if changed:  # a router started or came back: one more round trip, this once
            more = await conn.call([("HGETALL", wire.ROUTER + rid) for rid in changed])
            rows.update((rid, as_map(row)) for rid, row in zip(changed, more, strict=True))
        routers: dict[str, dict[str, Any]] = {self.id: self._mine}
        if scale is not None:
            routers[self.id] = self._mine | {"bytes_per_token": scale}
        load: dict[str, dict[str, int]] = {}
        for rid, row in rows.items():
            if not row:
                continue  # expired: crashed, stopped or cut off
            routers[rid] = info = _info(rid, row.get(b"info", b"{}"))
            info.pop("bytes_per_token", None)  # only ever the beat's own field
            theirs_scale = _float(row.get(_SCALE))
            if theirs_scale is not None:
                info["bytes_per_token"] = theirs_scale
            theirs = load[rid] = {}
            for f, v in row.items():
                if f.startswith(b"l:") and v.isdigit():
                    theirs[f[2:].decode()] = int(v)
        self._live = set(load)
        return routers, load


def _scored(reply: Any) -> dict[bytes, float]:
    """A ``ZRANGE ... WITHSCORES`` reply: [member, score] pairs (RESP3) or a flat list of
    members and scores (RESP2), scores as floats either way."""
    if reply and isinstance(reply[0], list):
        return {m: float(s) for m, s in reply}
    return {m: float(s) for m, s in zip(reply[::2], reply[1::2], strict=True)}


def _float(raw: bytes | None) -> float | None:
    """A positive finite number from a hash field, or None."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def oldest_scale(routers: Mapping[str, Mapping[str, Any]]) -> tuple[str, float] | None:
    """The bytes per token the replicas budget with: the one the oldest live router
    that learned one published (by its start time, then id: the same answer on every
    replica that read the same beats; a router joining later never changes it)."""
    best: tuple[float, str, float] | None = None
    for rid, info in routers.items():
        scale = info.get("bytes_per_token")
        started = info.get("started")
        if not isinstance(scale, float) or not isinstance(started, (int, float)):
            continue
        key = (float(started), rid, scale)
        if best is None or key < best:
            best = key
    return None if best is None else (best[1], best[2])


def _info(rid: str, raw: bytes) -> dict[str, Any]:
    try:
        info = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"id": rid}
    return info if isinstance(info, dict) else {"id": rid}
