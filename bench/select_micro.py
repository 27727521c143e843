"""CPU per call of the routing machinery of one request in bytes mode (no tokenizer), in
a loop: the chat body rendered and widened to token IDs, and ``cache_aware``'s
``select`` on the work model (the index's walk, the predictions, the insert), as
``serve`` builds them, over ``router_overhead.py``'s 64 chat bodies and two idle
workers. Caches stay warm in a loop: inside the router each piece costs about twice as
much (``handler_instructions.py`` measures the whole handler).

Usage:
    .venv/bin/python bench/select_micro.py [--calls 30000]

The kvroute imported is this checkout's (``router_overhead`` puts its ``python/`` first);
to measure another build, run a copy of ``bench/`` placed outside any checkout with that
build's interpreter.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import router_overhead as ro


def per_call(f: Callable[[int], Any], calls: int, repeat: int = 5) -> float:
    """Best of ``repeat`` runs of ``calls`` calls, CPU µs per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for i in range(calls):
            f(i)
        best = min(best, (time.process_time() - t0) / calls)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=30_000)
    args = ap.parse_args()

    import orjson

    from kvroute.config import Settings
    from kvroute.routing.policies import RouteRequest
    from kvroute.service.state import build_state

    a, b = "http://a:1", "http://b:1"
    state = build_state(Settings(worker_urls=[a, b], policy="cache_aware").validate())
    policy, tok = state.policy, state.tokenizer
    bodies = [orjson.loads(ro.request_body(1, i)) for i in range(64)]
    prompts = [tok.encode_text(tok.render_chat(body["messages"], body)) for body in bodies]
    loads = {a: 0, b: 0}
    for i in range(256):  # every prompt routed, its system prompt on both workers
        policy.select(RouteRequest(prompts[i % 64]), loads)

    def tokens(i: int) -> Any:
        body = bodies[i % 64]
        return tok.encode_text(tok.render_chat(body["messages"], body))

    def select(i: int) -> Any:
        return policy.select(RouteRequest(prompts[i % 64]), loads)

    print(f"prompt: {len(prompts[0]):,} token IDs (UTF-8 bytes)")
    for name, f in (("render + widen", tokens), ("cache_aware select", select)):
        print(f"{name}: {per_call(f, args.calls):.2f} µs CPU per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
