"""Shared fixtures: servers started by a test, stopped (by PID) at its end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvroute.eval.procs import Server
from support import RedisServer, start_fake_worker, start_router


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[Server]]:
    """Collects servers started by a test and stops them all at the end."""
    servers: list[Server] = []
    yield servers
    for s in reversed(servers):
        s.stop()


@pytest.fixture
def fleet(tmp_path: Path, processes: list[Server]) -> Callable[..., tuple[Server, list[Server]]]:
    """``fleet(n, *router_flags)`` -> (router, workers), all stopped after the test."""

    def make(n: int, *flags: str) -> tuple[Server, list[Server]]:
        workers = [start_fake_worker(tmp_path) for _ in range(n)]
        processes.extend(workers)
        router = start_router([w.url for w in workers], tmp_path, *flags)
        processes.append(router)
        return router, workers

    return make


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server on a free loopback port, stopped at the end of the test."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()
