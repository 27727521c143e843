"""Router replicas with and without a shared store, in the fleet simulator (virtual time).

For 1, 2 and 3 replicas (dealt requests in turn by a balancer in front of them), on the
same requests: ``approximate`` (each replica's own index and load, what ``kvroute serve``
does without ``--state-store``), ``approximate + store`` (``--state-store``: decisions
and each replica's load changes reach the others ``--store-delay-ms`` later),
``precise`` (``--kv-events``: every replica reads every engine's events) and
``precise + store`` (both flags). Prints one markdown table per workload: hit rate,
TTFT p50/p90/p99, and with the store the CPU this process spent applying the other
replicas' decisions to each replica's index (``DigestIndex.insert_digests``, the
production code), per routed request and summed over the replicas. Publishing's own
cost (queueing, ``XADD``) is Redis client work the simulator does not run:
``bench/shared_state_overhead.py`` and ``bench/http_shared_state.py`` measure it.
``--heartbeat-ms`` changes nothing here (heartbeats only expire a crashed router's load).

Usage:
    python bench/sim_shared_state.py --workloads mooncake,llmd --store-delay-ms 2
"""

from __future__ import annotations

import argparse
import collections
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvroute.config import parse_worker_capacity
from kvroute.fleet.shared import DigestIndex
from kvroute.fleet.shared.publishing import LOAD_LINGER_S
from kvroute.routing.policies.base import Decision, RouteRequest
from kvroute.routing.policies.cache_aware import CacheAware
from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import FleetConfig, prepare, simulate, upper_bound
from kvroute.sim.routers import RouterTier
from kvroute.sim.workloads import llmd, mooncake

TRACE = "/work/shared/traces/mooncake_synthetic_trace.jsonl"
MODES = ("approximate", "approximate + store", "precise", "precise + store")


def workload(name: str, args: argparse.Namespace) -> tuple[Any, FleetConfig]:
    guard, learn = parse_worker_capacity(args.worker_capacity)
    base = FleetConfig(
        cost=CostModel(),
        policy_settings={"seed": args.seed, "worker_capacity": guard},
        learn_capacity=learn,
        seed=args.seed,
    )
    if name == "mooncake":
        reqs = mooncake(args.trace, seed=args.seed, time_scale=args.time_scale)
        cfg = replace(base, workers=8)
    elif name == "llmd":
        reqs = llmd(output_len=1000, seed=args.seed, arrivals="poisson", rate=4.0)
        cfg = replace(base, workers=4, capacity_tokens=308_000)
    else:
        raise SystemExit(f"unknown workload {name!r}")
    if args.jitter_ms:  # how sensitive the tail is to the arrivals' exact instants
        rng = np.random.default_rng([args.jitter_seed, 0x717])
        for r in reqs:
            r.arrival_s = max(0.0, r.arrival_s + float(rng.uniform(-1, 1)) * args.jitter_ms / 1000)
    return prepare(reqs, 16), cfg


APPLY_NS = [0]


def _timed_apply() -> None:
    """Count the CPU time of every peer decision applied (``APPLY_NS``)."""
    apply = DigestIndex.insert_digests

    def timed(self: DigestIndex, worker: str, digests: bytes) -> None:
        t0 = time.process_time_ns()
        apply(self, worker, digests)
        APPLY_NS[0] += time.process_time_ns() - t0

    DigestIndex.insert_digests = timed  # type: ignore[method-assign]


DIAG: collections.Counter[str] = collections.Counter()


def _diagnose() -> None:
    """Count, per row, the decisions by reason and those a replica made while another
    replica's load change was still on its way to it (``DIAG``)."""
    select = CacheAware.select

    def tallied(self: CacheAware, request: RouteRequest, loads: Any) -> Decision:
        d = select(self, request, loads)
        DIAG[d.reason] += 1
        return d

    route = RouterTier.route

    def watched(
        self: RouterTier, r: int, request: RouteRequest, now: float = 0.0, out: int = 1
    ) -> str:
        unseen: set[str] = set()
        reserved: set[str] = set()  # workers a request was reserved on, unseen yet
        if self.shared:
            self._sync(now)
            k = self._next
            for _, j, w, load, *_ in self._work_wire:
                if j != k:
                    unseen.add(w)
                    if load[0] > self._heard[k].get((j, w), (0, 0, 0))[0]:
                        reserved.add(w)
        worker = route(self, r, request, now, out)
        if unseen:
            DIAG["load change unseen"] += 1
            DIAG["... onto that worker"] += worker in unseen
        if reserved:
            DIAG["reservation unseen"] += 1
            DIAG["... onto its worker"] += worker in reserved
        return worker

    CacheAware.select = tallied  # type: ignore[method-assign]
    RouterTier.route = watched  # type: ignore[method-assign]


def _release_delay(seconds: float) -> None:
    """``--release-delay-ms``: a replica's load changes that free a worker (a first
    byte, an end) reach the others after ``seconds`` instead of the store's delay;
    reservations keep it (which of the two the tail is sensitive to)."""
    import bisect

    def publisher(self: RouterTier, k: int) -> Any:
        last: dict[str, tuple[int, int, int]] = {}

        def publish(worker: str) -> None:
            st = self.work[k].state(worker)
            load = (st.requests, len(st.pending), st.prefill_tokens)
            grew = load[0] > last.get(worker, (0, 0, 0))[0]
            last[worker] = load
            at = self._now + (self.store_delay_s if grew else seconds)
            ends = self.work[k].decoding_ends(worker, self._now)
            bisect.insort(self._work_wire, (at, k, worker, load, ends), key=lambda e: e[0])

        return publish

    RouterTier._work_publisher = publisher  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default="mooncake,llmd")
    ap.add_argument("--replicas", default="1,2,3")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--store-delay-ms", type=float, default=2.0)
    ap.add_argument("--heartbeat-ms", type=float, default=500.0, help="heartbeat period")
    ap.add_argument(
        "--linger-ms",
        type=float,
        default=LOAD_LINGER_S * 1000,
        help="a load change alone is written with the next decision, with the first change "
        "made this long after it, or by the heartbeat, as serve's publisher does "
        "(default %(default)g; 0: each change at once)",
    )
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--worker-capacity", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="shift every arrival by a uniform draw within +/- this (a noise-floor check)",
    )
    ap.add_argument("--jitter-seed", type=int, default=1)
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="after each row: decisions by reason, and decisions made while another "
        "replica's load change was still on its way",
    )
    ap.add_argument(
        "--release-delay-ms",
        type=float,
        default=None,
        help="load changes that free a worker (first bytes, ends) reach the other replicas "
        "after this delay instead of --store-delay-ms (reservations keep it)",
    )
    args = ap.parse_args()
    _timed_apply()
    if args.release_delay_ms is not None:
        _release_delay(args.release_delay_ms / 1000)
    if args.diagnose:
        _diagnose()
    for name in args.workloads.split(","):
        prep, cfg = workload(name, args)
        print(
            f"\n### {name}: {cfg.workers} workers, {len(prep.requests)} requests, "
            f"upper bound {upper_bound(prep):.3f}, store delay {args.store_delay_ms:g} ms\n"
        )
        print(
            "| replicas | mode | hit rate | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) "
            "| apply CPU (µs/request) |"
        )
        print("|---|---|---|---|---|---|---|")
        for n in (int(x) for x in args.replicas.split(",")):
            for mode in args.modes.split(","):
                c = replace(cfg, router_replicas=n)
                policy = "cache_aware"
                if mode.endswith("+ store"):
                    c = replace(
                        c,
                        state_store_delay_s=args.store_delay_ms / 1000,
                        state_store_heartbeat_s=args.heartbeat_ms / 1000,
                        state_store_linger_s=args.linger_ms / 1000,
                    )
                if mode.startswith("precise"):
                    policy = "cache_aware+events"
                APPLY_NS[0] = 0
                DIAG.clear()
                row = simulate(prep, policy, c)
                cpu = "-"
                if mode.endswith("+ store"):
                    cpu = f"{APPLY_NS[0] / 1000 / len(prep.requests):.1f}"
                print(
                    f"| {n} | {mode} | {row.hit_rate:.3f} | {row.ttft_p50:.3f} | "
                    f"{row.ttft_p90:.3f} | {row.ttft_p99:.3f} | {cpu} |",
                    flush=True,
                )
                if args.diagnose:
                    print(f"|   | ({n} {mode}: {dict(DIAG)}) |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
