"""Soak: memory and resources stay bounded under a stream of unique prompts.

Part 1 (index): 1,000,000 unique prompts (plus a recurring set of shared ones) routed
through ``PrefixIndex`` with a per-worker budget, as cache_aware does (longest_match then
insert). Every 100k requests: process RSS, index memory and the largest worker's cached
tokens, which must stay at or under the budget.

Part 2 (router path): the real router process in front of fake workers, fed unique and
shared prompts for a bounded time; samples the router's RSS, open file descriptors and
the workers' in-flight counts, and compares start and end.

Usage: python bench/soak.py [--prompts 1000000] [--router-seconds 60]
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
from kvroute.procs import Server, free_port, kvroute_argv, start_server

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


async def drive(url: str, seconds: float, concurrency: int) -> int:
    sent = 0
    deadline = time.monotonic() + seconds
    rng = np.random.default_rng(1)
    shared = [f"shared system prompt {g}. " * 60 for g in range(16)]

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while time.monotonic() < deadline:
            if sent % 4 == 0:
                prompt = shared[sent % 16] + "q"
            else:
                prompt = " ".join(map(str, rng.integers(0, 10**6, 300)))
            body = {"prompt": prompt, "max_tokens": 4, "stream": sent % 2 == 0}
            r = await client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            sent += 1

    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
    return sent


def soak_router(seconds: float, budget: int) -> None:
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
            servers.append(router)
            print(
                f"\n## Router path: unique + shared prompts for {seconds:.0f}s, "
                f"--max-tree-size {budget:,}\n"
            )
            print(
                "| elapsed (s) | requests | router RSS (MB) | open fds | in flight | "
                "cached tokens (max worker) |"
            )
            print("|---:|---:|---:|---:|---:|---:|")
            total = 0
            t0 = time.monotonic()
            slices = max(1, int(seconds // 10))
            for _ in range(slices):
                total += asyncio.run(drive(router.url, seconds / slices, 32))
                ws = httpx.get(router.url + "/workers").json()
                print(
                    f"| {time.monotonic() - t0:.0f} | {total:,} | {rss_mb(router.pid):.0f} | "
                    f"{fds(router.pid)} | {sum(w['in_flight'] for w in ws)} | "
                    f"{max(w['cached_tokens'] for w in ws):,} |",
                    flush=True,
                )
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
    args = ap.parse_args()
    soak_index(args.prompts, args.workers, args.budget, args.prompt_len)
    soak_router(args.router_seconds, args.budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
