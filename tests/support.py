"""Helpers shared by the tests: fake workers and the router as real processes on loopback,
and the fake worker's recording and control endpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server

TESTS = Path(__file__).resolve().parent


def start_fake_worker(log_dir: Path, *flags: str) -> Server:
    port = free_port()
    return start_server(
        f"fake-{port}",
        [sys.executable, str(TESTS / "fake_worker.py"), "--port", str(port), *flags],
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


def records(worker: Server) -> list[dict[str, object]]:
    r = httpx.get(worker.url + "/records", timeout=5)
    out: list[dict[str, object]] = r.json()
    return out


def control(worker: Server, **kw: object) -> None:
    httpx.post(worker.url + "/control", json=kw, timeout=5).raise_for_status()
