"""Routing quality over HTTP: kvroute's policies and the peer routers, side by side.

Starts N simulated workers, then for each router in turn flushes every worker's cache,
starts the router in front of them, replays the same requests at the same times, and
reports hit rate (from the workers' own cached_tokens), TTFT p50/p90/p99, end-to-end
p50/p99, throughput and max/mean requests per worker, plus the workload's upper bound.
Output: a Markdown table, ``--json FILE``, and ``--plot FILE.png`` (TTFT CDF per router).

Usage:
    python bench/routing_quality.py --workload gsp --groups 16 --prompts-per-group 8 \\
        --workers 4 --rate 6 --policies cache_aware,round_robin --peers --plot ttft.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from kvroute.quality import RouterSpec, installed_peer_specs, run_router, start_sim_workers
from kvroute.sim.fleet import prepare, upper_bound
from kvroute.sim.report import ResultRow, markdown_table, to_json
from kvroute.sim.workloads import gsp, llmd, multiturn

ROOT = Path(__file__).resolve().parents[1]


def build(args: argparse.Namespace) -> list:  # type: ignore[type-arg]
    if args.workload == "gsp":
        return gsp(
            args.groups,
            args.prompts_per_group,
            args.system_len,
            args.question_len,
            args.output_len,
            seed=args.seed,
            arrivals="poisson",
            rate=args.rate,
        )
    if args.workload == "llmd":
        return llmd(
            args.groups,
            args.prompts_per_group,
            args.system_len,
            args.question_len,
            args.output_len,
            seed=args.seed,
            arrivals="poisson",
            rate=args.rate,
        )
    return multiturn(seed=args.seed, arrivals="poisson", rate=args.rate)


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


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", choices=("gsp", "llmd", "multiturn"), default="gsp")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policies",
        default="cache_aware,round_robin",
        help="kvroute policies to run, comma-separated",
    )
    ap.add_argument(
        "--kvroute-args",
        default="",
        help="extra flags for kvroute serve, e.g. '--worker-capacity 32'",
    )
    ap.add_argument("--worker-args", default="", help="extra flags for every sim worker")
    ap.add_argument("--peers", action="store_true", help="also run installed peer routers")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    ap.add_argument("--plot", default=None, help="write a TTFT CDF plot (PNG) to this file")
    args = ap.parse_args()

    requests = build(args)
    bound = upper_bound(prepare(requests, 16))
    extra = tuple(args.kvroute_args.split())
    specs = [RouterSpec(f"kvroute {p}", "kvroute", p, extra) for p in args.policies.split(",")]
    if args.peers:
        specs += installed_peer_specs(ROOT)
    rows: list[ResultRow] = []
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-quality-") as logs:
        workers = start_sim_workers(args.workers, logs, args.worker_args.split())
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
                        spec, workers, requests, log_dir=logs, root=ROOT, on_done=bar.update
                    )
                rows.append(row)
                samples[spec.name] = list(row.extra.get("ttft", []))
        finally:
            for w in workers:
                w.stop()
    print(markdown_table(rows, bound))
    if args.json:
        Path(args.json).write_text(
            to_json(rows, bound, workload=args.workload, workers=args.workers)
        )
    if args.plot:
        plot(rows, samples, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
