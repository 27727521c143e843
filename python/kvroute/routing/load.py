"""Load in units of work: what each worker still has to do, how fast it does it, and the
time to first token (TTFT) a request would see there.

One ``LoadModel`` per router process (and per simulated router replica: the fleet
simulator runs this same code in virtual time). Every time argument is a caller's clock
in seconds (``time.monotonic()`` in ``serve``, virtual time in ``kvroute.sim.fleet``).

What is counted, per worker
    * **prefill work**: the *uncached* prompt tokens of every request routed there whose
      first byte has not come back yet, as predicted from the index match at decision
      time (``reserve``). Released when the first byte arrives (``Ticket.first_byte``).
    * **decode work**: the requests in flight and their expected output tokens
      (``max_tokens`` / ``max_completion_tokens`` / ``max_new_tokens`` when the request
      sets one, else a running mean of observed outputs). Released when the request ends
      (``Ticket.end``; which also releases the prefill part if no byte ever came back).
    Both are released exactly once whatever ends the request, like the registry's
    ``Reservation``; ``serve`` chains the ticket's ``end`` to that reservation's release.
    * **what other routers and bypassing clients put there**, from the engines' own
      readings (``observe_engine``: vLLM ``num_requests_running/waiting`` and
      ``kv_cache_usage_perc``, SGLang's running/queued counts): requests beyond ours
      count for the slot term below, and waiting ones beyond ours count as that many
      requests of the mean uncached size of ours.

Learned speed, per worker (so a heterogeneous fleet is told apart)
    * prefill: time to first byte = ``overhead + uncached tokens / rate``, a line fitted
      to (uncached tokens, seconds from decision to first byte) samples
      (``ResistantLine``: a Theil-Sen slope on paired samples, the median residual as
      overhead; bounded window of ``WINDOW`` samples). Only requests that had nothing
      queued ahead of them and a free slot when routed give a sample (their first byte
      times their own prefill, nothing else). The sample is taken at the request's end,
      when the engine may have reported what it really had cached (``usage``
      ``prompt_tokens`` - ``cached_tokens``, in the router's token units): the index's
      guess is used only when it did not, so an evicted prefix the index still believed
      in does not pass for a slow worker.
    * index trust: the share of the cached tokens the index predicted that the engine
      reported it really had (EWMA, prior 1). The index only guesses (evictions, other
      routers, restarts); where its guesses fail, a predicted match is worth that much
      less: a request is expected to prefill ``uncached + (1 - trust) * matched``.
    * decode seconds per token: at each end with a known output length,
      ``(end - first byte) / (output tokens - 1)``, the median of the last ``WINDOW``.
    Before ``MIN_SAMPLES`` samples the priors hold: ``PRIOR_PREFILL_TPS`` (the
    simulator's default worker, an 8B model on one H100), ``PRIOR_OVERHEAD_S``, ``PRIOR_DECODE_S``.
    Medians shrug off the outliers a shared machine or a stall produce. A worker that
    leaves (or goes down) forgets what was learned (it may come back as other hardware).

The prediction (``ttft``), for a request with ``uncached`` tokens on worker ``w``::

    ahead   = prefill queued on w, in seconds: its requests' overheads and uncached
              tokens over the learned line (the oldest counted half: it is probably
              being prefilled, half done on average) + others' waiting requests, each
              of the mean uncached size of ours
    ttft    = ahead + overhead(w) + uncached / rate(w) + slot_wait(w)
    slot_wait = 0 while w has a free slot (requests in flight, ours + others, below its
              capacity: ``--worker-capacity`` or learned from the engines); else the
              request waits for (n - capacity + 1) of ``capacity`` slots to free, each
              after a uniformly spread remaining decode time (the k-th of ``capacity``
              running requests ends after k / (capacity + 1) of a whole decode):
              (n - capacity + 1) / (capacity + 1) * mean_expected_output * decode_s(w)
    A worker whose engine reports its KV cache >= ``KV_FULL`` full is treated as having
    no free slot (the engine cannot admit more), with its running count as capacity.

Prefill engines run one prompt at a time in arrival order (vLLM and SGLang schedule
waiting prompts FIFO), so work ahead adds up; decode running beside prefill slows it,
which the learned rate absorbs at the load it was measured under. Per-request overhead
(scheduling, HTTP) is the learned line's intercept.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

PRIOR_PREFILL_TPS = 15_000.0
PRIOR_OVERHEAD_S = 0.005
PRIOR_DECODE_S = 0.020
PRIOR_OUTPUT_TOKENS = 256.0
WINDOW = 16
MIN_SAMPLES = 3
KV_FULL = 0.95
OUTPUT_EWMA = 0.05  # weight of one observed output length in the running mean
TRUST_EWMA = 0.05  # weight of one reported cache hit in the index's trust


class ResistantLine:
    """``y = intercept + slope * x`` fitted robustly to the last ``window`` samples of each
    size class (``x`` within a factor of 2; bounded: at most ~32 classes). Each class is
    summed up by its medians; the slope is the median of the slopes between every two
    classes (a Theil-Sen estimator on class medians), the intercept the median residual
    of all samples. A few wild samples (a stall, a slot wait) move neither. Classes less
    than 1.5x apart are not paired; with no pair (the sizes seen are too alike to tell
    slope from intercept) the prior line is scaled
    as a whole to the samples (median ratio). An intercept that would go negative by
    more than rounding gives a line through the origin instead. Before ``min_samples``
    samples: the prior. Refitted at each sample, O(window log window)."""

    __slots__ = ("_by_size", "intercept", "min_samples", "prior", "slope", "window")

    def __init__(
        self,
        slope: float,
        intercept: float = 0.0,
        window: int = WINDOW,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        self.slope = slope
        self.intercept = intercept
        self.prior = (intercept, slope)
        self.min_samples = min_samples
        self.window = window
        # The last ``window`` samples of each size class (x within a factor 2): a burst
        # of one size (cache hits under load) must not push out what other sizes taught.
        self._by_size: dict[int, deque[tuple[float, float]]] = {}

    def observe(self, x: float, y: float) -> None:
        if not (x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)):
            return
        size = int(x).bit_length()
        bucket = self._by_size.get(size)
        if bucket is None:
            bucket = self._by_size[size] = deque(maxlen=self.window)
        bucket.append((x, y))
        pts = sorted(p for b in self._by_size.values() for p in b)
        n = len(pts)
        if n < self.min_samples:
            return
        groups = sorted(
            (median(p[0] for p in b), median(p[1] for p in b)) for b in self._by_size.values()
        )
        slopes = [
            (y2 - y1) / (x2 - x1)
            for i, (x1, y1) in enumerate(groups)
            for x2, y2 in groups[i + 1 :]
            if x2 > 1.5 * x1
        ]
        fit = median(slopes) if slopes else 0.0
        if fit > 0:
            slope = fit
            intercept = median(y - slope * x for x, y in pts)
            if intercept < -1e-6:  # too steep for what is seen: through the origin
                slope = median(y / x for x, y in pts)
            intercept = max(0.0, intercept)
        else:
            # The sizes seen are too alike to split slope from intercept: scale the
            # prior line as a whole (a 5x slower worker is 5x slower at any size).
            k = median(y / (self.prior[0] + self.prior[1] * x) for x, y in pts)
            intercept, slope = k * self.prior[0], k * self.prior[1]
        self.slope, self.intercept = slope, intercept

    @property
    def samples(self) -> int:
        return sum(len(b) for b in self._by_size.values())


class MedianEstimator:
    """Median of the last ``window`` samples; ``prior`` until ``min_samples`` came."""

    __slots__ = ("_samples", "_value", "min_samples", "prior")

    def __init__(self, prior: float, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self.prior = prior
        self.min_samples = min_samples
        self._samples: deque[float] = deque(maxlen=window)
        self._value = prior

    def observe(self, x: float) -> None:
        if x > 0 and x == x and x != float("inf"):
            self._samples.append(x)
            if len(self._samples) >= self.min_samples:
                self._value = median(self._samples)

    @property
    def value(self) -> float:
        return self._value

    @property
    def samples(self) -> int:
        return len(self._samples)


@dataclass(slots=True)
class EngineReading:
    """A worker's engine as last read from its /metrics, and our own count then."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    own: int = 0  # our requests in flight at the reading
    own_pending: int = 0  # ours without a first byte yet


@dataclass(slots=True, eq=False)
class WorkerWork:
    """One worker's outstanding work and learned speed."""

    prefill_tokens: int = 0
    requests: int = 0
    decode_tokens: int = 0  # expected output tokens of the requests in flight
    pending: dict[int, int] = field(default_factory=dict)  # ticket id -> uncached tokens
    # Seconds to first byte = intercept (per-request overhead) + slope * prefill tokens.
    prefill: ResistantLine = field(
        default_factory=lambda: ResistantLine(1 / PRIOR_PREFILL_TPS, PRIOR_OVERHEAD_S)
    )
    decode_s: MedianEstimator = field(default_factory=lambda: MedianEstimator(PRIOR_DECODE_S))
    engine: EngineReading | None = None
    # Share of the cached tokens the index predicts that the engine really had (from
    # usage.cached_tokens); a stale index (evictions it did not see) earns less trust.
    trust: float = 1.0


class Ticket:
    """The work one routed request reserved; ``first_byte`` and ``end`` act once each."""

    __slots__ = (
        "_model",
        "ahead",
        "alone",
        "closed",
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
    ) -> None:
        self._model = model
        self.id = tid
        self.worker = worker
        self.state = state
        self.uncached = uncached
        self.expected_out = expected_out
        self.started = now
        self.ahead = model.ahead(worker)
        # Nothing ahead of it and a free slot: its first byte times its own prefill.
        self.alone = not state.pending and model.slot_wait(worker) == 0.0
        e = state.engine
        if e is not None and e.waiting > e.own_pending:
            self.alone = False
        self.predicted = model.ttft(worker, uncached, matched)
        self.predicted_cached = matched
        self.first_at: float | None = None
        self.closed = False
        # Set by whoever reads the answer's usage, for ``end``: completion_tokens, and
        # the uncached prompt tokens the engine reports (prompt - cached_tokens).
        self.output_tokens: int | None = None
        self.reported_uncached: int | None = None
        self.prompt_tokens = uncached + matched
        self.sample: float | None = None  # the first-byte time, learned from at ``end``

    def first_byte(self, now: float, *, learn: bool = True) -> None:
        """The first byte came back: the prefill part is done (once; later calls and
        calls after ``end`` do nothing). ``learn``: the time measures the prefill (a
        streamed first chunk), not a whole answer."""
        if self.first_at is not None or self.closed:
            return
        self.first_at = now
        st = self.state
        if st.pending.pop(self.id, None) is not None:
            st.prefill_tokens -= self.uncached
        elapsed = now - self.started
        if learn:
            if self.alone:
                self.sample = elapsed
            if self._model.on_observe is not None:
                self._model.on_observe(self.worker, self.predicted, elapsed)

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
        st.requests -= 1
        st.decode_tokens -= self.expected_out
        if self.sample is not None:
            # Learned at the end, when the engine may have said what it really had
            # cached: a cache the index wrongly predicted must not pass for a slow worker.
            x = self.reported_uncached if self.reported_uncached is not None else self.uncached
            st.prefill.observe(x, self.sample)
        if self.reported_uncached is not None and self.predicted_cached > 0:
            real = min(self.predicted_cached, max(0, self.prompt_tokens - self.reported_uncached))
            st.trust += TRUST_EWMA * (real / self.predicted_cached - st.trust)
        if output_tokens is not None and output_tokens > 0:
            self._model.observe_output(output_tokens)
            if self.first_at is not None and output_tokens > 1:
                st.decode_s.observe((now - self.first_at) / (output_tokens - 1))


class LoadModel:
    """Per-worker work and learned speed; see the module docstring."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerWork] = {}
        # Shared with the saturation guard: fixed capacity, learned capacities, and the
        # requests engines hold beyond ours (``kvroute.fleet.engine_load``).
        self.fixed_capacity: int | None = None
        self.capacities: Mapping[str, int] = {}
        self.others: Mapping[str, int] = {}
        self.mean_output = PRIOR_OUTPUT_TOKENS
        self.mean_uncached = 0.0
        # Called with (worker, predicted TTFT, observed TTFT) at each learned first byte.
        self.on_observe: Callable[[str, float, float], None] | None = None
        self._ids = 0

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
        self.workers.pop(worker, None)

    def expected_output(self, max_tokens: int | None) -> int:
        if max_tokens is not None and max_tokens > 0:
            return max_tokens
        return max(1, round(self.mean_output))

    def observe_output(self, tokens: int) -> None:
        self.mean_output += OUTPUT_EWMA * (tokens - self.mean_output)

    def reserve(
        self, worker: str, uncached: int, expected_out: int, now: float, matched: int = 0
    ) -> Ticket:
        """Reserve a routed request's work on ``worker`` (at decision time): ``uncached``
        prompt tokens beyond the ``matched`` ones the index predicts it holds."""
        st = self.state(worker)
        uncached = max(0, uncached)
        matched = max(0, matched)
        self._ids += 1
        t = Ticket(self, self._ids, worker, st, uncached, expected_out, now, matched)
        # The prefill expected: the matched tokens the index may be wrong about count
        # in proportion to how often it was (``trust``).
        expect = uncached + round((1.0 - st.trust) * matched)
        t.uncached = expect
        st.pending[t.id] = expect
        st.prefill_tokens += expect
        st.requests += 1
        st.decode_tokens += expected_out
        self.mean_uncached += OUTPUT_EWMA * (uncached - self.mean_uncached)
        return t

    def observe_engine(
        self, worker: str, running: int, waiting: int, kv_usage: float | None = None
    ) -> None:
        """An engine's own reading (after a health check in ``serve``, a poll in the sim)."""
        st = self.state(worker)
        st.engine = EngineReading(running, waiting, kv_usage, st.requests, len(st.pending))

    # ----------------------------------------------------------------- prediction

    def prefill_rate(self, worker: str) -> float:
        """Learned prefill tokens/s of ``worker`` (the prior for an unknown one)."""
        st = self.workers.get(worker)
        return 1 / st.prefill.slope if st is not None else PRIOR_PREFILL_TPS

    def ahead(self, worker: str) -> float:
        """Seconds of prefill a request routed now would wait behind (module doc)."""
        st = self.workers.get(worker)
        if st is None:
            return 0.0
        line = st.prefill
        work = float(st.prefill_tokens)
        count = float(len(st.pending))
        if st.pending:  # the oldest is probably being prefilled: half done
            work -= next(iter(st.pending.values())) / 2
            count -= 0.5
        e = st.engine
        if e is not None and e.waiting > e.own_pending:
            others = e.waiting - e.own_pending
            work += others * self.mean_uncached
            count += others
        return count * line.intercept + work * line.slope

    def _capacity(self, worker: str, st: WorkerWork) -> int | None:
        e = st.engine
        if e is not None and e.kv_usage is not None and e.kv_usage >= KV_FULL and e.running:
            return e.running
        cap = self.fixed_capacity
        return cap if cap is not None else self.capacities.get(worker)

    def slot_wait(self, worker: str) -> float:
        """Seconds a request routed now would wait for a free slot (decode interference)."""
        st = self.workers.get(worker)
        if st is None:
            return 0.0
        cap = self._capacity(worker, st)
        if cap is None or cap < 1:
            return 0.0
        n = st.requests + self.others.get(worker, 0)
        if n < cap:
            return 0.0
        mean_out = st.decode_tokens / st.requests if st.requests else self.mean_output
        return (n - cap + 1) / (cap + 1) * mean_out * st.decode_s.value

    def wait(self, worker: str) -> float:
        """Predicted seconds before a request routed now starts its own prefill."""
        return self.ahead(worker) + self.slot_wait(worker)

    def ttft(self, worker: str, uncached: int, matched: int = 0) -> float:
        """Predicted time to first token of a request with ``uncached`` tokens beyond
        the ``matched`` ones the index predicts ``worker`` holds."""
        st = self.workers.get(worker)
        if st is None:
            return PRIOR_OVERHEAD_S + max(0, uncached) / PRIOR_PREFILL_TPS
        return (
            self.ahead(worker)
            + self.own_prefill(worker, uncached, matched)
            + self.slot_wait(worker)
        )

    def own_prefill(self, worker: str, uncached: int, matched: int = 0) -> float:
        """Predicted seconds of ``worker``'s prefill engine the request itself takes."""
        st = self.workers.get(worker)
        if st is None:
            return PRIOR_OVERHEAD_S + max(0, uncached) / PRIOR_PREFILL_TPS
        line = st.prefill
        expect = max(0, uncached) + (1.0 - st.trust) * max(0, matched)
        return line.intercept + expect * line.slope

    def queued_per_worker(self, workers: Iterable[str]) -> float:
        """Mean number of requests waiting for their first byte per worker of ``workers``
        (a proxy for how many requests will queue behind new work)."""
        n = total = 0
        for w in workers:
            st = self.workers.get(w)
            total += len(st.pending) if st is not None else 0
            n += 1
        return total / n if n else 0.0

    # ----------------------------------------------------------------- reading

    def snapshot(self, worker: str) -> dict[str, Any]:
        st = self.workers.get(worker) or WorkerWork()
        return {
            "prefill_tokens_queued": st.prefill_tokens,
            "requests": st.requests,
            "decode_tokens": st.decode_tokens,
            "predicted_wait_s": round(self.wait(worker), 6),
            "prefill_tokens_per_s": round(1 / st.prefill.slope, 1),
            "prefill_overhead_ms": round(st.prefill.intercept * 1000, 3),
            "prefill_samples": st.prefill.samples,
            "decode_ms_per_token": round(st.decode_s.value * 1000, 3),
            "decode_samples": st.decode_s.samples,
            "index_trust": round(st.trust, 4),
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
