"""A mixed fleet over HTTP: two base models, LoRA adapters and cache salts, one router.

Six ``kvroute sim-worker`` replicas: two serve ``alpha`` with the adapter ``alpha-sql``,
two serve ``alpha`` with ``alpha-sql`` and ``alpha-chat``, two serve ``beta``. A
generated-shared-prefix workload whose groups are dealt over six partitions:
``alpha``, ``alpha-sql``, ``alpha-chat``, ``beta``, and ``alpha`` under two tenants'
``cache_salt``. Each router in turn (the workers' caches flushed before each) gets the
same requests at the same times; hit rates are the workers' own ``cached_tokens``, per
partition, against that partition's bound (one infinite cache per partition: a hit never
crosses adapters or salts). Failed requests (a worker asked for a model it does not
serve answers 404) are counted.

    python bench/mixed_fleet.py --groups 48 --prompts-per-group 8 --rate 20
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvroute.eval.loadgen import replay
from kvroute.eval.peers import PEERS
from kvroute.eval.procs import Server, free_port, kvroute_argv, running, start_server
from kvroute.eval.quality import RouterSpec, kvroute_spec, reset_workers, start_router
from kvroute.sim.fleet import prepare, upper_bound
from kvroute.sim.report import percentile
from kvroute.sim.workloads import Request, gsp

ROOT = Path(__file__).resolve().parents[1]
FLEET = [
    ("alpha", "alpha-sql"),
    ("alpha", "alpha-sql"),
    ("alpha", "alpha-sql,alpha-chat"),
    ("alpha", "alpha-sql,alpha-chat"),
    ("beta", ""),
    ("beta", ""),
]
PARTITIONS = [
    ("alpha", None),
    ("alpha-sql", None),
    ("alpha-chat", None),
    ("beta", None),
    ("alpha", "tenant-1"),
    ("alpha", "tenant-2"),
]


@dataclass(slots=True)
class MixedRequest:
    arrival_s: float
    tokens: np.ndarray
    output_len: int
    group: int
    model: str
    cache_salt: str | None

    @property
    def partition(self) -> str:
        return self.model + (f" salt={self.cache_salt}" if self.cache_salt else "")


def workload(args: argparse.Namespace) -> list[MixedRequest]:
    base: list[Request] = gsp(
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        args.output_len,
        seed=args.seed,
        arrivals="poisson",
        rate=args.rate,
    )
    out = []
    for r in base:
        model, salt = PARTITIONS[r.group % len(PARTITIONS)]
        out.append(MixedRequest(r.arrival_s, r.tokens, r.output_len, r.group, model, salt))
    return out


def start_fleet(log_dir: str, sim_args: list[str]) -> list[Server]:
    workers: list[Server] = []
    for model, adapters in FLEET:
        port = free_port()
        argv = kvroute_argv("sim-worker", "--port", str(port), "--model", model, *sim_args)
        if adapters:
            argv += ["--lora-adapters", adapters]
        workers.append(start_server(f"sim-{model}-{port}", argv, port, log_dir=log_dir))
    return workers


def run(spec: RouterSpec, workers: list[Server], reqs: list[MixedRequest], log_dir: str,
        time_scale: float) -> dict[str, object]:  # fmt: skip
    reset_workers(workers)
    router = start_router(spec, workers, log_dir, ROOT)
    try:
        # Let the router read every worker's /v1/models (one health round).
        asyncio.run(asyncio.sleep(1.0))
        outcomes, _ = asyncio.run(replay(router.url, reqs, time_scale=time_scale, as_text=False))
    finally:
        router.stop()
    cached: dict[str, int] = defaultdict(int)
    prompt: dict[str, int] = defaultdict(int)
    failed = 0
    for req, out in zip(reqs, outcomes, strict=True):
        if out.status != 200:
            failed += 1
            continue
        cached[req.partition] += out.cached_tokens
        prompt[req.partition] += out.prompt_tokens
    ttft = [o.ttft_s * time_scale for o in outcomes if o.status == 200]
    return {
        "name": spec.name,
        "failed": failed,
        "hit": {p: cached[p] / prompt[p] if prompt[p] else float("nan") for p in prompt},
        "overall": sum(cached.values()) / max(sum(prompt.values()), 1),
        "ttft": [percentile(ttft, q) for q in (50, 90, 99)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=48)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per model second")
    p.add_argument("--time-scale", type=float, default=10.0, help="sim workers' --time-scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--peers", action="store_true", help="also SGLang's router, if installed")
    args = p.parse_args()

    reqs = workload(args)
    by_part: dict[str, list[MixedRequest]] = defaultdict(list)
    for r in reqs:
        by_part[r.partition].append(r)
    bounds = {
        k: upper_bound(prepare(v, 16))  # type: ignore[arg-type]
        for k, v in by_part.items()
    }
    specs = [kvroute_spec(pol) for pol in args.policies.split(",")]
    if args.peers and PEERS["sglang"].installed(ROOT):
        specs.append(RouterSpec("sglang-router cache_aware", "sglang"))
    sim_args = ["--time-scale", str(args.time_scale), "--block-size", "16"]
    with tempfile.TemporaryDirectory() as log_dir:
        with running(start_fleet(log_dir, sim_args)) as workers:
            rows = [run(s, workers, reqs, log_dir, args.time_scale) for s in specs]
    parts = sorted(by_part)
    fleet = "6 sim workers (2 alpha+sql, 2 alpha+sql+chat, 2 beta)"
    print(f"{len(reqs)} requests, {args.groups} groups over {len(PARTITIONS)} partitions, "
          f"{args.rate:g} req/s, {fleet}\n")  # fmt: skip
    print("| router | failed | overall hit | " + " | ".join(parts) + " | TTFT p50/p90/p99 (s) |")
    print("|---" * (len(parts) + 4) + "|")
    print("| bound (per partition) | | | " + " | ".join(f"{bounds[k]:.1%}" for k in parts) + " | |")
    for row in rows:
        hit = row["hit"]
        assert isinstance(hit, dict)
        cells = " | ".join(f"{hit.get(k, float('nan')):.1%}" for k in parts)
        t = row["ttft"]
        assert isinstance(t, list)
        print(f"| {row['name']} | {row['failed']} | {row['overall']:.1%} | {cells} | "
              f"{t[0]:.3f} / {t[1]:.3f} / {t[2]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
