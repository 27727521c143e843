"""``kvroute bench-index``: throughput of the native prefix index, called from Python.

Scenarios (same data as the Rust criterion bench, ``cargo bench --bench index``):

* INSERT: 10,000 requests of ~2,000 tokens (one of 6 template prefixes of ~30 tokens
  plus a random tail) into a fresh index, spread over 10, 50, 100 and 500 workers;
* MATCH of the same requests (100% hits): ``longest_match`` (what routing calls) and
  ``match`` (the per-worker dict);
* ROUTE: ``longest_match`` then ``insert`` per request into a fresh index;
* MIXED: 64 groups x 16 requests sharing 2,048-token system prompts + 128-token question;
* CONCURRENT: 2 Python threads mixing match and insert (the GIL is released inside);
* EVICTION: inserts under a budget of 10% of the tokens each worker receives.

A naive pure-Python trie (dict per token) runs on a subset in the same process and the
ratio is printed, as is the cost of one call with a 2,000-token list vs a u32 buffer,
and the index's memory per token (its own accounting and the process RSS delta).
No number here is asserted anywhere; it is a measurement to read.
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvroute import PrefixIndex

WORKER_COUNTS = (10, 50, 100, 500)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=10_000, help="requests per scenario")
    p.add_argument(
        "--naive-requests",
        type=int,
        default=500,
        help="requests given to the pure-Python trie baseline (it is slow and memory-hungry)",
    )
    p.add_argument("--seed", type=int, default=1, help="random seed for the token data")
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=list(WORKER_COUNTS),
        help="fleet sizes for INSERT/MATCH",
    )


def template_requests(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    templates = [
        rng.integers(0, 150_000, int(rng.integers(25, 36)), dtype=np.uint32) for _ in range(6)
    ]
    out = []
    for _ in range(n):
        tail = rng.integers(0, 150_000, int(rng.integers(1900, 2000)), dtype=np.uint32)
        out.append(np.concatenate([templates[int(rng.integers(0, 6))], tail]))
    return out


def shared_prefix_requests(seed: int) -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 150_000, 2048, dtype=np.uint32) for _ in range(64)]
    out = []
    for _ in range(16):
        for g, sys_prompt in enumerate(systems):
            out.append(
                (g, np.concatenate([sys_prompt, rng.integers(0, 150_000, 128, dtype=np.uint32)]))
            )
    return out


class NaiveTrie:
    """Baseline: one dict-of-dicts trie per worker, a Python object per token."""

    def __init__(self) -> None:
        self.roots: dict[str, dict[int, dict]] = {}  # type: ignore[type-arg]

    def insert(self, worker: str, tokens: Sequence[int]) -> None:
        node = self.roots.setdefault(worker, {})
        for t in tokens:
            node = node.setdefault(t, {})

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        out = {}
        for worker, root in self.roots.items():
            node, n = root, 0
            for t in tokens:
                nxt = node.get(t)
                if nxt is None:
                    break
                node, n = nxt, n + 1
            if n:
                out[worker] = n
        return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _row(name: str, ops: int, tokens: int, secs: float) -> str:
    return f"| {name} | {secs * 1e6 / ops:.2f} | {ops / secs:,.0f} | {tokens / secs:.3g} |"


def _ratio_row(name: str, naive: float, native: float, n: int) -> str:
    return f"| {name} | {naive * 1e6 / n:.1f} | {native * 1e6 / n:.2f} | {naive / native:.0f}x |"


def run(args: argparse.Namespace) -> int:
    reqs = template_requests(args.requests, args.seed)
    tokens = int(sum(len(r) for r in reqs))
    lines = [
        f"### kvroute bench-index: {len(reqs):,} requests, {tokens:,} tokens\n",
        "| scenario | µs/op | ops/s | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    memory = ""
    for w in args.workers:
        names = [f"http://10.0.0.{i}:8000" for i in range(w)]
        gc.collect()
        rss0 = _rss_bytes()
        idx = PrefixIndex()

        def insert_all(idx: PrefixIndex = idx, names: list[str] = names) -> None:
            for i, r in enumerate(reqs):
                idx.insert(names[i % len(names)], r)

        lines.append(_row(f"insert ({w} workers)", len(reqs), tokens, _timed(insert_all)))
        rss1 = _rss_bytes()
        lm = idx.longest_match
        secs = _timed(lambda lm=lm: [lm(r) for r in reqs])  # type: ignore[misc]
        lines.append(_row(f"longest_match, 100% hits ({w} workers)", len(reqs), tokens, secs))
        m = idx.match
        secs = _timed(lambda m=m: [m(r) for r in reqs])  # type: ignore[misc]
        lines.append(_row(f"match -> dict, 100% hits ({w} workers)", len(reqs), tokens, secs))
        fresh = PrefixIndex()

        def route(fresh: PrefixIndex = fresh, names: list[str] = names) -> None:
            for i, r in enumerate(reqs):
                fresh.longest_match(r)
                fresh.insert(names[i % len(names)], r)

        lines.append(
            _row(f"route: longest_match + insert ({w} workers)", len(reqs), tokens, _timed(route))
        )
        if w == max(args.workers):
            s = idx.stats()
            per_stored = s["memory_bytes"] / s["stored_tokens"]
            per_cached = s["memory_bytes"] / s["cached_tokens"]
            rss_per = (rss1 - rss0) / s["stored_tokens"]
            memory = (
                f"memory at {w} workers: index accounting {per_stored:.2f} bytes per stored "
                f"token ({per_cached:.2f} per cached token); process RSS grew {rss_per:.2f} "
                "bytes per stored token while inserting"
            )
        del idx, fresh

    shared = shared_prefix_requests(args.seed + 1)
    shared_tokens = int(sum(len(r) for _, r in shared))
    idx = PrefixIndex()
    names8 = [f"w{i}" for i in range(8)]

    def mixed() -> None:
        for g, r in shared:
            idx.longest_match(r)
            idx.insert(names8[g % 8], r)

    lines.append(
        _row(
            "mixed: match+insert, 2048+128 shared (8 workers)",
            len(shared),
            shared_tokens,
            _timed(mixed),
        )
    )

    names10 = [f"w{i}" for i in range(10)]
    conc = PrefixIndex()
    for i, r in enumerate(reqs[: len(reqs) // 2]):
        conc.insert(names10[i % 10], r)

    def worker(t: int) -> None:
        for i in range(t, len(reqs), 2):
            if i % 4 == 0:
                conc.insert(names10[i % 10], reqs[i])
            else:
                conc.longest_match(reqs[i])

    def concurrent() -> None:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    lines.append(
        _row(
            "concurrent: 2 threads, 3 match : 1 insert (10 workers)",
            len(reqs),
            tokens,
            _timed(concurrent),
        )
    )
    budget = tokens // 10 // 10
    ev = PrefixIndex(max_tokens_per_worker=budget)

    def evicting() -> None:
        for i, r in enumerate(reqs):
            ev.insert(names10[i % 10], r)

    lines.append(
        _row("insert with eviction, budget 10% (10 workers)", len(reqs), tokens, _timed(evicting))
    )

    # Baseline: the naive trie against the native index on the same subset.
    n = min(args.naive_requests, len(reqs))
    sub_lists = [r.tolist() for r in reqs[:n]]
    sub_tokens = int(sum(len(r) for r in sub_lists))
    naive = NaiveTrie()
    native = PrefixIndex()
    names = [f"w{i}" for i in range(10)]

    def naive_insert() -> None:
        for i, r in enumerate(sub_lists):
            naive.insert(names[i % 10], r)

    def native_insert() -> None:
        for i, r in enumerate(reqs[:n]):
            native.insert(names[i % 10], r)

    t_naive_ins = _timed(naive_insert)
    t_native_ins = _timed(native_insert)
    t_naive_m = _timed(lambda: [naive.match(r) for r in sub_lists])
    t_native_m = _timed(lambda: [native.match(r) for r in reqs[:n]])
    lines += [
        "",
        f"Pure-Python trie baseline ({n} requests, {sub_tokens:,} tokens, 10 workers, "
        "same process):",
        "",
        "| operation | naive µs/op | native µs/op | speed-up |",
        "|---|---:|---:|---:|",
        _ratio_row("insert", t_naive_ins, t_native_ins, n),
        _ratio_row("match", t_naive_m, t_native_m, n),
    ]

    # Cost of one call: a 2,000-token request that matches nothing in an empty index.
    empty = PrefixIndex()
    as_list = reqs[0][:2000].tolist()
    as_buf = reqs[0][:2000].copy()
    reps = 20_000
    t_list = _timed(lambda: [empty.longest_match(as_list) for _ in range(reps)])
    t_buf = _timed(lambda: [empty.longest_match(as_buf) for _ in range(reps)])
    lines += [
        "",
        f"One Python call, 2,000 tokens, empty index: list[int] {t_list * 1e6 / reps:.2f} µs, "
        f"uint32 buffer {t_buf * 1e6 / reps:.2f} µs",
        memory,
    ]
    print("\n".join(lines))
    return 0
