"""Router replicas sharing state through a Redis that speaks only TLS (``rediss://``).

A real ``redis-server`` with its plain port closed and a TLS port open, a certificate
signed by a throwaway CA made with ``openssl``; two ``kvroute serve`` replicas trust that
CA through the URL (``?ssl_ca_certs=``, redis-py's URL option). Decisions travel on the
unanswered publishing connection, which must be TLS too: a decision made through one
router is applied and matched by the other.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import redis

from kvroute.eval.procs import Server
from support import (
    REDIS_SERVER,
    certificates,
    free_port,
    metric,
    start_fake_worker,
    start_router,
    wait_until,
)

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None or shutil.which("openssl") is None,
    reason="needs redis-server and openssl",
)


def test_replicas_share_decisions_over_tls(tmp_path: Path, processes: list[Server]) -> None:
    ca = certificates(tmp_path, "redis")
    cert, key = tmp_path / "redis.crt", tmp_path / "redis.key"
    port = free_port()
    argv = [REDIS_SERVER or "redis-server", "--port", "0", "--tls-port", str(port)]
    argv += ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    argv += ["--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
    argv += ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with open(tmp_path / "redis-tls.log", "ab") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:

        def up() -> bool:
            try:
                with redis.Redis("127.0.0.1", port, ssl=True, ssl_ca_certs=str(ca)) as c:
                    return bool(c.ping())
            except redis.RedisError:
                return False

        assert wait_until(up), (tmp_path / "redis-tls.log").read_text()
        workers = [start_fake_worker(tmp_path) for _ in range(2)]
        processes.extend(workers)
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        flags = ("--state-store", url, "--state-store-heartbeat-secs", "0.1")
        r1, r2 = (start_router([w.url for w in workers], tmp_path, *flags) for _ in range(2))
        processes.extend((r1, r2))
        assert wait_until(
            lambda: all(metric(r, "kvroute_state_store_connected") == 1 for r in (r1, r2))
        )
        assert wait_until(
            lambda: all(len(httpx.get(r.url + "/routers", timeout=5).json()) == 2 for r in (r1, r2))
        )
        prompt = [7_000 + k for k in range(320)]
        body = {"model": "fake-model", "prompt": prompt, "max_tokens": 1}
        first = httpx.post(r1.url + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 200
        assert wait_until(
            lambda: metric(r2, "kvroute_state_store_applied_total", 'kind="insert"') >= 1
        )
        second = httpx.post(r2.url + "/v1/completions", json=body, timeout=30)
        assert second.status_code == 200
        assert second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
        assert metric(r2, "kvroute_routing_decisions_total", 'reason="cache_hit"') == 1
        # Nothing spoke plain text to it: a plain client cannot even ping.
        with pytest.raises(redis.RedisError), redis.Redis("127.0.0.1", port, socket_timeout=2) as c:
            c.ping()
    finally:
        server.kill()
        server.wait(timeout=10)
