"""One case of ``random_fleets.py``, traced: where each policy put each conversation, and
when the router learned the workers' capacities.

For the chat cases, whose groups are conversations: per policy, the hit rate and TTFT
p50 / p90 / p99, the conversations whose first turn went to each worker, the requests
each worker served and queued for a slot, how often a conversation changed worker, the
decisions by reason, and per worker its TTFT percentiles. Then, for the first
``--first`` first turns, when each was sent and where it went, and every capacity the
router learned (time, worker, running, waiting at the reading) in that span. The rate
is ``--load`` times the rule's capacity at the SLO, found by the same sweep as
``random_fleets.py``.

    cd bench && python trace_case.py --seed 0 --case 11 --load 0.5 --causal-turns
    cd bench && python trace_case.py --seed 0 --case 11 --load 0.5 --causal-turns \
        --capacity-reported
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import numpy as np

import random_fleets as rf
from kvroute.fleet import engine_load
from kvroute.routing.load import model as load_model
from work_aware import BASELINE, POLICIES, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", type=int, required=True)
    ap.add_argument("--load", type=float, default=0.5, help="fraction of the rule's capacity")
    ap.add_argument("--policies", default="cache_aware (work),min_ttft", help="besides the rule")
    ap.add_argument("--causal-turns", action="store_true", help="as random_fleets.py's")
    ap.add_argument("--capacity-reported", action="store_true", help="as random_fleets.py's")
    ap.add_argument("--first", type=int, default=64, help="first turns listed")
    a = ap.parse_args()
    case = rf.draw(a.seed, a.case)
    if not case.conversations:
        raise SystemExit(f"case {a.case} of seed {a.seed} is not a chat case: {case.text}")
    case.cfg = replace(
        case.cfg,
        learn_at_polls=True,
        causal_turns=a.causal_turns,
        capacity_reported=a.capacity_reported,
    )
    prep, cap = rf.rule_capacity(case, argparse.Namespace(slo=2.0, max_steps=8, bisect=4))
    print(f"{case.text}; rule's capacity {cap:.2f} req/s, run at {a.load:g}x")
    arrivals = case.arrive(prep, a.load * cap, 1)
    groups = [r.group for r in case.requests]
    chosen = [p for p in POLICIES if p[0] in a.policies.split(",") or p[0] == BASELINE]

    # When capacities are learned: the learner's calls, timed by the last decision's clock.
    clock = [0.0]
    learned: list[tuple[float, str, int, int]] = []
    reserve, observe = load_model.LoadModel.reserve, engine_load.CapacityLearner.observe

    def timed_reserve(self: Any, worker: str, *args: Any, **kw: Any) -> Any:
        now = args[2] if len(args) > 2 else kw.get("now")
        if now is not None:
            clock[0] = now
        return reserve(self, worker, *args, **kw)

    def noted_observe(self: Any, worker: str, running: int, waiting: int) -> None:
        before = dict(self.capacities)
        observe(self, worker, running, waiting)
        if self.capacities != before:
            learned.append((clock[0], worker, running, waiting))

    load_model.LoadModel.reserve = timed_reserve  # type: ignore[method-assign]
    engine_load.CapacityLearner.observe = noted_observe  # type: ignore[method-assign]
    try:
        for label, policy, settings in chosen:
            learned.clear()
            r = run(arrivals, policy, settings, case.cfg, record=True)
            where = np.asarray(r.extra["assigned"])
            ttft = np.asarray(r.extra["ttft"])
            sent = np.asarray(r.extra["sent"])
            n = int(r.extra["workers"])
            first: dict[int, int] = {}
            moves, last = 0, {}
            for i, g in enumerate(groups):
                first.setdefault(g, i)
                moves += g in last and last[g] != where[i]
                last[g] = where[i]
            homes = np.bincount([where[i] for i in first.values()], minlength=n)
            print(
                f"\n{label}: hit {r.hit_rate:.3f}, TTFT p50 / p90 / p99 {r.ttft_p50:.3f} / "
                f"{r.ttft_p90:.3f} / {r.ttft_p99:.3f} s; first turns per worker "
                f"{homes.tolist()}; requests {r.extra['per_worker']}; queued for a slot "
                f"{r.extra['slot_queued']}; moves {moves}; decisions {r.extra['decisions']}"
            )
            for w in range(n):
                t = ttft[where == w]
                if len(t):
                    q = np.percentile(t, [50, 90, 99])
                    print(
                        f"  worker {w}: {len(t)} requests, "
                        f"TTFT {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}"
                    )
            turns = sorted(first.values())[: a.first]
            print(
                "  first turns (sent s, worker): "
                + ", ".join(f"{sent[i]:.1f} w{where[i]}" for i in turns)
            )
            end = float(sent[turns[-1]]) if turns else 0.0
            for t, w, running, waiting in learned:
                if t <= end:
                    print(
                        f"  capacity learned at {t:.2f} s: {w} "
                        f"({running} running, {waiting} waiting)"
                    )
    finally:
        load_model.LoadModel.reserve = reserve  # type: ignore[method-assign]
        engine_load.CapacityLearner.observe = observe  # type: ignore[method-assign]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
