"""The bounds no router can beat (``kvroute.sim.bounds``): every simulated TTFT is above
its floor, no policy's capacity at the SLO is above the ceiling, and the two exact
sub-problems (slots, one machine's deadlines) give their known optima."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvroute.sim import workloads as wl
from kvroute.sim.bounds import (
    capacity_ceiling,
    good_needed,
    ideal_cached,
    most_in_slots,
    most_on_time,
    ttft_floor,
)
from kvroute.sim.cache import output_ids
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, heterogeneous, prepare, simulate, upper_bound

POLICIES = ["round_robin", "cache_aware", "min_ttft", "prefix_hash"]


@pytest.mark.parametrize(
    ("requests", "cfg"),
    [
        (
            wl.multiturn(12, 4, 256, 64, 48, seed=2, arrivals="poisson", rate=20.0),
            FleetConfig(workers=3, capacity_tokens=30_000),
        ),
        (
            wl.gsp(8, 6, 512, 64, 16, seed=1, arrivals="poisson", rate=30.0),
            FleetConfig(workers=4, worker_costs=heterogeneous(CostModel(), 4, 2, 0.5)),
        ),
    ],
)
def test_no_policy_serves_a_request_below_its_floor(
    requests: list[wl.Request], cfg: FleetConfig
) -> None:
    prep = prepare(requests, cfg.block_size)
    floor = ttft_floor(prep, cfg.costs())
    for policy in POLICIES:
        row = simulate(prep, policy, cfg, record=True)
        ttft = np.asarray(row.extra["ttft"])
        assert (ttft >= floor - 1e-9).all(), policy
        cached = np.asarray(row.extra["cached"])
        assert (cached <= ideal_cached(prep)).all(), policy
    # The floor is tight for a cold prompt on the fastest worker with nothing queued.
    assert floor[0] == pytest.approx(CostModel().prefill_s(len(prep.requests[0].tokens)))


def test_the_floor_counts_what_workers_cache_of_earlier_outputs() -> None:
    """A prompt that repeats an earlier request's prompt and answer finds the answer's
    blocks cached (workers cache output blocks); a floor blind to them would sit above
    the simulated TTFT."""
    rng = np.random.default_rng(0)
    first = rng.integers(0, wl.VOCAB, 256, dtype=np.uint32)
    follow = np.concatenate(
        (first, output_ids(159), rng.integers(0, wl.VOCAB, 64, dtype=np.uint32))
    )
    reqs = [wl.Request(0.0, first, 160, 0), wl.Request(10.0, follow.astype(np.uint32), 8, 0)]
    cfg = FleetConfig(workers=1)
    prep = prepare(reqs, cfg.block_size)
    row = simulate(prep, "round_robin", cfg, record=True)
    assert row.extra["cached"][1] > 256
    assert ideal_cached(prep)[1] == row.extra["cached"][1]
    assert row.extra["ttft"][1] >= ttft_floor(prep, cfg.costs())[1] - 1e-12


def test_ideal_cache_counts_prompts_as_the_hit_rate_bound_does() -> None:
    prep = prepare(wl.gsp(6, 4, 256, 32, 8, seed=0))
    tokens = sum(len(r.tokens) for r in prep.requests)
    assert ideal_cached(prep, outputs=False).sum() / tokens == pytest.approx(upper_bound(prep))


def test_most_in_slots_is_the_k_colourable_optimum() -> None:
    # Three overlapping at [2, 3): two slots keep two of them plus the disjoint ones.
    starts = np.array([0.0, 1.0, 2.0, 5.0, 5.5])
    ends = np.array([3.0, 4.0, 3.5, 6.0, 7.0])
    assert most_in_slots(starts, ends, 1) == 2  # [0,3) or [2,3.5), then one of the last
    assert most_in_slots(starts, ends, 2) == 4
    assert most_in_slots(starts, ends, 3) == 5
    # Back to back shares a slot.
    assert most_in_slots(np.array([0.0, 1.0]), np.array([1.0, 2.0]), 1) == 2


def test_most_on_time_drops_the_longest_late_job() -> None:
    work = np.array([2.0, 1.0, 1.0, 3.0])
    deadlines = np.array([2.0, 3.0, 4.0, 5.0])
    # Speed 1 from 0: 2 + 1 + 1 by 4 fits, the 3 s job cannot also finish by 5.
    assert most_on_time(work, deadlines, 0.0, 1.0) == 3
    assert most_on_time(work, deadlines, 0.0, 2.0) == 4
    assert good_needed(1024, 0.9) == 921


def test_no_policy_keeps_the_slo_above_the_capacity_ceiling() -> None:
    """At a rate 5% above the ceiling every policy misses the SLO; the ceiling is not
    absurdly loose either (a policy meets the SLO at a third of it)."""
    cfg = FleetConfig(workers=4, cost=CostModel(prefill_tokens_per_s=3000.0, max_batch=4))
    prep0 = prepare(wl.gsp(16, 8, 1024, 64, 64, seed=0), cfg.block_size)
    unit = np.cumsum(np.random.default_rng(3).exponential(1.0, len(prep0.requests)))
    ceiling = capacity_ceiling(prep0, cfg.costs(), unit, slo=1.0)
    assert np.isfinite(ceiling) and ceiling > 0

    def p90(rate: float, policy: str) -> float:
        reqs = [
            replace(r, arrival_s=float(t / rate)) for r, t in zip(prep0.requests, unit, strict=True)
        ]
        return simulate(prepare(reqs, cfg.block_size), policy, cfg).ttft_p90

    for policy in POLICIES:
        assert p90(ceiling * 1.05, policy) > 1.0, policy
    assert min(p90(ceiling / 3, policy) for policy in POLICIES) <= 1.0
