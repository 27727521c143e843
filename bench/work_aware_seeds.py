"""Work-aware routing on traffic the study's tables did not use: other workload seeds
and other rates, in the fleet simulator (virtual time).

Each case builds one of ``bench/work_aware.py``'s workload shapes with another seed (the
group order, the prompts, the chat lengths and popularity draws all change), runs it at
one Poisson rate (``work_aware.at_rate``), and prints TTFT p50 / p90 / p99 of SGLang's
rule (``cache_aware --load-metric requests``) and the ratios of ``min_ttft`` and
``cache_aware (work)`` to it. A check that the changes were not tuned to the tables'
traces; nothing here is swept.

``--arrivals N``: instead, the decode-bound GSP shapes of the tables (``gsp8``,
``hetero``) with the tables' own requests on N other Poisson arrival draws
(``at_rate``'s seed 1..N) at each ``--rates`` point, ``cache_aware (work)`` against
SGLang's rule: per metric the ratio of the means over the draws, the median per-draw
ratio, and on how many draws it is worse / better by more than 5%. Metrics: TTFT
p50/p90/p99 and mean, requests over 0.1 s (above a hit's 14-28 ms, below a cold
prefill's 150-290 ms), hit rate; with ``--capacity``, also the capacity at the SLO per
draw (``work_aware.capacity``, ``--bisect`` 4: within 4.4%).

    python bench/work_aware_seeds.py
    python bench/work_aware_seeds.py --arrivals 30 --rates gsp8:27.3,gsp8:28.6,hetero:22,hetero:27.3
    python bench/work_aware_seeds.py --arrivals 10 --rates gsp8:0,hetero:0 --capacity
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvroute.sim import workloads as wl
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, heterogeneous, prepare, simulate
from kvroute.sim.report import ResultRow
from work_aware import BASELINE, POLICIES, at_rate, capacity, run, scenarios

STEP_S = 0.1  # between a hit (14-28 ms) and a cold prefill (150-290 ms) on these shapes


def cases() -> list[tuple[str, Callable[[], list[wl.Request]], FleetConfig, float]]:
    base: dict[str, Any] = {"learn_capacity": True, "policy_settings": {"seed": 0}}
    slow = CostModel(prefill_tokens_per_s=3000.0)
    return [
        (
            "chat, seed 1, 9.4 req/s",
            lambda: wl.multiturn(200, 6, 800, 200, 200, sigma=1.8, seed=1),
            FleetConfig(workers=8, **base),
            9.4,
        ),
        (
            "chat, seed 2, 15 req/s",
            lambda: wl.multiturn(200, 6, 800, 200, 200, sigma=1.8, seed=2),
            FleetConfig(workers=8, **base),
            15.0,
        ),
        (
            "gsp8_prefill, seed 1, 30 req/s",
            lambda: wl.gsp(64, 16, 2048, 128, 32, seed=1),
            FleetConfig(workers=8, cost=slow, **base),
            30.0,
        ),
        (
            "hetero_prefill, seed 1, 22 req/s",
            lambda: wl.gsp(64, 16, 2048, 128, 32, seed=1),
            FleetConfig(workers=8, worker_costs=heterogeneous(slow, 8, 2, 0.5), **base),
            22.0,
        ),
        (
            "gsp8 with Zipf groups, seed 1, 25 req/s",
            lambda: wl.gsp(64, 16, 2048, 128, 256, popularity="zipf", seed=1),
            FleetConfig(workers=8, **base),
            25.0,
        ),
        (
            "hetero, seed 1, 25 req/s",
            lambda: wl.gsp(64, 16, 2048, 128, 256, seed=1),
            FleetConfig(workers=8, worker_costs=heterogeneous(CostModel(), 8, 2, 0.5), **base),
            25.0,
        ),
        (
            "llmd_zipf, seed 1, 6 req/s",
            lambda: wl.llmd(popularity="zipf", zipf_s=1.1, seed=1),
            FleetConfig(workers=8, **base),
            6.0,
        ),
    ]


def arrivals(n: int, rates: str, with_capacity: bool, bisect: int) -> None:
    """cache_aware (work) against SGLang's rule over ``n`` arrival draws (module doc)."""
    shapes = {sc.name: sc for sc in scenarios(None)}
    work = POLICIES[1]
    base = POLICIES[2]
    for spec in rates.split(","):
        name, _, r = spec.partition(":")
        sc = shapes[name]
        prep = prepare(sc.build(), sc.cfg.block_size)
        rate = float(r)
        stats: dict[str, list[tuple[float, float]]] = {}
        if rate > 0:
            for seed in range(1, n + 1):
                p = at_rate(prep, rate, seed)
                pair = []
                for _, policy, settings in (work, base):
                    cfg = replace(sc.cfg, policy_settings={**sc.cfg.policy_settings, **settings})
                    row = simulate(p, policy, cfg, record=True)
                    t = np.asarray(row.extra["ttft"])
                    pair.append(
                        {
                            "p50": row.ttft_p50,
                            "p90": row.ttft_p90,
                            "p99": row.ttft_p99,
                            "mean": float(t.mean()),
                            f"over {STEP_S} s": float((t > STEP_S).sum()),
                            "hit rate": row.hit_rate,
                        }
                    )
                for k in pair[0]:
                    stats.setdefault(k, []).append((pair[0][k], pair[1][k]))
        if with_capacity:
            tps = sum(c.prefill_tokens_per_s for c in sc.cfg.costs())
            r0 = tps / (prep.prompt_tokens / len(prep.requests)) / 4
            args = SimpleNamespace(slo=2.0, max_steps=8, bisect=bisect)
            for seed in range(1, n + 1):
                caps = [
                    capacity(prep, pol, st, sc.cfg, args, r0, seed)[0]
                    for _, pol, st in (work, base)
                ]
                stats.setdefault("capacity", []).append((caps[0], caps[1]))
        at = f"{rate} req/s" if rate > 0 else "swept"
        print(f"\n{name}, {at}, arrival seeds 1-{n}: cache_aware (work) / SGLang's rule\n")
        print(
            "| metric | work, mean | rule, mean | ratio of means | median ratio "
            "| worse / better by >5% |"
        )
        print("|---|---|---|---|---|---|")
        for k, v in stats.items():
            a = np.array(v)
            ratio = a[:, 0] / np.where(a[:, 1] > 0, a[:, 1], np.nan)
            w, b = a[:, 0].mean(), a[:, 1].mean()
            worse, better = int((ratio > 1.05).sum()), int((ratio < 1 / 1.05).sum())
            print(
                f"| {k} | {w:.4g} | {b:.4g} | {w / b:.3f} | {np.nanmedian(ratio):.3f}"
                f" | {worse} / {better} |",
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arrivals", type=int, default=0, help="arrival draws (module doc)")
    ap.add_argument("--rates", default="gsp8:27.3,hetero:27.3", help="shape:rate,...")
    ap.add_argument("--capacity", action="store_true", help="also sweep capacity per draw")
    ap.add_argument("--bisect", type=int, default=4)
    a = ap.parse_args()
    if a.arrivals:
        arrivals(a.arrivals, a.rates, a.capacity, a.bisect)
        return 0
    print(
        "| workload | SGLang's rule p50 / p90 / p99 (s) | min_ttft / it "
        "| cache_aware (work) / it |\n|---|---|---|---|"
    )
    for name, build, cfg, rate in cases():
        prep = at_rate(prepare(build(), cfg.block_size), rate)
        rows = {label: run(prep, policy, settings, cfg) for label, policy, settings in POLICIES[:3]}
        b = rows[BASELINE]

        def ratios(r: ResultRow, b: ResultRow = b) -> str:
            return (
                f"{r.ttft_p50 / b.ttft_p50:.2f} / {r.ttft_p90 / b.ttft_p90:.2f}"
                f" / {r.ttft_p99 / b.ttft_p99:.2f}"
            )

        print(
            f"| {name} | {b.ttft_p50:.3f} / {b.ttft_p90:.3f} / {b.ttft_p99:.3f} "
            f"| {ratios(rows['min_ttft'])} | {ratios(rows['cache_aware (work)'])} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
