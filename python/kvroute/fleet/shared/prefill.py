"""The routers' queued prefill, shared through the store (``--state-store``).

Why: the work model (``kvroute.routing.load``) predicts a request's time to first token
from the prefill queued on each worker. A router knows only the prefill *it* queued; the
others' in-flight counts (heartbeats) do not say which of their requests still wait for
a first byte nor how long their prompts are, and with long answers most of them are
decoding. Counting each as a queued prefill of average size makes a busy worker look
far worse than it is; ignoring them makes it look idle. Measured with three replicas on
the llm-d shape (``bench/sim_shared_state.py``), either way loses TTFT against one router.

What is shared: for each worker, how many of this router's requests wait for their first
byte there and their predicted uncached tokens, as absolute values. The load model calls
``changed`` whenever one of its reservations opens or closes (``LoadModel.on_pending``);
the worker is marked dirty and the store's publish task sends the current values of the
dirty workers with its next stream entry (``pack``), so a burst of changes costs one
record per worker. Absolute values rather than deltas: a lost or repeated entry cannot
make the sums drift, and after a reconnect the publisher simply resends everything.

Every router keeps the others' last values per (router, worker) and their sums
(``pending``, ``tokens``), which the load model reads (``peer_pending``,
``peer_prefill``). A router whose heartbeat expired is dropped (``keep``); with Redis
gone, everything is forgotten (``clear``) and each router predicts on its own queue.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection, Iterator

from kvroute.routing.load import LoadModel

_REC = struct.Struct("<HII")  # worker URL length, requests waiting, uncached tokens


def pack(values: list[tuple[str, int, int]]) -> bytes:
    parts: list[bytes] = []
    for url, n, tokens in values:
        raw = url.encode()
        parts += (_REC.pack(len(raw), max(0, n), max(0, min(tokens, 0xFFFFFFFF))), raw)
    return b"".join(parts)


def unpack(blob: bytes) -> Iterator[tuple[str, int, int]]:
    """The records of ``pack``; raises ValueError on a truncated blob."""
    view = memoryview(blob)
    at, end = 0, len(blob)
    while at < end:
        if at + _REC.size > end:
            raise ValueError("truncated prefill record")
        n_url, n, tokens = _REC.unpack_from(view, at)
        at += _REC.size
        if at + n_url > end:
            raise ValueError("truncated prefill record")
        yield bytes(view[at : at + n_url]).decode(errors="replace"), n, tokens
        at += n_url


class SharedPrefill:
    """This router's queued prefill to publish, and the other routers' to predict on."""

    def __init__(self, model: LoadModel, wake: Callable[[], None]) -> None:
        self.model = model
        self.pending: dict[str, int] = {}  # worker -> the others' requests waiting, summed
        self.tokens: dict[str, int] = {}  # worker -> their uncached tokens, summed
        self._heard: dict[bytes, dict[str, tuple[int, int]]] = {}
        self._dirty: set[str] = set()
        self._wake = wake
        model.peer_pending = self.pending
        model.peer_prefill = self.tokens
        model.on_pending = self.changed

    # ----------------------------------------------------------- publishing

    def changed(self, worker: str, _requests: int = 0, _tokens: int = 0) -> None:
        """A reservation on ``worker`` opened or closed (request path: O(1))."""
        if not self._dirty:
            self._wake()
        self._dirty.add(worker)

    @property
    def dirty(self) -> bool:
        return bool(self._dirty)

    def resend_all(self) -> None:
        """After (re)connecting: the peers may have missed changes, send every value."""
        self._dirty.update(self.model.workers)

    def take(self) -> bytes:
        """The current values of the workers changed since the last call, packed."""
        values = []
        for url in self._dirty:
            st = self.model.workers.get(url)
            values.append((url, len(st.pending), st.prefill_tokens) if st else (url, 0, 0))
        self._dirty.clear()
        return pack(values)

    # ----------------------------------------------------------- applying

    def apply(self, router: bytes, blob: bytes) -> None:
        """Another router's values (raises ValueError on a malformed blob)."""
        heard = self._heard.setdefault(router, {})
        for url, n, tokens in unpack(blob):
            was_n, was_t = heard.get(url, (0, 0))
            heard[url] = (n, tokens)
            self._add(url, n - was_n, tokens - was_t)

    def keep(self, live: Collection[bytes]) -> None:
        """Forget the routers not in ``live`` (their heartbeat expired)."""
        for router in [r for r in self._heard if r not in live]:
            for url, (n, tokens) in self._heard.pop(router).items():
                self._add(url, -n, -tokens)

    def clear(self) -> None:
        self._heard.clear()
        self.pending.clear()
        self.tokens.clear()

    def _add(self, url: str, n: int, tokens: int) -> None:
        self.pending[url] = self.pending.get(url, 0) + n
        self.tokens[url] = self.tokens.get(url, 0) + tokens
        if not self.pending[url] and not self.tokens[url]:
            del self.pending[url], self.tokens[url]
