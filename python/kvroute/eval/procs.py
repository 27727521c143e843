"""Start and stop local server processes on loopback (tests, demo, benchmarks).

Every server kvroute starts for itself (simulated workers, the router, peer routers)
goes through here: a free port on 127.0.0.1, a bounded wait for its health endpoint,
and a stop by PID that escalates from SIGTERM to SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO

import httpx

LOOPBACK = "127.0.0.1"


# Ports handed out lie below the kernel's ephemeral range: a port taken from that range
# (bind to port 0) can be claimed by any outgoing connection between the check and the
# child's own bind, which under a parallel test run happens. Below it only listeners
# compete, and each pytest-xdist worker draws from its own slice.
_POOL_FLOOR = 10000
_EPHEMERAL_FLOOR = 32768  # Linux's default, where the setting cannot be read
_next_port: int | None = None


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_FLOOR


def _port_slice() -> range | None:
    """This process's share of the ports below the ephemeral range (None: too few)."""
    top = _ephemeral_floor()
    if top - _POOL_FLOOR < 1000:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    index = worker[2:] if worker.startswith("gw") else ""
    if not (index.isdigit() and count.isdigit() and int(count) > int(index)):
        return range(_POOL_FLOOR, top)
    width = (top - _POOL_FLOOR) // int(count)
    start = _POOL_FLOOR + int(index) * width
    return range(start, start + width)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's
    ephemeral range (so no outgoing connection takes it before the server binds it);
    successive calls in one process return different ports."""
    global _next_port
    pool = _port_slice()
    if pool is not None:
        if _next_port is None or _next_port not in pool:
            _next_port = pool.start + (os.getpid() * 7919) % len(pool)
        for _ in range(len(pool)):
            port = _next_port
            _next_port = pool.start + (port + 1 - pool.start) % len(pool)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        found: int = s.getsockname()[1]
        return found


@dataclass
class Server:
    """A child process serving HTTP on ``url``."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: str | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        stop_process(self.proc, grace_s)

    def kill(self) -> None:
        """SIGKILL at once (fault injection)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL. Safe to call twice."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


def wait_healthy(
    url: str,
    path: str = "/health",
    timeout_s: float = 30.0,
    proc: subprocess.Popen[bytes] | None = None,
    verify: ssl.SSLContext | str | bool = True,
) -> None:
    """Poll ``url + path`` until it answers 200; raise if ``proc`` exits or time runs out.
    ``verify``: for an https ``url``, what to trust (httpx's ``verify``)."""
    deadline = time.monotonic() + timeout_s
    last: str = "no answer"
    with httpx.Client(timeout=2.0, trust_env=False, verify=verify) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: process exited with code {proc.returncode}")
            try:
                r = client.get(url + path)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(0.05)
    raise TimeoutError(f"{url}{path} not healthy after {timeout_s:.0f}s ({last})")


def start_server(
    name: str,
    argv: Sequence[str],
    port: int,
    *,
    health_path: str = "/health",
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    log_dir: str | None = None,
    scheme: str = "http",
    verify: ssl.SSLContext | str | bool = True,
) -> Server:
    """Start ``argv`` (which must listen on ``port``) and wait until it is healthy
    (``scheme`` https: trusting ``verify``)."""
    log_path = None
    full_env = dict(os.environ)
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    if env:
        full_env.update(env)
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"{name}.log")
        with open(log_path, "wb") as log:
            proc = _spawn(argv, log, full_env)
    else:
        proc = _spawn(argv, subprocess.DEVNULL, full_env)
    server = Server(name=name, url=f"{scheme}://{LOOPBACK}:{port}", proc=proc, log_path=log_path)
    try:
        wait_healthy(server.url, health_path, timeout_s, proc, verify)
    except BaseException:
        server.stop(grace_s=2.0)
        raise
    return server


def _spawn(
    argv: Sequence[str], out: IO[bytes] | int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(argv),
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def kvroute_argv(*args: str) -> list[str]:
    """argv that runs the kvroute CLI with this interpreter."""
    return [sys.executable, "-m", "kvroute", *args]


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """Stop every server in ``servers`` on exit, whatever happened."""
    try:
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()
