"""Work-aware routing on traffic the study's tables did not use: other workload seeds
and other rates, in the fleet simulator (virtual time).

Each case builds one of ``bench/work_aware.py``'s workload shapes with another seed (the
group order, the prompts, the chat lengths and popularity draws all change), runs it at
one Poisson rate (``work_aware.at_rate``), and prints TTFT p50 / p90 / p99 of SGLang's
rule (``cache_aware --load-metric requests``) and the ratios of ``min_ttft`` and
``cache_aware (work)`` to it. A check that the changes were not tuned to the tables'
traces; nothing here is swept.

    python bench/work_aware_seeds.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvroute.sim import workloads as wl
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, heterogeneous, prepare
from kvroute.sim.report import ResultRow
from work_aware import BASELINE, POLICIES, at_rate, run


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


def main() -> int:
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
