"""What the routers keep in Redis, and the store URL.

Keys (all under ``kvroute:``; one fleet per Redis database, chosen by the URL's ``/db``):

``kvroute:stream:<id>``
    One Redis Stream per router, where it writes its decisions and load changes (why one
    per router: ``streams``), trimmed to about ``--state-store-stream-len`` entries
    (``XADD ... MAXLEN ~``) and expiring an hour after the router's last heartbeat.
    Fields: ``r`` the publishing router's id, ``k`` the kind, ``t`` the publisher's
    clock in ms (lag metric). Kind ``i``: up to ``PER_ENTRY`` routing decisions packed
    in ``b`` (``pack_inserts``: per decision the worker URL and the prompt's block
    digests as little-endian u64s), one entry for many decisions because each Redis
    command costs the publisher and every reader tens of µs of Python; ``x``: what the
    digests are of (``PromptTokenizer.keying``: ``bytes``, or ``tokens:`` and a digest
    of the tokenizer), so a router keyed differently leaves them out. Field ``p``
    (with kind ``i``, or alone with kind ``p``): the publisher's load per worker that
    changed since its last entry (``loads.pack``: requests in flight, those waiting for
    a first byte, their uncached tokens). Field ``e`` (with ``p``): for those workers,
    when the publisher expects its decoding requests there to end (``loads.pack_ends``:
    up to ``ENDS_SHARED`` per worker, soonest first, in seconds from the write, so no
    clocks need agree); routers that do not read it ignore it.
``kvroute:stream``
    The shared stream, same fields, trimmed the same way. Kinds ``a`` / ``d``: worker
    ``w`` added / removed; ``c``: the workers' caches were flushed
    (``POST /flush_cache``), every router clears its index; ``h``: router ``r``
    connected, the others start reading its stream.
``kvroute:workers``
    A hash, worker URL -> ``1``: the fleet as the admin API last left it.
``kvroute:router:<id>``
    One hash per live router, rewritten every heartbeat with a TTL (a crashed router
    vanishes by itself): ``info`` (JSON: id, url, version, started) and ``l:<worker>``
    (its requests in flight on that worker).
``kvroute:routers``
    A sorted set, router id -> the time of its last heartbeat (ms, by its own clock),
    trimmed of the ids not stamped for an hour: which hashes and streams to look for
    (``heartbeat``), without scanning the database.
"""

from __future__ import annotations

import functools
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import hiredis

from kvroute.config import StoreURL

__all__ = ["StoreURL"]

PREFIX = "kvroute:"
STREAM = PREFIX + "stream"
STREAM_B = STREAM.encode()


def stream_of(router: bytes) -> bytes:
    """The stream a router writes its decisions and load to."""
    return STREAM_B + b":" + router


LIVE_B = (PREFIX + "live:").encode()


def channel_of(router: bytes) -> bytes:
    """The pub/sub channel a router publishes each of its stream's entries to, as it
    writes it (``publishing``): the other routers subscribe and are sent the entries
    instead of asking for them (``pushes``)."""
    return LIVE_B + router


def router_of_channel(channel: bytes) -> bytes | None:
    return channel[len(LIVE_B) :] if channel.startswith(LIVE_B) else None


WORKERS = PREFIX + "workers"
ROUTER = PREFIX + "router:"
ROUTERS = PREFIX + "routers"
LOAD_FIELD = "l:"
SCALE_FIELD = "bpt"  # a heartbeat's learned bytes per engine token (``fleet.budget``)

INSERT, ADDED, REMOVED, CLEARED, LOAD, HELLO = b"i", b"a", b"d", b"c", b"p", b"h"
KEYING = b"x"
ENDS = b"e"


def now_ms() -> int:
    return int(time.time() * 1000)


PER_ENTRY = 64  # decisions per stream entry, at most
_HEAD = struct.Struct("<HI")  # worker URL length, digest bytes


def pack_inserts(decisions: Iterable[tuple[str, bytes]]) -> bytes:
    """Decisions (worker URL, digests) as one blob: per decision a header, the URL and
    the digests."""
    parts: list[bytes] = []
    for worker, digests in decisions:
        url = encoded(worker)
        parts += (_HEAD.pack(len(url), len(digests)), url, digests)
    return b"".join(parts)


@functools.lru_cache(maxsize=4096)
def encoded(url: str) -> bytes:
    """A worker URL's bytes (encoded once: it is written with every change)."""
    return url.encode()


def records(
    blob: bytes, head: struct.Struct, body: Callable[[tuple[int, ...]], int], what: str
) -> Iterator[tuple[tuple[int, ...], memoryview, memoryview]]:
    """The records of a packed blob, each a ``head`` whose first field is the length of
    the worker URL that follows, then ``body(fields)`` bytes: yields (the head's fields,
    the URL, the body); raises ValueError ("truncated <what>") on a record cut short."""
    view = memoryview(blob)
    at, end = 0, len(blob)
    while at < end:
        if at + head.size > end:
            raise ValueError(f"truncated {what}")
        fields = head.unpack_from(view, at)
        at += head.size
        n_url, n_body = fields[0], body(fields)
        if at + n_url + n_body > end:
            raise ValueError(f"truncated {what}")
        yield fields, view[at : at + n_url], view[at + n_url : at + n_url + n_body]
        at += n_url + n_body


def unpack_inserts(blob: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The (worker URL, digests) pairs of ``pack_inserts``; raises ValueError when the
    blob is cut short or a digest run is not whole u64s."""
    for (_, n_dig), url, digests in records(blob, _HEAD, lambda f: f[1], "decision"):
        if n_dig % 8:
            raise ValueError("misaligned decision")
        yield bytes(url), bytes(digests)


def insert_entry(
    router: bytes,
    decisions: Sequence[tuple[str, bytes]],
    load: bytes = b"",
    keying: bytes = b"",
    ends: bytes = b"",
) -> dict[bytes, bytes]:
    t = b"%d" % now_ms()
    entry = {b"x": keying} if keying and decisions else {}
    entry.update({b"r": router, b"k": INSERT if decisions else LOAD, b"t": t})
    if decisions:
        entry[b"b"] = pack_inserts(decisions)
    if load:
        entry[b"p"] = load
        if ends:
            entry[ENDS] = ends
    return entry


def xadd(key: bytes, entry: dict[bytes, bytes], stream_len: int) -> bytes:
    """``XADD`` of ``entry`` to stream ``key`` trimmed to about ``stream_len`` entries,
    as the bytes of one Redis command (RESP: an array of bulk strings), for any entry.
    The publisher's writes use ``Commands``, which makes the same bytes for its own
    entries in one format (a write's packing halved again)."""
    parts = [_head(key, stream_len, len(entry))]
    for field, value in entry.items():
        parts += (_bulk(field), b"$%d\r\n" % len(value), value, b"\r\n")
    return b"".join(parts)


@functools.cache
def _head(key: bytes, stream_len: int, fields: int, auto_id: bool = True) -> bytes:
    """``XADD``'s arguments up to its fields; without ``auto_id``, up to the entry id
    (the caller writes it)."""
    args = (b"XADD", key, b"MAXLEN", b"~", b"%d" % stream_len)
    head = b"*%d\r\n" % (len(args) + 1 + 2 * fields) + b"".join(map(_bulk, args))
    return head + _bulk(b"*") if auto_id else head


@functools.cache
def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class Commands:
    """The ``XADD`` commands of one router's own stream, as bytes: what ``insert_entry`` and
    ``xadd`` make, with everything but the id, the clock, the decisions and the load
    encoded once (the publisher builds one per write, up to three per request).

    Entry ids are this router's, not Redis's (``next_id``: ``<ms>-<n>``, the clock when
    the router started, then 1, 2, 3... for its entries in order; it is its stream's
    only writer), so an entry pushed to the other routers (``publish``) and the same
    entry read back from the stream are told apart, and a reader of the pushes notices
    one that never came (``gapless``). With ``publish`` each ``XADD`` is
    followed by a ``PUBLISH`` of its own bytes to the router's channel
    (``channel_of``), in the same write (``pushes``)."""

    __slots__ = (
        "_epoch",
        "_insert",
        "_insert_load",
        "_insert_load_ends",
        "_load",
        "_load_ends",
        "_n",
        "_publish",
        "publish",
    )

    def __init__(
        self,
        key: bytes,
        router: bytes,
        stream_len: int,
        keying: bytes = b"",
        publish: bool = True,
    ) -> None:
        fields = _bulk(b"r") + _bulk(router) + _bulk(b"k")

        def head(n: int) -> bytes:
            return _head(key, stream_len, n, auto_id=False)

        self._load = (head(4), fields + _bulk(LOAD) + _bulk(b"t"))
        self._load_ends = (head(5), fields + _bulk(LOAD) + _bulk(b"t"))
        # Decisions say what their digests are of (field ``x``, ``KEYING``).
        n, x = (1, _bulk(KEYING) + _bulk(keying)) if keying else (0, b"")
        insert = x + fields + _bulk(INSERT) + _bulk(b"t")
        self._insert = (head(4 + n), insert)
        self._insert_load = (head(5 + n), insert)
        self._insert_load_ends = (head(6 + n), insert)
        self._publish = b"*3\r\n" + _bulk(b"PUBLISH") + _bulk(channel_of(router))
        self.publish = publish  # set per session: off where Redis refuses PUBLISH
        self._epoch, self._n = now_ms(), 0

    def next_id(self) -> bytes:
        """The next entry id: the one before's number plus one."""
        self._n += 1
        return b"%d-%d" % (self._epoch, self._n)

    def _done(self, head: tuple[bytes, bytes], rest: bytes) -> bytes:
        entry_id = self.next_id()
        xadd = b"%s$%d\r\n%s\r\n%s%s" % (head[0], len(entry_id), entry_id, head[1], rest)
        if not self.publish:
            return xadd
        return b"%s%s$%d\r\n%s\r\n" % (xadd, self._publish, len(xadd), xadd)

    def load(self, load: bytes, ends: bytes = b"") -> bytes:
        """An entry carrying load records only (kind ``p``), with their ends if any."""
        t = b"%d" % now_ms()
        rest = b"$%d\r\n%s\r\n$1\r\np\r\n$%d\r\n%s\r\n" % (len(t), t, len(load), load)
        if ends:
            return self._done(self._load_ends, rest + _ends_field(ends))
        return self._done(self._load, rest)

    def inserts(self, blob: bytes, load: bytes = b"", ends: bytes = b"") -> bytes:
        """An entry of packed decisions (``pack_inserts``), with load records and their
        ends if any (ends only with load records)."""
        t = b"%d" % now_ms()
        rest = b"$%d\r\n%s\r\n$1\r\nb\r\n$%d\r\n%s\r\n" % (len(t), t, len(blob), blob)
        if not load:
            return self._done(self._insert, rest)
        rest += b"$1\r\np\r\n$%d\r\n%s\r\n" % (len(load), load)
        if ends:
            return self._done(self._insert_load_ends, rest + _ends_field(ends))
        return self._done(self._insert_load, rest)


def follows(entry_id: bytes, last: bytes) -> bool | None:
    """Is ``entry_id`` the one right after ``last`` in a stream of ``Commands``' ids
    (True), one already seen (False), or later, some missing between (None)?"""
    ms, n = parse_id(entry_id)
    last_ms, last_n = parse_id(last)
    if (last_ms, last_n) == (0, 0) and n == 1:
        return True  # the router's first entry, to a reader that has read none
    if ms != last_ms:  # another epoch (a stream read from its start: last "0")
        return None if (ms, n) > (last_ms, last_n) else False
    return True if n == last_n + 1 else (False if n <= last_n else None)


def pushed_entry(payload: bytes) -> tuple[bytes, bytes, dict[bytes, bytes]]:
    """A pushed entry (the bytes of its ``XADD``, ``Commands``) as (stream key, entry id,
    fields); raises ValueError if it is not one."""
    reader = hiredis.Reader()
    reader.feed(payload)
    command = reader.gets()
    if (
        not isinstance(command, list)
        or len(command) < 6
        or len(command) % 2
        or command[0] != b"XADD"
        or command[2] != b"MAXLEN"
    ):
        raise ValueError("not a pushed stream entry")
    return command[1], command[5], dict(zip(command[6::2], command[7::2], strict=True))


def _ends_field(ends: bytes) -> bytes:
    """Field ``e`` and its value, the last of an entry (its head counts it)."""
    return b"$1\r\ne\r\n$%d\r\n%s\r\n" % (len(ends), ends)


def hello_entry(router: bytes) -> dict[bytes, bytes]:
    return {b"r": router, b"k": HELLO, b"t": b"%d" % now_ms()}


def member_entry(router: bytes, kind: bytes, worker: str) -> dict[bytes, bytes]:
    return {b"r": router, b"k": kind, b"w": worker.encode(), b"t": b"%d" % now_ms()}


def parse_id(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id ``ms-seq`` as a comparable pair."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
