"""CPU of one router's heartbeat (``kvroute.fleet.shared.heartbeat.Heartbeat.beat``)
with redis-py's reply parsers: its pure-Python one and hiredis (C), against a real
``redis-server`` on loopback, interleaved round by round.

A beat is one transaction (the router's hash rewritten, the registry stamped and read,
the live routers' hashes read): the store's idle cost is two of them per second. This
measures the client's CPU per beat (``time.process_time``, this process only: Redis's
side runs in its own), back to back, two routers beating in turn so each reads the
other's hash.

Usage:
    python bench/heartbeat_cpu.py [--beats 400] [--rounds 3] [--workers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser
from redis.utils import HIREDIS_AVAILABLE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kvroute.fleet.shared.heartbeat import Heartbeat  # noqa: E402
from support import RedisServer  # noqa: E402


async def per_beat(url: str, parser: type, beats: int, workers: int) -> float:
    """Microseconds of this process's CPU per beat, two routers beating in turn."""
    pool = aioredis.ConnectionPool.from_url(url, parser_class=parser)
    client = aioredis.Redis(connection_pool=pool)
    one = Heartbeat("r1", b'{"id":"r1"}', 2000)
    two = Heartbeat("r2", b'{"id":"r2"}', 2000)
    mine = {f"http://10.0.0.{i}:8000": i + 1 for i in range(workers)}
    try:
        for _ in range(20):  # warm: each router reads the other's hash from now on
            await one.beat(client, mine)
            await two.beat(client, mine)
        t0 = time.process_time()
        for _ in range(beats):
            await one.beat(client, mine)
            await two.beat(client, mine)
        return (time.process_time() - t0) / (2 * beats) * 1e6
    finally:
        await client.aclose()


async def run(args: argparse.Namespace) -> int:
    if not HIREDIS_AVAILABLE:
        print("hiredis is not installed (pip install hiredis)", file=sys.stderr)
        return 2
    parsers = {"python": _AsyncRESP2Parser, "hiredis": _AsyncHiredisParser}
    got: dict[str, list[float]] = {name: [] for name in parsers}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            for _ in range(args.rounds):
                for name, parser in parsers.items():
                    got[name].append(await per_beat(server.url, parser, args.beats, args.workers))
        finally:
            server.stop()
    print(f"| reply parser | µs of client CPU per beat, median of {args.rounds} (range) |")
    print("|---|---|")
    for name, values in got.items():
        print(f"| {name} | {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f}) |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--beats", type=int, default=400, help="beats per router and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8, help="workers in each beat's load")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
