"""The router's one upstream HTTP client, with a connection pool per worker.

httpcore's pool walks every connection it holds each time a request is queued and each
time a response is closed, and asks every idle connection whether its socket turned
readable (a poll through anyio per connection). With one pool for the whole fleet that
walk grows with the total number of upstream connections, and at 32-128 concurrent
requests it was the largest single cost of a proxied request in py-spy profiles. Behind
the one shared ``httpx.AsyncClient`` the transport below keeps a pool per worker origin,
so a request only walks its own worker's connections; the lookup is one dict get. A
busy worker's connections are further spread over a few sub-pools taken in turn, so
each walk covers a fraction of them (keep-alive reuse works within each sub-pool).
"""

from __future__ import annotations

import httpx

# Per worker: concurrent connections allowed, and idle ones kept for reuse.
MAX_CONNECTIONS_PER_WORKER = 1024
MAX_KEEPALIVE_PER_WORKER = 256
KEEPALIVE_EXPIRY_SECS = 30.0
# Sub-pools per worker (each created on first use): the pool walk costs
# O(connections / SHARDS) per request.
SHARDS = 8
# Of the headers httpx adds to every request, keep only a user agent: fewer headers to
# validate and write, and without Accept-Encoding answers come back as they are.
DEFAULT_HEADERS = {"user-agent": "kvroute"}
DROPPED_HEADERS = ("accept", "accept-encoding", "connection")


class _Shards:
    __slots__ = ("next", "pools")

    def __init__(self) -> None:
        self.pools: list[httpx.AsyncHTTPTransport | None] = [None] * SHARDS
        self.next = 0

    async def aclose(self) -> None:
        for pool in self.pools:
            if pool is not None:
                await pool.aclose()


class PerWorkerPools(httpx.AsyncBaseTransport):
    """Dispatches each request to the connection pool of its origin (created on first use)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[bytes, bytes, int | None], _Shards] = {}
        self._limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS_PER_WORKER // SHARDS,
            max_keepalive_connections=MAX_KEEPALIVE_PER_WORKER // SHARDS,
            keepalive_expiry=KEEPALIVE_EXPIRY_SECS,
        )

    def __len__(self) -> int:
        return len(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        shards = self._pools.get(key)
        if shards is None:
            shards = self._pools[key] = _Shards()
        i = shards.next
        shards.next = (i + 1) % SHARDS
        pool = shards.pools[i]
        if pool is None:
            pool = shards.pools[i] = httpx.AsyncHTTPTransport(limits=self._limits)
        return await pool.handle_async_request(request)

    async def drop(self, base_url: str) -> None:
        """Close the pool of a worker that left the fleet (its idle connections go)."""
        url = httpx.URL(base_url)
        shards = self._pools.pop((url.raw_scheme, url.raw_host, url.port), None)
        if shards is not None:
            await shards.aclose()

    async def aclose(self) -> None:
        every, self._pools = list(self._pools.values()), {}
        for shards in every:
            await shards.aclose()


def create_client(
    *, connect_s: float, first_byte_s: float, pool_s: float
) -> tuple[httpx.AsyncClient, PerWorkerPools]:
    """The shared client (timeouts: connect/write, read = first byte, wait for a pool
    slot) and its per-worker transport."""
    pools = PerWorkerPools()
    client = httpx.AsyncClient(
        transport=pools,
        headers=DEFAULT_HEADERS,
        timeout=httpx.Timeout(connect=connect_s, read=first_byte_s, write=connect_s, pool=pool_s),
        trust_env=False,
    )
    for name in DROPPED_HEADERS:
        del client.headers[name]
    return client, pools
