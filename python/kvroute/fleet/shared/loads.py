"""The routers' load per worker, shared through the store as it changes (``--state-store``).

Why: the work model (``kvroute.routing.load``) predicts a request's time to first token
from the prefill queued on each worker, and the balance rule and the saturation guard
count requests in flight. A router knows its own exactly. Heartbeats give the others'
in-flight counts every 0.5 s, late: a request that ended since still counts (the guard
then moves requests off their cache for nothing), and they do not say which requests
still wait for a first byte nor how long their prompts are (with long answers most are
decoding; counting each as a queued prefill of average size makes a busy worker look
far worse than it is, ignoring them makes it look idle). Measured with three replicas on
the llm-d shape (``bench/sim_shared_state.py``), both cost TTFT and hit rate against one
router.

What is shared: for each worker, this router's requests in flight there, how many of
them wait for their first byte, and their predicted uncached tokens, as absolute
values. The load model calls ``changed`` whenever one of its requests is reserved, has
its first byte or ends (``LoadModel.on_change``); the worker is marked dirty and the
store's publish task sends the current values of the dirty workers with its next stream
entry (``pack``), so a burst of changes costs one record per worker, and a decision and
its reservation usually ride in one entry. Absolute values rather than deltas: a lost or
repeated entry cannot make the sums drift, and after a reconnect the publisher resends
everything (``resend_all``).

When the others' waiting requests on a worker go from none to some, or one of them
has its first byte and more wait, one of theirs begins its prefill about then
(``LoadModel.peer_queue_moved``, on the receiver's clock): the queue ahead counts what is
left of it, as of a router's own head. Counted whole, a prefill another replica had
started a moment before made its worker (the prefix's cache holder, when that replica
had just routed the prefix's first request) look a whole prefill busier than it was,
and the guard moved the next request of the prefix off its cache: two to nine
``overflow`` decisions per HTTP run of three replicas where one router made none
(``bench/http_shared_state.py``, 480 requests).

Every router keeps the others' last values per (router, worker) and their sums
(``flight``: the store's ``peer_load``; ``pending``, ``tokens``: the load model's
``peer_pending``, ``peer_prefill``). A router whose heartbeat expired is dropped
(``keep``); with Redis gone, everything is forgotten (``clear``) and each router
balances and predicts on its own.

With each changed worker's values go its decoding requests' expected ends (``pack_ends``:
the soonest ``ENDS_SHARED``, in seconds from the write; read on the receiver's clock when
they arrive, so no clocks need agree, and the store's delay makes them that much late).
A worker at its capacity frees a slot when the first of its running requests ends: a
router that knew its own requests' ends but only counted the others' (an even share of
a mean decode each) priced full workers differently from one router that knows them
all, and three replicas moved requests off their cache holders where one router did not
(``bench/sim_shared_state.py``, llm-d: 2.5-7 points of hit rate below one router over
five seeds at 2 ms; with the ends shared within 1 point but one). The receiver keeps each
router's last list per worker and their merge (``ends``: the load model's
``peer_ends``).
"""

from __future__ import annotations

import array
import math
import struct
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from heapq import merge

from kvroute.fleet.shared.wire import encoded, records
from kvroute.routing.load import ENDS_SHARED, LoadModel

_REC = struct.Struct("<HIII")  # URL length, in flight, waiting for a first byte, tokens
_MAX = 0xFFFFFFFF
_ENDS = struct.Struct("<HH")  # URL length, ends (each a little-endian float32) that follow
_BIG_ENDIAN = sys.byteorder == "big"


def pack(values: list[tuple[str, int, int, int]]) -> bytes:
    parts: list[bytes] = []
    for url, flight, n, tokens in values:
        raw = encoded(url)
        parts += (_REC.pack(len(raw), _clamp(flight), _clamp(n), _clamp(tokens)), raw)
    return b"".join(parts)


def _clamp(v: int) -> int:
    return v if 0 <= v <= _MAX else min(max(0, v), _MAX)


def unpack(blob: bytes) -> Iterator[tuple[str, int, int, int]]:
    """The records of ``pack``; raises ValueError on a truncated blob."""
    for (_, flight, n, tokens), url, _ in records(blob, _REC, lambda f: 0, "load record"):
        yield bytes(url).decode(errors="replace"), flight, n, tokens


def pack_ends(values: Iterable[tuple[str, Sequence[float]]]) -> bytes:
    """Per worker URL, its ends in seconds from now (at most ``ENDS_SHARED`` kept)."""
    return b"".join(_ends_record(encoded(url), ends) for url, ends in values)


def _ends_record(raw: bytes, ends: Sequence[float]) -> bytes:
    if len(ends) > ENDS_SHARED:
        ends = ends[:ENDS_SHARED]
    times = array.array("f", ends)
    if _BIG_ENDIAN:
        times.byteswap()
    return _ENDS.pack(len(raw), len(times)) + raw + times.tobytes()


def unpack_ends(blob: bytes) -> Iterator[tuple[str, list[float]]]:
    """The records of ``pack_ends`` (at most ``ENDS_SHARED`` ends each, finite ones
    only, sorted); raises ValueError on a truncated blob."""
    for _, url, body in records(blob, _ENDS, lambda f: 4 * f[1], "ends record"):
        times = array.array("f")
        times.frombytes(body)
        if _BIG_ENDIAN:
            times.byteswap()
        yield (
            bytes(url).decode(errors="replace"),
            sorted(e for e in times[:ENDS_SHARED] if math.isfinite(e)),
        )


class SharedLoad:
    """This router's load to publish, and the other routers' to balance and predict on.

    ``flight`` may be given (the store's ``peer_load``, which other holders reference);
    it is updated in place."""

    def __init__(
        self, model: LoadModel, wake: Callable[[], None], flight: dict[str, int] | None = None
    ) -> None:
        self.model = model
        self.flight: dict[str, int] = {} if flight is None else flight
        self.pending: dict[str, int] = {}  # worker -> the others' requests waiting, summed
        self.tokens: dict[str, int] = {}  # worker -> their uncached tokens, summed
        self._heard: dict[bytes, dict[str, tuple[int, int, int]]] = {}
        self._from_beat: set[bytes] = set()  # routers known only from their heartbeat
        # worker -> the others' decoding requests' ends (model clock), merged; and each
        # router's last list per worker.
        self.ends: dict[str, list[tuple[float]]] = {}
        self._heard_ends: dict[bytes, dict[str, list[tuple[float]]]] = {}
        self._ends_sent: set[str] = set()  # workers whose last published ends were some
        self._dirty: set[str] = set()
        self._wake = wake
        model.peer = self.flight
        model.peer_pending = self.pending
        model.peer_prefill = self.tokens
        model.peer_ends = self.ends
        model.on_change = self.changed

    # ----------------------------------------------------------- publishing

    def changed(self, worker: str) -> None:
        """A request on ``worker`` was reserved, had its first byte or ended (O(1)); the
        publisher hears of every change (one old enough to go out may be waiting)."""
        self._dirty.add(worker)
        self._wake()

    @property
    def dirty(self) -> bool:
        return bool(self._dirty)

    def resend_all(self) -> None:
        """After (re)connecting: the peers may have missed changes, send every value."""
        self._dirty.update(self.model.workers)
        self._ends_sent.update(self.model.workers)  # and clear any ends they keep of ours

    def take(self) -> tuple[bytes, bytes]:
        """The current values of the workers changed since the last call, packed, and
        their decoding requests' ends (``pack_ends``; b"": none to send)."""
        workers = self.model.workers
        clock = self.model.clock
        now = clock() if clock is not None else None
        sent = self._ends_sent
        parts: list[bytes] = []
        ends: list[bytes] = []
        for url in self._dirty:
            raw = encoded(url)
            st = workers.get(url)
            if st is None:
                parts += (_REC.pack(len(raw), 0, 0, 0), raw)
            else:
                try:
                    rec = _REC.pack(len(raw), st.requests, len(st.pending), st.prefill_tokens)
                except struct.error:  # out of the u32 range
                    flight, n, tokens = st.requests, len(st.pending), st.prefill_tokens
                    rec = _REC.pack(len(raw), _clamp(flight), _clamp(n), _clamp(tokens))
                parts += (rec, raw)
                times = self.model.decoding_ends(url, now) if now is not None else None
                if times:
                    ends.append(_ends_record(raw, times))
                    sent.add(url)
                    continue
            if url in sent:  # none now: the others drop what they keep
                ends.append(_ends_record(raw, ()))
                sent.discard(url)
        self._dirty.clear()
        return b"".join(parts), b"".join(ends)

    # ----------------------------------------------------------- applying

    def apply(self, router: bytes, blob: bytes) -> None:
        """Another router's values (raises ValueError on a malformed blob)."""
        self._from_beat.discard(router)
        self._set(router, [(url, (f, n, t)) for url, f, n, t in unpack(blob)])

    def apply_ends(self, router: bytes, blob: bytes) -> None:
        """Another router's decoding requests' ends (raises ValueError on a malformed
        blob), read on the model's clock as they arrive."""
        clock = self.model.clock
        if clock is None:
            return
        now = clock()
        heard = self._heard_ends.setdefault(router, {})
        for url, ends in unpack_ends(blob):
            if ends:
                heard[url] = [(now + e,) for e in ends]
            elif heard.pop(url, None) is None:
                continue
            self._merge_ends(url)

    def _merge_ends(self, url: str) -> None:
        lists = [heard[url] for heard in self._heard_ends.values() if url in heard]
        if not lists:
            self.ends.pop(url, None)
        else:
            self.ends[url] = lists[0] if len(lists) == 1 else list(merge(*lists))

    def beat(self, router: bytes, flight: dict[str, int]) -> None:
        """A live router's heartbeat (its in flight per worker): counted only until it
        publishes its load (a router whose last records left the stream before this
        one started, or one without a load model)."""
        if router in self._heard and router not in self._from_beat:
            return
        self._from_beat.add(router)
        known = self._heard.get(router, {})
        values = {url: (0, 0, 0) for url in known}
        values.update((url, (n, 0, 0)) for url, n in flight.items())
        self._set(router, list(values.items()))

    def _set(self, router: bytes, values: list[tuple[str, tuple[int, int, int]]]) -> None:
        heard = self._heard.setdefault(router, {})
        for url, now in values:
            was = heard.get(url, (0, 0, 0))
            heard[url] = now
            self._add(url, now[0] - was[0], now[1] - was[1], now[2] - was[2])

    def keep(self, live: Collection[bytes]) -> None:
        """Forget the routers not in ``live`` (their heartbeat expired)."""
        for router in [r for r in self._heard if r not in live]:
            self._from_beat.discard(router)
            for url, (flight, n, tokens) in self._heard.pop(router).items():
                self._add(url, -flight, -n, -tokens)
        for router in [r for r in self._heard_ends if r not in live]:
            for url in self._heard_ends.pop(router):
                self._merge_ends(url)

    def clear(self) -> None:
        self._heard.clear()
        self._from_beat.clear()
        self._heard_ends.clear()
        self.ends.clear()
        self.flight.clear()
        self.pending.clear()
        self.tokens.clear()
        self.model.peer_head.clear()

    def _add(self, url: str, flight: int, n: int, tokens: int) -> None:
        before = self.pending.get(url, 0)
        clock = self.model.clock
        self.model.peer_queue_moved(
            url, before, before + n, tokens != 0, clock() if clock else None
        )
        for sums, v in ((self.flight, flight), (self.pending, n), (self.tokens, tokens)):
            total = sums.get(url, 0) + v
            if total:
                sums[url] = total
            else:
                sums.pop(url, None)
