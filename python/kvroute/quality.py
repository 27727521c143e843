"""Routing quality over HTTP: the same requests, at the same times, through each router,
in front of the same simulated workers, judged by the workers' own accounting.

For each router in turn: every worker's prefix cache is flushed and its counters reset,
the router is started in front of the workers, the workload is replayed (``loadgen``),
and the row is built from what clients saw (TTFT, latency) and what the workers report
(cached prompt tokens per request, requests served per worker). Used by ``kvroute demo``
and ``bench/routing_quality.py``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvroute.loadgen import ReplayRequest, replay
from kvroute.peers import PEERS, start_peer
from kvroute.procs import Server, free_port, kvroute_argv, start_server
from kvroute.sim.report import ResultRow, percentile, summarize


@dataclass(frozen=True)
class RouterSpec:
    """``kind``: "kvroute", "direct" (no router: requests go to the first worker only,
    useless for routing but a sanity check), or a peer name from ``kvroute.peers.PEERS``."""

    name: str
    kind: str
    policy: str = "cache_aware"
    args: tuple[str, ...] = field(default_factory=tuple)


def installed_peer_specs(root: Path) -> list[RouterSpec]:
    """A cache_aware spec for every peer router installed under ``root/.peers``; says on
    stderr which are skipped and how to install them."""
    specs = []
    for key, peer in PEERS.items():
        if peer.installed(root):
            specs.append(RouterSpec(f"{peer.name} cache_aware", key, "cache_aware"))
        else:
            print(f"skipping {peer.name}: not installed ({peer.install_hint()})", file=sys.stderr)
    return specs


def start_sim_workers(n: int, log_dir: str, args: Sequence[str] = ()) -> list[Server]:
    workers: list[Server] = []
    try:
        for _ in range(n):
            port = free_port()
            workers.append(
                start_server(
                    f"sim-worker-{port}",
                    kvroute_argv("sim-worker", "--port", str(port), *args),
                    port,
                    log_dir=log_dir,
                )
            )
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def start_router(spec: RouterSpec, workers: list[str], log_dir: str, root: Path) -> Server:
    if spec.kind == "kvroute":
        port = free_port()
        argv = kvroute_argv(
            "serve", "--port", str(port), "--policy", spec.policy,
            "--worker-urls", *workers, "--log-level", "warning", *spec.args,
        )  # fmt: skip
        return start_server(f"kvroute-{spec.policy}", argv, port, log_dir=log_dir)
    return start_peer(PEERS[spec.kind], root, workers, policy=spec.policy, log_dir=log_dir)


def reset_workers(workers: Sequence[Server]) -> None:
    with httpx.Client(timeout=10, trust_env=False) as c:
        for w in workers:
            c.post(w.url + "/flush_cache").raise_for_status()
            c.post(w.url + "/sim/reset_stats").raise_for_status()


def served_counts(workers: Sequence[Server]) -> list[int]:
    with httpx.Client(timeout=10, trust_env=False) as c:
        return [int(c.get(w.url + "/sim/stats").json()["requests_served"]) for w in workers]


def worker_ttfts(workers: Sequence[Server]) -> list[float]:
    """Every finished request's TTFT as the workers timed it (model seconds: queue and
    prefill on the worker, no router or HTTP time, not inflated by a time scale)."""
    out: list[float] = []
    with httpx.Client(timeout=30, trust_env=False) as c:
        for w in workers:
            log = c.get(w.url + "/sim/stats", params={"log": 1}).json().get("requests", [])
            out += [float(r["ttft_s"]) for r in log if r.get("finished")]
    return out


def run_router(
    spec: RouterSpec,
    workers: Sequence[Server],
    requests: Sequence[ReplayRequest],
    *,
    log_dir: str,
    root: Path,
    time_scale: float = 1.0,
    on_done: Callable[[], None] | None = None,
) -> ResultRow:
    reset_workers(workers)
    before = served_counts(workers)
    router = start_router(spec, [w.url for w in workers], log_dir, root)
    try:
        outcomes, wall = asyncio.run(
            replay(router.url, requests, time_scale=time_scale, on_done=on_done)
        )
    finally:
        router.stop()
    after = served_counts(workers)
    on_workers = worker_ttfts(workers)
    per_worker = [a - b for a, b in zip(after, before, strict=True)]
    ok = [o for o in outcomes if o.status == 200]
    # Client wall times x time_scale are model times plus the router's and HTTP's real
    # overhead, itself multiplied by the scale (see sim.engine): keep the scale small.
    s = time_scale
    return summarize(
        spec.name,
        ttft_s=[o.ttft_s * s for o in ok],
        e2e_s=[o.e2e_s * s for o in ok],
        prompt_tokens=sum(o.prompt_tokens for o in ok),
        cached_tokens=sum(o.cached_tokens for o in ok),
        output_tokens=sum(o.output_tokens for o in ok),
        duration_s=wall * s,
        per_worker=per_worker,
        errors=len(outcomes) - len(ok),
        extra={
            "ttft": [round(o.ttft_s * s, 6) for o in ok],
            "worker_ttft_p50": percentile(on_workers, 50),
            "worker_ttft_p90": percentile(on_workers, 90),
            "worker_ttft_p99": percentile(on_workers, 99),
            "time_scale": s,
            "per_worker": per_worker,
        },
    )
