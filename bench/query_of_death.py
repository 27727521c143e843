"""Query of death side by side: a poisoned request, then normal ones, through kvroute and
SGLang's router in front of the same kind of fleet (three ``kvroute sim-worker``
processes with ``--poison-marker``, fresh for each router).

    python bench/query_of_death.py [--action crash|drop] [--normal 20] [--routers kvroute sglang]

For each router: the poison's status, the statuses of the normal requests that follow,
how many workers are still alive after the poison and at the end (after a copy of the
poison is sent too), and (kvroute) what ``/workers`` says. The peer must be
installed under ``.peers/`` (``kvroute.eval.peers``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from kvroute.eval.peers import SGLANG, start_peer
from kvroute.eval.procs import Server, free_port, kvroute_argv, running, start_server

ROOT = Path(__file__).resolve().parent.parent
MARKER = "POISON-7f3a"


def sim_worker(log_dir: str, action: str) -> Server:
    port = free_port()
    argv = kvroute_argv(
        "sim-worker", "--port", str(port), "--time-scale", "50",
        "--poison-marker", MARKER, "--poison-action", action,
    )  # fmt: skip
    return start_server(f"sim-{port}", argv, port, log_dir=log_dir)


def kvroute_router(workers: list[str], log_dir: str) -> Server:
    port = free_port()
    argv = kvroute_argv("serve", "--port", str(port), "--worker-urls", *workers)
    return start_server(f"kvroute-{port}", argv, port, log_dir=log_dir)


def post(client: httpx.Client, url: str, prompt: str) -> str:
    try:
        body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
        return str(client.post(url + "/v1/completions", json=body).status_code)
    except httpx.HTTPError as e:
        return type(e).__name__


def probe(router_name: str, action: str, normal: int, log_dir: str) -> dict[str, object]:
    with running([]) as servers:
        workers = [sim_worker(log_dir, action) for _ in range(3)]
        servers.extend(workers)
        urls = [w.url for w in workers]
        if router_name == "kvroute":
            router = kvroute_router(urls, log_dir)
        else:
            router = start_peer(SGLANG, ROOT, urls, log_dir=log_dir)
        servers.append(router)
        with httpx.Client(timeout=60, trust_env=False) as c:
            t = time.monotonic()
            poison = post(c, router.url, f"bad input {MARKER}")
            poison_s = time.monotonic() - t
            time.sleep(0.5)  # let a crashed worker's exit be seen
            alive_after_poison = sum(w.alive() for w in workers)
            statuses = [post(c, router.url, f"normal question {i}") for i in range(normal)]
            copy = post(c, router.url, f"bad input {MARKER}")
            row: dict[str, object] = {
                "router": router_name,
                "action": action,
                "poison": poison,
                "poison_secs": round(poison_s, 2),
                "workers_alive_after_poison": alive_after_poison,
                "normal": dict(Counter(statuses)),
                "poison_copy": copy,
                "workers_alive_at_end": sum(w.alive() for w in workers),
            }
            if router_name == "kvroute":
                state = c.get(router.url + "/workers").json()
                row["workers_healthy"] = sum(1 for w in state if w["healthy"])
        return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--action", choices=("crash", "drop"), nargs="+", default=["crash", "drop"])
    p.add_argument("--normal", type=int, default=20)
    p.add_argument("--routers", nargs="+", default=["kvroute", "sglang"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        for action in args.action:
            for name in args.routers:
                print(json.dumps(probe(name, action, args.normal, log_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
