"""Routing quality over HTTP: kvroute's policies and the peer routers, side by side.

Starts N simulated workers, then for each router in turn flushes every worker's cache,
starts the router in front of them, replays the same requests at the same times, and
reports hit rate (from the workers' own cached_tokens), TTFT p50/p90/p99, end-to-end
p50/p99, throughput and max/mean requests per worker, plus the workload's upper bound.
Output: a Markdown table, ``--json FILE``, and ``--plot FILE.png`` (TTFT CDF per router).

A policy written ``POLICY+events`` (e.g. ``cache_aware+events``) runs kvroute in precise
mode: the workers then publish KV events and the router gets ``--kv-events`` for each.
A policy may carry its own serve flags after ``@`` (``cache_aware@--max-tree-size=308000``):
the row then runs with them on top of ``--kvroute-args``. ``--router-replicas N`` runs N
routers per row in front of the same workers, clients dealing requests to them in turn
(in precise mode each router subscribes to every worker's events).
``--time-scale S`` runs the workers S times faster than model time and replays the
arrivals S times faster; client times are multiplied back by S (so the router's own
overhead counts S times: keep S small), and the workers' own TTFT (model time, no router
or HTTP in it) is printed next to the table, with the workers' queue wait p99 (TTFT
minus the request's own prefill) and the busiest worker's prefill-busy time over the
fleet mean, as ``bench/work_aware.py`` reports them from the simulator.

Workloads are ``kvroute.sim.workloads``'s: ``gsp`` and ``llmd`` (``--popularity zipf``:
group popularity Zipf, ``--zipf-s``), ``multiturn`` (its defaults), ``chat`` (the
simulator's ``chat`` scenario: ``multiturn`` with log-normal lengths, ``--sigma`` 1.8;
defaults 200 conversations x 6 turns, system 800, user 200, output 200 tokens),
``rag`` (``--groups`` documents of about ``--doc-len`` tokens behind a shared system
prompt, ``--groups`` x ``--prompts-per-group`` questions; defaults system 1000, question
80, output 150 tokens) and ``mooncake``. With workload seed 0 a Poisson rate gives the
same arrival draw as ``bench/work_aware.py --rate`` (its ``at_rate``), so the simulator
runs the same requests.
``--causal-turns`` (chat, multiturn): each turn waits for the answer before it
(closed-loop conversations). A heterogeneous fleet: ``--slow-workers K
--slow-worker-args FLAGS`` gives the last K workers these sim-worker flags on top of
``--worker-args`` (the simulator's ``heterogeneous`` also slows the last ones).

Usage:
    python bench/routing_quality.py --workload gsp --groups 16 --prompts-per-group 8 \\
        --workers 4 --rate 6 --policies cache_aware,round_robin --peers --plot ttft.png
    python bench/routing_quality.py --workload llmd --workers 4 --rate 8 --time-scale 2 \\
        --capacity-tokens 308000 --kvroute-args '--max-tree-size 308000' \\
        --policies round_robin,cache_aware,cache_aware+events
    python bench/routing_quality.py --workload mooncake --workers 8 --time-scale 8 \\
        --output-cap 16 --peers --worker-args '--capacity-tokens 4000000'
    python bench/routing_quality.py --workload chat --workers 8 --rate 9.37 --peers
    python bench/routing_quality.py --workload gsp --groups 64 --prompts-per-group 16 \\
        --workers 8 --rate 24.87 --worker-args '--prefill-tokens-per-s 3000' \\
        --slow-workers 2 --slow-worker-args '--prefill-tokens-per-s 1500'
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvroute.eval.procs import Server
from kvroute.eval.quality import installed_peer_specs, kvroute_spec, run_router, start_sim_workers
from kvroute.sim.cost import DEFAULT_MAX_BATCH
from kvroute.sim.fleet import prepare, upper_bound
from kvroute.sim.report import ResultRow, markdown_table, to_json
from kvroute.sim.workloads import gsp, llmd, mooncake, multiturn, previous_turns, rag

# Per-workload defaults of the length flags (the simulator's scenarios for ``chat``).
LENGTHS = {
    "chat": {"system_len": 800, "user_len": 200, "output_len": 200},
    "rag": {"system_len": 1000, "question_len": 80, "output_len": 150},
    "default": {"system_len": 2048, "question_len": 128, "output_len": 32, "user_len": 128},
}

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def build(args: argparse.Namespace) -> list:  # type: ignore[type-arg]
    if args.workload == "mooncake":
        # The trace's own timestamps, compressed by --trace-speedup (model time).
        reqs = mooncake(args.trace, seed=args.seed, time_scale=args.trace_speedup, limit=args.limit)
        if args.output_cap:
            # Fewer streamed chunks per request: a Python router on a small machine then
            # measures routing, not its own streaming throughput (the cache is unchanged).
            for r in reqs:
                r.output_len = min(r.output_len, args.output_cap)
        return reqs
    arrivals = "burst" if args.rate <= 0 else "poisson"
    if args.workload == "chat":
        return multiturn(
            args.conversations,
            args.turns,
            args.system_len,
            args.user_len,
            args.output_len,
            sigma=args.sigma,
            seed=args.seed,
            arrivals=arrivals,
            rate=args.rate,
        )
    if args.workload == "gsp":
        return gsp(
            args.groups,
            args.prompts_per_group,
            args.system_len,
            args.question_len,
            args.output_len,
            popularity=args.popularity,
            zipf_s=args.zipf_s,
            seed=args.seed,
            arrivals=arrivals,
            rate=args.rate,
        )
    if args.workload == "rag":
        return rag(
            args.groups,
            args.groups * args.prompts_per_group,
            args.system_len,
            args.doc_len,
            args.question_len,
            args.output_len,
            seed=args.seed,
            arrivals=arrivals,
            rate=args.rate,
        )
    if args.workload == "llmd":
        return llmd(
            args.groups,
            args.prompts_per_group,
            args.system_len,
            args.question_len,
            args.output_len,
            popularity=args.popularity,
            zipf_s=args.zipf_s,
            seed=args.seed,
            arrivals=arrivals,
            rate=args.rate,
        )
    return multiturn(seed=args.seed, arrivals=arrivals, rate=args.rate)


def format_counters(counters: dict[str, float]) -> str:
    """Decisions by reason/source, then predicted vs reported reuse, on one line; with
    the work model's checked TTFT predictions, their mean absolute error (router wall
    seconds: multiply by --time-scale for model time)."""
    out = ", ".join(f"{k}={v:g}" for k, v in sorted(counters.items()))
    if counters.get("ttft_checked"):
        out += f", ttft_mae_s={counters['ttft_abs_error_s'] / counters['ttft_checked']:.4f}"
    return out


def plot(rows: list[ResultRow], samples: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ttft in samples.items():
        xs = np.sort(np.asarray(ttft))
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _max_batch(flags: list[str]) -> int | None:
    """The value of ``--max-batch`` in sim-worker flags (the last one), or None."""
    found = None
    for i, flag in enumerate(flags):
        if flag == "--max-batch" and i + 1 < len(flags):
            found = int(flags[i + 1])
        elif flag.startswith("--max-batch="):
            found = int(flag.split("=", 1)[1])
    return found


def stated_max_running(
    workers: list[Server], common: list[str], slow: list[str], args: argparse.Namespace
) -> tuple[str, ...]:
    """``--worker-max-running URL=N`` for every worker, N as the worker was started."""
    default = _max_batch(common) or DEFAULT_MAX_BATCH
    out: list[str] = []
    for i, w in enumerate(workers):
        n = default
        if i >= args.workers - args.slow_workers:
            n = _max_batch(common + slow) or default
        out += ["--worker-max-running", f"{w.url}={n}"]
    return tuple(out)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workload",
        choices=("gsp", "llmd", "multiturn", "chat", "mooncake", "rag"),
        default="gsp",
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16, help="gsp/llmd: groups; rag: documents")
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=None, help="2048 (chat: 800)")
    ap.add_argument("--question-len", type=int, default=None, help="128")
    ap.add_argument("--output-len", type=int, default=None, help="32 (chat: 200)")
    ap.add_argument("--doc-len", type=int, default=3000, help="rag: mean document length")
    ap.add_argument("--conversations", type=int, default=200, help="chat: conversations")
    ap.add_argument("--turns", type=int, default=6, help="chat: turns per conversation")
    ap.add_argument("--user-len", type=int, default=None, help="chat: user message median (200)")
    ap.add_argument(
        "--sigma", type=float, default=1.8, help="chat: log-normal shape of lengths (1.8)"
    )
    ap.add_argument(
        "--rate", type=float, default=6.0, help="Poisson arrivals per second (0: all at once)"
    )
    ap.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent (1.1)")
    ap.add_argument("--trace", default=str(TRACE), help="mooncake: the JSONL trace")
    ap.add_argument("--limit", type=int, default=None, help="mooncake: first N requests")
    ap.add_argument(
        "--output-cap", type=int, default=0, help="mooncake: at most this many output tokens"
    )
    ap.add_argument(
        "--trace-speedup", type=float, default=1.0, help="mooncake: compress the timestamps"
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run workers and arrivals this many times faster than model time",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--capacity-tokens",
        type=int,
        default=None,
        help="every sim worker's KV capacity in tokens (default: the sim worker's)",
    )
    ap.add_argument(
        "--policies",
        default="cache_aware,round_robin",
        help="kvroute policies to run, comma-separated; POLICY+events = precise mode",
    )
    ap.add_argument(
        "--kvroute-args",
        default="",
        help="extra flags for kvroute serve, e.g. '--worker-capacity 32'",
    )
    ap.add_argument("--worker-args", default="", help="extra flags for every sim worker")
    ap.add_argument(
        "--slow-workers",
        type=int,
        default=0,
        help="the last K workers also get --slow-worker-args (a heterogeneous fleet)",
    )
    ap.add_argument(
        "--slow-worker-args",
        default="",
        help="sim-worker flags for the --slow-workers, e.g. '--prefill-tokens-per-s 1500'",
    )
    ap.add_argument(
        "--state-max-running",
        action="store_true",
        help="give every kvroute router --worker-max-running URL=N for each worker, N its "
        "sim worker's --max-batch (as an operator states vLLM's --max-num-seqs)",
    )
    ap.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        help="kvroute routers per row, same flags, dealt requests in turn (default: 1)",
    )
    ap.add_argument(
        "--peers",
        nargs="?",
        const="all",
        default=None,
        help="also run installed peer routers (all, or a comma-separated list: sglang,vllm)",
    )
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    ap.add_argument("--plot", default=None, help="write a TTFT CDF plot (PNG) to this file")
    ap.add_argument(
        "--causal-turns",
        action="store_true",
        help="chat, multiturn: each turn is sent at its arrival time or once the answer "
        "before it has ended, whichever is later (closed-loop conversations, as chat "
        "clients send them; the simulator's --causal-turns)",
    )
    args = ap.parse_args()
    if not 0 <= args.slow_workers <= args.workers:
        ap.error("--slow-workers must be within [0, --workers]")
    if args.causal_turns and args.workload not in ("chat", "multiturn"):
        ap.error("--causal-turns needs --workload chat or multiturn")
    for k, v in LENGTHS.get(args.workload, LENGTHS["default"]).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)

    requests = build(args)
    bound = upper_bound(prepare(requests, 16))
    after = previous_turns(requests) if args.causal_turns else None
    extra = tuple(args.kvroute_args.split())
    specs = []
    for item in args.policies.split(","):
        policy, *own = item.split("@")
        spec = kvroute_spec(policy, extra + tuple(own))
        specs.append(replace(spec, name=" ".join([spec.name, *own])))
    if args.peers:
        only = None if args.peers == "all" else args.peers.split(",")
        specs += installed_peer_specs(ROOT, only)
    rows: list[ResultRow] = []
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-quality-") as logs:
        worker_args = args.worker_args.split()
        if args.time_scale != 1.0:
            worker_args += ["--time-scale", str(args.time_scale)]
        if args.capacity_tokens is not None:
            worker_args += ["--capacity-tokens", str(args.capacity_tokens)]
        workers = start_sim_workers(
            args.workers,
            logs,
            worker_args,
            kv_events=any(s.kv_events for s in specs),
            publishers_bind=args.router_replicas > 1,
            own_args=[()] * (args.workers - args.slow_workers)
            + [args.slow_worker_args.split()] * args.slow_workers,
        )
        if args.state_max_running:
            stated = stated_max_running(workers, worker_args, args.slow_worker_args.split(), args)
            specs = [replace(s, args=s.args + stated) if s.kind == "kvroute" else s for s in specs]
        try:
            for spec in specs:
                with tqdm(
                    total=len(requests),
                    desc=spec.name,
                    file=sys.stderr,
                    leave=False,
                    disable=None,
                    mininterval=1.0,
                ) as bar:
                    row = run_router(
                        spec,
                        workers,
                        requests,
                        log_dir=logs,
                        root=ROOT,
                        time_scale=args.time_scale,
                        on_done=bar.update,
                        replicas=args.router_replicas if spec.kind == "kvroute" else 1,
                        after=after,
                    )
                rows.append(row)
                if row.extra.get("routing"):
                    print(f"{spec.name}: {format_counters(row.extra['routing'])}", file=sys.stderr)
                samples[spec.name] = list(row.extra.get("ttft", []))
        finally:
            for w in workers:
                w.stop()
    print(markdown_table(rows, bound))
    print(
        "\nOn the workers (model s): TTFT p50 / p90 / p99, queue wait p99, busiest / mean "
        "prefill-busy; per-worker requests, errors:"
    )
    for r in rows:
        x = r.extra
        print(
            f"  {r.name}: {x['worker_ttft_p50']:.3f} / {x['worker_ttft_p90']:.3f} / "
            f"{x['worker_ttft_p99']:.3f}, {x['worker_queue_wait_p99']:.3f}, "
            f"{x['worker_busy_max_over_mean']:.2f}; {x.get('per_worker')}, {r.errors}"
        )
    if args.json:
        Path(args.json).write_text(
            to_json(
                rows,
                bound,
                workload=args.workload,
                workers=args.workers,
                rate=args.rate,
                time_scale=args.time_scale,
                capacity_tokens=args.capacity_tokens,
                kvroute_args=args.kvroute_args,
                router_replicas=args.router_replicas,
                output_len=args.output_len,
                worker_args=args.worker_args,
                slow_workers=args.slow_workers,
                slow_worker_args=args.slow_worker_args,
                seed=args.seed,
            )
        )
    if args.plot:
        plot(rows, samples, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
