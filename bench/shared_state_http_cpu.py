"""What ``--state-store`` adds to a router's CPU per request, end to end, at a steady rate.

``bench/shared_state_overhead.py`` measures publishing inside one process, with nothing
else running between a request's changes. Here two real ``kvroute serve`` processes run
side by side in front of the same two streaming workers (``router_overhead.py
--serve-worker``: N events ``--chunk-gap-ms`` apart, usage in the last), one alone and
one with ``--state-store`` on a loopback ``redis-server``. First, each router's CPU while
idle (heartbeats, health checks, the store's reads). Then, at each ``--rates`` point,
both routers get the same requests at once, each on its own Poisson draw, and each
router's CPU (every thread, nanoseconds on CPU from ``/proc/PID/task/*/schedstat``) is
read before and after. Printed per rate: each router's CPU per request (median over the
rounds, and the range) and the difference, round by round (the two measured over the
same seconds), as the median and the range.

The requests are ``router_overhead.py``'s 2,029-token chat prompts on 8 system prompts,
routed on bytes (``cache_aware``, no tokenizer), streamed; neither router writes an
access log. Redis's own CPU is not counted (another process).

``--baseline-python`` adds a third router at once, with ``--state-store`` too (on its
own Redis database, so the two with a store do not share state): the kvroute installed
for that interpreter (an earlier build), so a change to the store is measured against
its baseline over the same seconds. ``--other-keys N`` first fills both databases with N
keys of another application, as in a Redis the routers share with other data.
``--silent-store`` adds a router with a store that publishes nothing
(``silent_store_serve.py``: it connects, beats and reads as usual, and drops its
decisions and load changes where they are queued); the difference between the router
with a store and this one, round by round, is what publishing costs end to end.
``--unix-socket`` adds a router with a store reached through Redis's Unix socket
(``unix://``), as routers on Redis's own host can. ``--peers``: each router with a store
gets a peer of the same build on the same database, sent requests at the same rate (its
own Poisson draw, its CPU not counted), so the measured router applies the peer's
decisions and load changes (its ``XREAD`` woken by them) besides publishing its own:
what a store costs a router among replicas.

Usage:
    python bench/shared_state_http_cpu.py --rates 20,60 --requests 300 --rounds 6
    python bench/shared_state_http_cpu.py --baseline-python OLD_VENV/bin/python
    python bench/shared_state_http_cpu.py --rates 20,60 --unix-socket
    python bench/shared_state_http_cpu.py --rates 20,60,100 --silent-store
    python bench/shared_state_http_cpu.py --rates 20,60 --peers --baseline-python OLD/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

import router_overhead as ro  # noqa: E402
from kvroute.eval.procs import free_port, kvroute_argv, start_server  # noqa: E402
from support import RedisServer  # noqa: E402


def cpu_ns(pid: int) -> int:
    """Nanoseconds on CPU of every thread of ``pid`` so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


async def one(client: httpx.AsyncClient, url: str, body: bytes) -> str | None:
    """None if the request succeeded, else what went wrong (a status and the start of
    the body, or the client's exception)."""
    try:
        async with client.stream(
            "POST", url, content=body, headers={"content-type": "application/json"}
        ) as r:
            chunks = [c async for c in r.aiter_raw()]
            if r.status_code == 200:
                return None
            return f"HTTP {r.status_code}: {b''.join(chunks)[:200]!r}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


async def burst(url: str, bodies: list[bytes], rate: float, seed: int) -> list[str]:
    """``bodies`` as Poisson arrivals at ``rate``; what went wrong with those that failed."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(bodies))
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        at = 0.0
        for body, gap in zip(bodies, gaps, strict=True):
            at += float(gap)
            delay = start + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, url, body)))
        done = await asyncio.gather(*tasks)
    return [d for d in done if d is not None]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rates", default="5,20,80", help="requests per second, comma-separated")
    ap.add_argument("--requests", type=int, default=400, help="per router, rate and round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--stream-chunks", type=int, default=16, help="events per answer")
    ap.add_argument("--chunk-gap-ms", type=float, default=10.0, help="pause before each event")
    ap.add_argument("--idle-s", type=float, default=10.0, help="first, each router idle this long")
    ap.add_argument(
        "--other-keys",
        type=int,
        default=0,
        help="first fill Redis with this many keys of another application (a shared Redis)",
    )
    ap.add_argument(
        "--unix-socket",
        action="store_true",
        help="a third router with a store, reaching Redis through its Unix socket",
    )
    ap.add_argument(
        "--silent-store",
        action="store_true",
        help="a router with a store that publishes nothing: publishing's own cost is the "
        "difference from the router with a store",
    )
    ap.add_argument(
        "--baseline-python",
        help="a third router with a store: the kvroute installed for this interpreter",
    )
    ap.add_argument(
        "--peers",
        action="store_true",
        help="each router with a store gets a peer of its build on its database, sent the "
        "same rate of requests: applying the peer's entries is then counted too",
    )
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-store-cpu-"))
    servers = []
    redis = RedisServer(log_dir, unix_socket=args.unix_socket)
    try:
        with redis.client() as c:
            for db in (0, 1, 2):
                c.select(db)
                for at in range(0, args.other_keys, 10_000):
                    n = min(10_000, args.other_keys - at)
                    c.mset({f"app:{db}:{at + i}": b"x" for i in range(n)})
        urls = []
        for _ in range(2):
            port = free_port()
            argv = [sys.executable, str(HERE / "router_overhead.py"), "--serve-worker", str(port)]
            argv += ["--stream-chunks", str(args.stream_chunks)]
            argv += ["--chunk-gap-ms", str(args.chunk_gap_ms)]
            w = start_server(f"worker-{port}", argv, port, log_dir=str(log_dir))
            servers.append(w)
            urls.append(w.url)
        routers = {}
        setups = [("alone", []), ("with Redis", ["--state-store", redis.url])]
        if args.baseline_python:
            setups.append(("baseline, with Redis", ["--state-store", redis.url[:-1] + "1"]))
        if args.silent_store:  # its own database: it must not read the others' entries
            silent = ["--state-store", redis.url[:-1] + "3"]
            setups.append(("with Redis, publishing nothing", silent))
        if args.unix_socket:  # the last database: apart from the others
            unix = redis.unix_url[:-1] + "2"
            setups.append(("Redis on its Unix socket", ["--state-store", unix]))
        peers = []  # sent requests, not measured
        for name, extra in setups:
            for is_peer in (False, True) if extra and args.peers else (False,):
                port = free_port()
                argv = kvroute_argv("serve", "--worker-urls", *urls, "--port", str(port))
                argv += ["--policy", "cache_aware", "--log-level", "warning", *extra]
                if name.startswith("baseline"):
                    argv[0] = args.baseline_python
                if name.endswith("publishing nothing"):
                    argv = [sys.executable, str(HERE / "silent_store_serve.py"), *argv[3:]]
                srv = start_server(f"router-{port}", argv, port, log_dir=str(log_dir))
                servers.append(srv)
                if is_peer:
                    peers.append(srv)
                else:
                    routers[name] = srv
        names = list(routers)
        sent = [routers[n] for n in names] + peers  # every router requests go to
        warm = [ro.request_body(0, i, stream=True) for i in range(64)]
        for srv in [*routers.values(), *peers]:
            asyncio.run(burst(srv.url + "/v1/chat/completions", warm, 50.0, 0))
        idle0 = {n: cpu_ns(srv.proc.pid) for n, srv in routers.items()}
        t0 = time.monotonic()
        time.sleep(args.idle_s)
        idle_s = time.monotonic() - t0
        idle = {n: (cpu_ns(srv.proc.pid) - idle0[n]) / 1e6 / idle_s for n, srv in routers.items()}
        print(
            "idle, no requests: "
            + ", ".join(f"{n} {v:.2f} ms of CPU per second" for n, v in idle.items())
            + f" (over {idle_s:.0f} s)\n"
        )
        print(
            f"{args.requests} streamed requests per router, rate and round; {args.rounds} "
            f"rounds; {args.stream_chunks} events {args.chunk_gap_ms:g} ms apart; "
            + ("each router with a store beside a peer sent as many; " if peers else "")
            + f"load average before {os.getloadavg()[0]:.1f}\n"
        )
        stored = names[1:]  # the routers with a store, each against the one alone
        print(
            "| rate (req/s) | alone: µs/request, median (range) | "
            + " | ".join(f"{n} | added" for n in stored)
            + " | errors |\n|---|---|"
            + "---|---|" * len(stored)
            + "---|"
        )
        for rate in (float(r) for r in args.rates.split(",")):
            per: dict[str, list[float]] = {n: [] for n in names}
            errors = 0
            failed: list[str] = []
            for rnd in range(args.rounds):
                # Both routers at once, each its own Poisson draw of the same requests:
                # whatever else the machine does meanwhile weighs on both alike.
                bodies = [
                    ro.request_body(1000 * (rnd + 1) + int(rate), i, stream=True)
                    for i in range(args.requests)
                ]
                before = {n: cpu_ns(routers[n].proc.pid) for n in names}

                async def both(
                    bodies: list[bytes] = bodies, rnd: int = rnd, rate: float = rate
                ) -> list[list[str]]:
                    return list(
                        await asyncio.gather(
                            *(
                                burst(
                                    srv.url + "/v1/chat/completions",
                                    bodies,
                                    rate,
                                    rnd * len(sent) + k,
                                )
                                for k, srv in enumerate(sent)
                            )
                        )
                    )

                for srv, got in zip(sent, asyncio.run(both()), strict=True):
                    who = next((n for n, r in routers.items() if r is srv), "a peer")
                    errors += len(got)
                    failed += [f"{who} ({srv.url}), round {rnd}: {e}" for e in got]
                for n in names:
                    per[n].append((cpu_ns(routers[n].proc.pid) - before[n]) / 1000 / args.requests)

            def cell(xs: list[float]) -> str:
                return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"

            row = f"| {rate:g} | {cell(per[names[0]])} "
            for n in stored:
                added = [b - a for a, b in zip(per[names[0]], per[n], strict=True)]
                row += (
                    f"| {cell(per[n])} | {statistics.median(added):+.0f} "
                    f"({min(added):+.0f} to {max(added):+.0f}) "
                )
            print(row + f"| {errors} |", flush=True)
            if "with Redis, publishing nothing" in per:
                quiet = per["with Redis, publishing nothing"]
                pub = [a - b for a, b in zip(per["with Redis"], quiet, strict=True)]
                print(
                    f"  publishing at {rate:g} req/s (with Redis - publishing nothing, round "
                    f"by round): {statistics.median(pub):+.0f} µs per request "
                    f"({min(pub):+.0f} to {max(pub):+.0f})",
                    flush=True,
                )
            for f in failed:
                print(f"  failed at {rate:g} req/s: {f}", flush=True)
    finally:
        for srv in reversed(servers):
            srv.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
