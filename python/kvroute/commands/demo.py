"""``kvroute demo``: see cache-aware routing win, on this machine, in about a minute.

Starts 4 simulated workers (``kvroute sim-worker``: a real block-level prefix cache and a
prefill/decode cost model, see ``kvroute.sim``) and the router on free loopback ports,
replays one shared-prefix workload (32 groups x 4 requests: 2,048-token system prompt +
128-token question, Poisson arrivals) through round_robin and then cache_aware, and prints
the side-by-side table. Hit rate and cached tokens come from the workers' own answers
(``usage.prompt_tokens_details.cached_tokens``), TTFT from the client. Everything it
started is stopped before it returns.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from kvroute.eval.quality import RouterSpec, installed_peer_specs, run_router, start_sim_workers
from kvroute.sim.fleet import prepare, upper_bound
from kvroute.sim.report import markdown_table, to_json
from kvroute.sim.workloads import gsp


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--workers", type=int, default=4, help="simulated workers")
    p.add_argument("--groups", type=int, default=32, help="shared system prompts")
    p.add_argument("--prompts-per-group", type=int, default=4, help="requests per group")
    p.add_argument("--system-len", type=int, default=2048, help="system prompt tokens")
    p.add_argument("--question-len", type=int, default=128, help="question tokens")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--rate", type=float, default=6.0, help="arrivals per second (Poisson)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run SGLang's and vLLM's routers if installed under .peers/",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    requests = gsp(
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
    specs = [
        RouterSpec("kvroute round_robin", "kvroute", "round_robin"),
        RouterSpec("kvroute cache_aware", "kvroute", "cache_aware"),
    ]
    root = Path.cwd()
    if args.peers:
        specs += installed_peer_specs(root)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-demo-") as logs:
        print(f"starting {args.workers} simulated workers (logs in {logs})...", file=sys.stderr)
        workers = start_sim_workers(args.workers, logs)
        try:
            for spec in specs:
                with tqdm(
                    total=len(requests),
                    desc=spec.name,
                    unit="req",
                    file=sys.stderr,
                    leave=False,
                    disable=None,
                    mininterval=1.0,
                ) as bar:
                    rows.append(
                        run_router(
                            spec,
                            workers,
                            requests,
                            log_dir=logs,
                            root=root,
                            on_done=bar.update,
                        )
                    )
        finally:
            for w in workers:
                w.stop()
    if args.json:
        print(to_json(rows, bound, workload="gsp", workers=args.workers))
        return 0
    print(
        f"\n{len(requests)} requests: {args.groups} groups x {args.prompts_per_group}, "
        f"{args.system_len}-token system prompt + {args.question_len}-token question, "
        f"{args.output_len} output tokens, Poisson {args.rate:g}/s, {args.workers} workers\n"
    )
    print(markdown_table(rows, bound))
    by = {r.name: r for r in rows}
    rr, ca = by["kvroute round_robin"], by["kvroute cache_aware"]
    if rr.ttft_p50 > 0 and ca.ttft_p50 > 0:
        print(
            f"\ncache_aware vs round_robin: hit rate {ca.hit_rate:.1%} vs {rr.hit_rate:.1%}, "
            f"TTFT p50 {rr.ttft_p50 / ca.ttft_p50:.1f}x lower, "
            f"p99 {rr.ttft_p99 / ca.ttft_p99:.1f}x lower"
        )
    return 0
