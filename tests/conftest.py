"""Shared fixtures: fake workers and the router as real processes on loopback."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvroute.procs import Server, free_port, kvroute_argv, start_server

TESTS = Path(__file__).resolve().parent


def start_fake_worker(log_dir: Path) -> Server:
    port = free_port()
    return start_server(
        f"fake-{port}",
        [sys.executable, str(TESTS / "fake_worker.py"), "--port", str(port)],
        port,
        log_dir=str(log_dir),
    )


def start_router(workers: list[str], log_dir: Path, *extra: str) -> Server:
    port = free_port()
    argv = kvroute_argv(
        "serve",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--health-check-interval-secs",
        "0.2",
        *extra,
    )
    return start_server(f"router-{port}", argv, port, log_dir=str(log_dir))


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


def records(worker: Server) -> list[dict[str, object]]:
    r = httpx.get(worker.url + "/records", timeout=5)
    out: list[dict[str, object]] = r.json()
    return out


def control(worker: Server, **kw: object) -> None:
    httpx.post(worker.url + "/control", json=kw, timeout=5).raise_for_status()
