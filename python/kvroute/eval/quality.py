"""Routing quality over HTTP: the same requests, at the same times, through each router,
in front of the same simulated workers, judged by the workers' own accounting.

For each router in turn: every worker's prefix cache is flushed and its counters reset,
the router is started in front of the workers, the workload is replayed (``loadgen``),
and the row is built from what clients saw (TTFT, latency) and what the workers report
(cached prompt tokens per request, requests served per worker). Used by ``kvroute demo``
and ``bench/routing_quality.py``.

Precise mode (a spec with ``kv_events``): the workers publish vLLM-format KV events to one
socket the router binds (a topic per worker). ZMQ drops what a publisher sends before the
subscription reaches it, and the router trusts a stream only once it has seen a full
state, so after the router starts every worker's cache is flushed (``AllBlocksCleared``)
until ``/workers`` shows all of them ``precise``; only then does the timed replay start.

Router replicas (``replicas`` > 1, an HA deployment): that many routers with the same
flags in front of the same workers, clients dealing requests to them in turn; each has
its own index and loads. In precise mode every worker then binds its own PUB socket
(``ipc://`` in the log directory) and every router connects to all of them: a PUB socket
sends each subscriber every message. Counters and CPU time are summed over the routers.

Time scale: with workers run ``S`` times faster than real time (``--time-scale S``),
arrivals are sent ``S`` times sooner and every time the client measures is multiplied by
``S``, so rows are in the workers' model time (router and HTTP overhead count ``S`` times).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvroute.eval.loadgen import ReplayRequest, replay
from kvroute.eval.peers import PEERS, start_peer
from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.sim.report import ResultRow, percentile, summarize


@dataclass(frozen=True)
class RouterSpec:
    """``kind``: "kvroute", "direct" (no router: requests go to the first worker only,
    useless for routing but a sanity check), or a peer name from ``kvroute.eval.peers.PEERS``."""

    name: str
    kind: str
    policy: str = "cache_aware"
    args: tuple[str, ...] = field(default_factory=tuple)
    kv_events: bool = False  # kvroute only: --kv-events for every worker (precise mode)


EVENTS_SUFFIX = "+events"


def kvroute_spec(policy: str, args: Sequence[str] = ()) -> RouterSpec:
    """``policy``, or ``policy+events`` for the same policy in precise mode."""
    base = policy.removesuffix(EVENTS_SUFFIX)
    events = policy.endswith(EVENTS_SUFFIX)
    name = f"kvroute {base} (precise)" if events else f"kvroute {base}"
    return RouterSpec(name, "kvroute", base, tuple(args), kv_events=events)


def installed_peer_specs(root: Path, only: Sequence[str] | None = None) -> list[RouterSpec]:
    """A cache_aware spec for every peer router installed under ``root/.peers`` (or for
    those of ``only``, keys of ``PEERS``); says on stderr which are skipped and how to
    install them."""
    specs = []
    for key, peer in PEERS.items():
        if only is not None and key not in only:
            continue
        if peer.installed(root):
            specs.append(RouterSpec(f"{peer.name} cache_aware", key, "cache_aware"))
        else:
            print(f"skipping {peer.name}: not installed ({peer.install_hint()})", file=sys.stderr)
    return specs


def start_sim_workers(
    n: int,
    log_dir: str,
    args: Sequence[str] = (),
    *,
    kv_events: bool = False,
    publishers_bind: bool = False,
    own_args: Sequence[Sequence[str]] = (),
) -> list[Server]:
    """``n`` sim workers; with ``kv_events`` each publishes to one endpoint that a
    precise-mode router binds, under its own topic (``Server.extra["kv_events"]`` holds
    the ``--kv-events`` value for it). ``publishers_bind``: each worker binds its own
    ``ipc://`` endpoint instead, which any number of routers can connect to.
    ``own_args[i]``: flags for worker ``i`` only, after ``args`` (so they win), e.g. a
    slower prefill for some workers of a heterogeneous fleet."""
    workers: list[Server] = []
    shared = f"tcp://127.0.0.1:{free_port()}"
    try:
        for i in range(n):
            port = free_port()
            topic = f"kv@{i}"
            endpoint = f"ipc://{log_dir}/kv-{i}.sock" if publishers_bind else shared
            events = ["--kv-events-endpoint", endpoint, "--kv-events-topic", topic]
            w = start_server(
                f"sim-worker-{port}",
                kvroute_argv(
                    "sim-worker",
                    "--port",
                    str(port),
                    *args,
                    *(own_args[i] if i < len(own_args) else ()),
                    *(events if kv_events else []),
                ),
                port,
                log_dir=log_dir,
            )
            if kv_events:
                side = "connect" if publishers_bind else "bind"
                w.extra["kv_events"] = f"{w.url}={endpoint};{side};topic={topic}"
            workers.append(w)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def start_router(spec: RouterSpec, workers: Sequence[Server], log_dir: str, root: Path) -> Server:
    urls = [w.url for w in workers]
    if spec.kind == "kvroute":
        port = free_port()
        events: list[str] = []
        if spec.kv_events:
            for w in workers:
                if "kv_events" not in w.extra:
                    raise ValueError(f"{spec.name}: the workers do not publish KV events")
                events += ["--kv-events", str(w.extra["kv_events"])]
            if "--tokenizer" not in spec.args:  # simulated workers count UTF-8 bytes
                events.append("--token-id-prompts")
        argv = kvroute_argv(
            "serve", "--port", str(port), "--policy", spec.policy,
            "--worker-urls", *urls, "--log-level", "warning", *spec.args, *events,
        )  # fmt: skip
        # One log per replica (named by its port), none overwriting another's.
        return start_server(f"kvroute-{spec.policy}-{port}", argv, port, log_dir=log_dir)
    return start_peer(PEERS[spec.kind], root, urls, policy=spec.policy, log_dir=log_dir)


def worker_modes(router: Server) -> dict[str, str]:
    with httpx.Client(timeout=10, trust_env=False) as c:
        return {w["url"]: str(w["mode"]) for w in c.get(router.url + "/workers").json()}


def flush_sim_worker(client: httpx.Client, worker: Server) -> None:
    client.post(worker.url + "/flush_cache").raise_for_status()


def wait_precise(
    router: Server,
    workers: Sequence[Server],
    timeout_s: float = 30.0,
    flush: Callable[[httpx.Client, Server], None] = flush_sim_worker,
) -> None:
    """Flush the cache of every worker the router does not trust yet (its
    ``AllBlocksCleared`` is a full state) until all are ``precise``; raise on timeout.
    ``flush``: how to empty one worker's cache so that its engine publishes that."""
    deadline = time.monotonic() + timeout_s
    modes = worker_modes(router)
    with httpx.Client(timeout=30, trust_env=False) as c:
        while time.monotonic() < deadline:
            pending = [w for w in workers if modes.get(w.url) != "precise"]
            if not pending:
                return
            for w in pending:
                flush(c, w)
            time.sleep(0.2)
            modes = worker_modes(router)
    raise TimeoutError(f"workers not precise after {timeout_s:.0f}s: {modes}")


_SAMPLE = re.compile(r"^(kvroute_[a-z_]+)(?:\{([^}]*)\})? (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux ``/proc``; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def routing_counters(text: str) -> dict[str, float]:
    """From a kvroute ``/metrics`` page: decisions by ``reason/source``, predicted vs
    reported cached tokens by source (``predicted/<source>``, ``reported/<source>``), and
    the work model's TTFT predictions checked (``ttft_checked``) with their summed
    absolute error (``ttft_abs_error_s``, router wall seconds)."""
    out: dict[str, float] = {}
    for name, key in (
        ("kvroute_ttft_prediction_abs_error_seconds_count", "ttft_checked"),
        ("kvroute_ttft_prediction_abs_error_seconds_sum", "ttft_abs_error_s"),
    ):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m is not None:
            out[key] = float(m.group(1))
    names = {
        "kvroute_routing_decisions_total": "",
        "kvroute_predicted_cached_tokens_total": "predicted/",
        "kvroute_reported_cached_tokens_total": "reported/",
    }
    for name, labels, value in _SAMPLE.findall(text):
        if name not in names:
            continue
        lab = dict(_LABEL.findall(labels))
        key = names[name] + (
            f"{lab.get('reason', '')}/{lab.get('source', '')}" if not names[name] else lab["source"]
        )
        out[key] = out.get(key, 0.0) + float(value)
    return out


def router_counters(routers: Sequence[Server], spec: RouterSpec) -> dict[str, float]:
    """The routers' CPU seconds so far (``router_cpu_s``, with start-up) and, for kvroute,
    their decision and reuse counters (``routing_counters``), summed over the routers."""
    out: dict[str, float] = {}
    with httpx.Client(timeout=10, trust_env=False) as c:
        for router in routers:
            cpu = cpu_seconds(router.pid)
            if cpu is not None:
                out["router_cpu_s"] = round(out.get("router_cpu_s", 0.0) + cpu, 2)
            if spec.kind == "kvroute":
                for k, v in routing_counters(c.get(router.url + "/metrics").text).items():
                    out[k] = out.get(k, 0.0) + v
    return out


def reset_workers(workers: Sequence[Server]) -> None:
    with httpx.Client(timeout=10, trust_env=False) as c:
        for w in workers:
            c.post(w.url + "/flush_cache").raise_for_status()
            c.post(w.url + "/sim/reset_stats").raise_for_status()


def served_counts(workers: Sequence[Server]) -> list[int]:
    with httpx.Client(timeout=10, trust_env=False) as c:
        return [int(c.get(w.url + "/sim/stats").json()["requests_served"]) for w in workers]


def worker_log(workers: Sequence[Server]) -> tuple[list[tuple[float, float]], list[float]]:
    """From the workers' own request logs (model seconds): (TTFT, own prefill time) of
    every finished request, and each worker's prefill-busy time (the sum of its
    requests' own prefill times: what ``kvroute.sim.fleet`` reports as busy)."""
    runs: list[tuple[float, float]] = []
    busy: list[float] = []
    with httpx.Client(timeout=30, trust_env=False) as c:
        for w in workers:
            log = c.get(w.url + "/sim/stats", params={"log": 1}).json().get("requests", [])
            mine = [
                (float(r["ttft_s"]), float(r.get("prefill_s", 0.0)))
                for r in log
                if r.get("finished")
            ]
            runs += mine
            busy.append(sum(p for _, p in mine))
    return runs, busy


def worker_report(workers: Sequence[Server]) -> dict[str, float]:
    """Worker-side TTFT p50/p90/p99, queue wait p99 (TTFT minus the request's own
    prefill: time behind other requests, on the worker) and the busiest worker's
    prefill-busy time over the fleet mean, as the simulator reports them."""
    runs, busy = worker_log(workers)
    ttft = [t for t, _ in runs]
    out = {f"worker_ttft_p{q}": percentile(ttft, q) for q in (50, 90, 99)}
    out["worker_queue_wait_p99"] = percentile([t - p for t, p in runs], 99)
    mean = sum(busy) / len(busy) if busy else 0.0
    out["worker_busy_max_over_mean"] = max(busy) / mean if mean > 0 else 0.0
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
    replicas: int = 1,
    after: Sequence[int | None] | None = None,
) -> ResultRow:
    """One row; times in model seconds (client wall time x ``time_scale``).
    ``extra["routing"]`` holds the router's CPU seconds and, for kvroute, its decision
    and reuse counters (summed over ``replicas`` routers, dealt requests in turn).
    ``after``: closed-loop conversations (``replay``'s)."""
    reset_workers(workers)
    routers: list[Server] = []
    try:
        for _ in range(replicas):
            routers.append(start_router(spec, workers, log_dir, root))
        if spec.kv_events:
            for router in routers:
                wait_precise(router, workers)
            reset_workers(workers)  # the priming flushes are not part of the run
        before = served_counts(workers)
        outcomes, wall = asyncio.run(
            replay(
                [r.url for r in routers],
                requests,
                time_scale=time_scale,
                on_done=on_done,
                after=after,
            )
        )
        counters = router_counters(routers, spec)
        if spec.kv_events:
            for router in routers:
                for m in worker_modes(router).values():  # workers per mode at the end
                    counters[f"mode/{m}"] = counters.get(f"mode/{m}", 0.0) + 1
    finally:
        for router in routers:
            router.stop()
    after = served_counts(workers)
    on_workers = worker_report(workers)
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
            "routing": counters,
            **on_workers,
            "time_scale": s,
            "per_worker": per_worker,
            "router_replicas": replicas,
        },
    )
