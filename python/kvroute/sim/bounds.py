"""What no router can beat on a workload and fleet: a floor under TTFT and a ceiling on
the capacity at a TTFT SLO, in the fleet simulator's cost model (``sim.cost``).

They say which of the work-aware study's targets are reachable at all. A router that
routes perfectly still cannot serve a request faster than its own prefill of what no
cache could hold, nor serve more requests per second than the fleet's decode slots and
prefill engines allow. Both are relaxations (they drop constraints, never add one), so
they are bounds, not predictions: a target beyond them is out of reach for any router;
one within them is not thereby shown reachable.

**TTFT floor** (per request): the ideal cache is one infinite cache shared by the fleet
that holds every earlier request's whole sequence (prompt, and the output blocks the
simulated workers cache too) the moment it arrives. The request's cached tokens are the
leading blocks found there (capped at ``n - 1`` tokens as the workers cap them), and its
floor is the fastest worker's prefill of the rest with no queue at all:
``min over workers of overhead + uncached / prefill rate``. Every simulated TTFT is at
least its request's floor, so each percentile of the floors is at most that percentile of
any router's TTFTs.

**Capacity ceiling** at ``TTFT quantile <= SLO``: the arrivals are the benchmark's
Poisson draw scaled to the rate (``bench/work_aware.py``'s ``at_rate``: the draw at rate
``r`` is the draw at rate 1 divided by ``r``). A rate is feasible only if each of three
relaxations admits enough requests on time (``good_needed``: as many as
``numpy.percentile`` needs below the SLO):

* *decode slots*: a request answered within the SLO holds one of the fleet's slots
  (``sum of max_batch``) at least from ``arrival + SLO`` to ``arrival + floor + decode``
  (its decode at one token per ``decode_s_per_token``, the fastest a batch runs). The
  most requests whose intervals never overlap more than the slot count is found exactly
  by the greedy of earliest end (max k-colourable subgraph of an interval graph).
* *slot volume*: the slots pooled, a request answered within the SLO takes
  ``floor + decode`` slot-seconds, all done by ``arrival + SLO + decode``, none before
  it arrives. Checked from ``ORIGINS`` arrival times ``t0`` on: the requests arriving
  from ``t0`` cannot use a slot before ``t0``, the earlier ones may all be on time, and
  the most on time among the later ones is Moore-Hodgson's algorithm (one machine,
  deadlines: in deadline order, drop the longest kept job whenever one is late).
* *prefill engines*: the same, with the fleet pooled into one machine doing, per
  second, what all prefill engines together do at best (each worker's floors per
  second at the request where its speed relative to the floor is best), each request
  needing its floor of work by ``arrival + SLO``.

The simulated decode slows with the batch (``decode_batch_slowdown``), which these
relaxations ignore: where decode slots bind, the ceiling is loose by up to that factor.
And a late request costs nothing in them (it could be served after everything else),
although its prefill may be what later requests' cache hits need (a group's cold
prompt in GSP): where a few cold prefills carry many hits, the ceiling is loose too.
The highest feasible rate is found by doubling and bisection (monotone: a faster draw
only compresses the same intervals).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence

import numpy as np

from kvroute.sim.cost import CostModel
from kvroute.sim.fleet import Prepared

# Origins (arrival quantiles) from which the volume arguments are checked.
ORIGINS = 16


def ideal_cached(prep: Prepared, *, outputs: bool = True) -> np.ndarray:
    """Per request, the prompt tokens the ideal cache holds when it arrives (module doc).
    ``outputs``: earlier requests' output blocks count too (the workers cache them)."""
    seen: set[int] = set()
    bs = prep.block_size
    out = np.zeros(len(prep.requests), dtype=np.int64)
    for i, (req, keys) in enumerate(zip(prep.requests, prep.keys, strict=True)):
        n = len(req.tokens)
        prompt = keys[: n // bs]
        lo, hi = 0, len(prompt)  # the seen set is prefix-closed: binary search
        while lo < hi:
            mid = (lo + hi) // 2
            if int(prompt[mid]) in seen:
                lo = mid + 1
            else:
                hi = mid
        out[i] = min(lo, max(n - 1, 0) // bs) * bs
        seen.update((keys if outputs else prompt)[lo:].tolist())
    return out


def ttft_floor(prep: Prepared, costs: Sequence[CostModel]) -> np.ndarray:
    """Per request, the least TTFT any router could give it (module doc), seconds."""
    uncached = np.array([len(r.tokens) for r in prep.requests]) - ideal_cached(prep)
    per = [c.overhead_s + uncached / c.prefill_tokens_per_s for c in set(costs)]
    out: np.ndarray = np.minimum.reduce(per)
    return out


def good_needed(n: int, quantile: float) -> int:
    """How many of ``n`` values must be <= the SLO for numpy's (linear) percentile at
    ``quantile`` to be <= it: the value at ``floor(q (n - 1))`` must be."""
    return math.floor(quantile * (n - 1)) + 1 if n else 0


def most_in_slots(starts: np.ndarray, ends: np.ndarray, slots: int) -> int:
    """Most intervals ``[start, end)`` kept with never more than ``slots`` overlapping."""
    order = np.argsort(ends, kind="stable")
    tracks: list[float] = []  # sorted end times of the intervals each slot holds last
    kept = 0
    for i in order:
        s, e = float(starts[i]), float(ends[i])
        k = bisect.bisect_right(tracks, s)
        if k:  # the slot whose last interval ended latest, no later than s
            tracks.pop(k - 1)
        elif len(tracks) >= slots:
            continue
        bisect.insort(tracks, e)
        kept += 1
    return kept


def most_on_time(work: np.ndarray, deadlines: np.ndarray, origin: float, speed: float) -> int:
    """Most jobs done by their deadline on one machine of ``speed`` from ``origin``
    (Moore-Hodgson: in deadline order, drop the longest kept job whenever late)."""
    order = np.argsort(deadlines, kind="stable")
    kept: list[float] = []
    total = 0.0
    for i in order:
        w = float(work[i])
        heapq.heappush(kept, -w)
        total += w
        if total > speed * (float(deadlines[i]) - origin) + 1e-12:
            total += heapq.heappop(kept)
    return len(kept)


def feasible(
    floor: np.ndarray,
    decode: np.ndarray,
    arrivals: np.ndarray,
    slots: int,
    speed: float,
    slo: float,
    quantile: float,
) -> bool:
    """Could any router keep the TTFT ``quantile`` within ``slo`` (module doc)?"""
    need = good_needed(len(floor), quantile)
    if int((floor <= slo).sum()) < need:
        return False
    binding = floor + decode > slo
    free = int((~binding & (floor <= slo)).sum())
    fits = binding & (floor <= slo)
    a = arrivals[fits]
    in_slots = free + most_in_slots(a + slo, a + floor[fits] + decode[fits], slots)
    if in_slots < need:
        return False
    ok = floor <= slo
    slot_work = (floor + decode)[ok] / slots
    slot_due = (arrivals + slo + decode)[ok]
    prefill_due = arrivals[ok] + slo
    a = arrivals[ok]
    order = np.sort(a)
    for k in np.unique(np.linspace(0, len(order) - 1, ORIGINS).astype(int)):
        # The requests arriving from t0 on cannot use a slot or a prefill engine
        # before t0; the earlier ones may all be on time.
        t0 = float(order[k])
        after = a >= t0
        budget = need - (len(a) - int(after.sum()))
        if budget <= 0:
            continue
        if most_on_time(slot_work[after], slot_due[after], t0, 1.0) < budget:
            return False
        if most_on_time(floor[ok][after], prefill_due[after], t0, speed) < budget:
            return False
    return True


def capacity_ceiling(
    prep: Prepared,
    costs: Sequence[CostModel],
    unit_arrivals: np.ndarray,
    slo: float = 2.0,
    quantile: float = 0.9,
    bisect_steps: int = 12,
) -> float:
    """Highest rate at which some router might keep TTFT ``quantile`` <= ``slo``, an
    upper bound (module doc); ``unit_arrivals``: the arrival draw at rate 1."""
    floor = ttft_floor(prep, costs)
    out = np.array([r.output_len for r in prep.requests], dtype=np.float64)
    decode = np.maximum(out - 1, 0) * min(c.decode_s_per_token for c in costs)
    slots = sum(c.max_batch for c in costs)
    uncached = np.array([len(r.tokens) for r in prep.requests]) - ideal_cached(prep)
    # Worker w does request i's floor of work in t_w(i) >= floor(i) seconds: at most
    # max_i floor(i) / t_w(i) floors per second.
    speed = sum(
        float(np.max(floor / np.maximum(c.overhead_s + uncached / c.prefill_tokens_per_s, 1e-12)))
        for c in costs
    )

    def ok(rate: float) -> bool:
        return feasible(floor, decode, unit_arrivals / rate, slots, speed, slo, quantile)

    lo, hi = 0.0, 1.0
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e9:
            return math.inf
    for _ in range(bisect_steps):
        mid = (lo + hi) / 2 if lo == 0 else math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
