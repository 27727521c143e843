"""``kvroute simulate``: compare routing policies on a simulated fleet, in virtual time.

Runs the real policies and prefix index against simulated workers (``kvroute.sim.fleet``)
and prints the same table as the HTTP benchmark, with the upper bound of one infinite
cache shared by the fleet.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvroute.sim import cost as c


def add_cache_model_flags(p: argparse.ArgumentParser) -> None:
    """``--no-output-blocks``, ``--no-kv-admission``: the cache model's switches (shared
    with ``sim-worker``)."""
    p.add_argument(
        "--no-output-blocks",
        dest="output_blocks",
        action="store_false",
        help="generated tokens take no KV cache blocks (vLLM caches them; this is for "
        "measuring what they change)",
    )
    p.add_argument(
        "--no-kv-admission",
        dest="kv_admission",
        action="store_false",
        help="start a request whenever a decode slot is free, even if its prompt's blocks "
        "do not fit in the KV cache beside the running requests' (vLLM and SGLang wait; "
        "this is for measuring what that changes)",
    )


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """Fleet and cost-model flags (shared with ``kvroute analyze``)."""
    p.add_argument("--workers", type=int, default=8, help="simulated workers (default: 8)")
    p.add_argument("--capacity-tokens", type=int, default=c.DEFAULT_CAPACITY_TOKENS)
    p.add_argument("--block-size", type=int, default=c.DEFAULT_BLOCK_SIZE)
    p.add_argument("--prefill-tokens-per-s", type=float, default=c.DEFAULT_PREFILL_TOKENS_PER_S)
    p.add_argument("--decode-ms-per-token", type=float, default=c.DEFAULT_DECODE_S_PER_TOKEN * 1000)
    p.add_argument("--max-batch", type=int, default=c.DEFAULT_MAX_BATCH)
    p.add_argument(
        "--slow-workers",
        type=int,
        default=0,
        metavar="N",
        help="heterogeneous fleet: the last N workers prefill at --slow-prefill-factor "
        "times the speed of the others (default: 0)",
    )
    p.add_argument("--slow-prefill-factor", type=float, default=0.5, metavar="F")
    p.add_argument(
        "--load-metric",
        choices=("work", "requests"),
        default="work",
        help="cache_aware's least-loaded choice: predicted wait (work, default, as serve) "
        "or in-flight requests (SGLang's rule)",
    )
    p.add_argument(
        "--router-temperature",
        type=float,
        default=0.0,
        metavar="SECS",
        help="min_ttft: softmax temperature over predicted TTFT (default: 0)",
    )
    p.add_argument(
        "--max-tree-size",
        type=int,
        default=None,
        help="the router's index budget per worker in tokens (default: each worker's KV "
        "capacity, --capacity-tokens, as serve reads it from the engines)",
    )
    p.add_argument(
        "--unbounded-index",
        action="store_true",
        help="no index budget: the index never evicts (as SGLang's router's tree, 2^26 "
        "characters by default, at most sizes), whatever the engines evict",
    )
    p.add_argument("--seed", type=int, default=0)
    add_cache_model_flags(p)
    p.add_argument(
        "--worker-capacity",
        default="auto",
        metavar="auto|off|N",
        help="cache_aware saturation guard: a cache holder with this many requests in "
        "flight is passed over. auto (default, as serve in front of vLLM): each "
        "worker's capacity is learned when it is first seen queueing (here: at once; "
        "serve: at its next /metrics poll; SGLang engines report theirs from the "
        "start); off: SGLang's rule alone; N: fixed",
    )


def configure(p: argparse.ArgumentParser) -> None:
    from kvroute.sim.workloads import WORKLOADS

    p.add_argument(
        "--workload", choices=WORKLOADS, default=None, help="default: gsp, mooncake with --trace"
    )
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL, e.g. from kvroute serve --record (implies --workload "
        "mooncake)",
    )
    p.add_argument(
        "--policies",
        default="cache_aware,round_robin",
        help="comma-separated policy names (default: cache_aware,round_robin); "
        "cache_aware+events: precise mode, routed on the simulated caches' KV events",
    )
    add_fleet_args(p)
    g = p.add_argument_group("workload shape")
    g.add_argument(
        "--groups", type=int, default=None, help="gsp/llmd: prefix groups; rag: documents"
    )
    g.add_argument(
        "--prompts-per-group",
        type=int,
        default=None,
        help="gsp/llmd; rag: requests per document on average",
    )
    g.add_argument(
        "--doc-len",
        type=int,
        default=None,
        help="rag: mean document length in tokens (uniform over half to 1.5 times it)",
    )
    g.add_argument("--system-len", type=int, default=None)
    g.add_argument("--question-len", type=int, default=None)
    g.add_argument("--output-len", type=int, default=None)
    g.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform")
    g.add_argument("--conversations", type=int, default=None, help="multiturn")
    g.add_argument("--turns", type=int, default=None, help="multiturn")
    g.add_argument(
        "--sigma",
        type=float,
        default=None,
        help="multiturn: log-normal shape of system prompt and user message lengths "
        "(median --system-len / --question-len); 0 (default): fixed lengths",
    )
    g.add_argument(
        "--arrivals",
        choices=("burst", "poisson", "trace"),
        default=None,
        help="arrival process (default: trace for mooncake, burst otherwise)",
    )
    g.add_argument("--rate", type=float, default=0.0, help="poisson rate (requests/s)")
    g.add_argument("--time-scale", type=float, default=1.0, help="mooncake: speed-up")
    g.add_argument("--limit", type=int, default=None, help="mooncake: first N requests")
    d = p.add_argument_group(
        "what an approximate router cannot see",
        "precise mode (POLICY+events) sees all of these through the engines' KV events",
    )
    d.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        metavar="N",
        help="N router replicas (HA), dealt requests in turn; each has its own approximate "
        "index and its own in-flight loads, as N kvroute serve processes would; in "
        "precise mode all subscribe to every worker's events (default: 1)",
    )
    d.add_argument(
        "--bypass-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="this fraction of requests goes straight to a worker chosen at random "
        "(from --seed), unseen by the router: no index entry, no load (default: 0)",
    )
    d.add_argument(
        "--health-check-interval-secs",
        type=float,
        default=5.0,
        metavar="SECS",
        help="with the saturation guard on, each engine's running/waiting counts are read "
        "this often (as serve does after each health check); the guard adds what an engine "
        "holds beyond the router's own requests (default: 5, serve's default)",
    )
    d.add_argument(
        "--restart-every",
        type=float,
        default=None,
        metavar="SECS",
        help="every SECS of virtual time the next worker in turn loses its whole KV cache "
        "(AllBlocksCleared); its running requests carry on, so health checks see "
        "nothing (default: never)",
    )
    d.add_argument(
        "--causal-turns",
        action="store_true",
        help="multiturn only: each turn is sent at its drawn arrival time or when the "
        "answer before it has ended, whichever is later, as a chat client sends it "
        "(default: every turn at its drawn time, so one conversation can have several "
        "turns in flight at once)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_workload(args: argparse.Namespace) -> list[Any]:
    from kvroute.sim import workloads as wl

    if args.workload is None:
        args.workload = "mooncake" if args.trace else "gsp"
    kw: dict[str, Any] = {"seed": args.seed}
    if args.arrivals is not None:
        kw["arrivals"] = args.arrivals
        kw["rate"] = args.rate
    if args.workload in ("gsp", "llmd"):
        for name in ("groups", "prompts_per_group", "system_len", "question_len", "output_len"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
        kw["popularity"] = args.popularity
    elif args.workload == "rag":
        for name in ("system_len", "question_len", "output_len", "doc_len"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
        if args.groups is not None:
            kw["documents"] = args.groups
        kw["requests"] = kw.get("documents", 200) * (args.prompts_per_group or 6)
    elif args.workload == "multiturn":
        for name in ("conversations", "turns", "system_len", "output_len", "sigma"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
        if args.question_len is not None:
            kw["user_len"] = args.question_len
    elif args.workload == "mooncake":
        if not args.trace:
            raise ValueError("--workload mooncake needs --trace FILE")
        kw.update(path=args.trace, time_scale=args.time_scale, limit=args.limit)
    return wl.build(args.workload, **kw)


def fleet_config(args: argparse.Namespace) -> Any:
    from kvroute.config import parse_worker_capacity
    from kvroute.sim.fleet import FleetConfig, heterogeneous

    capacity, learn = parse_worker_capacity(args.worker_capacity)
    cost = c.CostModel(
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_s_per_token=args.decode_ms_per_token / 1000,
        max_batch=args.max_batch,
    )
    slow = getattr(args, "slow_workers", 0)
    return FleetConfig(
        workers=args.workers,
        capacity_tokens=args.capacity_tokens,
        block_size=args.block_size,
        cost=cost,
        worker_costs=(
            heterogeneous(cost, args.workers, slow, args.slow_prefill_factor) if slow else None
        ),
        max_tree_size=args.max_tree_size,
        engine_budgets=not getattr(args, "unbounded_index", False),
        policy_settings={
            "seed": args.seed,
            "worker_capacity": capacity,
            "load_metric": getattr(args, "load_metric", "work"),
            "router_temperature": getattr(args, "router_temperature", 0.0),
        },
        learn_capacity=learn,
        output_blocks=args.output_blocks,
        kv_admission=args.kv_admission,
        router_replicas=getattr(args, "router_replicas", 1),
        bypass_fraction=getattr(args, "bypass_fraction", 0.0),
        restart_every_s=getattr(args, "restart_every", None),
        causal_turns=getattr(args, "causal_turns", False),
        engine_poll_s=getattr(args, "health_check_interval_secs", 5.0),
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    from kvroute.sim.fleet import compare
    from kvroute.sim.report import markdown_table, to_json

    try:
        if args.workers < 1:
            raise ValueError("--workers must be >= 1")
        if args.router_replicas < 1:
            raise ValueError("--router-replicas must be >= 1")
        if not 0.0 <= args.bypass_fraction <= 1.0:
            raise ValueError("--bypass-fraction must be within [0, 1]")
        if not args.health_check_interval_secs > 0:
            raise ValueError("--health-check-interval-secs must be > 0")
        if args.restart_every is not None and not args.restart_every > 0:
            raise ValueError("--restart-every must be > 0")
        if args.causal_turns and args.workload != "multiturn":
            raise ValueError("--causal-turns needs --workload multiturn (turns of conversations)")
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if not policies:
            raise ValueError("--policies is empty")
        from kvroute.routing.policies import POLICY_NAMES

        unknown = [p for p in policies if p.removesuffix("+events") not in POLICY_NAMES]
        if unknown:
            raise ValueError(f"unknown policy {unknown[0]!r}; one of {', '.join(POLICY_NAMES)}")
        cfg = fleet_config(args)
        t0 = time.perf_counter()
        requests = build_workload(args)
    except (ValueError, OSError) as e:
        print(f"kvroute simulate: error: {e}", file=sys.stderr)
        return 2
    gen_s = time.perf_counter() - t0

    def progress(name: str, wall: float) -> None:
        print(f"  {name}: simulated in {wall:.1f} s", file=sys.stderr)

    print(
        f"{args.workload}: {len(requests)} requests, {args.workers} workers "
        f"(workload built in {gen_s:.1f} s)",
        file=sys.stderr,
    )
    rows, bound = compare(requests, policies, cfg, progress=progress)
    if args.json:
        print(
            to_json(
                rows,
                bound,
                workload=args.workload,
                workers=args.workers,
                requests=len(requests),
                router_replicas=args.router_replicas,
                bypass_fraction=args.bypass_fraction,
                restart_every_s=args.restart_every,
            )
        )
    else:
        print(markdown_table(rows, bound))
    return 0
