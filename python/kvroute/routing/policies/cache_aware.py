"""cache_aware: send a request where its prefix is cached, unless the fleet is imbalanced.

SGLang's rule with its defaults, on token IDs:

1. ``loads`` are in-flight requests per *healthy* worker, as reserved by the router at
   the moment of each choice (a burst cannot all see the same idle worker).
2. Imbalanced fleet: ``max - min > balance_abs_threshold`` (64) **and**
   ``max > balance_rel_threshold * min`` (1.5) -> the least-loaded worker.
3. Otherwise ``match_rate = longest matched prefix / request tokens``. Above
   ``cache_threshold`` (0.3) -> among the workers holding that longest match, the least
   loaded. At or below -> the least-loaded worker of the fleet (a new prefix).
4. The request's tokens are inserted into the index for the chosen worker: the router
   predicts that the worker now caches them.

Saturation guard (kvroute's addition): a cache holder that already has as many
requests in flight as it can run would queue this one behind a full batch, which costs
more TTFT than the prefill it saves. The request then goes to the least-loaded worker
below its capacity (reason ``overflow``), and that worker starts to hold the prefix
too, so a hot prefix grows a second home instead of a hot spot. With every worker at
capacity the rule above applies unchanged. Capacities: ``worker_capacity`` for every
worker when set (the engines' max running batch), else ``capacities`` per worker as
learned from the engines' own running/waiting counts (``kvroute.fleet.engine_load``); a
worker with no known capacity is never passed over. A worker's load for the guard is
this router's in-flight requests plus ``others``: what its engine last reported running
or waiting beyond them (other router replicas' requests, clients that bypass the
router). Without it, each of N replicas sees about 1/N of an engine's load and the guard
never fires.

Precise mode (``--kv-events``): workers whose KV event stream is trusted are matched
on what they really cache (``BlockIndex``, whole blocks), the others on the predicted
index; the thresholds keep their meaning. An engine reports a prompt's blocks only once
it admits the request, so a prompt routed to a busy worker is invisible until then and
the next request with the same prefix would miss it. Until a request ends (the router
calls ``on_done``), its prompt is also kept in a small index of pending prompts, and a
trusted worker's match is the longer of what it reports and what is pending on it.

Prompts in flight (work metric). The index's budget is each engine's KV capacity
(``kvroute.fleet.budget``) and it forgets prompts in the order they were routed, but an
engine never evicts the blocks of a request it is running and stores a queued one's
when it admits it. Where the budget binds (more prompts than the caches hold), the
index so forgot prompts the engine still held: the next turn of a conversation whose
previous turn was still decoding, or a request sharing a long prefix with one still
running, was taken for a miss and prefilled cold elsewhere. Once the index has evicted
anything (``evicted_tokens``), each routed prompt is also kept in the index of pending
prompts until its request ends (``on_done``), and a worker's match, for the rule and for
the predictions alike, is the longer of the two. When the request ends its prompt is
recorded in the index again, as the engine then puts its blocks last in its eviction
order: the next turn of a conversation, sent when the answer ends, finds it there.
Before any eviction every routed prompt is still in the index and nothing more is kept.
``pending_prompts=False`` turns it off; ``--load-metric requests`` keeps the rule's
index alone.

Load metric (``load_metric``, ``--load-metric``). ``requests`` is the rule above,
exactly, ties rotating with one cursor as earlier versions did. ``work`` (default) keeps
the two thresholds on request counts, as SGLang compares them, but wherever a
*least-loaded* worker is chosen (imbalanced fleet, a miss, ties among the longest-match
holders, the guard's alternative) it takes the worker with the least predicted time to
first token for this request (``kvroute.routing.load``: queued prefill tokens and this
request's uncached tokens there over the worker's learned prefill rate, plus the wait
for a slot), so a worker with one 100k-token prompt queued is no longer "as loaded" as
one with a 200-token prompt, and a slow worker is seen as slow; equal predictions go to
the fewer requests in flight, then rotate. These choices use the prediction's
*price*: stretched by 1 / (1 - occupied decode slots / capacity), since the later
requests of a prefix follow it to its worker (``kvroute.routing.load``). The saturation
guard fires on the same count test, and then moves the request only where that costs
less than the full holder: the costs the work guard compares (below), unstretched (the
full holder's wait for a slot is in its prediction; its stretch, the capacity itself
once full, is no time the request waits). Compared on predicted TTFTs alone, a cold
prefill that answered before a slot freed won, although every request queued after it
there waits for it too; each such move took a conversation's later turns along to a
worker that had one of its own, and while a fresh router knew few capacities the moves
stacked conversations. It also fires on work, full or not:
when sending the request to the cache holder costs more than sending it to the cheapest
worker (``LoadModel.cost``: predicted TTFT plus the delay its own prefill adds to the
requests that will queue behind it, the cost ``min_ttft`` minimises), it goes there
(``overflow``). The match threshold alone follows a holder whatever is queued on it;
where prompts are huge and caches small (the index still believes in evicted prefixes)
that piled "hits" that were really cold prefills onto one worker, and the request-count
rule, blind to sizes, did better at p99. When the holder is full (a wait for a slot in
its prediction), the work guard leaves the stretch out on every worker, for the same
reason as the count guard: priced at its capacity, a hit on a fast full worker lost to
a cold prefill on a slow worker with slots free that answered seconds later. The work
guard leaves a hit where it is when nothing is queued ahead of it on the holder, no
slot wait is predicted there (the request starts at once) and the cheaper worker is no
less occupied (its stretch is not lower): then only the request's own prefill would
be sooner elsewhere. Moved for that alone (a slow holder, a fast idle worker that would
prefill the whole prompt cold sooner than the holder its uncached part), a
conversation's later turns followed it to a worker that served one of its own while the
holder idled; the two then shared one KV cache and evicted each other's turns (closed-
loop chat, 16 conversations on 16 workers: TTFT p99 10x the rule's).

Corrections to SGLang's version: min/max over healthy workers only; ties between
equally good workers go to the least loaded and then rotate (no "first worker wins",
which piles every new prefix onto one worker at low load); if the workers holding the
longest match are all unhealthy, the best healthy match is used instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeAlias

from kvroute._native import PrefixIndex, TokenIds
from kvroute.routing.load import LoadModel, Predictions
from kvroute.routing.policies._common import (
    KeepsPromptsInFlight,
    PendingPrompts,
    TieBreaker,
    tie_window,
)
from kvroute.routing.policies.base import Decision, NoWorkerError, Policy, Reason, RouteRequest

# A holder whose predicted TTFT exceeds the request's own prefill there by at most this
# fraction of it has nothing queued ahead of the request (the work guard, module doc).
IDLE_TOLERANCE = 1e-3

# A prompt as the index takes it: as routed, or as its lookup converted it.
Tokens: TypeAlias = Sequence[int] | TokenIds


class PreciseSource(Protocol):
    """What precise mode offers (``kvroute.events.PreciseView``)."""

    def match(self, tokens: Sequence[int]) -> tuple[dict[str, int], set[str]]: ...


class CacheAware(KeepsPromptsInFlight, Policy):
    name = "cache_aware"

    def __init__(
        self,
        index: PrefixIndex,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        worker_capacity: int | None = None,
        load_metric: str = "work",
        pending_prompts: bool = True,
    ) -> None:
        if load_metric not in ("requests", "work"):
            raise ValueError("load metric must be requests or work")
        self.index = index
        self.load_metric = load_metric
        # The work model (shared with the caller, who reserves into it); requests: unused.
        self.work: LoadModel | None = LoadModel() if load_metric == "work" else None
        if self.work is not None:
            self.work.fixed_capacity = worker_capacity
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.worker_capacity = worker_capacity
        # Learned per-worker capacities (used when worker_capacity is None).
        self.capacities: Mapping[str, int] = {}
        # Per worker: requests its engine holds that this router did not send.
        self.others: Mapping[str, int] = {}
        self._ties = TieBreaker(per_worker=load_metric != "requests")
        self.precise: PreciseSource | None = None
        # Prompts routed and not yet ended, one pseudo-worker "<worker>\0<n>" each: in
        # precise mode, and on the work metric once the index's budget has evicted
        # (``pending_prompts``; module doc).
        self._pending = PendingPrompts(byte_tokens=getattr(index, "byte_tokens", False))
        self.pending_prompts = pending_prompts and load_metric == "work"

    def _precise_match(
        self, tokens: Sequence[int], loads: Mapping[str, int], approx: dict[str, int] | None
    ) -> tuple[int, list[str], dict[str, int]] | None:
        """Best match over healthy workers mixing event-fed and predicted state, or None
        when no worker is in precise mode. ``approx``: the index's match, if looked up."""
        if self.precise is None:
            return None
        exact, trusted = self.precise.match(tokens)
        if not trusted:
            return None
        if approx is None:
            approx = self.index.match(tokens)
        per = {w: (exact.get(w, 0) if w in trusted else approx.get(w, 0)) for w in loads}
        for w, n in self._pending.per_worker(tokens).items():
            if w in trusted and n > per.get(w, -1) and w in loads:
                per[w] = n
        best = max(per.values(), default=0)
        return best, [w for w, m in per.items() if m == best and m > 0], per

    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        if not loads:
            raise NoWorkerError("no healthy worker")
        tokens = request.tokens
        lo = min(loads.values())
        hi = max(loads.values())
        n = len(tokens)
        matches: dict[str, int] | None = None
        # Work mode reads the per-worker matches and the longest one: one walk, and the
        # tokens it converted (``ids``) go to the insert as they are.
        looked: tuple[dict[str, int], int, list[str], Tokens] | None = None
        ids: Tokens = tokens
        track = self.precise is not None
        # Per worker, the longest prefix of the prompt one of its requests in flight
        # shares: what it needs no new room for in that KV cache (None: not kept).
        in_flight: dict[str, int] | None = None
        if self.work is not None:
            if n:
                looked = self.index.lookup(tokens)
                if not track and self._budget_evicted():
                    track = True
                    in_flight = self._pending.per_worker(looked[3])
                    looked = self._with_pending(looked, in_flight)
                matches, ids = looked[0], looked[3]
            else:
                matches = {}
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            worker = self._least(loads, None, self._predict(loads, n, matches))
            decision = self._decision(worker, "imbalance", 0, matches, n, in_flight)
            return self._record(decision, n, ids, track)
        approx = looked[0] if looked is not None else None
        precise = (
            self._precise_match(tokens, loads, approx) if n and self.precise is not None else None
        )
        if precise is not None:
            matched, healthy, per = precise
            if matches is not None:
                matches = per
        else:
            if looked is not None:
                _, matched, holders, _ = looked
            else:
                matched, holders = self.index.longest_match(tokens) if n else (0, [])
            healthy = [w for w in holders if w in loads]
        if matched and not healthy:
            # The deepest holders are down: fall back to the best healthy match.
            if approx is None:
                approx = self.index.match(tokens)
            per_worker = {w: m for w, m in approx.items() if w in loads}
            if per_worker:
                matched = max(per_worker.values())
                healthy = [w for w, m in per_worker.items() if m == matched]
            else:
                matched = 0
        reason: Reason
        pred = self._predict(loads, n, matches)
        if n and healthy and matched / n > self.cache_threshold:
            worker = self._least(loads, healthy, pred)
            reason = "cache_hit"
            # Requests expected to queue behind new work, for both guards' costs.
            work = self.work
            behind = work.queued_per_worker(loads) if work is not None and pred is not None else 0.0
            alt = self._cheaper(worker, loads, pred, behind)
            if alt is not None:
                worker, reason, matched = alt, "overflow", 0
            elif self._full(worker, loads):
                free = [w for w in loads if not self._full(w, loads)]
                if free:
                    alt = self._least(loads, free, pred)
                    if self._move_pays(alt, worker, pred, behind):
                        worker = alt
                        reason = "overflow"
                        matched = 0
        else:
            worker = self._least(loads, None, pred)
            reason = "cache_miss"
            matched = 0 if worker not in healthy else matched
        decision = self._decision(worker, reason, matched, matches, n, in_flight)
        decision.precise = precise is not None
        return self._record(decision, n, ids, track)

    def _with_pending(
        self, looked: tuple[dict[str, int], int, list[str], Tokens], in_flight: dict[str, int]
    ) -> tuple[dict[str, int], int, list[str], Tokens]:
        """The index's answer (``lookup``) with each worker's match raised to the longest
        prompt in flight there that shares the request's prefix (``in_flight``): what the
        budget evicted from the index but the engine still holds (module doc)."""
        per = PendingPrompts.raised(looked[0], in_flight)
        if per is None:
            return looked
        best = max(per.values())
        return per, best, [w for w, m in per.items() if m == best], looked[3]

    def _decision(
        self,
        worker: str,
        reason: Reason,
        matched: int,
        matches: dict[str, int] | None,
        n: int = 0,
        in_flight: dict[str, int] | None = None,
    ) -> Decision:
        """The decision; in work mode it carries what the chosen worker is predicted to
        hold (its own match, whatever the reason), for the work reservation, and the
        prompt tokens it will keep in that KV cache beyond our requests in flight there
        (when those are kept: ``in_flight``)."""
        d = Decision(worker, reason, matched)
        if matches is not None:
            d.cached_tokens = matches.get(worker, 0)
            if in_flight is not None:
                d.kv_tokens = n - in_flight.get(worker, 0)
        return d

    def _predict(
        self, loads: Mapping[str, int], n: int, matches: dict[str, int] | None
    ) -> Predictions | None:
        """This request's predicted TTFT on every healthy worker, once per decision
        (``work``; None on counts)."""
        if self.work is None or matches is None:
            return None
        return self.work.predict(loads, n, matches)

    def _least(
        self, loads: Mapping[str, int], among: Sequence[str] | None, pred: Predictions | None
    ) -> str:
        """Least loaded: by request count (``requests``) or by this request's predicted
        TTFT priced by occupancy (``work``: ``Predictions.price``); exact ties rotate."""
        if pred is None:
            return self._ties.least_loaded(loads, among)
        if among is None:
            return self._ties.least_by(pred.price, loads)
        price = pred.price
        return self._ties.least_by({w: price[w] for w in among if w in loads}, loads)

    def _move_pays(self, alt: str, holder: str, pred: Predictions | None, behind: float) -> bool:
        """Guard: does moving off the full ``holder`` to ``alt`` pay? (always, on counts;
        on work, when ``alt``'s unstretched cost is the lower: module doc; ``behind``:
        ``LoadModel.queued_per_worker``)"""
        if pred is None:
            return True
        return pred.unstretched_cost(alt, behind) < pred.unstretched_cost(holder, behind)

    def _cheaper(
        self, holder: str, loads: Mapping[str, int], pred: Predictions | None, behind: float
    ) -> str | None:
        """Work guard: the worker that costs less than the cache ``holder`` for this
        request (``LoadModel.cost``: its TTFT there plus the delay its prefill adds to
        the ``behind`` requests queued after it), or None (always, on counts)."""
        if pred is None:
            return None
        # ``Predictions.cost`` and ``unstretched_cost``, inlined (every worker, every
        # decision that reaches the guard).
        ttft, own_ = pred.ttft, pred.own
        if pred.slot[holder] > 0.0:
            # The holder is full: its wait for a slot is in its prediction, and its
            # stretch (the capacity itself) is no time the request waits. Stretched,
            # a hit on a fast full worker lost to a cold prefill on a slow one with
            # slots free that answers seconds later (module doc).
            cost = {w: ttft[w] + behind * own_[w] for w in loads}
        else:
            stretch = pred.stretch
            cost = {w: (ttft[w] + behind * own_[w]) * stretch[w] for w in loads}
        alt = self._ties.least_by(cost, loads)
        if cost[holder] - cost[alt] <= tie_window(cost[alt]):
            return None
        own = pred.own[holder]
        if (
            pred.stretch[alt] >= pred.stretch[holder]
            and pred.ttft[holder] - own <= IDLE_TOLERANCE * own
        ):
            # Nothing queued ahead of it on the holder and no wait for a slot: it starts
            # at once there, and the other worker is no less occupied. Only its own
            # prefill would be sooner there (a faster worker, cold): moved for that, the
            # prefix's later requests follow it to a worker with streams of its own
            # while the holder idles (module doc). It stays.
            return None
        return alt

    def _record(self, decision: Decision, n: int, tokens: Tokens, track: bool) -> Decision:
        """The chosen worker now holds ``tokens``, ``n`` of them (predicted; also pending
        until the request ends when ``track``: precise mode, or a budget that evicts)."""
        if n:
            decision.held_before = self.index.insert(decision.worker, tokens)
            # This insert may be the one that first evicts: kept from it on.
            if track or self._budget_evicted():
                decision.ticket = self._pending.add(decision.worker, tokens)
        return decision

    def _full(self, worker: str, loads: Mapping[str, int]) -> bool:
        cap = self.worker_capacity
        if cap is None:
            cap = self.capacities.get(worker)
        return cap is not None and loads[worker] + self.others.get(worker, 0) >= cap

    def on_worker_added(self, worker: str) -> None:
        self.index.add_worker(worker)
