"""Routing quality against real vLLM: the same chat requests through each router in
front of vLLM CPU replicas of the tiny model, judged by vLLM's own accounting.

Starts ``--replicas`` replicas (``serve.py``, dev mode so ``POST /reset_prefix_cache``
works, ``--enable-scale-out`` so the vLLM router can render prompts), then for each router
in turn: resets every replica's prefix cache, reads its counters, starts the router in
front of the replicas, replays the workload (streaming ``/v1/chat/completions`` at
Poisson arrival times), stops the router and reads the counters again. Per router:

* hit rate from vLLM's ``/metrics`` (``prefix_cache_hits / prefix_cache_queries``, token
  counts, deltas over the run) and from the answers'
  ``usage.prompt_tokens_details.cached_tokens`` (cached / prompt tokens);
* TTFT p50/p99 as the client sees it (first streamed chunk with a choice);
* requests per replica (``vllm:request_success`` deltas);
* for kvroute, the router's CPU seconds and its predicted vs reported reused tokens.

Precise mode (``kvroute-cache_aware+events``): the replicas publish KV cache events, each
on its own ``ipc://`` socket with a replay endpoint, and kvroute connects to all of them
(``--kv-events URL=ipc://...;replay=tcp://...``); before the timed replay every replica's
prefix cache is reset (vLLM publishes ``AllBlocksCleared``) until the router shows every
replica ``precise``. ``--router-replicas N`` starts N routers of each kind with the same
flags and deals the requests to them in turn (an HA deployment; each router has its own
index and loads; in precise mode all of them read every replica's events).

Cache pressure: ``--kv-blocks B`` gives each replica B KV blocks of ``--block-size``
tokens (default: the whole 1 GiB, ~130k tokens, no eviction); the script prints the
groups' system prompts as a share of the fleet's KV (the llm-d shape: ~73%).

Workload: ``--groups`` system prompts of ~``--system-tokens`` tokens (random words,
counted with the model's tokenizer), each asked ``--per-group`` distinct questions;
groups interleaved at random. kvroute gets ``--tokenizer`` (the model's), so it routes
on the exact token IDs vLLM computes; the peers route on text as they do.

Usage (after the install in docs/real-engine.md and ``make_tiny_model.py``; peers per README):
    .venv/bin/python bench/engine/quality.py --json bench/results/engine_quality.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve

from kvroute.eval.peers import PEERS
from kvroute.eval.procs import Server, free_port
from kvroute.eval.quality import (
    RouterSpec,
    kvroute_spec,
    router_counters,
    start_router,
    wait_precise,
)
from kvroute.sim.report import percentile

ROOT = serve.ROOT
ROUTERS = ("kvroute-round_robin", "kvroute-cache_aware", "sglang", "vllm")
PRECISE = "kvroute-cache_aware+events"  # also accepted in --routers
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "shi", "vo", "pe", "zu", "gra", "tel", "om")


@dataclass(frozen=True)
class ChatRequest:
    arrival_s: float
    group: int
    messages: list[dict[str, str]]


def _words(rng: np.random.Generator, n: int) -> str:
    lens = rng.integers(1, 4, n)
    picks = rng.integers(0, len(SYLLABLES), int(lens.sum()))
    out, i = [], 0
    for k in lens.tolist():
        out.append("".join(SYLLABLES[j] for j in picks[i : i + k].tolist()))
        i += k
    return " ".join(out)


def _text_of_tokens(rng: np.random.Generator, count: Any, n_tokens: int) -> str:
    """Random words, grown until the tokenizer counts at least ``n_tokens``."""
    text = ""
    while count(text) < n_tokens:
        text += (" " if text else "") + _words(rng, 64)
    return text


def workload(
    groups: int, per_group: int, system_tokens: int, question_tokens: int, rate: float, seed: int
) -> list[ChatRequest]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(serve.MODEL / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    rng = np.random.default_rng([seed, 11])
    systems = [f"Group {g}. " + _text_of_tokens(rng, count, system_tokens) for g in range(groups)]
    order = np.repeat(np.arange(groups), per_group)
    rng.shuffle(order)
    gaps = rng.exponential(1.0 / rate, len(order))
    times = np.cumsum(gaps) - gaps[0]
    out = []
    for i, (g, t) in enumerate(zip(order.tolist(), times.tolist(), strict=True)):
        question = f"Question {i}: " + _text_of_tokens(rng, count, question_tokens)
        msgs = [{"role": "system", "content": systems[g]}, {"role": "user", "content": question}]
        out.append(ChatRequest(t, g, msgs))
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def counters(url: str) -> dict[str, float]:
    """Prefix-cache queries/hits and finished requests from a replica's /metrics."""
    want = {
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:request_success_total": "requests",
    }
    out = dict.fromkeys(want.values(), 0.0)
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in want:
            out[want[m.group(1)]] += float(m.group(2))
    return out


async def _one(client: httpx.AsyncClient, url: str, req: ChatRequest, out_len: int) -> dict:  # type: ignore[type-arg]
    body = {
        "model": "tiny",
        "messages": req.messages,
        "max_tokens": out_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"status": resp.status_code, "error": (await resp.aread())[:200].decode()}
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        return {"status": 0, "error": f"{type(e).__name__}: {e}"}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "status": 200,
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


async def replay(url: str | list[str], requests: list[ChatRequest], out_len: int) -> list[dict]:  # type: ignore[type-arg]
    """Each request at its arrival time; several URLs (router replicas): request ``i`` to
    ``url[i % len(url)]``."""
    urls = [url] if isinstance(url, str) else url
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(600, connect=10)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as c:
        t0 = time.perf_counter()

        async def at(i: int, req: ChatRequest) -> dict:  # type: ignore[type-arg]
            await asyncio.sleep(max(req.arrival_s - (time.perf_counter() - t0), 0))
            return await _one(c, urls[i % len(urls)], req, out_len)

        return list(await asyncio.gather(*(at(i, r) for i, r in enumerate(requests))))


def spec_for(name: str) -> RouterSpec:
    if name.startswith("kvroute-"):
        return kvroute_spec(name.removeprefix("kvroute-"), ("--tokenizer", str(serve.MODEL)))
    return RouterSpec(f"{PEERS[name].name} cache_aware", name, "cache_aware")


def reset_cache(client: httpx.Client, replica: Server) -> None:
    """Reset a replica's prefix cache. vLLM publishes the ``AllBlocksCleared`` event with
    its next engine step, so the replica then runs one request of a prompt shorter than a
    block (it stores nothing)."""
    client.post(replica.url + "/reset_prefix_cache").raise_for_status()
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    client.post(replica.url + "/v1/completions", json=body).raise_for_status()


def run_router(
    name: str,
    replicas: list[Server],
    requests: list[ChatRequest],
    out_len: int,
    logs: str,
    *,
    router_replicas: int = 1,
) -> dict[str, Any]:
    """One router (or ``router_replicas`` of it) over the whole workload, from cold
    caches; vLLM's counters judge it."""
    spec = spec_for(name)
    routers: list[Server] = []
    try:
        for _ in range(router_replicas):
            routers.append(start_router(spec, replicas, logs, ROOT))
        for router in routers if spec.kv_events else ():
            wait_precise(router, replicas, timeout_s=60, flush=reset_cache)
        with httpx.Client(timeout=60, trust_env=False) as c:
            for r in replicas:  # cold caches for the run
                reset_cache(c, r)
        before = [counters(r.url) for r in replicas]
        outcomes = asyncio.run(replay([r.url for r in routers], requests, out_len))
        routing = router_counters(routers, spec)
    finally:
        for router in routers:
            router.stop()
    after = [counters(r.url) for r in replicas]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in before[0]}
    ok = [o for o in outcomes if o["status"] == 200]
    ttft = [o["ttft"] for o in ok]
    prompt = sum(o["prompt_tokens"] for o in ok)
    return {
        "name": spec.name,
        "requests": len(ok),
        "errors": [o["error"] for o in outcomes if o["status"] != 200][:3],
        "failed": len(outcomes) - len(ok),
        "hit_rate_metrics": delta["hits"] / delta["queries"] if delta["queries"] else 0.0,
        "hit_rate_usage": sum(o["cached_tokens"] for o in ok) / prompt if prompt else 0.0,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "per_replica": [
            int(a["requests"] - b["requests"]) for a, b in zip(after, before, strict=True)
        ],
        "prompt_tokens": prompt,
        "router_replicas": router_replicas,
        "routing": routing,
        "ttft": [round(t, 4) for t in ttft],
    }


def start_replicas(
    n: int,
    block_size: int,
    logs: str,
    *,
    kv_blocks: int | None = None,
    max_model_len: int = 4096,
    events: bool = False,
) -> list[Server]:
    """``kv_blocks`` None: the whole 1 GiB, ~130k tokens of the tiny model, no eviction.
    ``events``: each replica publishes KV events on its own socket, with a replay
    endpoint; ``Server.extra["kv_events"]`` is kvroute's ``--kv-events`` for it."""
    opts = serve.ReplicaOptions(
        block_size=block_size,
        num_gpu_blocks=kv_blocks,
        max_model_len=max_model_len,
        extra_args=["--enable-scale-out"],
    )
    ncpu = os.cpu_count() or 1
    replicas: list[Server] = []
    try:
        for i in range(n):
            port = free_port()
            endpoint = replay_at = None
            if events:
                endpoint = f"ipc://{logs}/events-{i}.sock"
                replay_at = f"tcp://127.0.0.1:{free_port()}"
            replicas.append(
                serve.start_replica(
                    port,
                    i % ncpu,
                    events_endpoint=endpoint,
                    replay_endpoint=replay_at,
                    options=opts,
                    scratch=f"{logs}/r{i}",
                )
            )
            if events:
                spec = f"{replicas[-1].url}={endpoint};replay={replay_at}"
                replicas[-1].extra["kv_events"] = spec
        # One short request each, so no router pays for a replica's first forward pass.
        warm = ChatRequest(0.0, -1, [{"role": "user", "content": "warm up"}])
        for r in replicas:
            out = asyncio.run(replay(r.url, [warm], 2))[0]
            if out["status"] != 200:
                raise RuntimeError(f"{r.url} failed a warm-up request: {out}")
    except BaseException:
        for r in replicas:
            r.stop()
        raise
    return replicas


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| router/policy | hit rate (vLLM /metrics) | hit rate (cached_tokens) "
        "| TTFT p50 / p90 / p99 (s) | requests per replica | errors "
        "| predicted / reported reuse (tokens) | router CPU (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rt = r.get("routing", {})
        pred = sum(v for k, v in rt.items() if k.startswith("predicted/"))
        got = sum(v for k, v in rt.items() if k.startswith("reported/"))
        reuse = f"{pred:,.0f} / {got:,.0f}" if got else ""
        cpu = f"{rt['router_cpu_s']:.1f}" if "router_cpu_s" in rt else ""
        lines.append(
            f"| {r['name']} | {r['hit_rate_metrics']:.1%} | {r['hit_rate_usage']:.1%} "
            f"| {r['ttft_p50']:.3f} / {r.get('ttft_p90', float('nan')):.3f} / "
            f"{r['ttft_p99']:.3f} | {'/'.join(map(str, r['per_replica']))} "
            f"| {r.get('failed', '')} "
            f"| {reuse} | {cpu} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help=f"from: {', '.join((*ROUTERS, PRECISE))} (the last: kvroute in precise mode)",
    )
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (default: the whole 1 GiB, no eviction)",
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        help="routers of each kind, dealt requests in turn",
    )
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    args = ap.parse_args(argv)
    missing = serve.engine_available()
    if missing:
        sys.exit(missing)
    names = [n for n in args.routers.split(",") if n]
    for n in names:
        if n not in (*ROUTERS, PRECISE):
            sys.exit(f"unknown router {n!r}; from: {', '.join((*ROUTERS, PRECISE))}")
        if not n.startswith("kvroute-") and not PEERS[n].installed(ROOT):
            sys.exit(f"{n} not installed: {PEERS[n].install_hint()}")
    requests = workload(
        args.groups,
        args.per_group,
        args.system_tokens,
        args.question_tokens,
        args.rate,
        args.seed,
    )
    if args.kv_blocks is not None:
        system = args.groups * args.system_tokens
        fleet = args.kv_blocks * args.block_size * args.replicas
        print(
            f"system prompts: ~{system:,} tokens, {system / fleet:.0%} of the fleet's KV "
            f"({args.replicas} x {args.kv_blocks} blocks x {args.block_size} tokens)",
            file=sys.stderr,
        )
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-engine-") as logs:
        replicas = start_replicas(
            args.replicas,
            args.block_size,
            logs,
            kv_blocks=args.kv_blocks,
            max_model_len=args.max_model_len,
            events=PRECISE in names,
        )
        try:
            for name in names:
                rows.append(
                    run_router(
                        name,
                        replicas,
                        requests,
                        args.output_tokens,
                        logs,
                        router_replicas=args.router_replicas,
                    )
                )
                print(f"done: {rows[-1]['name']}", file=sys.stderr, flush=True)
        finally:
            for r in replicas:
                r.stop()
    print(table(rows))
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
