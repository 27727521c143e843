"""What the routers keep in Redis, and the store URL.

Keys (all under ``kvroute:``; one fleet per Redis database, chosen by the URL's ``/db``):

``kvroute:stream``
    A Redis Stream, trimmed to about ``--state-store-stream-len`` entries
    (``XADD ... MAXLEN ~``). One entry per routing decision or membership change:
    ``r`` the publishing router's id, ``k`` the kind (``i`` insert, ``a`` worker added,
    ``d`` worker removed), ``w`` the worker URL, ``h`` the prompt's block digests
    (little-endian u64s, inserts only), ``t`` the publisher's clock in ms (lag metric).
``kvroute:workers``
    A hash, worker URL -> ``1``: the fleet as the admin API last left it.
``kvroute:router:<id>``
    One hash per live router, rewritten every heartbeat with a TTL (a crashed router
    vanishes by itself): ``info`` (JSON: id, url, version, started) and ``l:<worker>``
    (its requests in flight on that worker).
"""

from __future__ import annotations

import time

from kvroute.config import StoreURL

__all__ = ["StoreURL"]

PREFIX = "kvroute:"
STREAM = PREFIX + "stream"
WORKERS = PREFIX + "workers"
ROUTER = PREFIX + "router:"
LOAD_FIELD = "l:"

INSERT, ADDED, REMOVED = b"i", b"a", b"d"


def now_ms() -> int:
    return int(time.time() * 1000)


def insert_entry(router: bytes, worker: str, digests: bytes) -> dict[bytes, bytes]:
    return {
        b"r": router,
        b"k": INSERT,
        b"w": worker.encode(),
        b"h": digests,
        b"t": b"%d" % now_ms(),
    }


def member_entry(router: bytes, kind: bytes, worker: str) -> dict[bytes, bytes]:
    return {b"r": router, b"k": kind, b"w": worker.encode(), b"t": b"%d" % now_ms()}


def parse_id(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id ``ms-seq`` as a comparable pair."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
