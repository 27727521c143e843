"""The work model's state and arithmetic; the algorithm is described in the package
docstring (``kvroute.routing.load``)."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import merge
from statistics import median
from typing import Any

from kvroute.routing.load.estimators import MIN_SAMPLES, MedianEstimator, ResistantLine

PRIOR_PREFILL_TPS = 15_000.0
PRIOR_OVERHEAD_S = 0.005
PRIOR_DECODE_S = 0.020
PRIOR_OUTPUT_TOKENS = 256.0
KV_FULL = 0.95
OUTPUT_EWMA = 0.05  # weight of one observed output length in the running mean
TRUST_EWMA = 0.05  # weight of one reported cache hit in the index's trust
# A router shares the expected ends of at most this many of its decoding requests per
# worker (the soonest): a full worker's slot wait reads the first few ends past its
# capacity, and the rest count as of unknown progress.
ENDS_SHARED = 64
_UNSET: Any = object()


@dataclass(slots=True)
class EngineReading:
    """A worker's engine as last read from its /metrics, and our own count then."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    own: int = 0  # our requests in flight at the reading
    own_pending: int = 0  # ours without a first byte yet
    peer_pending: int = 0  # other routers' without a first byte, when shared (--state-store)
    own_kv: int = 0  # prompt tokens our requests in flight pinned then (``WorkerWork.kv``)


@dataclass(slots=True, eq=False)
class WorkerWork:
    """One worker's outstanding work and learned speed."""

    prefill_tokens: int = 0
    requests: int = 0
    decode_tokens: int = 0  # expected output tokens of the requests in flight
    pending: dict[int, int] = field(default_factory=dict)  # ticket id -> uncached tokens
    # Ticket id -> when it was routed, for the pending ones that found a free slot and
    # nothing of anyone else's waiting: their prefill starts when the one ahead ends.
    since: dict[int, float] = field(default_factory=dict)
    # Seconds to first byte = intercept (per-request overhead) + slope * prefill tokens.
    prefill: ResistantLine = field(
        default_factory=lambda: ResistantLine(
            1 / PRIOR_PREFILL_TPS, PRIOR_OVERHEAD_S, min_samples=MIN_SAMPLES
        )
    )
    decode_s: MedianEstimator = field(default_factory=lambda: MedianEstimator(PRIOR_DECODE_S))
    # Seconds per output token against the requests running beside it (engines step
    # slower with a larger batch): a line in the batch a request decoded in, which it
    # joined at its first byte. Times the ends of the requests decoding (``ends``).
    decode: ResistantLine = field(default_factory=lambda: ResistantLine(0.0, PRIOR_DECODE_S))
    engine: EngineReading | None = None
    # Share of the cached tokens the index predicts that the engine really had (from
    # usage.cached_tokens); a stale index (evictions it did not see) earns less trust.
    trust: float = 1.0
    # The engine's cache unit in tokens, learned: the greatest common divisor of the
    # cached counts it reported (0: none reported yet). See ``observe_reuse``.
    grain: int = 0
    # When the last of our first bytes came back (None: unknown, or not a prefill's end),
    # and whose (ticket ids grow in routing order).
    last_first: float | None = None
    last_first_id: int = 0
    # A prefill line (intercept, slope) known from outside before any sample of ours
    # (``LoadModel.know``): used in place of the fleet's line until this worker learns.
    known: tuple[float, float] | None = None
    # Our requests past their first byte (decoding, streamed), as (expected end, first
    # byte, output tokens still expected then, batch it decodes in, ticket id),
    # ascending; the ends as timed by the decode line ``ends_fit`` (intercept, slope),
    # re-timed when the line has learned since. A full worker's slot wait is read from
    # these (``LoadModel._release``).
    ends: list[tuple[float, float, int, int, int]] = field(default_factory=list)
    ends_fit: tuple[float, float] = (PRIOR_DECODE_S, 0.0)
    # Prompt tokens each of our requests in flight keeps in the worker's KV cache
    # (ticket id -> tokens not shared with another of ours there), and their sum: what
    # a request routed now waits to find room beside (``LoadModel.kv_wait``).
    kv: dict[int, int] = field(default_factory=dict)
    kv_tokens: int = 0

    def per_token(self, batch: int) -> float:
        """Seconds per output token with ``batch`` requests running (``decode``)."""
        line = self.decode
        return line.intercept + line.slope * batch

    def observe_reuse(self, predicted: int, reported: int, prompt: int, fleet_grain: int) -> None:
        """One request's engine reported ``reported`` cached tokens of a ``prompt``-token
        prompt where the index predicted ``predicted``. Trust moves towards the share of
        the predicted tokens the engine *could* report that it did: engines cache whole
        blocks (vLLM 16 tokens, its CPU build 128) and never the prompt's last token, so
        only the predicted match rounded down to whole blocks (of this worker's learned
        unit, else the fleet's, else 1) is checked. A match of a few tokens is no
        evidence either way: prompts often share their first tokens with one routed
        before (a template's opening, text by chance), which no engine reports cached,
        and counted as failures they took trust to the share of requests that were real
        hits (so every long match, predicted right, was taken for mostly cold)."""
        if reported > 0:
            self.grain = math.gcd(self.grain, reported)
        unit = self.grain or fleet_grain or 1
        checked = min(predicted, prompt - 1) // unit * unit
        if checked > 0:
            self.trust += TRUST_EWMA * (min(checked, reported) / checked - self.trust)


class Ticket:
    """The work one routed request reserved; ``first_byte`` and ``end`` act once each."""

    __slots__ = (
        "_model",
        "ahead",
        "alone",
        "batch",
        "clean",
        "closed",
        "end_at",
        "expected_out",
        "first_at",
        "id",
        "output_tokens",
        "predicted",
        "predicted_cached",
        "prompt_tokens",
        "reported_uncached",
        "sample",
        "started",
        "state",
        "uncached",
        "worker",
    )

    def __init__(
        self,
        model: LoadModel,
        tid: int,
        worker: str,
        state: WorkerWork,
        uncached: int,
        expected_out: int,
        now: float,
        matched: int = 0,
        predict: bool = True,
        kv: int = 0,
    ) -> None:
        self._model = model
        self.id = tid
        self.worker = worker
        self.state = state
        self.uncached = uncached
        self.expected_out = expected_out
        self.started = now
        self.predicted_cached = matched
        self.first_at: float | None = None
        self.end_at: tuple[float, float, int, int, int] | None = None  # in ``state.ends``
        self.batch = 0  # requests running when it began to decode (0: not streamed)
        self.closed = False
        # Set by whoever reads the answer's usage, for ``end``: completion_tokens, and
        # the uncached prompt tokens the engine reports (prompt - cached_tokens).
        self.output_tokens: int | None = None
        self.reported_uncached: int | None = None
        self.prompt_tokens = uncached + matched
        self.sample: float | None = None  # the first-byte time, learned from at ``end``
        if not predict:
            # Nothing will read a prediction (a whole answer: its first byte is its
            # last, no prefill time to learn from or deadline to shorten).
            self.ahead = self.predicted = 0.0
            self.clean = self.alone = False
            return
        self.ahead = model.ahead(worker)
        # A free slot and no one else's requests waiting (neither an engine's unknown
        # ones nor other routers' shared ones): from the moment its prefill starts, its
        # first byte times its own prefill alone.
        self.clean = model.admission_wait(worker, kv) == 0.0 and not (model.peer_pending or {}).get(
            worker, 0
        )
        e = state.engine
        if e is not None and e.waiting > e.own_pending + e.peer_pending:
            self.clean = False
        # Nothing of ours ahead of it either: it starts at once.
        self.alone = self.clean and not state.pending
        self.predicted = model.ttft(worker, uncached, matched, kv)

    def first_byte(self, now: float, *, learn: bool = True) -> None:
        """The first byte came back: the prefill part is done (once; later calls and
        calls after ``end`` do nothing). ``learn``: the time measures the prefill (a
        streamed first chunk), not a whole answer."""
        if self.first_at is not None or self.closed:
            return
        self.first_at = now
        st = self.state
        oldest = next(iter(st.pending), None) == self.id
        queued = st.pending.pop(self.id, None) is not None
        if queued:
            st.prefill_tokens -= self.uncached
            st.since.pop(self.id, None)
        elapsed = now - self.started
        previous, ahead_id = st.last_first, st.last_first_id
        st.last_first, st.last_first_id = (now if learn else None), self.id
        if learn:
            # Decoding from now on: it holds its slot until its expected output is out.
            rest = max(0, self.expected_out - 1)
            b = self.batch = self._model.running(self.worker, st)
            self.end_at = (_ends_at(now, rest, b, st.ends_fit), now, rest, b, self.id)
            insort(st.ends, self.end_at)
            if self.alone:
                self.sample = elapsed
            elif (
                self.clean
                and oldest
                and previous is not None
                and previous > self.started
                and ahead_id < self.id
            ):
                # Queued behind ours: prefills run one at a time in arrival order, so
                # its own began when the one ahead of it gave its first byte. (A later
                # request that overtook it, an engine interleaving prefills, gives none.)
                self.sample = now - previous
            if self._model.on_observe is not None:
                self._model.on_observe(self.worker, self.predicted, elapsed)
        if queued or learn:
            # Told once the worker's state is whole (its queue and its decodes' ends):
            # a store may read it at once (the simulator's does).
            self._model.changed(self.worker)

    def end(self, now: float, output_tokens: int | None = None) -> None:
        """The request ended, however (once; releases what is still reserved).
        ``output_tokens``: how many it generated, when known (learns decode speed)."""
        if self.closed:
            return
        self.closed = True
        if output_tokens is None:
            output_tokens = self.output_tokens
        st = self.state
        if st.pending.pop(self.id, None) is not None:
            st.prefill_tokens -= self.uncached
            st.since.pop(self.id, None)
        if self.end_at is not None:
            ends = st.ends
            i = bisect_left(ends, self.end_at)
            if i < len(ends) and ends[i] == self.end_at:
                del ends[i]
            else:  # re-timed since
                ends[:] = [e for e in ends if e[4] != self.id]
        st.requests -= 1
        st.decode_tokens -= self.expected_out
        st.kv_tokens -= st.kv.pop(self.id, 0)
        self._model.changed(self.worker)
        if self.sample is not None:
            # Learned at the end, when the engine may have said what it really had
            # cached: a cache the index wrongly predicted must not pass for a slow worker.
            x = self.reported_uncached if self.reported_uncached is not None else self.uncached
            st.prefill.observe(x, self.sample)
            self._model.relearn_fleet()
        if self.reported_uncached is not None and self.predicted_cached > 0:
            reported = max(0, self.prompt_tokens - self.reported_uncached)
            model = self._model
            if reported > 0:
                model.grain = math.gcd(model.grain, reported)
            st.observe_reuse(self.predicted_cached, reported, self.prompt_tokens, model.grain)
        if output_tokens is not None and output_tokens > 0:
            self._model.observe_output(output_tokens)
            # Decode speed only from a streamed answer (``batch``: its first byte was
            # its first token). A whole answer's "first byte" came with its last token:
            # (end - first byte) is the time to read the body, which taught a decode of
            # a few microseconds per token.
            if self.batch and self.first_at is not None and output_tokens > 1:
                per = (now - self.first_at) / (output_tokens - 1)
                st.decode_s.observe(per)
                st.decode.observe(self.batch, per)


def _ends_at(first: float, rest: int, batch: int, fit: tuple[float, float]) -> float:
    """When a request decoding since ``first`` ends: ``rest`` more tokens at the seconds
    per token the decode line ``fit`` (intercept, slope) gives its ``batch``."""
    return first + rest * (fit[0] + fit[1] * batch)


def _own(st: WorkerWork, intercept: float, slope: float, uncached: int, matched: int) -> float:
    """``LoadModel.own_prefill`` on ``st``'s line."""
    expect = max(0, uncached) + (1.0 - st.trust) * max(0, matched)
    return intercept + expect * slope


class Predictions:
    """One request's predicted time to first token (``ttft``), own prefill seconds
    (``own``), wait for a decode slot (``slot``, part of ``ttft``: above 0 only on a
    worker at its capacity) and occupancy stretch (``stretch``, ``LoadModel.stretch``)
    per worker, as ``LoadModel.predict`` computed them for one decision; ``price``: the
    time a choice compares, ``ttft`` times ``stretch``."""

    __slots__ = ("own", "price", "slot", "stretch", "ttft")

    def __init__(
        self,
        ttft: dict[str, float],
        own: dict[str, float],
        stretch: dict[str, float],
        price: dict[str, float],
        slot: dict[str, float],
    ) -> None:
        self.ttft = ttft
        self.own = own
        self.stretch = stretch
        self.price = price
        self.slot = slot

    def cost(self, worker: str, behind: float) -> float:
        """``LoadModel.cost`` of the request on ``worker``."""
        return (self.ttft[worker] + behind * self.own[worker]) * self.stretch[worker]

    def unstretched_cost(self, worker: str, behind: float) -> float:
        """``cost`` without the occupancy stretch: the request's own TTFT plus the delay
        its prefill adds to the ``behind`` requests queued after it."""
        return self.ttft[worker] + behind * self.own[worker]


class LoadModel:
    """Per-worker work and learned speed; see the module docstring."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerWork] = {}
        # Shared with the saturation guard: fixed capacity, learned capacities, and the
        # requests engines hold beyond ours (``kvroute.fleet.engine_load``).
        self.fixed_capacity: int | None = None
        self.capacities: Mapping[str, int] = {}
        # The most each engine was seen running with nothing waiting (``CapacityLearner``).
        self.capacity_floors: Mapping[str, int] = {}
        self.others: Mapping[str, int] = {}
        # Other router replicas' requests in flight per worker (``--state-store``): each
        # takes a slot; unless their queued prefill is shared (``peer_pending``), each
        # also counts as a queued prefill of our mean uncached size (an upper bound).
        self.peer: Mapping[str, int] = {}
        # When the store shares them: other routers' requests still waiting for their
        # first byte per worker, and their uncached prompt tokens (replaces the guess above).
        # None: not shared, the guess above stands.
        self.peer_pending: Mapping[str, int] | None = None
        self.peer_prefill: Mapping[str, int] = {}
        # Per worker, since when (this model's clock) the head of the other routers'
        # waiting requests there has been prefilling, as far as this router can tell
        # (``peer_queue_moved``): ``_ahead`` counts what is left of it, as of ours.
        self.peer_head: dict[str, float] = {}
        # When the store shares them: other routers' decoding requests per worker, each
        # as a 1-tuple of when it is expected to end on this model's clock, soonest
        # first (``SharedLoad``; at most ``ENDS_SHARED`` per router and worker). A full
        # worker's slot frees at those ends, as at ours; the peers' requests not listed
        # are of unknown progress.
        self.peer_ends: Mapping[str, list[tuple[float]]] = {}
        # Each worker's KV cache in the index's units (tokens, or bytes when routing on
        # bytes), as its engine reported it (``IndexBudget.kv_units``); a worker not
        # listed has no wait for KV room predicted.
        self.kv_capacity: Mapping[str, int] = {}
        self.mean_output = PRIOR_OUTPUT_TOKENS
        # The fleet's cache unit (``WorkerWork.grain`` over every worker): what a worker
        # that has reported no cached tokens yet is assumed to cache in.
        self.grain = 0
        self.mean_uncached = 0.0
        # (intercept, slope) of the fleet's typical worker: the median of the learned
        # lines; what a worker without samples of its own is assumed to do (None: prior).
        # Computed when read after a change (``relearn_fleet``): a worker without a line
        # of its own is rare once the fleet has learned, and the median over every
        # worker cost ~20 µs per streamed answer with 64.
        self._fleet: tuple[float, float] | None = None
        self._fleet_stale = False
        # Called with (worker, predicted TTFT, observed TTFT) at each learned first byte.
        self.on_observe: Callable[[str, float, float], None] | None = None
        # Called with the worker whenever a request is reserved there, has its first
        # byte or ends: its requests and queued prefill changed (``--state-store``
        # shares them).
        self.on_change: Callable[[str], None] | None = None
        self._ids = 0
        # The caller's clock, in the times it passes to ``reserve`` (``serve``:
        # ``time.monotonic``; the simulator: virtual time): how long the prefill at the
        # head of a worker's queue has been running. None: counted half done.
        self.clock: Callable[[], float] | None = None

    # ----------------------------------------------------------------- bookkeeping

    def state(self, worker: str) -> WorkerWork:
        st = self.workers.get(worker)
        if st is None:
            st = self.workers[worker] = WorkerWork()
        return st

    def add_worker(self, worker: str) -> None:
        self.state(worker)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker``'s learned speed and engine reading; tickets still open on it
        keep releasing into the old record (so nothing goes negative)."""
        if self.workers.pop(worker, None) is not None:
            self._fleet_stale = True

    def expected_output(self, max_tokens: int | None) -> int:
        if max_tokens is not None and max_tokens > 0:
            return max_tokens
        return max(1, round(self.mean_output))

    def observe_output(self, tokens: int) -> None:
        self.mean_output += OUTPUT_EWMA * (tokens - self.mean_output)

    def reserve(
        self,
        worker: str,
        uncached: int,
        expected_out: int,
        now: float,
        matched: int = 0,
        predict: bool = True,
        kv: int | None = None,
    ) -> Ticket:
        """Reserve a routed request's work on ``worker`` (at decision time): ``uncached``
        prompt tokens beyond the ``matched`` ones the index predicts it holds.
        ``predict=False``: the ticket's predicted time to first token is not needed
        (not computed; the work is reserved all the same). ``kv``: the prompt tokens it
        will keep in the worker's KV cache beyond what our other requests in flight
        there keep (``Decision.kv_tokens``); None: ``uncached``."""
        st = self.state(worker)
        uncached = max(0, uncached)
        matched = max(0, matched)
        kv = uncached if kv is None else max(0, kv)
        self._ids += 1
        t = Ticket(self, self._ids, worker, st, uncached, expected_out, now, matched, predict, kv)
        if kv:
            st.kv[t.id] = kv
            st.kv_tokens += kv
        # The prefill expected: the matched tokens the index may be wrong about count
        # in proportion to how often it was (``trust``).
        expect = uncached + round((1.0 - st.trust) * matched)
        t.uncached = expect
        st.pending[t.id] = expect
        if t.clean:
            st.since[t.id] = now
        st.prefill_tokens += expect
        st.requests += 1
        st.decode_tokens += expected_out
        self.changed(worker)
        self.mean_uncached += OUTPUT_EWMA * (uncached - self.mean_uncached)
        return t

    def _now(self) -> float | None:
        clock = self.clock
        return clock() if clock is not None else None

    def changed(self, worker: str) -> None:
        if self.on_change is not None:
            self.on_change(worker)

    def observe_engine(
        self, worker: str, running: int, waiting: int, kv_usage: float | None = None
    ) -> None:
        """An engine's own reading (after a health check in ``serve``, a poll in the sim)."""
        st = self.state(worker)
        peers = (self.peer_pending or {}).get(worker, 0)
        st.engine = EngineReading(
            running,
            waiting,
            kv_usage,
            st.requests,
            len(st.pending),
            peer_pending=peers,
            own_kv=st.kv_tokens,
        )

    def peer_queue_moved(
        self, worker: str, before: int, after: int, tokens_moved: bool, at: float | None
    ) -> None:
        """The other routers' requests waiting for a first byte on ``worker`` went from
        ``before`` to ``after`` (summed over routers), their tokens changed or not
        (``tokens_moved``), heard at ``at`` on this model's clock. From none to some, the
        first of them starts its prefill then (unless one of ours is ahead: ``_ahead``);
        fewer but some, or as many with other tokens (one left, another came, in one
        record), one had its first byte and the next starts. Counted whole instead, a
        peer's prefill already under way made its worker look a whole prefill busier
        than it was to every other router, and the guard moved the next request of the
        same prefix off its cache (three replicas over HTTP; one router, knowing its own
        head, did not)."""
        if after == before and not tokens_moved:
            return
        if after <= 0 or at is None:
            self.peer_head.pop(worker, None)
        elif before <= 0 or after <= before:
            self.peer_head[worker] = at

    def relearn_fleet(self) -> None:
        """A worker's line learned: the fleet line is computed again when next read."""
        self._fleet_stale = True

    @property
    def fleet_line(self) -> tuple[float, float] | None:
        """The fleet line: the median intercept and slope of the workers that learned
        (None: none has)."""
        if self._fleet_stale:
            self._fleet_stale = False
            lines = [
                p for p in (st.prefill.learned for st in self.workers.values()) if p is not None
            ]
            self._fleet = (
                (median(p[0] for p in lines), median(p[1] for p in lines)) if lines else None
            )
        return self._fleet

    # ----------------------------------------------------------------- prediction

    def line(self, st: WorkerWork) -> tuple[float, float]:
        """(intercept, slope) of ``st``'s prefill: learned, else the fleet's typical
        worker's (a fixed prior that is too fast would draw every request to the workers
        not yet measured, whose queues then give no clean sample to correct it)."""
        line = st.prefill.learned
        if line is not None:
            return line
        if st.known is not None:
            return st.known
        fleet = self.fleet_line
        return st.prefill.prior if fleet is None else fleet

    def know(self, worker: str, overhead_s: float, tokens_per_s: float) -> None:
        """``worker``'s prefill line as known from outside (the simulator's
        ``FleetConfig.known_speeds``): it stands until the worker has ``MIN_SAMPLES``
        samples of its own, in place of the fleet's typical line."""
        self.state(worker).known = (overhead_s, 1.0 / tokens_per_s)

    def prefill_rate(self, worker: str) -> float:
        """Learned prefill tokens/s of ``worker`` (the prior for an unknown one)."""
        st = self.workers.get(worker)
        return 1 / self.line(st)[1] if st is not None else PRIOR_PREFILL_TPS

    def ahead(self, worker: str, size_hint: int = 0) -> float:
        """Seconds of prefill a request routed now would wait behind (module doc).
        ``size_hint``: the uncached size to assume for requests of unknown size (other
        routers') before any of ours has been seen."""
        st = self.workers.get(worker)
        if st is None:
            return 0.0
        intercept, slope = self.line(st)
        return self._ahead(worker, st, intercept, slope, size_hint, self._now())

    def _ahead(
        self,
        worker: str,
        st: WorkerWork,
        intercept: float,
        slope: float,
        size_hint: int,
        now: float | None,
    ) -> float:
        if not st.pending:
            # Nothing of ours queued there (most workers of a large fleet, at most
            # decisions): only the other routers' or the engine's others can be ahead.
            shared = self.peer_pending
            theirs = shared.get(worker, 0) if shared is not None else self.peer.get(worker, 0)
            e = st.engine
            if not theirs and (e is None or e.waiting <= e.own_pending + e.peer_pending):
                return 0.0
        work = float(st.prefill_tokens)
        count = float(len(st.pending))
        left = 0.0
        peer_n = 0
        peer_tokens = 0
        peer_at: float | None = None  # when the other routers' head began (``peer_queue_moved``)
        if self.peer_pending is not None:
            peer_n = self.peer_pending.get(worker, 0)
            if peer_n > 0:
                peer_tokens = self.peer_prefill.get(worker, 0)
                if now is not None:
                    peer_at = self.peer_head.get(worker)
        # The head of the queue, being prefilled: when it was routed (ours) or heard to
        # begin (theirs), and its size; the earlier of ours and theirs.
        head_at: float | None = None
        head_size = 0.0
        if st.pending:
            oldest, tokens = next(iter(st.pending.items()))
            at = st.since.get(oldest)
            if now is None or (at is None and peer_at is None):
                # Probably being prefilled: half done.
                work -= tokens / 2
                count -= 0.5
            elif at is not None and (peer_at is None or at <= peer_at):
                head_at, head_size = at, tokens
        if head_at is None and peer_at is not None:
            head_at, head_size = peer_at, peer_tokens / peer_n  # theirs: their mean size
        if head_at is not None and now is not None:
            # Its prefill began then, or when the one ahead of it gave its first byte:
            # what is left of its predicted prefill.
            last = st.last_first
            if last is not None and last > head_at:
                head_at = last
            work -= head_size
            count -= 1
            left = max(0.0, intercept + head_size * slope - (now - head_at))
        e = st.engine
        if e is not None and e.waiting > e.own_pending + e.peer_pending:
            # Waiting requests nobody shared (bypass traffic, routers without a store).
            others = e.waiting - e.own_pending - e.peer_pending
            work += others * self.mean_uncached
            count += others
        if self.peer_pending is not None:  # shared: their queued prefill exactly
            work += peer_tokens
            count += peer_n
        else:
            peers = self.peer.get(worker, 0)
            if peers:
                # Their size is not shared: the larger of our running mean and this one.
                work += peers * max(self.mean_uncached, size_hint)
                count += peers
        return left + count * intercept + work * slope

    def typical_capacity(self) -> int | None:
        """What a worker not yet seen queueing is assumed to run at once: the largest
        capacity learned on any worker (None: none learned). A fleet's replicas are
        usually alike. Assumed too large, a worker corrects it (it queues, and an engine
        reading learns its own); assumed unknown, it had no slot wait at all and drew
        requests past its decode slots until a reading happened to catch it queueing.
        Not for a worker seen running more than that with nothing waiting
        (``capacity_floors``): it is larger than the ones learned, its capacity is
        unknown (no slot wait, stretch 1) until it queues. Assumed the others' size,
        such a worker was priced as full while it had slots free, and the small worker
        whose capacity had been learned drew the requests it should have shed.

        Once one such worker is seen, the fleet is not alike: None for every worker not
        yet seen queueing (their capacity is unknown too, until each queues). Were only
        the one seen running more unstretched, every request a holder near the small
        size could shed went to it (its price one stretch, theirs up to that size's),
        whatever it already had queued: a sink, where the other larger workers had
        slots free."""
        caps = self.capacities
        if not caps:
            return None
        top = max(caps.values())
        floors = self.capacity_floors
        if floors and max(floors.values()) > top:
            for worker, floor in floors.items():
                if floor > top and worker not in caps:
                    return None
        return top

    def _capacity(self, worker: str, st: WorkerWork, typical: int | None = -1) -> int | None:
        """``typical``: ``typical_capacity()`` if already computed (-1: not yet)."""
        e = st.engine
        if e is not None and e.kv_usage is not None and e.kv_usage >= KV_FULL and e.running:
            return e.running
        cap = self.fixed_capacity
        if cap is not None:
            return cap
        cap = self.capacities.get(worker)
        if cap is None:
            cap = self.typical_capacity() if typical == -1 else typical
            if cap is not None and self.capacity_floors.get(worker, 0) > cap:
                return None
        return cap

    def slot_wait(self, worker: str) -> float:
        """Seconds a request routed now would wait for a free slot (decode interference)."""
        st = self.workers.get(worker)
        if st is None:
            return 0.0
        return self._slot_wait(worker, st)

    def _slot_wait(self, worker: str, st: WorkerWork, typical: int | None = -1) -> float:
        return self._slots(worker, st, typical)[0]

    def _slots(self, worker: str, st: WorkerWork, typical: int | None = -1) -> tuple[float, float]:
        """(slot wait, occupancy stretch) of ``worker`` (module doc)."""
        cap = self._capacity(worker, st, typical)
        if cap is None or cap < 1:
            return 0.0, 1.0
        unknown = self._unknown(worker)
        n = st.requests + unknown
        if n < cap:
            return 0.0, cap / (cap - n)
        peers = self.peer_pending
        prefilling = peers.get(worker, 0) if peers is not None else 0
        wait = self._release(st, n - cap, cap, unknown, self.peer_ends.get(worker), prefilling)
        return wait, float(cap)

    def _unknown(self, worker: str) -> int:
        """Requests on ``worker`` that are not ours: its engine's beyond ours, and other
        router replicas'."""
        return self.others.get(worker, 0) + self.peer.get(worker, 0)

    def running(self, worker: str, st: WorkerWork) -> int:
        """Requests running on ``worker`` (ours and others'), at most its capacity."""
        n = st.requests + self._unknown(worker)
        cap = self._capacity(worker, st)
        return n if cap is None else max(1, min(n, cap))

    def _release(
        self,
        st: WorkerWork,
        j: int,
        cap: int,
        unknown: int,
        peer: list[tuple[float]] | None = None,
        peer_prefilling: int = 0,
    ) -> float:
        """Seconds until the ``j``-th (from 0) of a full worker's ``cap`` running
        requests ends: the request waits for that slot (module doc). Ours past their
        first byte end when their expected output is out, at the learned seconds per
        token of the batch each decodes in, and the other routers' decoding ones at
        the ends they published (``peer``); requests of unknown progress (``unknown``:
        others', peers' neither listed nor among the ``peer_prefilling`` ones waiting
        for a first byte) end spread evenly over one mean decode of a full batch; the
        rest of the running ones (ours and peers' still in prefill) after a whole one.
        Without a clock, or with the queue deeper than the running requests, each of
        ``cap`` running requests is taken to end after a uniformly spread share of a
        mean decode."""
        mean_out = st.decode_tokens / st.requests if st.requests else self.mean_output
        token = st.per_token(cap)  # one token, in a full batch
        whole = mean_out * token
        spread = (j + 1) / (cap + 1) * whole
        ends: Sequence[tuple[float, ...]] = st.ends
        now = self._now()
        if now is None or not (ends or peer) or j >= cap:
            return spread
        self._retime(st)
        if peer:
            # The other routers' decoding requests end where they said: no longer of
            # unknown progress.
            ends = list(merge(st.ends, peer))
            unknown -= len(peer)
        # Theirs still in prefill are a whole decode away, as ours are.
        unknown = max(0, unknown - peer_prefilling)
        prefilling = max(0, cap - len(ends) - unknown)
        if not unknown:
            # Only ours: the j-th of the decoding ones' ends and the prefilling ones',
            # a whole decode away. (j < cap <= the running ones: the index is in range.)
            sooner = bisect_left(ends, (now + whole,))
            if j >= sooner:
                if j < sooner + prefilling:
                    return whole
                j -= prefilling
            return max(token, ends[j][0] - now)
        i = b = 0
        wait = 0.0
        for _ in range(j + 1):
            # The next to free: our earliest expected end (at least one more token away),
            # the next of the unknown ones, or one still in prefill, whichever is sooner.
            mine = max(token, ends[i][0] - now) if i < len(ends) else math.inf
            theirs = (b + 1) / (unknown + 1) * whole if b < unknown else math.inf
            later = whole if prefilling else math.inf
            if mine <= theirs and mine <= later:
                wait, i = mine, i + 1
            elif theirs <= later:
                wait, b = theirs, b + 1
            else:  # j < cap <= the running ones: one is always left
                wait, prefilling = later, prefilling - 1
        return wait

    def stretch(self, worker: str) -> float:
        """How much a choice stretches ``worker``'s predicted times for its occupied
        decode slots: 1 / (1 - n / capacity), n (requests in flight, ours + others)
        counted up to one short of its capacity, so from 1 (idle, or capacity unknown)
        to the capacity (full: the slot wait then prices the queue). Module doc."""
        st = self.workers.get(worker)
        if st is None:
            return 1.0
        return self._slots(worker, st)[1]

    def wait(self, worker: str) -> float:
        """Predicted seconds before a request routed now starts its own prefill."""
        return self.ahead(worker) + self.slot_wait(worker)

    def ttft(self, worker: str, uncached: int, matched: int = 0, kv: int | None = None) -> float:
        """Predicted time to first token of a request with ``uncached`` tokens beyond
        the ``matched`` ones the index predicts ``worker`` holds, keeping ``kv`` prompt
        tokens in its KV cache beyond ours in flight there (None: ``uncached``)."""
        st = self.workers.get(worker)
        if st is None:
            return PRIOR_OVERHEAD_S + max(0, uncached) / PRIOR_PREFILL_TPS
        intercept, slope = self.line(st)
        now = self._now()
        need = max(0, uncached) if kv is None else kv
        return (
            self._ahead(worker, st, intercept, slope, max(0, uncached), now)
            + _own(st, intercept, slope, uncached, matched)
            + max(self._slot_wait(worker, st), self._kv_wait(worker, st, need, now))
        )

    def admission_wait(self, worker: str, kv: int) -> float:
        """Seconds a request routed now would wait to be admitted: for a free decode
        slot, or for room for its ``kv`` prompt tokens in the KV cache, the longer."""
        st = self.workers.get(worker)
        if st is None:
            return 0.0
        return max(self._slot_wait(worker, st), self._kv_wait(worker, st, kv, self._now()))

    def kv_wait(self, worker: str, kv: int) -> float:
        """Seconds a request routed now would wait for room for ``kv`` prompt tokens in
        ``worker``'s KV cache (``_kv_wait``)."""
        st = self.workers.get(worker)
        if st is None:
            return 0.0
        return self._kv_wait(worker, st, kv, self._now())

    def kv_pinned(self, worker: str) -> int:
        """Prompt tokens ``worker``'s KV cache is predicted to keep for the requests in
        flight: ours (``WorkerWork.kv_tokens``), and others' as its engine last reported
        its cache in use beyond ours (only where requests not ours run there)."""
        st = self.workers.get(worker)
        if st is None:
            return 0
        cap = self.kv_capacity.get(worker)
        return st.kv_tokens + (self._others_kv(worker, st, cap) if cap else 0)

    def _others_kv(self, worker: str, st: WorkerWork, cap: int) -> int:
        """KV tokens in use by requests not ours, from the engine's last reading: its
        usage beyond what ours kept then. Only where its engine holds requests not ours
        (``_unknown``): ours are counted without the blocks a request shares with
        another we ended, so a reading above our count alone is no one else's."""
        e = st.engine
        if e is None or e.kv_usage is None or not self._unknown(worker):
            return 0
        return max(0, int(e.kv_usage * cap) - e.own_kv)

    def _kv_wait(self, worker: str, st: WorkerWork, need: int, now: float | None) -> float:
        """Seconds until ``worker``'s KV cache has room for ``need`` more prompt tokens
        beside the ones the requests in flight keep (``kv_pinned``): 0 while they fit.
        Engines admit a waiting request only when its prompt's blocks not already in
        use fit in the free ones (vLLM's scheduler, SGLang's token budget), first come
        first served; a request alone always fits. Room frees as requests end: ours
        decoding at their expected ends (as the slot wait reads them, soonest first,
        each freeing what it keeps); the rest is kept by requests still waiting or in
        prefill (ours, others'), which free it one request lifetime (a prefill of the
        mean uncached size and a mean decode) per cache's worth. Without a clock: the
        share of the kept tokens that must go, of a mean decode."""
        cap = self.kv_capacity.get(worker) if need > 0 else None
        if not cap:
            return 0.0
        ours = st.kv_tokens
        pinned = ours + self._others_kv(worker, st, cap)
        over = min(pinned, pinned + need - cap)
        if over <= 0:
            return 0.0
        mean_out = st.decode_tokens / st.requests if st.requests else self.mean_output
        token = st.per_token(max(1, st.requests + self._unknown(worker)))
        whole = mean_out * token
        if now is None:
            return over / pinned * whole
        self._retime(st)
        kept = st.kv
        freed = 0
        last = token
        for e in st.ends:
            freed += kept.get(e[4], 0)
            last = max(token, e[0] - now)
            if freed >= over:
                return last
        intercept, slope = self.line(st)
        life = whole + intercept + slope * self.mean_uncached
        return last + (over - freed) / cap * life

    def _retime(self, st: WorkerWork) -> None:
        """Re-time ``st``'s decoding ends if its decode line has learned since."""
        fit = (st.decode.intercept, st.decode.slope)
        if st.ends_fit != fit:
            st.ends[:] = sorted(
                (_ends_at(f, r, b, fit), f, r, b, tid) for _, f, r, b, tid in st.ends
            )
            st.ends_fit = fit

    def own_prefill(self, worker: str, uncached: int, matched: int = 0) -> float:
        """Predicted seconds of ``worker``'s prefill engine the request itself takes."""
        st = self.workers.get(worker)
        if st is None:
            return PRIOR_OVERHEAD_S + max(0, uncached) / PRIOR_PREFILL_TPS
        intercept, slope = self.line(st)
        return _own(st, intercept, slope, uncached, matched)

    def cost(self, worker: str, tokens: int, matched: int, behind: float) -> float:
        """What routing a ``tokens``-long request to ``worker`` (which holds ``matched``
        of them) costs the fleet, in seconds: its own predicted TTFT there plus the delay
        its prefill adds to the ``behind`` requests expected to queue after it (FIFO:
        each waits its prefill longer), stretched for the worker's occupied decode slots
        (``stretch``). ``behind``: ``queued_per_worker``."""
        uncached = tokens - matched
        return (
            self.ttft(worker, uncached, matched)
            + behind * self.own_prefill(worker, uncached, matched)
        ) * self.stretch(worker)

    def predict(
        self, workers: Collection[str], tokens: int, matches: Mapping[str, int]
    ) -> Predictions:
        """One request's ``ttft``, ``own_prefill`` and ``stretch`` on each of
        ``workers`` (its ``tokens`` of which ``matches`` says each worker holds how
        many), computed once per decision: the same numbers as calling ``ttft`` (with
        ``kv=0``: choices leave the wait for KV room out, module doc), ``own_prefill``,
        ``stretch`` and ``cost`` worker by worker."""
        ttft: dict[str, float] = {}
        own: dict[str, float] = {}
        price: dict[str, float] = {}
        # What an idle worker has (most of a large fleet's, at most decisions): no
        # stretch and no slot wait; a busy one's are set below.
        stretch = dict.fromkeys(workers, 1.0)
        slots = dict.fromkeys(workers, 0.0)
        known = self.workers
        fleet: Any = _UNSET
        # No capacity known for any worker (none fixed, learned or read): no slot wait.
        no_caps = self.fixed_capacity is None and not self.capacities
        typical = self.typical_capacity()
        now = self._now()
        # Workers where someone else's requests are (other routers', an engine's beyond
        # ours): the others, with nothing of ours there, are idle to this model.
        others = self.others
        peers = self.peer
        shared = self.peer_pending
        busy = {w for w, v in others.items() if v} if others else set()
        if peers:
            busy.update(w for w, v in peers.items() if v)
        if shared:
            busy.update(w for w, v in shared.items() if v)
        for w in workers:
            matched = matches.get(w, 0)
            uncached = tokens - matched
            st = known.get(w)
            if st is None:
                ttft[w] = own[w] = price[w] = (
                    PRIOR_OVERHEAD_S + max(0, uncached) / PRIOR_PREFILL_TPS
                )
                continue
            # ``line`` and ``_own`` inlined: this runs for every worker at every decision.
            line = st.prefill.learned
            if line is None:
                line = st.known
                if line is None:
                    if fleet is _UNSET:
                        fleet = self.fleet_line  # read once, and only when needed
                    line = st.prefill.prior if fleet is None else fleet
            intercept, slope = line
            if uncached < 0:
                uncached = 0
            if matched < 0:
                matched = 0
            o = own[w] = intercept + (uncached + (1.0 - st.trust) * matched) * slope
            e = st.engine
            if (
                not st.pending
                and w not in busy
                and (e is None or e.waiting <= e.own_pending + e.peer_pending)
            ):
                # Nothing queued ahead (``_ahead`` would say so).
                if not st.requests:
                    # Idle (most workers of a large fleet at low load): no slot wait
                    # (``_slots`` would say so), no stretch.
                    ttft[w] = price[w] = o + 0.0
                    continue
                ahead = 0.0
            else:
                ahead = self._ahead(w, st, intercept, slope, uncached, now)
            if no_caps and e is None:
                slot, x = 0.0, 1.0
            else:
                # ``_slots``, inlined up to a worker with a slot free.
                cap = self._capacity(w, st, typical)
                if cap is None or cap < 1:
                    slot, x = 0.0, 1.0
                else:
                    n = st.requests
                    if w in busy:
                        n += others.get(w, 0) + peers.get(w, 0)  # ``_unknown``
                    if n < cap:
                        slot, x = 0.0, cap / (cap - n)
                    else:
                        slot, x = self._slots(w, st, typical)
            t = ttft[w] = ahead + o + slot
            stretch[w] = x
            price[w] = t * x
            slots[w] = slot
        return Predictions(ttft, own, stretch, price, slots)

    def decoding_ends(self, worker: str, now: float) -> list[float]:
        """When our decoding requests on ``worker`` are expected to end, in seconds
        from ``now``, the soonest ``ENDS_SHARED``: what the store shares with the other
        routers (their ``peer_ends``)."""
        st = self.workers.get(worker)
        if st is None or not st.ends:
            return []
        return [e[0] - now for e in st.ends[:ENDS_SHARED]]

    def queued_per_worker(self, workers: Collection[str]) -> float:
        """Mean number of requests waiting for their first byte per worker of ``workers``
        (a proxy for how many requests will queue behind new work): ours, and the
        other routers' when the store shares them (with only ours, each of N replicas
        would see about 1/N of the queue and move requests off their cache too often)."""
        n = len(workers)
        if not n:
            return 0.0
        # Over the workers with requests waiting, not every worker: most of a large
        # fleet's have none at most decisions.
        known = self.workers
        total = sum(len(st.pending) for w, st in known.items() if st.pending and w in workers)
        peers = self.peer_pending
        if peers:
            total += sum(v for w, v in peers.items() if v and w in workers)
        return total / n

    # ----------------------------------------------------------------- reading

    def snapshot(self, worker: str) -> dict[str, Any]:
        st = self.workers.get(worker) or WorkerWork()
        intercept, slope = self.line(st)
        return {
            "prefill_tokens_queued": st.prefill_tokens,
            "requests": st.requests,
            "decode_tokens": st.decode_tokens,
            "predicted_wait_s": round(self.wait(worker), 6),
            "occupancy_stretch": round(self.stretch(worker), 4),
            "prefill_tokens_per_s": round(1 / slope, 1),
            "prefill_overhead_ms": round(intercept * 1000, 3),
            "prefill_samples": st.prefill.samples,
            "decode_ms_per_token": round(st.decode_s.value * 1000, 3),
            "decode_samples": st.decode_s.samples,
            # The line the ends of decoding requests are timed by: ms per token alone,
            # and added per request running beside it.
            "decode_ms_per_token_alone": round(st.decode.intercept * 1000, 3),
            "decode_ms_per_token_per_request": round(st.decode.slope * 1000, 4),
            "index_trust": round(st.trust, 4),
            # Prompt tokens our requests in flight keep in its KV cache, and its size as
            # the engine reported it (None: not reported, no wait for room predicted);
            # both in the index's units (bytes when routing without a tokenizer).
            "kv_tokens_in_flight": st.kv_tokens,
            "kv_capacity_tokens": self.kv_capacity.get(worker),
        }


def max_tokens_of(body: Mapping[str, Any]) -> int | None:
    """The output cap a request body sets (OpenAI ``max_completion_tokens`` /
    ``max_tokens``, SGLang ``sampling_params.max_new_tokens``), or None."""
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    sp = body.get("sampling_params")
    if isinstance(sp, Mapping):
        v = sp.get("max_new_tokens")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None
