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


def start_sim_worker_at(host: str, port: int, log_dir: Path, *flags: str) -> Server:
    """A ``kvroute sim-worker`` on ``host:port`` (e.g. 127.0.0.2: every 127.0.0.0/8
    address is local on Linux, so several workers can share one port)."""
    import subprocess

    from kvroute.eval.procs import wait_healthy

    argv = kvroute_argv("sim-worker", "--host", host, "--port", str(port), *flags)
    log_path = log_dir / f"sim-{host}-{port}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    server = Server(f"sim-{host}", f"http://{host}:{port}", proc, str(log_path))
    try:
        wait_healthy(server.url, proc=proc)
    except BaseException:
        server.stop(grace_s=2.0)
        raise
    return server


def worker_urls(router: Server) -> set[str]:
    """The workers a router lists right now."""
    r = httpx.get(router.url + "/workers", timeout=5)
    return {w["url"] for w in r.json()}


def start_sim_worker(log_dir: Path, *flags: str) -> Server:
    """``kvroute sim-worker`` on a free port, fast (time scale 50) unless told."""
    port = free_port()
    argv = kvroute_argv("sim-worker", "--port", str(port), "--time-scale", "50", *flags)
    return start_server(f"sim-{port}", argv, port, log_dir=str(log_dir))


def metric(router: Server, name: str) -> float:
    """Sum of a Prometheus metric's samples (every label set) on the router."""
    text = httpx.get(router.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total
