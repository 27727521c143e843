"""``kvroute analyze TRACE``: measure before you route.

Reads a Mooncake-format trace (``hash_ids`` per request) or a JSONL of requests with
token IDs (``tokens``, ``input_ids`` or ``prompt_token_ids``; optional ``timestamp`` ms
and ``output_length``), then reports:

* prefix sharing: prompt blocks in total and distinct (shared blocks are what a prefix
  cache can reuse at all);
* the hit-rate upper bound (one infinite cache shared by the fleet);
* round_robin and cache_aware on a simulated fleet of ``--workers`` with
  ``--capacity-tokens`` each (``kvroute.sim.fleet``);
* a one-line verdict: is cache-aware routing worth it for this traffic?
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from kvroute.commands.simulate import add_fleet_args, fleet_config


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="Mooncake-format JSONL, or JSONL of requests")
    add_fleet_args(p)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--time-scale", type=float, default=1.0, help="speed up the timestamps")
    p.add_argument("--json", action="store_true")


def load(path: str, limit: int | None, seed: int, time_scale: float) -> list[Any]:
    from kvroute.sim import workloads as wl

    rows = wl.read_trace(path, limit)
    if all("hash_ids" in r for r in rows):
        return wl.from_trace_rows(rows, seed=seed, time_scale=time_scale)
    out = []
    for i, r in enumerate(rows):
        ids = r.get("tokens", r.get("input_ids", r.get("prompt_token_ids")))
        if not isinstance(ids, list):
            raise ValueError(f"line {i + 1}: neither hash_ids nor a token list")
        out.append(
            wl.Request(
                float(r.get("timestamp", 0.0)) / 1000.0 / time_scale,  # type: ignore[arg-type]
                np.asarray(ids, dtype=np.uint32),
                max(int(r.get("output_length", 1)), 1),  # type: ignore[call-overload]
                -1,
            )
        )
    return sorted(out, key=lambda q: q.arrival_s)


def verdict(bound: float, rr: float, ca: float, ttft_ratio: float) -> str:
    if bound < 0.05:
        return "not worth it: almost no prefix is shared (upper bound under 5%)"
    gain = ca - rr
    if gain >= 0.10 or (gain >= 0.03 and ttft_ratio <= 0.8):
        return (
            f"worth it: cache_aware reuses {gain:+.1%} more prompt tokens than round_robin "
            f"(TTFT p50 x{ttft_ratio:.2f})"
        )
    if bound - rr >= 0.10:
        return (
            f"marginal at this size: sharing exists (bound {bound:.0%}) but the caches are "
            "too small or the fleet too large to keep it; try more --capacity-tokens"
        )
    return f"not worth it: round_robin already gets {rr:.0%} of a {bound:.0%} bound"


def run(args: argparse.Namespace) -> int:
    from kvroute.sim.fleet import prepare, simulate, upper_bound
    from kvroute.sim.report import markdown_table, to_json

    try:
        requests = load(args.trace, args.limit, args.seed, args.time_scale)
        cfg = fleet_config(args)
    except (ValueError, OSError, KeyError) as e:
        print(f"kvroute analyze: error: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("kvroute analyze: error: the trace is empty", file=sys.stderr)
        return 2
    prep = prepare(requests, cfg.block_size)
    total_blocks = sum(len(k) for k in prep.keys)
    distinct = len(set(np.concatenate(prep.keys).tolist())) if total_blocks else 0
    bound = upper_bound(prep)
    rows = [simulate(prep, p, cfg) for p in ("round_robin", "cache_aware")]
    rr, ca = rows
    ratio = ca.ttft_p50 / rr.ttft_p50 if rr.ttft_p50 > 0 else 1.0
    line = verdict(bound, rr.hit_rate, ca.hit_rate, ratio)
    if args.json:
        print(
            to_json(
                rows,
                bound,
                requests=len(requests),
                prompt_tokens=prep.prompt_tokens,
                blocks=total_blocks,
                distinct_blocks=distinct,
                verdict=line,
            )
        )
        return 0
    print(f"{len(requests)} requests, {prep.prompt_tokens:,} prompt tokens")
    share = 1 - distinct / total_blocks if total_blocks else 0.0
    print(
        f"prefix sharing: {total_blocks:,} blocks of {cfg.block_size} tokens, "
        f"{distinct:,} distinct ({share:.1%} repeats)"
    )
    print(f"upper bound (one infinite shared cache): {bound:.1%}")
    print(f"fleet: {cfg.workers} workers x {cfg.capacity_tokens:,} cached tokens each\n")
    print(markdown_table(rows, bound))
    print(f"\nverdict: {line}")
    return 0
