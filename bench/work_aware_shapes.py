"""Work-aware routing on traffic shapes the study's tables do not have, in the fleet
simulator (virtual time, the production policy and index code).

The tables (``bench/work_aware.py``) cover GSP, llm-d, multi-turn chat and the Mooncake
trace; the rates and shapes of other fleets differ. Each shape here is built with
``--workload-seeds`` seeds and run on ``--arrivals`` Poisson arrival draws at each of
``--loads`` fractions of SGLang's rule's capacity at the SLO (TTFT p90 <= 2 s; found
per shape by ``work_aware.capacity`` on workload seed 0, ``--bisect`` steps), so every
shape is compared where its fleet is busy, not at a rate picked by hand. Per shape and
load: SGLang's rule (``cache_aware --load-metric requests``, unbounded index) as the
baseline, then ``min_ttft``, ``cache_aware (work)`` (the default) and round-robin:
hit-rate difference, ratio of the mean TTFT p50 / p90 / p99 over the runs, and the
runs worse / better than the rule by more than 5%. ``--unpriced``: also both work
policies with decode-slot occupancy left out of their choices' price (``LoadModel.stretch``
fixed at 1: kvroute before it), on the same runs. ``--per-worker``: then, for the first
workload seed and arrival draw at the last load, each policy's requests per worker and
how many of them waited for a decode slot (the simulator's ``per_worker`` and
``slot_queued``).

Shapes:

* ``rag``: ``workloads.rag`` (a 1,000-token system prompt shared by all, one of 200
  documents of 1,500-4,500 tokens drawn Zipf(0.9), an 80-token question; 150 output
  tokens), 8 workers.
* ``rag_hetero``: the same on a fleet whose last 2 of 8 workers prefill at half speed.
* ``longout``: GSP 64 x 16 (2,048 + 128 tokens) whose output lengths are log-normal
  (median 128, shape 1.2, capped at 4,096): a few requests hold a decode slot 30 times
  longer than the median one.
* ``agent``: multi-turn sessions with long tool outputs: 60 sessions of up to 12 turns,
  a 3,000-token start, 1,200-token steps (both log-normal, shape 0.6), 150 output tokens.
* ``mixed``: 70% unique short prompts (200-700 tokens, 100 output tokens) and 30% on 12
  long shared prefixes (6,000 + 200 tokens, 300 output tokens), interleaved.
* ``bursty``: GSP 64 x 16 arriving in alternating bursts and lulls of 60 requests each
  (4x and 4/7 of the mean rate).

    python bench/work_aware_shapes.py
    python bench/work_aware_shapes.py --only rag_hetero --loads 0.5,0.8 --workload-seeds 3
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

import work_aware
from kvroute.routing.load import LoadModel
from kvroute.sim import workloads as wl
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, Prepared, heterogeneous, prepare
from kvroute.sim.report import ResultRow
from work_aware import BASELINE, POLICIES, at_rate, capacity, run

BURST_LEN = 60  # requests per burst and per lull (``bursty``)
BURST_X = 4.0  # a burst's rate over the mean; a lull's is 4/7 of it, so the mean holds


def longout(seed: int) -> list[wl.Request]:
    reqs = wl.gsp(64, 16, 2048, 128, 128, seed=seed)
    rng = np.random.default_rng([seed, 13])
    for r in reqs:
        r.output_len = int(min(4096, max(8, rng.lognormal(math.log(128), 1.2))))
    return reqs


def agent(seed: int) -> list[wl.Request]:
    return wl.multiturn(60, 12, 3000, 1200, 150, sigma=0.6, seed=seed)


def mixed(seed: int, n: int = 1200) -> list[wl.Request]:
    rng = np.random.default_rng([seed, 12])
    systems = [wl._draw(rng, 6000) for _ in range(12)]
    out = []
    for _ in range(n):
        if rng.random() < 0.7:
            out.append(wl.Request(0.0, wl._draw(rng, int(rng.integers(200, 701))), 100, -1))
        else:
            g = int(rng.integers(12))
            prompt = np.concatenate((systems[g], wl._draw(rng, 200)))
            out.append(wl.Request(0.0, prompt, 300, g))
    return out


def bursty_at_rate(prep: Prepared, rate: float, seed: int = 7) -> Prepared:
    """``at_rate`` with the rate modulated: bursts and lulls of ``BURST_LEN`` requests."""
    n = len(prep.requests)
    gaps = np.random.default_rng([0, seed]).exponential(1.0, n)
    lull_x = 1.0 / (2.0 - 1.0 / BURST_X)  # mean gap over a burst and a lull stays 1
    burst = (np.arange(n) // BURST_LEN) % 2 == 0
    gaps = np.where(burst, gaps / BURST_X, gaps / lull_x)
    times = (np.cumsum(gaps) - gaps[0]) / rate
    reqs = [replace(r, arrival_s=float(t)) for r, t in zip(prep.requests, times, strict=True)]
    return Prepared(reqs, prep.keys, prep.block_size)


@contextlib.contextmanager
def unpriced() -> Iterator[None]:
    """Choices priced without decode-slot occupancy (a measuring device)."""
    slots = LoadModel._slots
    setattr(LoadModel, "_slots", lambda m, w, st, t=-1: (slots(m, w, st, t)[0], 1.0))  # noqa: B010
    try:
        yield
    finally:
        setattr(LoadModel, "_slots", slots)  # noqa: B010


Shape = tuple[Callable[[int], list[wl.Request]], FleetConfig, Callable[..., Prepared]]


def shapes() -> dict[str, Shape]:
    base: dict[str, Any] = {"learn_capacity": True, "policy_settings": {"seed": 0}}
    plain = FleetConfig(workers=8, **base)
    hetero = FleetConfig(workers=8, worker_costs=heterogeneous(CostModel(), 8, 2, 0.5), **base)
    return {
        "rag": (lambda s: wl.rag(seed=s), plain, at_rate),
        "rag_hetero": (lambda s: wl.rag(seed=s), hetero, at_rate),
        "longout": (longout, plain, at_rate),
        "agent": (
            lambda s: wl.multiturn(60, 12, 3000, 1200, 150, sigma=0.6, seed=s),
            plain,
            at_rate,
        ),
        "mixed": (mixed, plain, at_rate),
        "bursty": (lambda s: wl.gsp(64, 16, 2048, 128, 256, seed=s), plain, bursty_at_rate),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    ap.add_argument("--loads", default="0.5,0.8", help="fractions of the rule's capacity")
    ap.add_argument("--workload-seeds", type=int, default=2)
    ap.add_argument("--arrivals", type=int, default=2, help="arrival draws per seed")
    ap.add_argument("--slo", type=float, default=2.0)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--bisect", type=int, default=4)
    ap.add_argument("--unpriced", action="store_true", help="also without occupancy (doc)")
    ap.add_argument("--per-worker", action="store_true", help="requests per worker (doc)")
    ap.add_argument(
        "--learn-at-polls",
        action="store_true",
        help="capacities learned only at the router's engine polls, as serve learns them",
    )
    a = ap.parse_args()
    chosen = set(a.only.split(",")) if a.only else None
    policies = [(label, pol, st, False) for label, pol, st in POLICIES]
    if a.unpriced:
        policies += [
            (f"{label}, slots unpriced", pol, st, True)
            for label, pol, st in POLICIES
            if label in ("min_ttft", "cache_aware (work)")
        ]
    labels = [p[0] for p in policies]
    for name, (build, cfg, arrive) in shapes().items():
        if chosen is not None and name not in chosen:
            continue
        if a.learn_at_polls:
            cfg = replace(cfg, learn_at_polls=True)
        preps = [prepare(build(s), cfg.block_size) for s in range(a.workload_seeds)]
        p0 = preps[0]
        tps = sum(c.prefill_tokens_per_s for c in cfg.costs())
        r0 = tps / (p0.prompt_tokens / len(p0.requests)) / 4
        _, pol, st, _ = policies[labels.index(BASELINE)]
        sweep = argparse.Namespace(slo=a.slo, max_steps=a.max_steps, bisect=a.bisect)
        work_aware.at_rate = arrive  # the sweep draws arrivals as this shape does
        try:
            cap, _ = capacity(p0, pol, st, cfg, sweep, r0)
        finally:
            work_aware.at_rate = at_rate
        print(
            f"\n### {name}: {len(p0.requests)} requests, 8 workers; SGLang's rule's capacity "
            f"at TTFT p90 <= {a.slo:g} s: {cap:.2f} req/s\n\n| load | policy | hit rate "
            "(rule: absolute) | TTFT p50 / p90 / p99: rule (s), others / rule | runs worse "
            "/ better by > 5%: p50, p90, p99 |\n|---|---|---|---|---|",
            flush=True,
        )
        for load in (float(x) for x in a.loads.split(",")):
            rate = load * cap
            rows: dict[str, list[ResultRow]] = {label: [] for label in labels}
            for prep in preps:
                for d in range(1, a.arrivals + 1):
                    p = arrive(prep, rate, d)
                    for label, policy, settings, off in policies:
                        with unpriced() if off else contextlib.nullcontext():
                            rows[label].append(run(p, policy, settings, cfg))
            rule = rows[BASELINE]
            rq = np.array([[r.ttft_p50, r.ttft_p90, r.ttft_p99] for r in rule])
            rhit = np.mean([r.hit_rate for r in rule])
            print(
                f"| {load:g} ({rate:.1f} req/s) | SGLang's rule | {rhit:.1%} "
                f"| {rq[:, 0].mean():.3f} / {rq[:, 1].mean():.3f} / {rq[:, 2].mean():.3f} | |"
            )
            for label in labels:
                if label == BASELINE:
                    continue
                q = np.array([[r.ttft_p50, r.ttft_p90, r.ttft_p99] for r in rows[label]])
                hit = np.mean([r.hit_rate for r in rows[label]]) - rhit
                mean = q.mean(0) / rq.mean(0)
                ratio = q / rq
                worse = (ratio > 1.05).sum(0).tolist()
                better = (ratio < 1 / 1.05).sum(0).tolist()
                counts = ", ".join(f"{w} / {b}" for w, b in zip(worse, better, strict=True))
                print(
                    f"| | {label} | {hit * 100:+.1f} points | {mean[0]:.2f} / {mean[1]:.2f} / "
                    f"{mean[2]:.2f} | {counts} |",
                    flush=True,
                )
        if a.per_worker:
            print(f"\nPer worker, workload seed 0, draw 1, {rate:.1f} req/s:\n")
            for label in labels:
                r = rows[label][0]
                print(
                    f"* {label}: requests {r.extra['per_worker']}, waited for a decode slot "
                    f"{r.extra['slot_queued']}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
