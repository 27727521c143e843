"""The router's one upstream HTTP client, with a connection pool per worker.

Behind the one shared ``httpx.AsyncClient`` sits ``PerWorkerPools``: requests to a plain
``http://`` worker go over that worker's keep-alive connections in ``kvroute.service.h1pool``
(an asyncio protocol with httptools' parser: ~1 ms less router CPU per request than
httpcore), found with one dict lookup. Anything else (``https://`` workers, HEAD) goes
through httpcore, a pool per worker origin split into sub-pools taken in turn: httpcore
walks every connection of a pool, polling each idle one, on every request and release,
so a smaller pool is a shorter walk.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import NamedTuple

import httpx

from kvroute.service import h1pool

# Per worker: concurrent connections allowed, and idle ones kept for reuse.
MAX_CONNECTIONS_PER_WORKER = 1024
MAX_KEEPALIVE_PER_WORKER = 256
KEEPALIVE_EXPIRY_SECS = 30.0
# Sub-pools per worker (each created on first use): the pool walk costs
# O(connections / SHARDS) per request.
SHARDS = 8
# Of the headers httpx adds to every request, keep only a user agent: fewer headers to
# validate and write, and without Accept-Encoding answers come back as they are.
USER_AGENT = b"kvroute"
DEFAULT_HEADERS = {"user-agent": USER_AGENT.decode()}
DROPPED_HEADERS = ("accept", "accept-encoding", "connection")
_FRAMING = ("content-length", "transfer-encoding", "host")  # written by Forward itself


class _Shards:
    __slots__ = ("next", "pools")

    def __init__(self) -> None:
        self.pools: list[httpx.AsyncHTTPTransport | None] = [None] * SHARDS
        self.next = 0

    async def aclose(self) -> None:
        for pool in self.pools:
            if pool is not None:
                await pool.aclose()


Key = tuple[bytes, bytes, int | None]


class PerWorkerPools(httpx.AsyncBaseTransport):
    """Dispatches each request to the connection pool of its origin (created on first use)."""

    def __init__(self) -> None:
        self._origins: dict[Key, h1pool.Origin] = {}
        self._pools: dict[Key, _Shards] = {}
        self._limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS_PER_WORKER // SHARDS,
            max_keepalive_connections=MAX_KEEPALIVE_PER_WORKER // SHARDS,
            keepalive_expiry=KEEPALIVE_EXPIRY_SECS,
        )

    def __len__(self) -> int:
        """Origins with a pool."""
        return len(self._origins) + len(self._pools)

    def connections(self) -> int:
        """Open connections to the workers (plain HTTP ones)."""
        return sum(len(o) for o in self._origins.values())

    def origin(self, url: httpx.URL) -> h1pool.Origin | None:
        """The keep-alive connections to ``url``'s origin (None: not plain HTTP)."""
        key = (url.raw_scheme, url.raw_host, url.port)
        if key[0] != b"http":
            return None
        origin = self._origins.get(key)
        if origin is None:
            origin = self._origins[key] = h1pool.Origin(
                url.host,
                url.port or 80,
                MAX_CONNECTIONS_PER_WORKER,
                MAX_KEEPALIVE_PER_WORKER,
                KEEPALIVE_EXPIRY_SECS,
            )
        return origin

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        if key[0] == b"http" and request.method in h1pool.METHODS:
            origin = self.origin(url)
            assert origin is not None
            return await h1pool.send(origin, request)
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
        key = (url.raw_scheme, url.raw_host, url.port)
        origin = self._origins.pop(key, None)
        if origin is not None:
            origin.close()
        shards = self._pools.pop(key, None)
        if shards is not None:
            await shards.aclose()

    async def aclose(self) -> None:
        origins, self._origins = list(self._origins.values()), {}
        for origin in origins:
            origin.close()
        every, self._pools = list(self._pools.values()), {}
        for shards in every:
            await shards.aclose()


class _Target(NamedTuple):
    url: httpx.URL
    host: bytes
    origin: h1pool.Origin | None  # plain HTTP: its connections, written to directly
    request_line: bytes  # b"POST /path HTTP/1.1\r\n"


class Forward:
    """The inference path's way to the workers. ``AsyncClient.send`` adds what a proxy
    does not use (client header and cookie merging, cookie extraction from every answer,
    auth and redirect flows, a wrapper around the response stream): ~10% of the router's
    CPU per request in py-spy profiles. To a plain ``http://`` worker the request's
    bytes (request line, headers, body) are written here and handed to the worker's
    connections (``h1pool.exchange``), with no ``httpx.Request`` built, encoded and read
    back; the answer is an ``httpx.Response`` as always. Anything else goes to the
    transport as an ``httpx.Request`` with bytes headers, Host and Content-Length set,
    and the body as a ready stream. Timeouts are the client's; parsed URLs are kept per
    worker path."""

    def __init__(self, client: httpx.AsyncClient, transport: httpx.AsyncBaseTransport) -> None:
        self.transport = transport
        self.timeouts = client.timeout.as_dict()
        self.extensions = {"timeout": self.timeouts}
        self._urls: dict[str, _Target] = {}

    def _target(self, url: str) -> _Target:
        known = self._urls.get(url)
        if known is None:
            if len(self._urls) >= 4096:  # workers come and go: keep the cache bounded
                self._urls.clear()
            parsed = httpx.URL(url)
            pools = self.transport
            origin = pools.origin(parsed) if isinstance(pools, PerWorkerPools) else None
            line = b"POST " + parsed.raw_path + b" HTTP/1.1\r\n"
            known = self._urls[url] = _Target(parsed, parsed.netloc, origin, line)
        elif known.origin is not None and known.origin.dropped:
            del self._urls[url]  # the worker left and came back: its new connections
            return self._target(url)
        return known

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> Awaitable[httpx.Response]:
        """POST ``body``; the answer streams (read it or close it). Not a coroutine
        itself: it hands back the one that sends (one frame less on every resume)."""
        target = self._target(url)
        if target.origin is not None:
            # The head as h1pool._head writes it for the same request.
            parts = [target.request_line]
            for k, v in headers.items():
                if k not in _FRAMING:
                    parts += (k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n")
            lines = len(parts) // 4 + 4  # request line, host, content-length, blank line
            parts += (b"host: ", target.host, b"\r\n")
            if "user-agent" not in headers:
                parts.append(b"user-agent: " + USER_AGENT + b"\r\n")
                lines += 1
            parts += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n")
            head = b"".join(parts)
            h1pool.check_head(head, lines)
            return h1pool.exchange(target.origin, head + body, self.timeouts)
        parsed, host = target.url, target.host
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"host", host))
        raw.append((b"content-length", str(len(body)).encode()))
        if "user-agent" not in headers:
            raw.append((b"user-agent", USER_AGENT))
        request = httpx.Request(
            "POST", parsed, stream=httpx.ByteStream(body), headers=raw, extensions=self.extensions
        )
        return self.transport.handle_async_request(request)


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
