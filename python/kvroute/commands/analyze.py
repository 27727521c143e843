"""``kvroute analyze TRACE``: measure before you route.

Reads a Mooncake-format trace (``hash_ids`` per request; ``kvroute serve --record``
writes one), a JSONL of requests with token IDs (``tokens``, ``input_ids`` or
``prompt_token_ids``; optional ``timestamp`` ms and ``output_length``), or a JSONL of
OpenAI request bodies (``messages`` for chat/completions, ``prompt`` for completions),
tokenized as kvroute serve would with ``--tokenizer`` (chat template included; UTF-8
bytes without it), output length from ``max_tokens``. Then it reports:

* prefix sharing: prompt blocks in total and distinct (shared blocks are what a prefix
  cache can reuse at all);
* the hit-rate upper bound (one infinite cache shared by the fleet);
* round_robin and cache_aware on a simulated fleet of ``--workers`` with
  ``--capacity-tokens`` each (``kvroute.sim.fleet``);
* a one-line verdict: is cache-aware routing worth it for this traffic?
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import numpy as np

from kvroute.commands.simulate import add_fleet_args, fleet_config


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "trace",
        metavar="TRACE",
        help="Mooncake-format JSONL (kvroute serve --record), JSONL of token-ID "
        "requests, or JSONL of OpenAI chat/completions request bodies",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|MODEL_ID",
        help="tokenizer for a JSONL of request bodies (the model's, as given to kvroute "
        "serve: a directory or a Hugging Face model ID); without it prompts are UTF-8 bytes",
    )
    p.add_argument(
        "--tokenizer-revision",
        default=None,
        metavar="REV",
        help="with a model ID: as kvroute serve's --tokenizer-revision",
    )
    add_fleet_args(p)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--time-scale", type=float, default=1.0, help="speed up the timestamps")
    p.add_argument("--json", action="store_true")


def load(
    path: str,
    limit: int | None,
    seed: int,
    time_scale: float,
    tokenizer: str | None = None,
    revision: str | None = None,
) -> list[Any]:
    from kvroute.sim import workloads as wl

    rows = wl.read_trace(path, limit)
    if all("hash_ids" in r for r in rows):
        return wl.from_trace_rows(rows, seed=seed, time_scale=time_scale)
    if rows and all(isinstance(r, dict) and ("messages" in r or "prompt" in r) for r in rows):
        if tokenizer is not None:
            from kvroute.routing.tokenizer_files import resolve_tokenizer

            tokenizer = resolve_tokenizer(tokenizer, revision)
        rows = asyncio.run(_tokenize_bodies(rows, tokenizer))
    out = []
    for i, r in enumerate(rows):
        ids = r.get("tokens", r.get("input_ids", r.get("prompt_token_ids")))
        if not isinstance(ids, list):
            raise ValueError(f"line {i + 1}: none of hash_ids, a token list, messages or prompt")
        out.append(
            wl.Request(
                float(r.get("timestamp", 0.0)) / 1000.0 / time_scale,  # type: ignore[arg-type]
                np.asarray(ids, dtype=np.uint32),
                max(int(r.get("output_length", 1)), 1),  # type: ignore[call-overload]
                -1,
            )
        )
    return sorted(out, key=lambda q: q.arrival_s)


async def _tokenize_bodies(
    rows: list[dict[str, Any]], tokenizer_dir: str | None
) -> list[dict[str, Any]]:
    """OpenAI request bodies -> rows with ``tokens`` and ``output_length``."""
    from kvroute.errors import RouterError
    from kvroute.routing.tokenization import PromptTokenizer

    tok = PromptTokenizer(tokenizer_dir)
    out = []
    for i, body in enumerate(rows):
        route = "chat" if "messages" in body else "completions"
        try:
            ids = await tok.tokens_for(route, body)
        except RouterError as e:
            raise ValueError(f"line {i + 1}: {e}") from None
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        out.append(
            {
                "tokens": list(ids),
                "timestamp": body.get("timestamp", 0.0),
                "output_length": limit if isinstance(limit, int) and limit > 0 else 1,
            }
        )
    return out


def verdict(bound: float, rr: float, ca: float, ttft_ratio: float) -> str:
    """Worth it or not, and why, from the simulated hit rates and TTFT ratio."""
    if bound < 0.05:
        return (
            f"not worth it, because almost no prompt prefix repeats: even one infinite "
            f"cache shared by the fleet would serve only {bound:.1%} of prompt tokens"
        )
    gain = ca - rr
    if gain >= 0.10 or (gain >= 0.03 and ttft_ratio <= 0.8):
        return (
            f"worth it, because cache_aware serves {ca:.1%} of prompt tokens from cache "
            f"against {rr:.1%} for round_robin ({gain:+.1%}; TTFT p50 x{ttft_ratio:.2f})"
        )
    if bound - rr >= 0.10:
        return (
            f"marginal at this size, because prefixes repeat (bound {bound:.0%}) but the "
            f"caches are too small or the fleet too large to keep them (cache_aware "
            f"{ca:.1%}, round_robin {rr:.1%}); try more --capacity-tokens"
        )
    return (
        f"not worth it, because round_robin already serves {rr:.1%} of prompt tokens "
        f"from cache, of a {bound:.1%} bound (cache_aware {ca:.1%})"
    )


def run(args: argparse.Namespace) -> int:
    from kvroute.sim.fleet import prepare, simulate, upper_bound
    from kvroute.sim.report import markdown_table, to_json

    try:
        requests = load(
            args.trace,
            args.limit,
            args.seed,
            args.time_scale,
            args.tokenizer,
            args.tokenizer_revision,
        )
        cfg = fleet_config(args)
    except (ValueError, OSError, KeyError) as e:
        print(f"kvroute analyze: error: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("kvroute analyze: error: the trace is empty", file=sys.stderr)
        return 2
    prep = prepare(requests, cfg.block_size)
    total_blocks = sum(len(k) for k in prep.keys)
    distinct = len(set(np.concatenate(prep.keys).tolist())) if total_blocks else 0
    bound = upper_bound(prep)
    rows = [simulate(prep, p, cfg) for p in ("round_robin", "cache_aware")]
    rr, ca = rows
    ratio = ca.ttft_p50 / rr.ttft_p50 if rr.ttft_p50 > 0 else 1.0
    line = verdict(bound, rr.hit_rate, ca.hit_rate, ratio)
    if args.json:
        print(
            to_json(
                rows,
                bound,
                requests=len(requests),
                prompt_tokens=prep.prompt_tokens,
                blocks=total_blocks,
                distinct_blocks=distinct,
                verdict=line,
            )
        )
        return 0
    print(f"{len(requests)} requests, {prep.prompt_tokens:,} prompt tokens")
    share = 1 - distinct / total_blocks if total_blocks else 0.0
    print(
        f"prefix sharing: {total_blocks:,} blocks of {cfg.block_size} tokens, "
        f"{distinct:,} distinct ({share:.1%} repeats)"
    )
    print(f"upper bound (one infinite shared cache): {bound:.1%}")
    print(f"fleet: {cfg.workers} workers x {cfg.capacity_tokens:,} cached tokens each\n")
    print(markdown_table(rows, bound))
    print(f"\nverdict: {line}")
    return 0
