"""In-process CPU cost of the router's tokenization per chat request, by encoder.

Chat requests like the overhead bench's (one of 8 long system prompts, then a fresh user
message) go through ``PromptTokenizer`` with the shipped Qwen3 tokenizer, once with the
``tokenizers`` encoder, once with tiktoken's exact BPE (``kvroute.routing.bpe`` with the
native encoder off), once with that and the cache of rendered chat templates
(``kvroute.routing.template_cache``), and once with the native exact BPE
(``kvroute.routing.native_bpe``) and the template cache (the default), interleaved round
by round so machine noise hits all alike. CPU time (``time.process_time``) per request;
the first round warms the caches and is not counted. The chat template is rendered as
``serve`` renders it (sandboxed, in its thread pool), in full in the first two variants.

    python bench/tokenize_micro.py --requests 200 --rounds 5
    python bench/tokenize_micro.py --requests 200 --rounds 5 --turns 4   # histories
    python bench/tokenize_micro.py --requests 200 --rounds 5 --ascii    # ASCII words only
    python bench/tokenize_micro.py --offload   # the thread hop against encoding inline
    python bench/tokenize_micro.py --encoders --ascii   # the encoder calls alone

``--encoders`` measures the encoder calls alone on the user messages (no template, no
segment cache): ``tokenizers``, tiktoken's BPE and the native one, per message.

A second table compares routing the same requests with ``cache_aware --load-metric
requests`` (two workers, idle) on the whole prompt and with decide first
(``kvroute.routing.decide_first``): CPU from the body to the decision (what delays the
forward at one connection), and in all (the rest encoded and inserted after the
decision), in the same interleaved rounds.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvroute._native import PrefixIndex
from kvroute.routing.decide_first import decide_on
from kvroute.routing.policies import create_policy
from kvroute.routing.policies.base import RouteRequest
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

WORDS = (
    "alpha beta gamma delta router cache prefix token worker fleet prompt engine "
    "latency 42 7 résumé 東京 🙂 the of and to in is for on with as"
).split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--system-words", type=int, default=1100)
    p.add_argument("--user-words", type=int, default=380)
    p.add_argument(
        "--turns", type=int, default=0, help="earlier user/assistant turns before the new message"
    )
    p.add_argument(
        "--ascii",
        action="store_true",
        help="ASCII words only (as bench/router_overhead.py's prompts), no accents, CJK or emoji",
    )
    p.add_argument(
        "--encoders",
        action="store_true",
        help="measure the encoder calls alone on the user messages, and exit",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="measure what a thread hop costs against encoding on the loop, and exit",
    )
    args = p.parse_args()
    rng = random.Random(0)
    if args.offload:
        offload_costs(rng)
        return

    words = [w for w in WORDS if w.isascii()] if args.ascii else WORDS

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    systems = [text(args.system_words) for _ in range(8)]
    qwen = default_tokenizer_dir()
    variants = {
        "tokenizers": PromptTokenizer(qwen, fast_bpe=False, template_cache=False),
        "tiktoken BPE": PromptTokenizer(qwen, template_cache=False, native_bpe=False),
        "tiktoken BPE + template cache": PromptTokenizer(qwen, native_bpe=False),
        "native BPE + template cache": PromptTokenizer(qwen),
    }
    if args.encoders:
        encoder_costs(variants["native BPE + template cache"], text, args)
        return
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    loads = {"w0": 0, "w1": 0}

    def router() -> tuple[PromptTokenizer, object]:
        policy = create_policy("cache_aware", PrefixIndex(None), load_metric="requests")
        for w in loads:
            policy.on_worker_added(w)
        return PromptTokenizer(qwen), policy

    routes = {"whole prompt": router(), "decide first": router()}
    decided: dict[str, list[float]] = {k: [] for k in routes}
    total: dict[str, list[float]] = {k: [] for k in routes}
    n_early = 0

    async def route(name: str, body: dict[str, object]) -> tuple[float, float]:
        nonlocal n_early
        tok, policy = routes[name]
        clock = time.process_time
        t0 = clock()
        if name == "whole prompt":
            policy.select(RouteRequest(await tok.tokens_for("chat", body)), loads)  # type: ignore[attr-defined]
            t = clock() - t0
            return t, t
        prompt = await tok.partial("chat", body)
        start = None if prompt.complete else decide_on(tok, prompt, policy, loads)
        if start is not None:
            n_early += 1
            prompt = start[0]
            d = policy.select(RouteRequest(start[1]), loads)  # type: ignore[attr-defined]
            t = clock() - t0
            policy.index.insert(d.worker, tok.finish(prompt))  # type: ignore[attr-defined]
            return t, clock() - t0
        policy.select(RouteRequest(tok.finish(prompt)), loads)  # type: ignore[attr-defined]
        t = clock() - t0
        return t, t

    async def run() -> None:
        for _ in range(args.rounds):
            bodies = []
            for i in range(args.requests):
                history = []
                for _ in range(args.turns):
                    history += [
                        {"role": "user", "content": text(40)},
                        {"role": "assistant", "content": text(60)},
                    ]
                messages = [
                    {"role": "system", "content": systems[i % len(systems)]},
                    *history,
                    {"role": "user", "content": text(args.user_words)},
                ]
                bodies.append({"messages": messages})
            for name, tok in variants.items():
                t0 = time.process_time()
                for body in bodies:
                    await tok.tokens_for("chat", body)
                cpu[name].append((time.process_time() - t0) / len(bodies) * 1e6)
            for name in routes:
                times = [await route(name, body) for body in bodies]
                decided[name].append(sum(t for t, _ in times) / len(times) * 1e6)
                total[name].append(sum(t for _, t in times) / len(times) * 1e6)

    asyncio.run(run())
    base = statistics.median(cpu["tokenizers"][1:])
    print("| encoder | CPU µs / request (median of rounds after the first) | ratio |")
    print("|---|---:|---:|")
    for name, values in cpu.items():
        med = statistics.median(values[1:])
        print(f"| {name} ({variants[name].encoder}) | {med:.0f} | {med / base:.2f}x |")
    cached = variants["native BPE + template cache"].template_stats()
    print(f"\ntemplate cache: {cached['hits']} hits, {cached['misses']} misses\n")
    print("| route | CPU µs to the decision | ratio | CPU µs in all | ratio |")
    print("|---|---:|---:|---:|---:|")
    d0 = statistics.median(decided["whole prompt"][1:])
    a0 = statistics.median(total["whole prompt"][1:])
    for name in routes:
        d = statistics.median(decided[name][1:])
        a = statistics.median(total[name][1:])
        print(f"| {name} | {d:.0f} | {d / d0:.2f}x | {a:.0f} | {a / a0:.2f}x |")
    print(f"\ndecided early: {n_early} of {args.requests * args.rounds} requests")


def encoder_costs(tok: PromptTokenizer, text: Callable[[int], str], args: Any) -> None:
    """CPU per user message of each encoder alone, interleaved round by round."""
    bpe = tok._bpe
    assert bpe is not None and bpe.native is not None, "the native BPE is needed"
    fast = tok._fast
    encoders: dict[str, Callable[[str], object]] = {
        "tokenizers": lambda t: array.array(
            "I", fast.encode_batch([t], add_special_tokens=False)[0].ids
        ),
        "tiktoken BPE": lambda t: array.array("I", bpe.encode_tiktoken(t)),
        "native BPE": bpe.encode_ids,
    }
    cpu: dict[str, list[float]] = {k: [] for k in encoders}
    n_tokens = n_chars = 0
    for _ in range(args.rounds):
        texts = [text(args.user_words) for _ in range(args.requests)]
        n_chars += sum(map(len, texts))
        n_tokens += sum(len(bpe.encode_ids(t)) for t in texts)
        for name, encode in encoders.items():
            t0 = time.process_time()
            for t in texts:
                encode(t)
            cpu[name].append((time.process_time() - t0) / len(texts) * 1e6)
    n = args.rounds * args.requests
    print(f"{n_chars / n:.0f} characters, {n_tokens / n:.0f} tokens per message\n")
    print("| encoder | CPU µs / message (median of rounds after the first) | ratio |")
    print("|---|---:|---:|")
    base = statistics.median(cpu["tokenizers"][1:])
    for name, values in cpu.items():
        med = statistics.median(values[1:])
        print(f"| {name} | {med:.1f} | {med / base:.3f}x |")


def offload_costs(rng: random.Random) -> None:
    """CPU of an ``asyncio.to_thread`` hop (uvloop, a function that does nothing) and
    of encoding 8,192 characters of several kinds of text with the fast BPE (what
    ``kvroute.routing.tokenization.OFFLOAD_COST`` weighs)."""
    import uvloop

    CJK = "中文测试你好世界日本語のテキスト한국어，。"
    bpe = PromptTokenizer(default_tokenizer_dir())._bpe
    assert bpe is not None, "the fast BPE is needed"
    kinds = {
        "ASCII prose": lambda: " ".join(
            f"{rng.choice(WORDS[:12])}{rng.randrange(100)}" for _ in range(1100)
        ),
        "indented code": lambda: "\n".join(
            "    " * rng.randrange(4) + f"x = f(a, b)  # {rng.choice(WORDS[:12])}"
            for _ in range(300)
        ),
        "CJK": lambda: "".join(rng.choice(CJK) for _ in range(8192)),
        "emoji and Latin": lambda: "".join(rng.choice("😀👍🏽🇫🇷 aé") for _ in range(8192)),
    }
    print("| text | ns / character | 2,048 characters µs | 6,144 characters µs |")
    print("|---|---:|---:|---:|")
    for name, make in kinds.items():
        texts = [make()[:8192] for _ in range(30)]
        t0 = time.process_time()
        for t in texts:
            bpe.encode_ids(t)
        per = (time.process_time() - t0) / sum(map(len, texts))
        print(f"| {name} | {per * 1e9:.0f} | {per * 2048e6:.0f} | {per * 6144e6:.0f} |")

    async def hops() -> float:
        def nothing() -> None:
            return None

        for _ in range(200):
            await asyncio.to_thread(nothing)
        t0 = time.process_time()
        for _ in range(3000):
            await asyncio.to_thread(nothing)
        return (time.process_time() - t0) / 3000

    print(f"\nthread hop (asyncio.to_thread under uvloop): {uvloop.run(hops()) * 1e6:.0f} µs CPU")


if __name__ == "__main__":
    main()
