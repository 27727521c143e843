"""Soak: memory and resources stay bounded under a stream of unique prompts.

Part 1 (index): 1,000,000 unique prompts (plus a recurring set of shared ones) routed
through ``PrefixIndex`` with a per-worker budget, as cache_aware does (longest_match then
insert). Every 100k requests: process RSS, index memory and the largest worker's cached
tokens, which must stay at or under the budget.

Part 2 (router path): the real router process in front of fake workers, fed unique and
shared prompts (half of them streamed) for a bounded time. Every ``--sample-secs`` it
samples the router's RSS, open file descriptors, TCP sockets (any state), established
connections towards the workers and from clients (from /proc), its asyncio task count
(the ``kvroute_asyncio_tasks`` gauge) and the workers' in-flight counts; then once more
when the load ends and after 15 idle seconds, which must be back at the idle row's level.

Part 3 (default budget, ``--unique-chats N``): the router with default flags (no
``--max-tree-size``; the index budget is the documented fallback, the tokenizer's segment
cache its default byte bound) and ``--tokenizer`` when the Qwen3 tokenizer is installed,
fed N unique ~1,000-character chat prompts; a row every N/10 requests with the router's
RSS, the largest worker's cached tokens against its budget, and the segment cache's
size. RSS must level off once the budgets are reached.

Usage: python bench/soak.py [--prompts 1000000] [--router-seconds 60] [--sample-secs 10]
       [--unique-chats 200000]
(``--prompts 0`` skips part 1, ``--router-seconds 0`` part 2)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from kvroute import PrefixIndex
from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server

ROOT = Path(__file__).resolve().parents[1]


def rss_mb(pid: int | None = None) -> float:
    path = f"/proc/{pid or 'self'}/status"
    with open(path) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def soak_index(n: int, workers: int, budget: int, prompt_len: int) -> None:
    idx = PrefixIndex(max_tokens_per_worker=budget)
    names = [f"w{i}" for i in range(workers)]
    rng = np.random.default_rng(0)
    shared = [rng.integers(0, 150_000, prompt_len, dtype=np.uint32) for _ in range(64)]
    print(
        f"\n## Index: {n:,} unique prompts of {prompt_len} tokens + 1 shared in 10, "
        f"{workers} workers, budget {budget:,} tokens/worker\n"
    )
    print(
        "| requests | RSS (MB) | index memory (MB) | nodes | max worker cached | "
        "evicted tokens | µs/request |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    t_last = time.perf_counter()
    block = 100_000
    for start in range(0, n, block):
        batch = rng.integers(0, 150_000, (block, prompt_len), dtype=np.uint32)
        for i in range(block):
            r = shared[i % 64] if i % 10 == 0 else batch[i]
            matched, holders = idx.longest_match(r)
            w = holders[0] if holders and matched * 2 > prompt_len else names[i % workers]
            idx.insert(w, r)
        s = idx.stats()
        worst = max(idx.cached_tokens(w) for w in names)
        now = time.perf_counter()
        print(
            f"| {start + block:,} | {rss_mb():.0f} | {s['memory_bytes'] / 2**20:.0f} | "
            f"{s['nodes']:,} | {worst:,} | {s['evicted_tokens']:,} | "
            f"{(now - t_last) * 1e6 / block:.2f} |",
            flush=True,
        )
        t_last = now
        assert worst <= budget


def tcp_connections(pid: int, remote_ports: set[int], local_port: int) -> tuple[int, int, int]:
    """(established connections from ``pid`` to ``remote_ports``, established
    connections accepted on ``local_port``, TCP sockets of ``pid`` in any state), from
    /proc: what the OS holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    upstream = downstream = total = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[9] not in inodes:
                    continue
                total += 1
                if cols[3] != "01":  # ESTABLISHED
                    continue
                if int(cols[2].rsplit(":", 1)[1], 16) in remote_ports:
                    upstream += 1
                elif int(cols[1].rsplit(":", 1)[1], 16) == local_port:
                    downstream += 1
    return upstream, downstream, total


def gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def drive(url: str, deadline: float, concurrency: int, counts: dict[str, int]) -> None:
    rng = np.random.default_rng(1)
    shared = [f"shared system prompt {g}. " * 60 for g in range(16)]

    async def one(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            n = counts["sent"]
            counts["sent"] += 1
            if n % 4 == 0:
                prompt = shared[n % 16] + "q"
            else:
                prompt = " ".join(map(str, rng.integers(0, 10**6, 300)))
            body = {"prompt": prompt, "max_tokens": 4, "stream": n % 2 == 0}
            try:
                r = await client.post(url + "/v1/completions", json=body)
                ok = r.status_code == 200 and b"error" not in r.content
            except httpx.HTTPError:
                ok = False
            counts["ok" if ok else "errors"] += 1

    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        await asyncio.gather(*(one(client) for _ in range(concurrency)))


async def observe(
    router: Server, workers: list[Server], seconds: float, every: float, concurrency: int
) -> None:
    ports = {int(w.url.rsplit(":", 1)[1]) for w in workers}
    port = int(router.url.rsplit(":", 1)[1])
    counts = {"sent": 0, "ok": 0, "errors": 0}
    t0 = time.monotonic()

    async def row(client: httpx.AsyncClient, label: str) -> None:
        ws = (await client.get(router.url + "/workers")).json()
        tasks = gauge((await client.get(router.url + "/metrics")).text, "kvroute_asyncio_tasks")
        up, down, total = tcp_connections(router.pid, ports, port)
        print(
            f"| {label} | {counts['ok']:,} | {counts['errors']} | {rss_mb(router.pid):.0f} | "
            f"{fds(router.pid)} | {total} | {up} | {down} | {tasks:.0f} | "
            f"{sum(w['in_flight'] for w in ws)} | {max(w['cached_tokens'] for w in ws):,} |",
            flush=True,
        )

    print(
        "| elapsed (s) | requests ok | errors | router RSS (MB) | open fds | TCP sockets | "
        "upstream conns | client conns | asyncio tasks | in flight | cached tokens (max worker) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    # The observer has its own client: its one connection shows in "client conns".
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        await row(client, "0 (idle)")
        load = asyncio.create_task(drive(router.url, t0 + seconds, concurrency, counts))
        due = every
        while not load.done():
            await asyncio.wait({load}, timeout=max(0.0, t0 + due - time.monotonic()))
            if not load.done():
                await row(client, f"{time.monotonic() - t0:.0f}")
                due += every
        await load
        await row(client, f"{time.monotonic() - t0:.0f} (load ended)")
        # Idle keep-alive connections close after the workers' keep-alive timeout (5 s)
        # and are reaped by the router's next health check (5 s).
        await asyncio.sleep(15)
        await row(client, f"{time.monotonic() - t0:.0f} (idle 15 s)")


def soak_router(seconds: float, budget: int, every: float, concurrency: int) -> None:
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            for _ in range(2):
                port = free_port()
                servers.append(
                    start_server(
                        f"fake-{port}",
                        [
                            sys.executable,
                            str(ROOT / "tests" / "fake_worker.py"),
                            "--port",
                            str(port),
                        ],
                        port,
                        log_dir=logs,
                    )
                )
            port = free_port()
            router = start_server(
                "router",
                kvroute_argv(
                    "serve",
                    "--port",
                    str(port),
                    "--max-tree-size",
                    str(budget),
                    "--worker-urls",
                    *[s.url for s in servers],
                ),
                port,
                log_dir=logs,
            )
            workers = list(servers)
            servers.append(router)
            print(
                f"\n## Router path: unique + shared prompts for {seconds:.0f}s, "
                f"{concurrency} concurrent clients, --max-tree-size {budget:,}\n"
            )
            asyncio.run(observe(router, workers, seconds, every, concurrency))
        finally:
            for s in reversed(servers):
                s.stop()


async def drive_unique_chats(router: Server, n: int, concurrency: int) -> None:
    rng = np.random.default_rng(2)
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    sent = ok = errors = 0
    kinds: dict[str, int] = {}  # errors by HTTP status or exception name
    lock = asyncio.Lock()
    every = max(1, n // 10)

    async def row(client: httpx.AsyncClient, label: str) -> None:
        ws = (await client.get(router.url + "/workers")).json()
        worst = max(ws, key=lambda w: w["cached_tokens"])
        tok = (await client.get(router.url + "/metrics")).text
        print(
            f"| {label} | {ok:,} | {errors} | {rss_mb(router.pid):.0f} | "
            f"{worst['cached_tokens']:,} | {worst['index_budget']:,} | "
            f"{gauge(tok, 'kvroute_tokenizer_cache_bytes') / 2**20:.1f} |",
            flush=True,
        )

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal sent, ok, errors
        while True:
            async with lock:
                if sent >= n:
                    return
                i = sent
                sent += 1
            words = " ".join(map(str, rng.integers(0, 10**6, 140)))  # ~1,000 characters
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Question {i}: {words}"},
                ],
                "max_tokens": 4,
            }
            try:
                r = await client.post(router.url + "/v1/chat/completions", json=body)
                good, kind = r.status_code == 200, f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                good, kind = False, type(e).__name__
            async with lock:
                if not good:
                    kinds[kind] = kinds.get(kind, 0) + 1
                ok, errors = (ok + 1, errors) if good else (ok, errors + 1)
                due = (ok + errors) % every == 0
            if due:
                await row(client, f"{ok + errors:,}")

    print(
        "| requests | ok | errors | router RSS (MB) | cached tokens (max worker) | "
        "its index budget | segment cache (MB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        await row(client, "0 (idle)")
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
    print(f"\nerrors by kind: {kinds or 'none'}")


def soak_unique_chats(n: int, concurrency: int, extra: list[str]) -> None:
    from kvroute.routing.tokenization import default_tokenizer_dir

    tokenizer = default_tokenizer_dir()
    servers: list[Server] = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            for _ in range(2):
                port = free_port()
                argv = [sys.executable, str(ROOT / "tests" / "fake_worker.py"), "--port", str(port)]
                servers.append(start_server(f"fake-{port}", argv, port, log_dir=logs))
            port = free_port()
            flags = (["--tokenizer", tokenizer] if tokenizer else []) + extra
            argv = kvroute_argv(
                "serve", "--port", str(port), "--worker-urls", *[s.url for s in servers], *flags
            )
            router = start_server("router", argv, port, log_dir=logs, timeout_s=60)
            servers.append(router)
            print(
                f"\n## Default budget: {n:,} unique chat prompts, {concurrency} concurrent "
                f"clients, default flags{' + --tokenizer (Qwen3)' if tokenizer else ''}"
                f"{' + ' + ' '.join(extra) if extra else ''}\n"
            )
            asyncio.run(drive_unique_chats(router, n, concurrency))
        finally:
            for s in reversed(servers):
                s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=1_000_000)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2_000_000, help="tokens per worker")
    ap.add_argument("--router-seconds", type=float, default=60.0)
    ap.add_argument("--sample-secs", type=float, default=10.0, help="router phase: row period")
    ap.add_argument("--concurrency", type=int, default=32, help="router phase: clients")
    ap.add_argument("--unique-chats", type=int, default=0, help="part 3: requests (0 skips)")
    ap.add_argument(
        "--router-arg", action="append", default=[], help="part 3: one more router argument"
    )
    args = ap.parse_args()
    if args.prompts > 0:
        soak_index(args.prompts, args.workers, args.budget, args.prompt_len)
    if args.router_seconds > 0:
        soak_router(args.router_seconds, args.budget, args.sample_secs, args.concurrency)
    if args.unique_chats > 0:
        soak_unique_chats(args.unique_chats, args.concurrency, args.router_arg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
