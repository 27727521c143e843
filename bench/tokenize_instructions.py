"""Instructions per chat request of the router's tokenization (callgrind), by encoder:
a count that other jobs on the machine do not disturb, unlike CPU time.

    python bench/tokenize_instructions.py                  # render, segment cache, encode
    python bench/tokenize_instructions.py --encoder-only   # the encoder calls alone

The requests are ``tokenize_micro --ascii``'s (one of 8 system prompts of 1,100 words, a
fresh user message of 380). For each encoder (tiktoken's exact BPE, the native one) the
script runs itself under ``valgrind --tool=callgrind --instr-atstart=no`` twice, with
``--few`` and ``--many`` requests: the child loads the Qwen3 tokenizer, warms the
segment and template caches with 40 requests, and counts instructions only while its
requests run (``callgrind_control -i on``/``off``). The difference of the two counts
over the difference in requests is the count per request, without the toggling's cost.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
from typing import Any

WORDS = (
    "alpha beta gamma delta router cache prefix token worker fleet prompt engine "
    "latency 42 7 the of and to in is for on with as"
).split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder-only", action="store_true")
    p.add_argument("--few", type=int, default=20)
    p.add_argument("--many", type=int, default=100)
    p.add_argument("--child", nargs=2, metavar=("ENCODER", "REQUESTS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.encoder_only)
        return
    what = "encoder call" if args.encoder_only else "request"
    print(f"| encoder | instructions / {what} | ratio |\n|---|---:|---:|")
    counts = {}
    for encoder in ("tiktoken", "native"):
        few, many = (count(encoder, n, args.encoder_only) for n in (args.few, args.many))
        counts[encoder] = (many - few) / (args.many - args.few)
        ratio = counts[encoder] / counts["tiktoken"]
        print(f"| {encoder} | {counts[encoder] / 1e3:,.0f}k | {ratio:.2f}x |")


def count(encoder: str, requests: int, encoder_only: bool) -> int:
    """Instructions callgrind collected in a child run."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={tmp}/out",
            sys.executable,
            __file__,
            "--child",
            encoder,
            str(requests),
            *(["--encoder-only"] if encoder_only else []),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", run.stderr)
    assert found, run.stderr[-2000:]
    return int(found.group(1))


def child(encoder: str, requests: int, encoder_only: bool) -> None:
    from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

    tok = PromptTokenizer(default_tokenizer_dir(), native_bpe=encoder == "native")
    assert tok.encoder == ("native-bpe" if encoder == "native" else "fast-bpe"), tok.encoder
    bpe = tok._bpe
    assert bpe is not None
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    systems = [text(1100) for _ in range(8)]

    def bodies(n: int) -> list[dict[str, Any]]:
        return [
            {
                "messages": [
                    {"role": "system", "content": systems[i % len(systems)]},
                    {"role": "user", "content": text(380)},
                ]
            }
            for i in range(n)
        ]

    async def route(todo: list[dict[str, Any]]) -> None:
        for body in todo:
            await tok.tokens_for("chat", body)

    asyncio.run(route(bodies(40)))
    todo = bodies(requests)
    users = [body["messages"][1]["content"] for body in todo]

    def toggle(state: str) -> None:
        subprocess.run(
            ["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True
        )

    toggle("on")
    if not encoder_only:
        asyncio.run(route(todo))
    elif encoder == "native":
        for user in users:
            bpe.encode_ids(user)
    else:
        for user in users:
            array.array("I", bpe.encode_tiktoken(user))
    toggle("off")


if __name__ == "__main__":
    main()
