"""The upstream client: a pool per worker origin, sub-pools in turn, lean headers; and
the ASGI fast path's error rendering."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from kvroute import upstream
from kvroute.app import create_app
from kvroute.config import Settings
from kvroute.upstream import create_client


async def _http_server(seen: list[bytes]) -> tuple[asyncio.Server, str]:
    """A keep-alive HTTP/1.1 server that records each request head and answers 200."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                seen.append(head)
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
async def two_servers() -> AsyncIterator[tuple[list[bytes], list[str]]]:
    seen: list[bytes] = []
    servers = [await _http_server(seen) for _ in range(2)]
    yield seen, [url for _, url in servers]
    for server, _ in servers:
        server.close()
        await server.wait_closed()


async def test_one_pool_per_worker_and_drop(two_servers: tuple[list[bytes], list[str]]) -> None:
    seen, urls = two_servers
    client, pools = create_client(connect_s=2, first_byte_s=2, pool_s=2)
    try:
        for _ in range(2 * upstream.SHARDS):
            for url in urls:
                r = await client.post(url + "/v1/completions", content=b"{}")
                assert r.status_code == 200 and r.content == b"ok"
        assert len(pools) == 2
        # Every sub-pool of a worker was used in turn and kept its connection alive.
        for shards in pools._pools.values():
            assert shards.next == 0
            assert all(p is not None and len(p._pool.connections) == 1 for p in shards.pools)
        await pools.drop(urls[0] + "/")
        assert len(pools) == 1
        await pools.drop("http://127.0.0.1:1")  # unknown: nothing happens
        assert len(pools) == 1
    finally:
        await client.aclose()
    assert len(pools) == 0
    head = seen[0].lower()
    assert b"user-agent: kvroute" in head
    for dropped in (b"accept-encoding", b"accept:", b"connection:"):
        assert dropped not in head


async def test_fast_path_renders_unexpected_errors_as_openai_500() -> None:
    app = create_app(Settings(worker_urls=["http://w1:8000"]).validate())

    async def broken(*_: object) -> None:
        raise RuntimeError("boom")

    app.inference = broken  # type: ignore[assignment]
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router"
    ) as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "internal_error" and "boom" not in err["message"]
        # Other routes still go through FastAPI.
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/v1/completions")).status_code == 405
