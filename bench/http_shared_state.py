"""Router replicas over HTTP in front of sim workers: alone, with Redis, precise.

Starts a ``redis-server`` on loopback and N ``kvroute sim-worker`` processes (publishing
KV events, each on its own socket), then for 1, 2 and 3 ``kvroute serve`` replicas
(clients deal requests to them in turn) replays the same llm-d-shaped requests through
``cache_aware`` alone, ``cache_aware --state-store`` (Redis flushed before each row, so no
row starts warm), and ``cache_aware --kv-events`` (precise). Hit rate from the workers'
own accounting, TTFT from the clients, router CPU per request summed over the replicas
(start-up included). Rows are ``kvroute.eval.quality.run_router``'s.

``--trace DIR`` keeps every process's log in DIR, runs the routers at ``--log-level debug``
(one line per decision: worker, reason, match; the extra logging moves timings, so a
traced run's numbers are its own) and tags each request with an ID naming its group, then
prints, per row, the misses that followed another replica's decision for the same group
within 3 s (model time): a replica that did not yet know what another had routed.

Usage:
    python bench/http_shared_state.py --groups 24 --prompts-per-group 5 --rate 4 \\
        --time-scale 2 --replicas 1,2,3
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from kvroute.eval.quality import kvroute_spec, run_router, start_sim_workers  # noqa: E402
from kvroute.sim.fleet import prepare, upper_bound  # noqa: E402
from kvroute.sim.workloads import llmd  # noqa: E402
from support import RedisServer  # noqa: E402

MODES = ("approximate", "approximate + Redis", "precise")
UNSEEN_S = 3.0  # model seconds: a miss this soon after a peer's decision for its group
_DECISION = re.compile(
    rb"DEBUG kvroute\.service\.proxy: g(\d+)-a([\d.]+) \S+ -> (\S+) \((\w+), \w+, matched (\d+) "
)


@dataclass(slots=True)
class Tagged:
    """A workload request with an ID naming its group and arrival (``--trace``)."""

    arrival_s: float
    tokens: object
    output_len: int
    group: int
    request_id: str


def tagged(requests: list) -> list[Tagged]:
    return [
        Tagged(r.arrival_s, r.tokens, r.output_len, r.group, f"g{r.group}-a{r.arrival_s:.4f}")
        for r in requests
    ]


def unseen_misses(logs: list[Path]) -> tuple[int, int]:
    """From the routers' debug logs (one per replica): the decisions made, and the misses
    (nothing matched) of a group whose previous request another replica had routed
    less than ``UNSEEN_S`` earlier."""
    decisions: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for n, log in enumerate(logs):
        for m in _DECISION.finditer(log.read_bytes()):
            decisions[int(m[1])].append((float(m[2]), n, int(m[5])))
    unseen = 0
    for seq in decisions.values():
        seq.sort()
        for (t0, who0, _), (t1, who1, matched) in itertools.pairwise(seq):
            if matched == 0 and who1 != who0 and t1 - t0 < UNSEEN_S:
                unseen += 1
    return sum(map(len, decisions.values())), unseen


@contextlib.contextmanager
def log_dir(trace: str | None) -> Iterator[str]:
    if trace is None:
        with tempfile.TemporaryDirectory(prefix="kvroute-shared-") as logs:
            yield logs
    else:
        Path(trace).mkdir(parents=True, exist_ok=True)
        yield trace


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--prompts-per-group", type=int, default=5)
    ap.add_argument("--system-len", type=int, default=6000)
    ap.add_argument("--question-len", type=int, default=1200)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--capacity-tokens", type=int, default=100_000)
    ap.add_argument("--replicas", default="1,2,3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--modes",
        default="approximate,approximate + Redis,precise",
        help="which rows, comma-separated (default: all three)",
    )
    ap.add_argument(
        "--trace",
        metavar="DIR",
        help="keep the logs in DIR, log each decision, tag requests by group; print the "
        "misses that followed another replica's decision for their group within 3 s",
    )
    args = ap.parse_args()
    chosen = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in chosen if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    requests = llmd(
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        args.output_len,
        seed=args.seed,
        arrivals="poisson",
        rate=args.rate,
    )
    bound = upper_bound(prepare(requests, 16))
    sent = tagged(requests) if args.trace else requests
    print(f"{len(requests)} requests, {args.workers} workers, upper bound {bound:.3f}\n")
    print(
        "| replicas | mode | hit rate | TTFT p50 / p90 / p99 (s) | errors | router CPU/req (ms) "
        "| decisions: hit / miss / overflow |"
    )
    print("|---|---|---|---|---|---|---|")
    with log_dir(args.trace) as logs:
        redis = RedisServer(Path(logs))
        worker_args = [
            "--time-scale", str(args.time_scale), "--capacity-tokens", str(args.capacity_tokens),
        ]  # fmt: skip
        workers = start_sim_workers(
            args.workers, logs, worker_args, kv_events=True, publishers_bind=True
        )
        try:
            debug = ("--log-level", "debug") if args.trace else ()
            modes = {
                "approximate": kvroute_spec("cache_aware", debug),
                "approximate + Redis": kvroute_spec(
                    "cache_aware", ("--state-store", redis.url, *debug)
                ),
                "precise": kvroute_spec("cache_aware+events", debug),
            }
            modes = {m: spec for m, spec in modes.items() if m in chosen}
            for n in (int(x) for x in args.replicas.split(",")):
                for mode, spec in modes.items():
                    with redis.client() as c:
                        c.flushdb()
                    before = set(Path(logs).glob("kvroute-*.log"))
                    row = run_router(
                        replace(spec, name=mode),
                        workers,
                        sent,
                        log_dir=logs,
                        root=ROOT,
                        time_scale=args.time_scale,
                        replicas=n,
                    )
                    routing = row.extra["routing"]
                    cpu = routing.get("router_cpu_s", 0.0)
                    # Decisions by reason, summed over the replicas and both sources.
                    by = {
                        r: sum(v for k, v in routing.items() if k.startswith(r + "/"))
                        for r in ("cache_hit", "cache_miss", "overflow")
                    }
                    print(
                        f"| {n} | {mode} | {row.hit_rate:.3f} | {row.ttft_p50:.3f} / "
                        f"{row.ttft_p90:.3f} / {row.ttft_p99:.3f} | {row.errors} | "
                        f"{cpu / len(requests) * 1000:.2f} | {by['cache_hit']:.0f} / "
                        f"{by['cache_miss']:.0f} / {by['overflow']:.0f} |",
                        flush=True,
                    )
                    if args.trace:
                        made, unseen = unseen_misses(
                            sorted(set(Path(logs).glob("kvroute-*.log")) - before)
                        )
                        print(
                            f"|   | traced: {made} decisions logged, {unseen} misses within "
                            f"{UNSEEN_S:.0f} s of another replica's decision for their group "
                            "|  |  |  |  |",
                            flush=True,
                        )
        finally:
            for w in workers:
                w.stop()
            redis.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
