"""The worker list the routers share, and the changes to it.

The ``kvroute:workers`` hash is the list as the admin API last left it; every change made
through one router's admin API (``POST /workers``, ``DELETE /workers/...``,
``POST /flush_cache``) is queued here and kept until Redis has taken it (up to 10,000
pending changes; routing decisions, by contrast, are dropped when Redis is away too
long), written to the hash and announced on the stream in one transaction, and applied
by the other routers as they read the stream.

At each (re)connection: a router's ``--worker-urls`` are added to the list when it first
connects; a store found without the hash (the first router, or a Redis restarted empty)
gets every worker this router knows, so the union of the routers' lists survives; then
this router adds the listed workers it lacks and, unless the store had lost the list,
drops those the list no longer has (removed elsewhere while it was away).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis

import kvroute.fleet.shared.wire as wire
from kvroute.fleet.registry import Registry


class Membership:
    def __init__(self, registry: Registry, applied: dict[str, int], pending_len: int) -> None:
        self.registry = registry
        self.applied = applied  # the store's counters, by kind
        self.pending: deque[tuple[bytes, str]] = deque(maxlen=pending_len)
        self._seed = list(registry.workers)  # the command line's, shared at first connect
        # Releases what a worker removed by another router held here (connections...).
        self.on_removed: Callable[[str], Coroutine[Any, Any, None]] | None = None
        # Checks a worker another router added (no traffic here until it answers).
        self.on_added: Callable[[str], None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    def queue(self, kind: bytes, url: str) -> None:
        self.pending.append((kind, url))

    async def connected(self, client: aioredis.Redis, router: bytes, stream_len: int) -> bool:
        """Share what must be shared after (re)connecting; True if the store had lost
        the list."""
        lost = not await client.exists(wire.WORKERS)
        if lost or self._seed:
            known = list(self.registry.workers) if lost else self._seed
            self.pending.extendleft((wire.ADDED, url) for url in reversed(known))
            self._seed = []
        await self.flush(client, router, stream_len)
        return lost

    async def reconcile(self, client: aioredis.Redis, lost: bool) -> None:
        names: Any = await client.hkeys(wire.WORKERS)
        shared = {k.decode() for k in names}
        for url in sorted(shared - set(self.registry.workers)):
            self.apply(wire.ADDED, url)
        if not lost:
            for url in sorted(set(self.registry.workers) - shared):
                self.apply(wire.REMOVED, url)

    async def flush(self, client: aioredis.Redis, router: bytes, stream_len: int) -> None:
        while self.pending:
            kind, url = self.pending[0]
            pipe = client.pipeline(transaction=True)
            if kind == wire.ADDED:
                pipe.hset(wire.WORKERS, url, b"1")
            elif kind == wire.REMOVED:
                pipe.hdel(wire.WORKERS, url)
            entry = wire.member_entry(router, kind, url)
            pipe.xadd(wire.STREAM, entry, maxlen=stream_len, approximate=True)  # type: ignore[arg-type]
            await pipe.execute()
            self.pending.popleft()  # only once Redis has it

    def apply(self, kind: bytes, url: str) -> None:
        """Another router added or removed ``url``."""
        if kind == wire.ADDED:
            if url not in self.registry.workers:
                self.registry.add(url)
                self.applied["added"] += 1
                if self.on_added is not None:
                    self.on_added(url)
        elif self.registry.remove(url) is not None:
            self.applied["removed"] += 1
            if self.on_removed is not None:
                task = asyncio.get_running_loop().create_task(self.on_removed(url))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
