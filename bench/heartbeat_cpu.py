"""CPU of one router's heartbeat (``kvroute.fleet.shared.heartbeat.Heartbeat.beat``)
against a real ``redis-server`` on loopback: this build, and with ``--baseline-python``
an earlier build's, interleaved round by round.

A beat is one transaction (the router's hash rewritten, the registry stamped and read,
the live routers' hashes read); a router with a store beats twice a second, so the beat
is most of what the store costs while no requests come. Measured: the client's CPU per
beat (``time.process_time``: that process only, Redis's side runs in its own), two
routers beating in turn so each reads the other's hash, back to back (``--gaps-ms 0``)
and with the loop idle between beats as in ``serve`` (500 ms: caches cold, the wake-up
counted). Each build runs in a process of its own (the interpreter's installed kvroute):
this one with this interpreter, the baseline with ``--baseline-python``. Builds before
the store's own connection (``kvroute.fleet.shared.direct``) beat through redis-py's
pipeline, with hiredis parsing the replies.

Usage:
    python bench/heartbeat_cpu.py [--rounds 3] [--workers 8] [--gaps-ms 0,500]
    python bench/heartbeat_cpu.py --baseline-python BASE/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


async def per_beat(url: str, beats: int, workers: int, gap_s: float) -> float:
    """Microseconds of this process's CPU per beat, two routers beating in turn, the
    loop idle ``gap_s`` before each."""
    import redis.asyncio as aioredis

    from kvroute.fleet.shared.heartbeat import Heartbeat

    client = aioredis.from_url(url)
    try:
        from kvroute.fleet.shared.direct import Direct
    except ImportError:  # a build before it: the beat takes the redis-py client
        conn: Any = client
    else:
        conn = await Direct.open(client, 2.0)
    one = Heartbeat("r1", b'{"id":"r1"}', 60_000)
    two = Heartbeat("r2", b'{"id":"r2"}', 60_000)
    mine = {f"http://10.0.0.{i}:8000": i + 1 for i in range(workers)}
    try:
        for _ in range(20):  # warm: each router reads the other's hash from now on
            await one.beat(conn, mine)
            await two.beat(conn, mine)
        spent = 0.0
        for _ in range(beats):
            for hb in (one, two):
                if gap_s:
                    await asyncio.sleep(gap_s)
                t0 = time.process_time()
                await hb.beat(conn, mine)
                spent += time.process_time() - t0
        return spent / (2 * beats) * 1e6
    finally:
        if conn is not client:
            await conn.close()
        await client.aclose()


def child(args: argparse.Namespace) -> int:
    import uvloop

    got = uvloop.run(per_beat(args.child, args.beats, args.workers, args.gap_ms / 1000))
    print(json.dumps(got))
    return 0


def measure(python: str, url: str, beats: int, workers: int, gap_ms: float) -> float:
    argv = [python, __file__, "--child", url, "--beats", str(beats)]
    argv += ["--workers", str(workers), "--gap-ms", str(gap_ms)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900)
    return float(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from support import RedisServer

    builds = {"this build": sys.executable}
    if args.baseline_python:
        builds["baseline"] = args.baseline_python
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    got: dict[tuple[str, float], list[float]] = {(b, g): [] for b in builds for g in gaps}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        try:
            for _ in range(args.rounds):
                for gap in gaps:
                    beats = args.beats if gap == 0 else args.idle_beats
                    for name, python in builds.items():
                        got[name, gap].append(measure(python, server.url, beats, args.workers, gap))
        finally:
            server.stop()
    print(f"µs of the client's CPU per beat, median of {args.rounds} rounds (range)\n")
    print("| build | " + " | ".join(f"{g:g} ms between beats" for g in gaps) + " |")
    print("|---|" + "---|" * len(gaps))
    for name in builds:
        cells = []
        for gap in gaps:
            v = got[name, gap]
            cells.append(f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--beats", type=int, default=400, help="beats per router, back to back")
    ap.add_argument(
        "--idle-beats", type=int, default=30, help="beats per router with the loop idle between"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8, help="workers in each beat's load")
    ap.add_argument("--gaps-ms", default="0,500", help="idle time before each beat, ms")
    ap.add_argument("--baseline-python", help="an interpreter with an earlier kvroute installed")
    ap.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--gap-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    return child(args) if args.child else run(args)


if __name__ == "__main__":
    sys.exit(main())
