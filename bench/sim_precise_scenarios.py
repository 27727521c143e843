"""Precise vs approximate vs round-robin in the fleet simulator, on the llm-d shape, under
what approximate routing cannot see (router replicas, bypass traffic, engine restarts).

For each scenario, guard setting and seed, on the same requests: round_robin, cache_aware
with the router's defaults (unbounded index, what ``kvroute serve`` does without
``--max-tree-size``), cache_aware with the index budget set to the engines' real KV
capacity (``--max-tree-size`` = ``--capacity-tokens``, "tuned"), and
cache_aware+events (precise mode, router defaults). Precise mode is also run with the
tuned budget and the script checks both runs are identical: with every worker trusted the
approximate index it keeps as a fallback is never consulted. Each row is what
``kvroute simulate`` prints for the same flags.

Usage:
    python bench/sim_precise_scenarios.py --seeds 0,1,2,3,4 \\
        --json bench/results/sim_precise_scenarios.json > table.md
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from kvroute.config import parse_worker_capacity
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, prepare, simulate, upper_bound
from kvroute.sim.report import ResultRow
from kvroute.sim.workloads import llmd

# Picked before any result was seen: two replicas (the smallest HA deployment), 10-30%
# of traffic past the router, a restart a minute (compressed: the run lasts ~190 s).
SCENARIOS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "2 router replicas": {"router_replicas": 2},
    "10% bypass": {"bypass_fraction": 0.1},
    "20% bypass": {"bypass_fraction": 0.2},
    "30% bypass": {"bypass_fraction": 0.3},
    "restart every 60 s": {"restart_every_s": 60.0},
}
FLAGS = {
    "router_replicas": "--router-replicas",
    "bypass_fraction": "--bypass-fraction",
    "restart_every_s": "--restart-every",
}
ROWS = ("round_robin", "approximate (default)", "approximate (tuned)", "precise")


def run_seed(seed: int, guard: str, scenario: dict[str, Any], args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    reqs = llmd(output_len=args.output_len, seed=seed, arrivals="poisson", rate=args.rate)
    prep = prepare(reqs, 16)
    capacity, learn = parse_worker_capacity(guard)
    cfg = FleetConfig(
        workers=args.workers,
        capacity_tokens=args.capacity_tokens,
        cost=CostModel(),
        policy_settings={"seed": seed, "worker_capacity": capacity},
        learn_capacity=learn,
        seed=seed,
        **scenario,
    )
    tuned = replace(cfg, max_tree_size=args.capacity_tokens)
    rows: dict[str, ResultRow] = {
        "round_robin": simulate(prep, "round_robin", cfg),
        "approximate (default)": simulate(prep, "cache_aware", cfg),
        "approximate (tuned)": simulate(prep, "cache_aware", tuned),
        "precise": simulate(prep, "cache_aware+events", cfg),
    }
    check = simulate(prep, "cache_aware+events", tuned)
    same = (check.hit_rate, check.ttft_p90) == (rows["precise"].hit_rate, rows["precise"].ttft_p90)
    out = {
        k: {
            "hit_rate": r.hit_rate,
            "ttft_p50": r.ttft_p50,
            "ttft_p90": r.ttft_p90,
            "ttft_p99": r.ttft_p99,
            "e2e_p99": r.e2e_p99,
        }
        for k, r in rows.items()
    }
    return {"rows": out, "precise_same_with_tuned_budget": same, "bound": upper_bound(prep)}


def command(guard: str, scenario: dict[str, Any], args: argparse.Namespace, tuned: bool) -> str:
    extra = " ".join(f"{FLAGS[k]} {v:g}" for k, v in scenario.items())
    budget = f" --max-tree-size {args.capacity_tokens}" if tuned else ""
    pols = "cache_aware" if tuned else "round_robin,cache_aware,cache_aware+events"
    return (
        f"kvroute simulate --workload llmd --workers {args.workers} --capacity-tokens "
        f"{args.capacity_tokens}{budget} --arrivals poisson --rate {args.rate:g} --output-len "
        f"{args.output_len} --worker-capacity {guard} --seed S --policies {pols}"
        + (f" {extra}" if extra else "")
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--guards", default="auto,off")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated names")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--capacity-tokens", type=int, default=308_000)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--summary", default=None, metavar="JSON", help="only print the summary table of a run"
    )
    args = ap.parse_args()
    if args.summary:
        print_summary(orjson.loads(Path(args.summary).read_bytes()))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    results: list[dict[str, Any]] = []
    for name in args.scenarios.split(","):
        scenario = SCENARIOS[name]
        for guard in args.guards.split(","):
            per_seed = {}
            for seed in seeds:
                t0 = time.perf_counter()
                per_seed[seed] = run_seed(seed, guard, scenario, args)
                print(f"{name}, guard {guard}, seed {seed}: {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr)  # fmt: skip
            results.append(
                {
                    "scenario": name,
                    "guard": guard,
                    "flags": scenario,
                    "command": command(guard, scenario, args, False),
                    "command_tuned": command(guard, scenario, args, True),
                    "seeds": per_seed,
                }
            )
            print_table(results[-1], seeds)
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_bytes(
            orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
        )
    return 0


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def print_table(res: dict[str, Any], seeds: list[int]) -> None:
    s = res["seeds"]
    print(f"\n#### {res['scenario']}, guard {res['guard']} (mean of seeds {seeds})\n")
    print(f"`{res['command']}`; tuned row: `{res['command_tuned']}`\n")
    print("| policy | hit rate | TTFT p50 / p90 / p99 (s) |\n|---|---|---|")
    for row in ROWS:
        v = {k: mean([s[x]["rows"][row][k] for x in seeds]) for k in s[seeds[0]]["rows"][row]}
        print(
            f"| {row} | {v['hit_rate']:.1%} | {v['ttft_p50']:.3f} / {v['ttft_p90']:.3f} / "
            f"{v['ttft_p99']:.3f} |"
        )
    for ref in ("approximate (default)", "approximate (tuned)"):
        p90 = [(s[x]["rows"]["precise"]["ttft_p90"], s[x]["rows"][ref]["ttft_p90"]) for x in seeds]
        ratios = [a / b for a, b in p90]
        dhit = [s[x]["rows"]["precise"]["hit_rate"] - s[x]["rows"][ref]["hit_rate"] for x in seeds]
        met = sum(1 for r, d in zip(ratios, dhit, strict=True) if r <= 0.5 and d >= 0)
        print(
            f"\nprecise / {ref}: p90 ratio per seed "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + "; hit rate difference (points) "
            + ", ".join(f"{100 * d:+.1f}" for d in dhit)
            + f"; target met in {met}/{len(seeds)} seeds"
        )
    same = all(s[x]["precise_same_with_tuned_budget"] for x in seeds)
    print(f"\nprecise identical with the tuned budget: {same}")


def print_summary(results: list[dict[str, Any]]) -> None:
    """One table: per scenario and guard, each row's mean over the seeds (hit rate, TTFT
    p50/p90/p99), then precise's p90 over approximate's (default budget) per seed."""
    print(
        "| scenario | guard | round_robin | approximate (default) | approximate (tuned) "
        "| precise | precise p90 / approx. default p90, per seed |"
    )
    print("|---|---|---|---|---|---|---|")
    for res in results:
        s = res["seeds"]
        seeds = list(s)
        cells = []
        for row in ROWS:
            v = {k: mean([s[x]["rows"][row][k] for x in seeds]) for k in s[seeds[0]]["rows"][row]}
            cells.append(
                f"{v['hit_rate']:.1%} · {v['ttft_p50']:.2f} / {v['ttft_p90']:.2f} / "
                f"{v['ttft_p99']:.2f}"
            )
        ratios = [
            s[x]["rows"]["precise"]["ttft_p90"] / s[x]["rows"]["approximate (default)"]["ttft_p90"]
            for x in seeds
        ]
        print(
            f"| {res['scenario']} | {res['guard']} | "
            + " | ".join(cells)
            + " | "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + " |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
