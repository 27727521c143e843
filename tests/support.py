"""Helpers shared by the tests: fake workers and the router as real processes on loopback,
and the fake worker's recording and control endpoints."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server, stop_process

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


def wait_for_ping(server: RedisServer | SentinelServer, what: str) -> None:
    """Until ``server`` answers PING (15 s at most; stopped if it never does)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.proc.returncode}")
        try:
            with server.client() as c:
                c.ping()
            return
        except redis.RedisError:
            time.sleep(0.05)
    server.stop()
    raise TimeoutError(f"{what} did not answer PING within 15 s")


class RedisServer:
    """A redis-server on a free loopback port, no persistence, stopped by PID.
    ``unix_socket``: it also listens on a Unix socket (``unix_url``); ``extra``: more
    of redis-server's options."""

    def __init__(
        self,
        log_dir: Path,
        password: str | None = None,
        port: int | None = None,
        unix_socket: bool = False,
        extra: tuple[str, ...] = (),
    ):
        self.port = port or free_port()
        self.password = password
        # A short path: a Unix socket's path is limited to 107 bytes.
        self.socket = f"/tmp/kvroute-redis-{self.port}.sock" if unix_socket else None
        argv = [
            REDIS_SERVER or "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            # Where a replica's full sync writes its snapshot (dump.rdb), instead of
            # the directory the tests were started from.
            "--dir",
            str(log_dir),
        ]
        if password:
            argv += ["--requirepass", password]
        if self.socket:
            argv += ["--unixsocket", self.socket, "--unixsocketperm", "700"]
        argv += extra
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"redis-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.socket is not None, "started without unix_socket=True"
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket}?db=0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def _wait_ready(self) -> None:
        wait_for_ping(self, "redis-server")

    def kill(self) -> None:
        """SIGKILL (an outage, not a shutdown)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        stop_process(self.proc)
        if self.socket:
            Path(self.socket).unlink(missing_ok=True)


REDIS_SERVER = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
)
# Test modules that need a real redis-server: ``pytestmark = NEEDS_REDIS``.
NEEDS_REDIS = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)"
)


def wait_until(cond: Callable[[], object], timeout_s: float = 30.0) -> bool:
    """Poll ``cond`` until it is true or ``timeout_s`` passes (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


async def until(cond: Callable[[], object], within: float) -> bool:
    """Poll ``cond`` until true, ``within`` seconds at most, letting the event loop (a
    store's tasks) run in between (``wait_until`` inside a coroutine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return False


def wait_for(pred: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> None:
    """``wait_until``, failing the test with what was awaited when ``timeout`` passes."""
    if not wait_until(pred, timeout):
        raise AssertionError(f"timed out waiting for {what}")


def metric(router: Server, name: str, *labels: str) -> float:
    """The sum of the router's /metrics samples named ``name`` whose labels contain every
    string of ``labels`` (0 when there is none)."""
    text = httpx.get(router.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(x in series for x in labels):
            total += float(value)
    return total


class SentinelServer:
    """A Redis Sentinel (``redis-server --sentinel``) on a free loopback port watching
    the primary at ``primary_port`` as ``mymaster`` (quorum 1, down after 1 s), stopped
    by PID."""

    def __init__(self, log_dir: Path, primary_port: int) -> None:
        self.port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        conf = log_dir / f"sentinel-{self.port}.conf"  # Sentinel rewrites it: its own file
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\n"
            f"sentinel monitor mymaster 127.0.0.1 {primary_port} 1\n"
            "sentinel down-after-milliseconds mymaster 1000\n"
            "sentinel failover-timeout mymaster 3000\n"
        )
        with open(log_dir / f"sentinel-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [REDIS_SERVER or "redis-server", str(conf), "--sentinel"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for_ping(self, "redis-sentinel")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def primary_port(self) -> int:
        with self.client() as c:
            return int(c.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")[1])

    def stop(self) -> None:
        stop_process(self.proc)


def cluster_flags(d: Path) -> tuple[str, ...]:
    """redis-server's options for a cluster-mode node (no slots assigned: enough to be
    refused), its bus on a free port of its own (by default the port + 10,000, which
    a free port above 55,535 cannot have)."""
    nodes = d / f"nodes-{free_port()}.conf"
    bus = str(free_port())
    return ("--cluster-enabled", "yes", "--cluster-config-file", str(nodes), "--cluster-port", bus)


def certificates(d: Path, *names: str) -> Path:
    """A throwaway CA (``d/ca.crt``, made with ``openssl``), and for each of ``names`` a
    key and a certificate it signed for 127.0.0.1 (``d/NAME.key``, ``d/NAME.crt``).
    Returns the CA's certificate."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    if not (d / "ca.crt").exists():
        openssl(
            *"req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvroute-test-ca".split(),
            *("-keyout", "ca.key", "-out", "ca.crt"),
        )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in names:
        openssl(
            *"req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1".split(),
            *("-keyout", f"{name}.key", "-out", f"{name}.csr"),
        )
        openssl(
            *"x509 -req -days 2 -CAcreateserial -extfile san.ext".split(),
            *("-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-out", f"{name}.crt"),
        )
    return d / "ca.crt"
