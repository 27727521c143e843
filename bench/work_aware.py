"""Work-aware routing in the simulator: min_ttft and cache_aware (work) against the
request-count rule (cache_aware --load-metric requests: SGLang's rule) and round-robin.

Every policy runs on the same requests and the same simulated fleet (virtual time, the
production policy and index code, ``kvroute.sim.fleet``). Per scenario:

* **capacity at the SLO**: the highest Poisson rate at which TTFT p90 <= ``--slo`` (2 s),
  by a bounded sweep per policy: from ``r0`` (the rate at which the fleet's raw prefill
  throughput equals the offered prompt tokens with no cache at all, over 4) the rate is
  doubled (or halved) until the SLO flips, at most ``--max-steps`` times, then bisected
  ``--bisect`` times in log space (default 5: within 2.2%). The requests keep their order
  and only their arrival times change between sweep points.
* **the table row**: every policy at one common rate, ``--load`` (0.8) x the capacity of
  cache_aware on request counts (SGLang's rule), so the fleet is busy but not drowning.
  Hit rate (and the bound of one infinite shared cache), TTFT p50/p90/p99, queue wait p99
  (TTFT minus the request's own prefill time), the busiest worker's prefill-busy time over
  the mean, and the work model's TTFT prediction error (mean absolute, routed requests).

Scenarios: ``mooncake`` (the Mooncake synthetic trace, ``--trace``, 4M cached tokens per
worker as in the routing-quality study), ``gsp8`` (SGLang's
generated-shared-prefix defaults, 8 workers), ``llmd_zipf`` (llm-d's long shared prefix
shape, group popularity Zipf s=1.1), ``chat`` (multi-turn chat, log-normal lengths:
``multiturn(sigma=1.8)``, prompt p99 ~17x median, up to ~90k tokens), ``hetero``
(gsp8 on a fleet whose last 2 of 8 workers prefill at half speed), ``gsp64`` (gsp with
512 groups on 64 workers), ``gsp8_prefill`` and ``hetero_prefill`` (the routing-quality
study's prefill-bound GSP shape: 3,000 prefill tokens/s, 32 output tokens; the second with
2 of 8 workers at half speed), ``mooncake_200k`` (the trace at the default 200k tokens per
worker: heavy cache pressure, where the approximate index believes in evicted prefixes).

    python bench/work_aware.py --out bench/results/work_aware.json

``--as-text``: every prompt becomes what ``bench/routing_quality.py`` sends and a router
without a tokenizer routes on, one printable ASCII byte per token (94 values), so
unrelated prompts share a few leading tokens by chance, as they do over HTTP.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from kvroute.eval.loadgen import tokens_to_text
from kvroute.sim import workloads as wl
from kvroute.sim.bounds import capacity_ceiling, ttft_floor
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, Prepared, heterogeneous, prepare, simulate, upper_bound
from kvroute.sim.report import ResultRow

# Settings per row; "engine_budgets" is the fleet's (FleetConfig), the rest the policy's.
# kvroute's rows budget their index as serve does (each worker's reported KV capacity);
# SGLang's router's tree (2^26 characters by default) evicts nothing at these sizes.
POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("min_ttft", "min_ttft", {}),
    ("cache_aware (work)", "cache_aware", {"load_metric": "work"}),
    ("cache_aware (requests)", "cache_aware", {"load_metric": "requests", "engine_budgets": False}),
    ("round_robin", "round_robin", {"engine_budgets": False}),
]
BASELINE = "cache_aware (requests)"


@dataclass
class Scenario:
    name: str
    build: Callable[[], list[wl.Request]]
    cfg: FleetConfig


def scenarios(trace: str | None) -> list[Scenario]:
    cost = CostModel()
    slow_cost = CostModel(prefill_tokens_per_s=3000.0)
    base = {"learn_capacity": True, "policy_settings": {"seed": 0}}
    out = []
    if trace:
        # 4M tokens per worker, as the routing-quality study: capacity does not limit.
        out.append(
            Scenario(
                "mooncake",
                lambda: wl.mooncake(trace),
                FleetConfig(workers=8, capacity_tokens=4_000_000, **base),  # type: ignore[arg-type]
            )
        )
    out += [
        Scenario("gsp8", lambda: wl.gsp(64, 16, 2048, 128, 256), FleetConfig(workers=8, **base)),  # type: ignore[arg-type]
        Scenario(
            "llmd_zipf",
            lambda: wl.llmd(popularity="zipf", zipf_s=1.1),
            FleetConfig(workers=8, **base),  # type: ignore[arg-type]
        ),
        Scenario(
            "chat",
            lambda: wl.multiturn(200, 6, 800, 200, 200, sigma=1.8),
            FleetConfig(workers=8, **base),  # type: ignore[arg-type]
        ),
        Scenario(
            "hetero",
            lambda: wl.gsp(64, 16, 2048, 128, 256),
            FleetConfig(workers=8, worker_costs=heterogeneous(cost, 8, 2, 0.5), **base),  # type: ignore[arg-type]
        ),
        Scenario("gsp64", lambda: wl.gsp(512, 16, 2048, 128, 256), FleetConfig(workers=64, **base)),  # type: ignore[arg-type]
        # Prefill-bound: the routing-quality study's GSP shape (3,000 prefill tokens/s,
        # 32 output tokens), where routing decides the capacity; and 2 of its 8 workers
        # at half that speed.
        Scenario(
            "gsp8_prefill",
            lambda: wl.gsp(64, 16, 2048, 128, 32),
            FleetConfig(workers=8, cost=slow_cost, **base),  # type: ignore[arg-type]
        ),
        Scenario(
            "hetero_prefill",
            lambda: wl.gsp(64, 16, 2048, 128, 32),
            FleetConfig(workers=8, worker_costs=heterogeneous(slow_cost, 8, 2, 0.5), **base),  # type: ignore[arg-type]
        ),
    ]
    if trace:
        # The default 200k tokens per worker: the index believes in evicted prefixes.
        out.append(
            Scenario("mooncake_200k", lambda: wl.mooncake(trace), FleetConfig(workers=8, **base))  # type: ignore[arg-type]
        )
    return out


def as_text(requests: list[wl.Request]) -> list[wl.Request]:
    """The prompts as the HTTP benchmark sends them (``--as-text``, module doc)."""
    out = []
    for r in requests:
        text = tokens_to_text(cast(Sequence[int], r.tokens))
        out.append(replace(r, tokens=np.frombuffer(text.encode(), np.uint8).astype(np.uint32)))
    return out


def at_rate(prep: Prepared, rate: float, seed: int = 7) -> Prepared:
    """The same requests, in the same order, arriving as a Poisson process at ``rate``
    (``seed``: the arrival draw; the tables use 7)."""
    gaps = np.random.default_rng([0, seed]).exponential(1.0 / rate, len(prep.requests))
    times = np.cumsum(gaps) - gaps[0]
    reqs = [replace(r, arrival_s=float(t)) for r, t in zip(prep.requests, times, strict=True)]
    return Prepared(reqs, prep.keys, prep.block_size)


def unit_arrivals(n: int, seed: int = 7) -> np.ndarray:
    """``at_rate``'s arrival times at rate 1 (at rate r they are these / r)."""
    gaps = np.random.default_rng([0, seed]).exponential(1.0, n)
    return np.cumsum(gaps) - gaps[0]


def bounds(sc: Scenario, prep: Prepared, slo: float, sweep: bool) -> dict[str, float]:
    """What no router can beat (``kvroute.sim.bounds``): TTFT floor p50/p90/p99 and,
    when swept, the capacity ceiling at the SLO on the sweep's arrival draw."""
    floor = ttft_floor(prep, sc.cfg.costs())
    out = {f"ttft_floor_p{q}": float(np.percentile(floor, q)) for q in (50, 90, 99)}
    if sweep:
        arr = unit_arrivals(len(prep.requests))
        out["capacity_ceiling"] = capacity_ceiling(prep, sc.cfg.costs(), arr, slo)
    return out


def reachable(b: dict[str, float], base: dict[str, float | None], base_cap: float | None) -> str:
    """Whether 0.8x the baseline's TTFT p50 and p99 and 1.25x its capacity are within the
    bounds (``base``: its ``ttft_p50`` and ``ttft_p99``)."""
    parts = []
    for q in ("p50", "p99"):
        v = base.get(f"ttft_{q}")
        if v:
            f = b[f"ttft_floor_{q}"]
            ok = f <= 0.8 * v
            parts.append(
                f"{q} floor {f:.3f} s = {f / v:.2f}x SGLang's rule's {v:.3f} s: "
                f"0.8x {'not excluded' if ok else 'UNREACHABLE'}"
            )
    if base_cap and "capacity_ceiling" in b:
        cap = b["capacity_ceiling"]
        ok = cap >= 1.25 * base_cap
        parts.append(
            f"capacity ceiling {cap:.2f} req/s = {cap / base_cap:.2f}x its {base_cap:.2f}: "
            f"1.25x {'not excluded' if ok else 'UNREACHABLE'}"
        )
    return "; ".join(parts)


def run(
    prep: Prepared,
    policy: str,
    settings: dict[str, Any],
    cfg: FleetConfig,
    *,
    record: bool = False,
) -> ResultRow:
    """One simulated run of ``policy`` (its ``settings``, ``engine_budgets`` among them)
    on ``cfg``; ``record``: per-request results in ``extra`` (``simulate``)."""
    settings = dict(settings)
    budgets = settings.pop("engine_budgets", cfg.engine_budgets)
    c = replace(cfg, engine_budgets=budgets, policy_settings={**cfg.policy_settings, **settings})
    return simulate(prep, policy, c, record=record)


def capacity(
    prep: Prepared,
    policy: str,
    settings: dict[str, Any],
    cfg: FleetConfig,
    args: Any,
    r0: float,
    seed: int = 7,
) -> tuple[float, int]:
    """Highest Poisson rate with TTFT p90 <= SLO (see module doc); (rate, runs).
    ``seed``: the arrival draw (``at_rate``)."""
    runs = 0

    def ok(rate: float) -> bool:
        nonlocal runs
        runs += 1
        return run(at_rate(prep, rate, seed), policy, settings, cfg).ttft_p90 <= args.slo

    lo = hi = None
    rate = r0
    for _ in range(args.max_steps):
        if ok(rate):
            lo = rate
            if hi is not None:
                break
            rate *= 2
        else:
            hi = rate
            if lo is not None:
                break
            rate /= 2
    if lo is None or hi is None:
        return (lo or 0.0), runs
    for _ in range(args.bisect):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="/work/shared/traces/mooncake_synthetic_trace.jsonl")
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    p.add_argument("--slo", type=float, default=2.0, help="TTFT p90 SLO in seconds (2)")
    p.add_argument("--load", type=float, default=0.8, help="table rate / baseline capacity")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--bisect", type=int, default=5)
    p.add_argument(
        "--no-sweep",
        action="store_true",
        help="no capacity sweep: the table at the workload's own arrival times (the "
        "Mooncake trace's timestamps), capacity not reported",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="no capacity sweep: the table at this Poisson rate (at_rate's draw; with "
        "workload seed 0 the same arrivals as bench/routing_quality.py --rate)",
    )
    p.add_argument(
        "--learn-at-polls",
        action="store_true",
        help="workers' capacities learned only at the router's engine polls (every 5 s), "
        "as serve learns them, not the moment a worker queues",
    )
    p.add_argument(
        "--known-speeds",
        action="store_true",
        help="every router knows each worker's prefill speed from the start (its cost "
        "model) instead of learning it from first bytes",
    )
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument(
        "--as-text",
        action="store_true",
        help="prompts as routing_quality.py sends them: one ASCII byte per token (the "
        "index then budgets 4 bytes per reported token, as serve without a tokenizer)",
    )
    p.add_argument(
        "--bounds-only",
        action="store_true",
        help="only the bounds (kvroute.sim.bounds), no routing; with --against, compared "
        "with SGLang's rule's p50 and capacity in those JSON results",
    )
    p.add_argument("--against", nargs="*", default=[], help="JSON files written by --out")
    p.add_argument(
        "--ratios",
        nargs="+",
        metavar="JSON",
        help="no simulation: the summary table (ratios to SGLang's rule) of results "
        "written by --out, one row per scenario and file",
    )
    args = p.parse_args()
    if args.ratios:
        print(ratio_table(args.ratios))
        return 0
    trace = args.trace if args.trace and Path(args.trace).exists() else None
    chosen = set(args.only.split(",")) if args.only else None
    results: dict[str, Any] = {"slo_s": args.slo, "load": args.load, "scenarios": {}}
    for sc in scenarios(trace):
        if chosen is not None and sc.name not in chosen:
            continue
        t0 = time.perf_counter()
        if args.learn_at_polls:
            sc.cfg = replace(sc.cfg, learn_at_polls=True)
        if args.known_speeds:
            sc.cfg = replace(sc.cfg, known_speeds=True)
        reqs = sc.build()
        if args.as_text:  # serve routes these on bytes and budgets its index alike
            sc.cfg = replace(sc.cfg, index_in_bytes=True)
        prep = prepare(as_text(reqs) if args.as_text else reqs, sc.cfg.block_size)
        bound = upper_bound(prep)
        sweep = not args.no_sweep and args.rate is None
        bnd = bounds(sc, prep, args.slo, sweep)
        if args.bounds_only:
            base_row, base_cap = stored(args.against, sc.name)
            print(
                f"{sc.name}: TTFT floor p50/p90/p99 {bnd['ttft_floor_p50']:.3f} / "
                f"{bnd['ttft_floor_p90']:.3f} / {bnd['ttft_floor_p99']:.3f} s, capacity "
                f"ceiling {bnd.get('capacity_ceiling', float('nan')):.2f} req/s. "
                + reachable(bnd, base_row, base_cap),
                flush=True,
            )
            results["scenarios"][sc.name] = {"bounds": bnd}
            continue
        tps = sum(c.prefill_tokens_per_s for c in sc.cfg.costs())
        r0 = tps / (prep.prompt_tokens / len(prep.requests)) / 4
        caps: dict[str, float] = {}
        if sweep:
            for label, pol, settings in POLICIES:
                caps[label], _ = capacity(prep, pol, settings, sc.cfg, args, r0)
        rate = args.load * caps[BASELINE] if caps else (args.rate or 0.0)
        rows = []
        for label, pol, settings in POLICIES:
            row = run(at_rate(prep, rate) if rate else prep, pol, settings, sc.cfg)
            row.name = label
            rows.append(row)
        at = f"{rate:.2f} req/s (Poisson)" if rate else "the workload's own arrival times"
        print(
            f"\n### {sc.name}: {len(prep.requests)} requests, {sc.cfg.workers} workers, "
            f"table at {at} ({time.perf_counter() - t0:.0f} s)\n"
        )
        print(table(rows, caps, bound))
        print(
            "\nDecisions by reason: "
            + "; ".join(
                f"{r.name}: "
                + ", ".join(f"{k}={v}" for k, v in sorted(r.extra["decisions"].items()))
                for r in rows
            )
        )
        base = rows[[label for label, _, _ in POLICIES].index(BASELINE)]
        print(
            f"\nBounds: TTFT floor p50/p90/p99 {bnd['ttft_floor_p50']:.3f} / "
            f"{bnd['ttft_floor_p90']:.3f} / {bnd['ttft_floor_p99']:.3f} s; "
            + reachable(bnd, base.to_dict(), caps.get(BASELINE))
        )
        sys.stdout.flush()
        results["scenarios"][sc.name] = {
            "requests": len(prep.requests),
            "workers": sc.cfg.workers,
            "rate": rate,
            "upper_bound": bound,
            "bounds": bnd,
            "capacity": caps,
            "rows": [r.to_dict() for r in rows],
        }
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=float))
    return 0


def ratio_table(paths: list[str]) -> str:
    """Markdown: per scenario in each ``--out`` file, min_ttft's and cache_aware (work)'s
    TTFT p50 / p90 / p99 and capacity over SGLang's rule's, min_ttft's hit rate over the
    bound and its p50 over round-robin's."""
    lines = [
        "| scenario | results | `min_ttft` TTFT p50 / p90 / p99 | capacity @ SLO | hit / bound "
        "| `cache_aware (work)` p50 / p90 / p99 | capacity | `min_ttft` p50 / round-robin's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        for name, sc in json.loads(Path(path).read_text())["scenarios"].items():
            if "rows" not in sc:
                continue
            rows = {r["name"]: r for r in sc["rows"]}
            base, caps = rows[BASELINE], sc.get("capacity") or {}

            def ttft(label: str, rows: dict[str, Any] = rows, base: Any = base) -> str:
                return " / ".join(
                    f"{rows[label][f'ttft_p{q}'] / base[f'ttft_p{q}']:.2f}" for q in (50, 90, 99)
                )

            def cap(label: str, caps: dict[str, float] = caps) -> str:
                return f"{caps[label] / caps[BASELINE]:.2f}x" if caps.get(BASELINE) else "-"

            m = rows["min_ttft"]
            lines.append(
                f"| {name} | {Path(path).name} | {ttft('min_ttft')} | {cap('min_ttft')} "
                f"| {m['hit_rate'] / sc['upper_bound']:.2f} | {ttft('cache_aware (work)')} "
                f"| {cap('cache_aware (work)')} "
                f"| {m['ttft_p50'] / rows['round_robin']['ttft_p50']:.2f} |"
            )
    return "\n".join(lines)


def stored(paths: list[str], name: str) -> tuple[dict[str, float | None], float | None]:
    """SGLang's rule's row and capacity for scenario ``name`` in ``--out`` files (the
    first file that has the scenario)."""
    for path in paths:
        sc = json.loads(Path(path).read_text())["scenarios"].get(name)
        if sc is None or "rows" not in sc:
            continue
        row = next(r for r in sc["rows"] if r["name"] == BASELINE)
        return row, sc["capacity"].get(BASELINE)
    return {}, None


def table(rows: list[ResultRow], caps: dict[str, float], bound: float) -> str:
    head = (
        "| policy | hit rate (bound) | TTFT p50 / p90 / p99 (s) | queue wait p99 (s) "
        "| busiest / mean busy | TTFT MAE (s) | capacity @ p90<=SLO (req/s) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r.extra
        cap = f"{caps[r.name]:.2f}" if r.name in caps else "-"
        lines.append(
            f"| {r.name} | {r.hit_rate:.1%} ({bound:.1%}) | {r.ttft_p50:.3f} / {r.ttft_p90:.3f}"
            f" / {r.ttft_p99:.3f} | {e['queue_wait_p99']:.3f} | {e['busy_max_over_mean']:.2f}"
            f" | {e['ttft_mae_s']:.3f} | {cap} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
