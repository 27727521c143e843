"""``kvroute doctor --state-store URL`` against real ``redis-server`` processes: a Redis
the routers can use passes and lists the live routers, leaving no key behind; a wrong
password, a cluster node, and a user refused the stream commands fail with the fix; a
user refused ``CLIENT`` is a warning. The password never shows."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import redis.asyncio as aioredis

from kvroute.eval.procs import kvroute_argv
from kvroute.fleet.shared.direct import Direct
from kvroute.fleet.shared.heartbeat import Heartbeat
from support import NEEDS_REDIS, RedisServer, cluster_flags

pytestmark = NEEDS_REDIS


def doctor(url: str) -> tuple[int, dict[str, dict[str, str]], str]:
    out = subprocess.run(
        [*kvroute_argv("doctor", "--state-store", url, "--json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    return out.returncode, {f["check"]: f for f in report["state_store"]}, out.stdout + out.stderr


def test_a_usable_store_passes_and_lists_its_routers(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    try:

        async def stamp() -> None:  # one live router in that database
            client = aioredis.from_url(server.url)
            async with await Direct.open(client, 2.0) as conn:
                await Heartbeat("r1", b'{"id": "r1"}', 60_000).beat(conn, {})
            await client.aclose()

        asyncio.run(stamp())
        with server.client() as c:
            keys = c.dbsize()
        code, found, _ = doctor(server.url)
        assert code == 0
        assert [found[k]["status"] for k in ("server", "round trip", "commands")] == ["ok"] * 3
        assert found["client reply"]["status"] == "ok" and found["pushes"]["status"] == "ok"
        assert "1 router(s) live in this database (r1)" in found["routers"]["detail"]
        with server.client() as c:
            assert c.dbsize() == keys  # the scratch keys are gone
    finally:
        server.stop()


def test_what_the_routers_cannot_use_fails_with_the_fix(tmp_path: Path) -> None:
    secret = "doctor-pa55"
    cluster = RedisServer(tmp_path / "b", extra=cluster_flags(tmp_path))
    try:
        code, found, _ = doctor(cluster.url)
        assert code == 1 and "Redis Cluster" in found["server"]["detail"]
    finally:
        cluster.stop()
    server = RedisServer(tmp_path / "a", password=secret)
    try:
        code, found, text = doctor(server.url.replace(secret, "wrong-" + secret))
        assert code == 1 and found["connect"]["status"] == "fail"
        assert "password" in found["connect"]["fix"] and secret not in text

        with server.client() as c:  # users refused some of what the routers send
            c.execute_command("ACL", "SETUSER", "nostream", "on", ">pw", "~*", "&*", "+@all")
            c.execute_command("ACL", "SETUSER", "nostream", "-@stream")
            c.execute_command("ACL", "SETUSER", "noclient", "on", ">pw", "~*", "&*", "+@all")
            c.execute_command("ACL", "SETUSER", "noclient", "-client")
            # Redis 7's default for a new user: no pub/sub channel at all.
            c.execute_command("ACL", "SETUSER", "nochannel", "on", ">pw", "~*", "+@all")
        base = f"redis://{{}}:pw@127.0.0.1:{server.port}/0"
        code, found, text = doctor(base.format("nostream"))
        assert code == 1 and found["commands"]["status"] == "fail", text
        code, found, text = doctor(base.format("noclient"))
        assert code == 0 and found["client reply"]["status"] == "warn", text
        assert "CLIENT" in found["client reply"]["fix"]
        code, found, text = doctor(base.format("nochannel"))
        assert code == 0 and found["pushes"]["status"] == "warn", text
        assert "&kvroute:live:*" in found["pushes"]["fix"]
    finally:
        server.stop()
