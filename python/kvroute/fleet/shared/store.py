"""The shared-state client: one background task per router talking to Redis.

Nothing on the request path waits for Redis: decisions and load changes are queued and
written at the end of the event-loop turn, unanswered (``publishing``). A background task
publishes membership changes and takes over the writes while Redis is slow to read.
Another task reads the other routers' streams (``XREAD BLOCK`` from the last ids seen,
``streams``) and applies their entries to the local index and fleet (``applying``); a
third rewrites this router's heartbeat (announce + in-flight per worker, with a TTL)
and reads the others'. While Redis is down, slow or unreachable these tasks fail, the
router routes on its local state, peers' load is forgotten, and the connection is
retried with exponential backoff (0.1 s doubling to 5 s); once back, the buffered
decisions and membership changes are published and the streams are read on from the
last ids seen.

Why streams, and pub/sub only beside them: pub/sub forgets a message a subscriber was
not connected for, silently. A stream keeps the last ``stream_len`` entries with ids, so
a router that lost its connection, was slow or restarted reads on from its last id and
misses nothing unless it fell more than ``stream_len`` entries behind (detected: a
``gap`` is counted and the worker list is reconciled from the ``workers`` hash). A new
router replays the retained streams at start, so it begins with the fleet's recent
routing state instead of an empty index. ``MAXLEN ~`` keeps memory bounded (an entry
holds up to 64 decisions of about 40 bytes plus 8 per 16 prompt tokens each). Entries
are read 20 at a time per stream, so applying a backlog (a new router's replay) holds
the event loop for a few ms per read, never for the whole backlog. Once a peer's stream
has been read to its end after subscribing to its channel, its entries come pushed
instead (``pushes``: one send less per entry, the ``XREAD`` sent again after each
reply), and the stream is read again whenever the pushes cannot be trusted to hold
everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

import kvroute.fleet.shared.wire as wire
from kvroute.fleet.budget import IndexBudget
from kvroute.fleet.registry import Registry
from kvroute.fleet.shared.applying import Applier, StoreCounters
from kvroute.fleet.shared.digests import DigestIndex
from kvroute.fleet.shared.direct import Direct, as_map, stream_entries
from kvroute.fleet.shared.heartbeat import Heartbeat, oldest_scale
from kvroute.fleet.shared.loads import SharedLoad
from kvroute.fleet.shared.members import Membership
from kvroute.fleet.shared.publishing import Publisher, unanswered
from kvroute.fleet.shared.pushes import Pushes
from kvroute.fleet.shared.server import client_for, close, unsupported
from kvroute.fleet.shared.streams import Streams
from kvroute.routing.load import LoadModel

log = logging.getLogger("kvroute.fleet.shared")

READ_COUNT = 20  # entries per XREAD: at most 1,280 decisions applied per loop turn
# An idle XREAD returns after this: with nothing to read, each return is a wake-up of
# the router (about 0.3 ms of CPU on a 2-core VM). A new router is followed at once
# all the same (its greeting is an entry of the shared stream, which ends the wait).
# The reading connection's socket timeout is this plus REPLY_S: a Redis that stopped
# answering ends the session within that even if a cancellation was swallowed.
READ_BLOCK_MS = 3000
REPLY_S = 2.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0


class StateStore(Publisher, Applier):
    """This router's view of the shared state; ``peer_load`` is its main output.

    ``peer_load``: per worker, the requests other live routers have in flight on it
    (summed; a router whose heartbeat expired counts for nothing). With ``work`` (the
    router's load model) each router publishes its load as it changes and the others
    read it off the stream a few ms later (``loads``: in flight, and the queued
    prefill the load model also reads); without, as of their last heartbeats plus one
    for each decision a peer published since. The dict is updated in place, so holders
    of a reference (``Registry.peer_load``, a load model) always read the current value.
    ``routers``: the live routers (this one included), id -> info.
    """

    def __init__(
        self,
        url: wire.StoreURL,
        registry: Registry,
        index: DigestIndex | None,
        *,
        router_url: str,
        version: str,
        heartbeat_s: float = 0.5,
        stream_len: int = 2000,
        buffer_len: int = 10_000,
        work: LoadModel | None = None,
        keying: str = "",
        budget: IndexBudget | None = None,
    ) -> None:
        self.url = url
        self.registry = registry
        # The index budgets (bytes mode): the bytes per token this router learns are
        # published with its heartbeat; the oldest router's are the ones all use.
        self.budget = budget if budget is not None and budget.follows else None
        self.index = index
        self.id = os.urandom(6).hex()
        self._rid = self.id.encode()
        self.heartbeat_s = heartbeat_s
        self.ttl_ms = max(int(heartbeat_s * 4000), 2000)  # 4 heartbeats, at least 2 s
        self.stream_len = stream_len
        # What this router's index keys are made of (``PromptTokenizer.keying``): sent
        # with its decisions, compared with the others' (``applying``).
        self.keying = keying.encode()
        info = {"id": self.id, "url": router_url, "version": version, "started": time.time()}
        if keying:
            info["index"] = keying
        self._info_base = info
        self.info = orjson.dumps(info)
        self._beats = Heartbeat(self.id, self.info, self.ttl_ms)
        self.peer_load: dict[str, int] = {}
        self.routers: dict[str, dict[str, Any]] = {}
        self.counters = StoreCounters()
        self.connected = False
        self._buf: deque[tuple[str, bytes]] = deque()
        self._buf_len = buffer_len
        self.members = Membership(registry, self.counters.applied, buffer_len)
        self.streams = Streams(wire.stream_of(self._rid))  # replayed from their start
        self._commands = wire.Commands(self.streams.own, self._rid, stream_len, self.keying)
        self.pushes = Pushes(self.streams, self._apply)
        self._foreign: set[bytes] = set()  # routers keyed differently, warned of once
        self._wake = asyncio.Event()
        # The publishing connection's writer while connected (``_unanswered``), and
        # whether a write is already scheduled for the end of this event-loop turn.
        self._writer: asyncio.StreamWriter | None = None
        self._soon = False
        self._lingering: float | None = None  # when the oldest unwritten load change came
        self.answered = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._refused: str | None = None  # why the server was refused, said once
        self._client: aioredis.Redis | None = None
        if index is not None:
            index.on_insert = self.publish_insert
        # The work model's load and queued prefill, shared both ways (``loads``).
        self.shared_load = None
        if work is not None:
            self.shared_load = SharedLoad(work, self._load_changed, self.peer_load)

    # ------------------------------------------------------------- request path

    def publish_insert(self, worker: str, digests: bytes) -> None:
        """Queue a routing decision for the stream (never blocks, never raises)."""
        if len(self._buf) >= self._buf_len:
            self._buf.popleft()
            self.counters.dropped += 1
        self._buf.append((worker, digests))
        if not self._soon:
            self._queued()

    def worker_added(self, url: str) -> None:
        """The admin API added ``url`` here: share it (queued like a decision)."""
        self.members.queue(wire.ADDED, url)
        self._wake.set()

    def worker_removed(self, url: str) -> None:
        self.members.queue(wire.REMOVED, url)
        self._wake.set()

    def index_cleared(self) -> None:
        """The admin API flushed the workers' caches and this router's index: the
        others clear theirs. Decisions not yet published predate the flush: dropped."""
        self._buf.clear()
        self.members.queue(wire.CLEARED, "")
        self._wake.set()

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._client = client_for(
            self.url,
            socket_timeout=REPLY_S,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),  # this class does the retrying, with backoff
        )
        self._task = asyncio.create_task(self._run(), name="kvroute-state-store")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            if self.connected:  # leave the live list at once rather than by TTL
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(0.5):
                        await self._client.delete(wire.ROUTER + self.id)
            with contextlib.suppress(Exception):
                await close(self._client)

    async def _run(self) -> None:
        delay = BACKOFF_MIN_S
        while True:
            began = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down/slow/refusing: keep routing locally
                if self._stopping:  # a cancellation redis-py swallowed (``_publish_loop``)
                    raise asyncio.CancelledError from e
                self.counters.errors += 1
                if self.connected:
                    if time.monotonic() - began > BACKOFF_MAX_S:  # else: failing at once
                        delay = BACKOFF_MIN_S
                    log.warning(
                        "state store %s lost (%s); routing on local state, reconnecting",
                        self.url.redacted,
                        _describe(e),
                    )
                self.connected = False
                self._beats.forget()
                self.peer_load.clear()
                self.routers.clear()
                if self.shared_load is not None:
                    self.shared_load.clear()
                if self._client is not None:  # pooled sockets to a dead server
                    with contextlib.suppress(Exception):
                        await self._client.connection_pool.disconnect()
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _session(self) -> None:
        client = self._client
        assert client is not None
        await client.ping()
        await self._check_server(client)
        await self._catch_up(client)
        pub, resp3 = await unanswered(client, REPLY_S)
        beats = reads = None
        try:
            await self._may_publish(client)
            beats = await Direct.open(client, REPLY_S)
            reads = await Direct.open(client, READ_BLOCK_MS / 1000 + REPLY_S)
            # The others follow this router's stream from now (``streams``).
            await client.xadd(
                wire.STREAM,
                wire.hello_entry(self._rid),  # type: ignore[arg-type]
                maxlen=self.stream_len,
                approximate=True,
            )
            if self.shared_load is not None:
                self.shared_load.resend_all()
            self.connected = True
            self.counters.connects += 1
            log.info("state store %s connected (router id %s)", self.url.redacted, self.id)
            self._writer = pub._writer  # redis-py's, once connected; see _unanswered
            assert self._writer is not None
            self.pushes.reset(self._writer if resp3 else None, await _client_id(reads))
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._publish_loop(client, self._writer))
                tg.create_task(self._read_loop(reads))
                tg.create_task(self._heartbeat_loop(beats))
                tg.create_task(self._watch(pub))
        finally:
            self._writer = None
            self.pushes.reset(None)
            with contextlib.suppress(Exception):
                await pub.disconnect()
            for conn in (beats, reads):
                if conn is not None:
                    await conn.close()

    async def _check_server(self, client: aioredis.Redis) -> None:
        """Refuse a server the store cannot work with (``server.unsupported``: a Redis
        Cluster, or one older than 5.0), saying why once. The session fails and is
        retried with backoff, routing on local state meanwhile."""
        info: Any = await client.info("server")
        cluster: Any = await client.info("cluster")
        why = unsupported(info, cluster)
        if why is None:
            return
        if why != self._refused:
            self._refused = why
            log.error("state store %s is %s; routing on local state", self.url.redacted, why)
        raise UnsupportedStore(why)

    async def _may_publish(self, client: aioredis.Redis) -> None:
        """Whether this session pushes its entries to the peers (``pushes``): Redis
        takes ``PUBLISH`` (an ACL may refuse it; the writes go unanswered, so a refusal
        would go unseen). Said in the heartbeat, which the peers read before they rely
        on the pushes."""
        try:
            await client.publish(wire.channel_of(self._rid), b"")
            publish = True
        except ResponseError as e:
            publish = False
            if self._commands.publish:
                log.warning(
                    "state store refused PUBLISH (%s): the other routers read this one's "
                    "entries by XREAD (more CPU per entry): allow the PUBLISH command",
                    e,
                )
        self._commands.publish = publish
        self._beats.set_info(self._info(publish))

    def _info(self, pushes: bool) -> bytes:
        info = dict(self._info_base)
        if pushes:
            info["pushes"] = True
        return orjson.dumps(info)

    async def _catch_up(self, client: aioredis.Redis) -> None:
        """After (re)connecting: share the start-up workers and pending membership
        changes, notice a store that lost its data or a gap in the stream, and reconcile
        the worker list with the shared one."""
        lost = await self.members.connected(client, self._rid, self.stream_len)
        await self.streams.discover(client)
        gaps = await self.streams.check(client)
        if gaps:
            self.counters.gaps += gaps
            log.warning("state store: fell behind the streams' retention; resynchronised")
        await self.members.reconcile(client, lost)

    # ------------------------------------------------------------- loops

    async def _read_loop(self, conn: Direct) -> None:
        streams = self.streams
        while True:
            asked = streams.read_args()
            asked_round = streams.round
            (got,) = await conn.call(
                [
                    (
                        "XREAD",
                        "COUNT",
                        READ_COUNT,
                        "BLOCK",
                        READ_BLOCK_MS,
                        "STREAMS",
                        *asked.keys(),
                        *asked.values(),
                    )
                ]
            )
            full = set()
            for key, entries in stream_entries(got):
                if len(entries) >= READ_COUNT:
                    full.add(key)
                for entry_id, fields in entries:
                    streams.last[key] = entry_id
                    self._apply(as_map(fields))
            self.pushes.caught_up(asked_round, asked, full)
            live = {wire.stream_of(rid.encode()) for rid in self.routers}
            streams.done_reading(asked, full, live)

    async def _heartbeat_loop(self, conn: Direct) -> None:
        while True:
            self.flush_lingering()  # the load changes no later change took along
            await self._beat(conn)
            await asyncio.sleep(self.heartbeat_s)

    async def _beat(self, conn: Direct) -> None:
        mine = {url: w.in_flight for url, w in self.registry.workers.items() if w.in_flight > 0}
        budget = self.budget
        learned = None if budget is None else budget.learned
        routers, load = await self._beats.beat(conn, mine, self.streams.routers(), learned)
        self.routers = routers
        if budget is not None and (agreed := oldest_scale(routers)) is not None:
            rid, scale = agreed
            moved = budget.adopt(scale, "this router" if rid == self.id else f"router {rid}")
            if moved and self.index is not None:
                # At once, not at the budget loop's next round (up to a health interval
                # later): the replicas' indexes differ only while their scales do.
                budget.apply(self.index, list(self.registry.workers))
        self.streams.follow_routers(routers)
        self.pushes.want(
            rid.encode() for rid, info in routers.items() if rid != self.id and info.get("pushes")
        )
        if self.streams.unasked():
            # A router this one stopped reading (its heartbeat lapsed, or it never
            # greeted) is live again: read it now, not when the blocked XREAD ends.
            self.pushes.reread()
        if self.shared_load is not None:  # load as published when it changed (``loads``)
            self.shared_load.keep({rid.encode() for rid in routers})
            for rid, theirs in load.items():
                self.shared_load.beat(rid.encode(), theirs)
            return
        self.peer_load.clear()
        for theirs in load.values():
            for url, n in theirs.items():
                self.peer_load[url] = self.peer_load.get(url, 0) + n


async def _client_id(conn: Direct) -> int | None:
    """``conn``'s ``CLIENT ID`` (None where an ACL refuses ``CLIENT``)."""
    try:
        (got,) = await conn.call([("CLIENT", "ID")])
    except ResponseError:
        return None
    return got if isinstance(got, int) else None


class UnsupportedStore(Exception):
    """The server is not one the store can work with (``StateStore._check_server``)."""


def _describe(e: BaseException) -> str:
    """An error's type and message (redis-py's name host and port, never the password)."""
    if isinstance(e, BaseExceptionGroup):
        return ", ".join(_describe(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"
