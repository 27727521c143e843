"""Quarantine of requests that break workers (queries of death), and first-byte deadlines.

A request that fails twice on two workers in a way tied to the request (the connection
reset or closed while it was in flight: the worker crashed or dropped it) is most likely
the cause, not the workers. Its fingerprint, a hash of its prompt's token IDs (of the
body's bytes when the policy does not tokenize; never the text itself), is kept for
``--quarantine-secs`` and copies of it are refused at once with a 502, so one bad
request cannot walk through the fleet taking a worker down at every retry.

The first-byte deadline bounds how long an attempt waits for a worker's answer to
begin. A worker's real prefill speed is learned elsewhere; until it is known the
deadline is derived from the prompt's size at a deliberately slow rate
(``CONSERVATIVE_PREFILL_TOKENS_PER_S``, slower than a small model on a laptop CPU),
plus a generous floor for queueing inside the engine, and never past
``--first-byte-timeout-secs``. A non-streamed answer starts only when the whole
completion is done, so its deadline adds the requested output tokens at a slow decode
rate (``CONSERVATIVE_DECODE_S_PER_TOKEN``), or is the cap when the output is unbounded.
"""

from __future__ import annotations

import array
import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# Deliberately slow: a deadline is a bound for a hung or lost request, never a guess of
# the latency, so an engine slower than this is unlikely (vLLM on 2 CPU cores with a
# 0.6B model prefills several hundred tokens per second).
CONSERVATIVE_PREFILL_TOKENS_PER_S = 100.0
CONSERVATIVE_DECODE_S_PER_TOKEN = 0.5
# How many fingerprints are kept at most (oldest dropped first).
MAX_QUARANTINED = 4096


def fingerprint(tokens: Sequence[int], body: bytes) -> int:
    """64-bit hash of the prompt's token IDs (of ``body`` when there are none)."""
    if len(tokens):
        kept = isinstance(tokens, array.array | bytes)  # no tokenizer: bytes
        data = bytes(tokens if kept else array.array("I", tokens))
    else:
        data = body
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def first_byte_secs(
    prompt_tokens: int,
    *,
    floor_s: float,
    cap_s: float,
    output_tokens: int | None = None,
    streaming: bool = True,
    prefill_tokens_per_s: float | None = None,
) -> float:
    """How long an attempt may wait for a worker's first byte.

    ``prefill_tokens_per_s``: the worker's learned prefill speed when known (it is then
    still divided by 4: a deadline must not fire on a busy but healthy worker); None
    uses the conservative rate. Non-streamed answers add the output's decode time.
    """
    rate = CONSERVATIVE_PREFILL_TOKENS_PER_S
    if prefill_tokens_per_s is not None and prefill_tokens_per_s > 0:
        rate = min(rate, prefill_tokens_per_s / 4)
    secs = floor_s + prompt_tokens / rate
    if not streaming:
        if output_tokens is None:
            return cap_s
        secs += output_tokens * CONSERVATIVE_DECODE_S_PER_TOKEN
    return min(max(secs, floor_s), cap_s)


def output_tokens(body: dict[str, Any]) -> int | None:
    """The output length a request asks for (OpenAI or SGLang field), if any."""
    params = body.get("sampling_params")
    for src, key in (
        (body, "max_completion_tokens"),
        (body, "max_tokens"),
        (params, "max_new_tokens"),
    ):
        if isinstance(src, dict):
            v = src.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                return v
    return None


class Quarantine:
    """Fingerprints refused until they expire; bounded, oldest dropped first."""

    def __init__(self, ttl_s: float, max_size: int = MAX_QUARANTINED) -> None:
        self.ttl_s = ttl_s
        self.max_size = max_size
        self._until: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def add(self, fp: int) -> None:
        if self.ttl_s <= 0:
            return
        self._until[fp] = time.monotonic() + self.ttl_s
        self._until.move_to_end(fp)
        while len(self._until) > self.max_size:
            self._until.popitem(last=False)

    def holds(self, fp: int) -> bool:
        until = self._until.get(fp)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._until[fp]
            return False
        return True
