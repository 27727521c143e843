"""The router's one upstream HTTP client, with a connection pool per worker.

httpcore's pool walks every connection it holds each time a request is queued and each
time a response is closed, and asks every idle connection whether its socket turned
readable (a poll through anyio per connection). With one pool for the whole fleet that
walk grows with the total number of upstream connections, and at 32-128 concurrent
requests it was the largest single cost of a proxied request in py-spy profiles. Behind
the one shared ``httpx.AsyncClient`` the transport below keeps a pool per worker origin,
so a request only walks its own worker's connections; the lookup is one dict get.
"""

from __future__ import annotations

import httpx

# Per worker: concurrent connections allowed, and idle ones kept for reuse.
MAX_CONNECTIONS_PER_WORKER = 1024
MAX_KEEPALIVE_PER_WORKER = 256
KEEPALIVE_EXPIRY_SECS = 30.0


class PerWorkerPools(httpx.AsyncBaseTransport):
    """Dispatches each request to the connection pool of its origin (created on first use)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}
        self._limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS_PER_WORKER,
            max_keepalive_connections=MAX_KEEPALIVE_PER_WORKER,
            keepalive_expiry=KEEPALIVE_EXPIRY_SECS,
        )

    def __len__(self) -> int:
        return len(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = httpx.AsyncHTTPTransport(limits=self._limits)
        return await pool.handle_async_request(request)

    async def drop(self, base_url: str) -> None:
        """Close the pool of a worker that left the fleet (its idle connections go)."""
        url = httpx.URL(base_url)
        pool = self._pools.pop((url.raw_scheme, url.raw_host, url.port), None)
        if pool is not None:
            await pool.aclose()

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


def create_client(
    *, connect_s: float, first_byte_s: float, pool_s: float
) -> tuple[httpx.AsyncClient, PerWorkerPools]:
    """The shared client (timeouts: connect/write, read = first byte, wait for a pool
    slot) and its per-worker transport."""
    pools = PerWorkerPools()
    client = httpx.AsyncClient(
        transport=pools,
        timeout=httpx.Timeout(connect=connect_s, read=first_byte_s, write=connect_s, pool=pool_s),
        trust_env=False,
    )
    return client, pools
