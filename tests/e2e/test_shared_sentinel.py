"""Router replicas sharing state through a Redis primary found by Sentinel
(``redis+sentinel://``), across a failover: real ``redis-server`` processes (a primary, a
replica, a sentinel) and two ``kvroute serve`` replicas in front of fake workers. A
decision made through one router is matched through the other before the failover and
after the primary is killed and the sentinel promotes the replica, no request fails
meanwhile, and the routers end up writing to the new primary."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx

from kvroute.eval.procs import Server, kvroute_argv
from support import (
    NEEDS_REDIS,
    RedisServer,
    SentinelServer,
    metric,
    start_fake_worker,
    start_router,
    wait_until,
)

pytestmark = NEEDS_REDIS


def group_prompt(g: int, i: int) -> list[int]:
    return [20_000 + 1000 * g + k for k in range(320)] + [500 + i] * 20


def ask(router: Server, g: int, i: int) -> httpx.Response:
    body = {"model": "fake-model", "prompt": group_prompt(g, i), "max_tokens": 1}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=30)


def applied(router: Server) -> float:
    return metric(router, "kvroute_state_store_applied_total", 'kind="insert"')


def test_replicas_share_through_a_sentinel_primary_across_a_failover(
    tmp_path: Path, processes: list[Server]
) -> None:
    primary = RedisServer(tmp_path / "primary", extra=("--repl-diskless-sync-delay", "0"))
    follow = ("--replicaof", "127.0.0.1", str(primary.port))
    replica = RedisServer(tmp_path / "replica", extra=follow)
    sentinel = SentinelServer(tmp_path / "sentinel", primary.port)
    try:
        workers = [start_fake_worker(tmp_path) for _ in range(2)]
        processes.extend(workers)
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/mymaster/0"
        routers = []
        for _ in range(2):
            r = start_router(
                [w.url for w in workers],
                tmp_path,
                "--state-store",
                url,
                "--state-store-heartbeat-secs",
                "0.1",
            )
            processes.append(r)
            routers.append(r)
        r1, r2 = routers

        def live(r: Server) -> int:
            return len(httpx.get(r.url + "/routers", timeout=5).json())

        assert wait_until(lambda: live(r1) == 2 and live(r2) == 2)

        def shared(g: int) -> None:
            """Group ``g`` routed through r1, then matched through r2."""
            before = applied(r2)
            first = ask(r1, g, 0)
            assert first.status_code == 200, first.text
            assert wait_until(lambda: applied(r2) > before)
            again = ask(r2, g, 1)
            assert again.status_code == 200, again.text
            assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]

        shared(0)
        out = subprocess.run(
            kvroute_argv("doctor", "--state-store", url, "--json"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        found = {f["check"]: f for f in json.loads(out.stdout)["state_store"]}
        assert out.returncode == 0 and found["server"]["status"] == "ok", out.stdout
        assert "2 router(s) live" in found["routers"]["detail"]

        # The replica holds the primary's data and the sentinel knows it; then the
        # primary dies, and the sentinel promotes the replica.
        def synced() -> bool:
            with replica.client() as c:
                info = c.info("replication")
            with sentinel.client() as c:
                known = c.execute_command("SENTINEL", "replicas", "mymaster")
            return info.get("master_link_status") == "up" and bool(known)

        assert wait_until(synced, timeout_s=30)
        primary.kill()
        assert wait_until(lambda: sentinel.primary_port() == replica.port, timeout_s=30)

        # Requests go on throughout; both routers find the new primary and share again.
        errors: list[int] = []

        def back() -> bool:
            for r in routers:
                resp = ask(r, 99, 0)
                if resp.status_code != 200:
                    errors.append(resp.status_code)
            return all(metric(r, "kvroute_state_store_connected") == 1 for r in routers) and all(
                live(r) == 2 for r in routers
            )

        assert wait_until(back, timeout_s=30)
        assert errors == []
        shared(1)
        with replica.client() as c:  # the new primary holds the routers' streams
            assert c.execute_command("ROLE")[0] == b"master"
            assert any(k.startswith(b"kvroute:stream:") for k in c.keys("kvroute:*"))
    finally:
        sentinel.stop()
        replica.stop()
        primary.stop()
