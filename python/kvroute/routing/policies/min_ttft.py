"""min_ttft: send each request where its first token is predicted to come back soonest.

For every healthy worker ``w`` the policy asks the work model (``kvroute.routing.load``)::

    uncached(w) = request tokens - tokens of its prefix the index predicts w holds
    ttft(w)     = (prefill work queued on w + uncached(w)) / w's learned prefill rate
                  + slot wait on w (decode interference: no free slot until a running
                  request ends)

and picks the worker of least **cost**: ``ttft(w) + L * own(w)``, where ``own(w)`` is the
request's own share of it (its prefill seconds there) and ``L`` the mean number of
requests waiting for their first byte per healthy worker. The second term is the delay
this request's prefill adds to the requests that will queue behind it (FIFO: each of
them waits ``own(w)`` longer; about ``L`` of them, by Little's law at the current load).
Pure TTFT (``L`` = 0, an idle fleet) would spread a hot prefix to an idle worker as soon
as the holder's queue exceeds one cold prefill, and at high load those extra cold
prefills (more total work, a lower hit rate) are what saturates the fleet; the term
makes a miss cost more the busier the fleet is. A long match lowers ``uncached`` and so
wins while the holder's queue is short; once the queue ahead of it costs more than the
prefill its cache saves (counted ``1 + L`` times), a faster or idler worker wins and
starts to hold the prefix too. Nothing compares request
counts: a 100,000-token prompt weighs what it costs, and a slower worker (learned rate)
gets proportionally less work. The cost is stretched by ``1 / (1 - n / capacity)`` for
the ``n`` decode slots taken on ``w`` (``LoadModel.stretch``): the later requests of a
prefix follow it, so cold work goes where slots are free and hits stay home.

Ties (predictions within 1 ms or 2% of the best: the model is not more precise than
that): the longer match, when it saves more than that window of prefill time (a
few-token partial match such as a shared "Group " before different prompts must not
send every new prefix to one worker), then the fewer requests in flight (their decode
will compete for slots later), then rotation (never "first worker wins").

``temperature`` > 0 (``--router-temperature``, seconds): sample a worker with
probability proportional to exp(-(ttft - best) / T) instead, which spreads a burst that
arrives between two load updates; 0 (default) is deterministic.

Once the index's budget has evicted anything, the prompts of requests in flight are
kept too and a worker's match is the longer of the index's and theirs (an engine never
evicts a running request's blocks; ``cache_aware``'s module doc, ``pending_prompts``).

The request's tokens are inserted into the index for the chosen worker (as cache_aware
does); the caller reserves the predicted work (``LoadModel.reserve``) in the same step,
so the next decision already sees it. Reasons: ``cache_hit`` (the chosen worker holds
the longest match), ``overflow`` (a worker with a longer match was passed over because
its queue costs more than the prefill it saves), ``cache_miss`` (no worker holds any of
the prompt, or only a prefix whose prefill saving is within the tie window: a few
leading tokens shared by chance are no hit, and passing them over is no overflow).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from kvroute._native import PrefixIndex
from kvroute.routing.load import LoadModel
from kvroute.routing.policies._common import (
    KeepsPromptsInFlight,
    PendingPrompts,
    TieBreaker,
    tie_window,
)
from kvroute.routing.policies.base import Decision, NoWorkerError, Policy, Reason, RouteRequest


class MinTtft(KeepsPromptsInFlight, Policy):
    name = "min_ttft"

    def __init__(
        self,
        index: PrefixIndex,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        pending_prompts: bool = True,
    ) -> None:
        if temperature < 0:
            raise ValueError("router temperature must be >= 0")
        self.index = index
        self.temperature = temperature
        self.work = LoadModel()  # the caller shares its own (state / simulator)
        self._rng = random.Random(seed)
        self._ties = TieBreaker()
        # Prompts in flight once the index's budget has evicted (as cache_aware's).
        self.pending_prompts = pending_prompts
        self._pending = PendingPrompts(byte_tokens=getattr(index, "byte_tokens", False))

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        if not loads:
            raise NoWorkerError("no healthy worker")
        tokens = request.tokens
        n = len(tokens)
        matches = self.index.match(tokens) if n else {}
        track = bool(n) and self._budget_evicted()
        # Per worker, the longest prefix one of its requests in flight shares: no new KV
        # room needed for it, for the work reservation (None: not kept, before the
        # index's budget evicted).
        in_flight: dict[str, int] | None = None
        if track:
            in_flight = self._pending.per_worker(tokens)
            matches = PendingPrompts.raised(matches, in_flight) or matches
        work = self.work
        behind = work.queued_per_worker(loads)
        pred = work.predict(loads, n, matches)
        scored = [(pred.cost(w, behind), -matches.get(w, 0), w) for w in loads]
        best_t = min(s[0] for s in scored)
        tie = tie_window(best_t)
        if self.temperature > 0 and len(scored) > 1:
            worker = self._sample(scored)
        else:
            near = [s for s in scored if s[0] - best_t <= tie]
            # Prefill time each near worker's match saves; a longer match wins only
            # by more than the tie window.
            saved = {w: -m / work.prefill_rate(w) for _, m, w in near}
            most = max(saved.values())
            worker = self._ties.least_loaded(
                {w: loads[w] for w, s in saved.items() if most - s <= tie}
            )
        matched = matches.get(worker, 0)
        longest, holder = max(((m, w) for w, m in matches.items()), default=(0, worker))
        reason: Reason
        if longest == 0 or longest / work.prefill_rate(holder) <= tie:
            # Nothing held, or a few tokens shared by chance: a tie, deciding nothing.
            reason = "cache_miss"
        elif matched >= longest:
            reason = "cache_hit"
        else:
            reason = "overflow"
        decision = Decision(worker, reason, matched, cached_tokens=matched)
        if in_flight is not None:
            decision.kv_tokens = n - in_flight.get(worker, 0)
        if n:
            decision.held_before = self.index.insert(worker, tokens)
            if track or self._budget_evicted():
                decision.ticket = self._pending.add(worker, tokens)
        return decision

    def _sample(self, scored: Sequence[tuple[float, int, str]]) -> str:
        best = min(s[0] for s in scored)
        weights = [math.exp(-(t - best) / self.temperature) for t, _, _ in scored]
        return self._rng.choices([w for _, _, w in scored], weights)[0]

    def on_worker_added(self, worker: str) -> None:
        self.index.add_worker(worker)
        self.work.add_worker(worker)
