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

``--workload-seeds N`` (with ``--arrivals M``): the same shapes built with workload seeds
0..N-1 (seed 0: the tables' requests; the others change the group order and prompts),
each on M arrival draws, at each ``--rates`` point: per workload seed the mean hit rates
and the ratio of the mean TTFT p50, p90 and p99 over the draws, ``cache_aware (work)``
over SGLang's rule, and the same for SGLang's rule with only its tie rotation changed
(kvroute's per-worker rotation instead of its single cursor): how far the percentiles
move on tie order alone; then over all runs, per percentile, the ratio of the means, the
median per-run ratio and the runs worse / better by more than 5%.

    python bench/work_aware_seeds.py --workload-seeds 8 --arrivals 6 --rates hetero:22
    python bench/work_aware_seeds.py --workload-seeds 5 --arrivals 2 \\
        --rates chat:6,chat:9.37,chat:12
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvroute._native import PrefixIndex
from kvroute.routing.policies._common import TieBreaker
from kvroute.routing.policies.cache_aware import CacheAware
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


def shape(name: str, seed: int) -> tuple[list[wl.Request], FleetConfig]:
    """One of the tables' GSP, chat or llm-d shapes built with workload ``seed``."""
    base: dict[str, Any] = {"learn_capacity": True, "policy_settings": {"seed": 0}}
    fast, slow = CostModel(), CostModel(prefill_tokens_per_s=3000.0)
    out = 32 if name.endswith("_prefill") else 256
    cost = slow if name.endswith("_prefill") else fast
    if name in ("gsp8", "gsp8_prefill"):
        return wl.gsp(64, 16, 2048, 128, out, seed=seed), FleetConfig(workers=8, cost=cost, **base)
    if name in ("hetero", "hetero_prefill"):
        costs = heterogeneous(cost, 8, 2, 0.5)
        return wl.gsp(64, 16, 2048, 128, out, seed=seed), FleetConfig(
            workers=8, worker_costs=costs, **base
        )
    if name == "chat":
        return wl.multiturn(200, 6, 800, 200, 200, sigma=1.8, seed=seed), FleetConfig(
            workers=8, **base
        )
    if name == "llmd_zipf":
        return wl.llmd(popularity="zipf", zipf_s=1.1, seed=seed), FleetConfig(workers=8, **base)
    raise SystemExit(f"no workload-seed builder for {name}")


def rule_rotated(index: PrefixIndex) -> CacheAware:
    """SGLang's rule (``--load-metric requests``) with kvroute's per-worker tie rotation
    instead of its single cursor: a change of tie order alone (a measuring device)."""
    policy = CacheAware(index, load_metric="requests")
    policy._ties = TieBreaker(per_worker=True)
    return policy


def workload_seeds(n: int, draws: int, rates: str) -> None:
    """Per workload seed, mean TTFT ratios and hit rates against SGLang's rule (module doc)."""
    for spec in rates.split(","):
        name, _, r = spec.partition(":")
        rate = float(r)
        print(
            f"\n{name}, {rate} req/s, workload seeds 0-{n - 1} x arrival seeds 1-{draws}"
            "\n\n| workload seed | SGLang's rule p50 / p90 / p99 (s), mean | hit rate: rule, "
            "work | cache_aware (work) / it, p50 / p90 / p99 | it with per-worker tie rotation "
            "/ it, p90 / p99 |\n|---|---|---|---|---|"
        )
        pct: dict[str, dict[str, list[float]]] = {
            k: {"p50": [], "p90": [], "p99": [], "hit": []} for k in ("rule", "work", "rotated")
        }
        for seed in range(n):
            reqs, cfg = shape(name, seed)
            prep = prepare(reqs, cfg.block_size)
            runs: dict[str, list[ResultRow]] = {k: [] for k in pct}
            for d in range(1, draws + 1):
                p = at_rate(prep, rate, d)
                runs["rule"].append(run(p, POLICIES[2][1], POLICIES[2][2], cfg))
                runs["work"].append(run(p, POLICIES[1][1], POLICIES[1][2], cfg))
                runs["rotated"].append(
                    simulate(p, rule_rotated, replace(cfg, engine_budgets=False))
                )
            m: dict[str, dict[str, float]] = {}
            for k, v in runs.items():
                got = {
                    "p50": [x.ttft_p50 for x in v],
                    "p90": [x.ttft_p90 for x in v],
                    "p99": [x.ttft_p99 for x in v],
                    "hit": [x.hit_rate for x in v],
                }
                m[k] = {q: float(np.mean(xs)) for q, xs in got.items()}
                for q, xs in got.items():
                    pct[k][q] += xs
            rule, work, rot = m["rule"], m["work"], m["rotated"]
            print(
                f"| {seed} | {rule['p50']:.3f} / {rule['p90']:.3f} / {rule['p99']:.3f} "
                f"| {rule['hit']:.1%}, {work['hit']:.1%} "
                f"| {work['p50'] / rule['p50']:.2f} / {work['p90'] / rule['p90']:.2f} / "
                f"{work['p99'] / rule['p99']:.2f} "
                f"| {rot['p90'] / rule['p90']:.2f} / {rot['p99'] / rule['p99']:.2f} |",
                flush=True,
            )
        base = {q: np.array(xs) for q, xs in pct["rule"].items()}
        for k, label in (("work", "cache_aware (work)"), ("rotated", "rule, per-worker ties")):
            arr = {q: np.array(xs) for q, xs in pct[k].items()}
            parts = []
            for q in ("p50", "p90", "p99"):
                ratio = arr[q] / base[q]
                parts.append(
                    f"{q} {arr[q].mean() / base[q].mean():.3f} (median ratio "
                    f"{np.median(ratio):.3f}, worse / better by >5%: "
                    f"{int((ratio > 1.05).sum())} / {int((ratio < 1 / 1.05).sum())})"
                )
            hit = (arr["hit"] - base["hit"]).mean()
            print(f"| all {n * draws} runs, {label} | | hit {hit:+.1%} | {'; '.join(parts)} | |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arrivals", type=int, default=0, help="arrival draws (module doc)")
    ap.add_argument("--rates", default="gsp8:27.3,hetero:27.3", help="shape:rate,...")
    ap.add_argument("--capacity", action="store_true", help="also sweep capacity per draw")
    ap.add_argument("--bisect", type=int, default=4)
    ap.add_argument("--workload-seeds", type=int, default=0, help="workload seeds (module doc)")
    a = ap.parse_args()
    if a.workload_seeds:
        workload_seeds(a.workload_seeds, a.arrivals or 6, a.rates)
        return 0
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
