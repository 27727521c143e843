"""``kvroute serve --record FILE``: the routed traffic as a Mooncake-format trace.

One JSON line per routed request: ``timestamp`` (ms since the recording started),
``input_length`` (prompt tokens), ``output_length`` (the tokens the request asked for:
``max_tokens``, ``max_completion_tokens`` or SGLang's ``max_new_tokens``; 0 when unset)
and ``hash_ids``: one id per 512-token block of the prompt (the last block may be
partial), each a hash of that block's token IDs chained with the previous block's id,
so two prompts share a leading id exactly when they share that prefix of blocks, as in
the Mooncake trace. Never text, never token IDs. The hashes are keyed with a random salt
drawn when the router starts (not written), so a recorded id cannot be checked against
the hash of a guessed text; ids are comparable within one run of the router.

Off the request path: ``record`` only puts the parsed body (and the token IDs when the
policy already computed them) on a bounded queue, never waits, and counts what it drops
when the queue is full. A background thread tokenizes (its own tokenizer, same
directory), hashes and writes. The file is rotated like a log file: past ``max_bytes``
it becomes ``FILE.1`` (``FILE.1`` becomes ``FILE.2``...), keeping ``max_files`` files
in all, so the recording never holds more than about ``max_bytes * max_files``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.routing.prompts import token_array
from kvroute.routing.tokenization import PromptTokenizer

log = logging.getLogger("kvroute.service.recorder")

BLOCK_TOKENS = 512  # the Mooncake trace's block size
OUTPUT_KEYS = ("max_completion_tokens", "max_tokens")


def hash_ids(tokens: Sequence[int], salt: bytes, block: int = BLOCK_TOKENS) -> list[int]:
    """Chained ids of the prompt's blocks: id_i = H(salt, id_(i-1), block_i tokens)."""
    arr = token_array(tokens)
    out: list[int] = []
    prev = b""
    for start in range(0, len(arr), block):
        digest = hashlib.blake2b(
            prev + arr[start : start + block].tobytes(), digest_size=8, key=salt
        ).digest()
        prev = digest
        out.append(int.from_bytes(digest, "big") >> 1)  # 63 bits: a signed int64 anywhere
    return out


def output_length(kind: str, body: dict[str, Any]) -> int:
    """The output length the request asked for, 0 when it did not say."""
    source = body.get("sampling_params") if kind == "generate" else body
    keys = ("max_new_tokens",) if kind == "generate" else OUTPUT_KEYS
    if isinstance(source, dict):
        for k in keys:
            v = source.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                return v
    return 0


class RotatingWriter:
    """Appends lines to ``path``; rotates past ``max_bytes``, keeping ``max_files``."""

    def __init__(self, path: str, max_bytes: int, max_files: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._f = open(path, "ab")
        self._size = self._f.tell()

    def write(self, line: bytes) -> None:
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._f.write(line)
        self._size += len(line)

    def _rotate(self) -> None:
        self._f.close()
        for i in range(self.max_files - 1, 0, -1):
            src = self.path if i == 1 else f"{self.path}.{i - 1}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i}")
        if self.max_files == 1:
            os.remove(self.path)
        self._f = open(self.path, "ab")
        self._size = 0

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TraceRecorder:
    def __init__(
        self,
        path: str,
        tokenizer_dir: str | None,
        *,
        max_bytes: int = 100 * 2**20,
        max_files: int = 5,
        queue_size: int = 10_000,
    ) -> None:
        self.writer = RotatingWriter(path, max_bytes, max_files)
        self.salt = os.urandom(16)
        self.t0 = time.time()
        self.written = 0
        self.dropped = 0
        self.failed = 0
        self._tokenizer_dir = tokenizer_dir
        self._q: queue.Queue[tuple[float, str, dict[str, Any], Sequence[int]] | None] = queue.Queue(
            queue_size
        )
        self._thread = threading.Thread(target=self._run, name="kvroute-recorder", daemon=True)
        self._thread.start()

    def record(self, kind: str, body: dict[str, Any], tokens: Sequence[int]) -> None:
        """Queue one routed request; never blocks (dropped and counted when full)."""
        try:
            self._q.put_nowait((time.time(), kind, body, tokens))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the thread and close the file."""
        try:
            self._q.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        tokenizer = PromptTokenizer(self._tokenizer_dir)
        loop = asyncio.new_event_loop()
        try:
            while True:
                item = self._q.get()
                if item is None:
                    break
                try:
                    self.writer.write(self._line(loop, tokenizer, *item))
                    self.written += 1
                except Exception as e:  # one bad request must not end the recording
                    self.failed += 1
                    log.warning("--record: request not recorded (%s)", type(e).__name__)
                if self._q.empty():
                    self.writer.flush()
        finally:
            loop.close()
            self.writer.close()

    def _line(
        self,
        loop: asyncio.AbstractEventLoop,
        tokenizer: PromptTokenizer,
        at: float,
        kind: str,
        body: dict[str, Any],
        tokens: Sequence[int],
    ) -> bytes:
        if not tokens:
            tokens = loop.run_until_complete(tokenizer.tokens_for(kind, body))
        row = {
            "timestamp": round((at - self.t0) * 1000),
            "input_length": len(tokens),
            "output_length": output_length(kind, body),
            "hash_ids": hash_ids(tokens, self.salt),
        }
        return orjson.dumps(row) + b"\n"


class RecorderCollector(Collector):
    """``kvroute_record_*``: what ``--record`` wrote, dropped and failed to record."""

    def __init__(self, recorder: TraceRecorder) -> None:
        self.recorder = recorder

    def collect(self) -> Iterator[Metric]:
        r = self.recorder
        yield CounterMetricFamily(
            "kvroute_record_written", "Requests written to the --record trace", value=r.written
        )
        yield CounterMetricFamily(
            "kvroute_record_dropped",
            "Requests not recorded because the --record queue was full (never waited for)",
            value=r.dropped,
        )
        yield CounterMetricFamily(
            "kvroute_record_failed",
            "Requests the --record writer could not tokenize or write",
            value=r.failed,
        )
