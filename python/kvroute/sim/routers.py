"""The router side of the fleet simulation: router replicas, traffic that bypasses them,
and precise mode's event feed.

What an approximate router cannot see, modelled so precise mode can be judged on it:

* **Router replicas** (an HA deployment, ``replicas`` > 1). ``kvroute serve`` keeps its
  state per process: its approximate index holds what *it* routed, its loads are the
  requests *it* sent and has not seen end (``workers.Registry``). Here each replica is its
  own policy instance with its own ``PrefixIndex`` (budgeted alike) and its own
  loads, and routed requests are dealt to the replicas in turn (a round-robin load
  balancer in front of them). What the replicas share is what they read from the
  engines: the saturation guard's capacities come from the engines' ``/metrics`` (one
  ``CapacityLearner`` for all, observing the engine's own running/waiting counts), and in
  precise mode every replica subscribes to every engine's events (one ``BlockIndex``
  stands for N identical copies). Each replica's pending prompts stay its own.
* **Bypass** (``bypass_fraction``): that fraction of requests goes straight to a worker
  chosen uniformly at random (a client pinned to an endpoint, a batch job): no replica
  routes it or counts its load. Its blocks reach precise mode through the events like
  any other. Which requests bypass and where they go depends only on ``seed``, so every
  policy compared sees the same bypass traffic.
* **Engine load** (``poll``): as ``serve`` reads each engine's running/waiting counts
  after its health checks, every replica learns at each poll how many requests an
  engine holds beyond its own (``others``), which the saturation guard adds to the
  replica's own load.

* **A shared store** (``store_delay_s``, ``kvroute serve --state-store``): each replica
  keys its index by block digests (``kvroute.fleet.shared.DigestIndex``) and its
  decisions reach the other replicas' indexes ``store_delay_s`` later (the Redis round
  trip and the reader's wake-up); so does each replica's load per worker whenever it
  changes (requests in flight, those waiting for a first byte, their uncached tokens),
  which the others add to their own, as ``kvroute.fleet.shared.loads`` publishes and
  applies it. A load change alone waits as ``serve``'s publisher makes it wait
  (``store_linger_s``): a decision takes it along, so does the first change made
  ``store_linger_s`` or more after it, and otherwise the replica's next heartbeat
  writes it (``heartbeat_s``, each replica's beats a fraction of an interval apart).
  Heartbeats expire nothing here: no replica crashes. Routing on bytes with budgets from
  the engines, each replica learns its bytes per token and all budget with the oldest
  one's (replica 0's, as soon as it learned one; serve publishes it with the heartbeat).

Work (``kvroute.routing.load``): each replica keeps its own ``LoadModel``, shared with
its policy (``min_ttft``, ``cache_aware`` on the work metric), and reserves each routed
request's predicted work in the same step as its load, exactly as ``serve`` does; the
fleet reports first bytes (``first_byte``) and ends (``done``) in virtual time, which is
how the replicas learn each worker's speed. Engine polls also feed each replica's model
(running and waiting counts).

Precise mode in virtual time (``InstantEvents``): the caches report straight into the
``BlockIndex`` as they store, evict and clear blocks (no wire, no loss, no delay) and
every worker is trusted, as the router does with ``--kv-events`` and every worker
``precise``.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import Counter, deque
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, cast

import numpy as np

from kvroute._native import BlockIndex, PrefixIndex
from kvroute.config import Settings
from kvroute.fleet.budget import IndexBudget
from kvroute.fleet.engine_load import CapacityLearner
from kvroute.fleet.shared import DigestIndex
from kvroute.routing.load import LoadModel, Ticket
from kvroute.routing.policies.base import Decision, Policy, RouteRequest
from kvroute.sim.cache import PrefixCache

PolicyFactory = Callable[[PrefixIndex], Policy]


class InstantEvents:
    """Precise mode in virtual time: caches report straight into a ``BlockIndex``; every
    worker is trusted (the ``PreciseSource`` the policy asks)."""

    def __init__(self, workers: Sequence[str]) -> None:
        self.index = BlockIndex()
        self.trusted = set(workers)

    def match(self, tokens: Sequence[int]) -> tuple[dict[str, int], set[str]]:
        return self.index.match(tokens), self.trusted

    def cache(self, worker: str, capacity_tokens: int, block_size: int) -> PrefixCache:
        index = self.index

        def stored(hashes: list[int], parent: int | None, ids: list[int], bs: int) -> None:
            index.stored(worker, parent, hashes, ids, bs)

        def removed(hashes: list[int]) -> None:
            index.removed(worker, hashes)

        def cleared() -> None:
            index.clear_worker(worker)

        return PrefixCache(
            capacity_tokens, block_size, on_store=stored, on_remove=removed, on_clear=cleared
        )


def bypass_plan(n: int, fraction: float, workers: int, seed: int) -> list[int]:
    """Per request (arrival order): the worker it goes to directly, or -1 (routed)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("bypass fraction must be within [0, 1]")
    if fraction == 0.0 or n == 0:
        return [-1] * n
    rng = np.random.default_rng([seed, 0xB1A5])  # apart from the workload's own stream
    goes = rng.random(n) < fraction
    where = rng.integers(0, workers, n)
    return np.where(goes, where, -1).tolist()  # type: ignore[no-any-return]


# serve's defaults (--tree-size-fallback, --max-total-tree-size).
TREE_SIZE_FALLBACK = Settings.tree_size_fallback
MAX_TOTAL_TREE_SIZE = Settings.max_total_tree_size


class RouterTier:
    """``replicas`` instances of one policy in front of ``names``; see the module doc."""

    def __init__(
        self,
        make: PolicyFactory,
        names: Sequence[str],
        *,
        replicas: int = 1,
        max_tree_size: int | None = None,
        learner: CapacityLearner | None = None,
        events: InstantEvents | None = None,
        store_delay_s: float | None = None,
        store_linger_s: float = 0.0,
        heartbeat_s: float = 0.5,
        worker_budgets: Sequence[int] | None = None,
        index_in_bytes: bool = False,
        kv_waits: bool = True,
    ) -> None:
        if replicas < 1:
            raise ValueError("router replicas must be >= 1")
        self.names = list(names)
        self.shared = store_delay_s is not None
        self.store_delay_s = store_delay_s or 0.0
        # A load change alone waits this long for company, as serve's publisher makes it
        # (``fleet.shared.publishing.LOAD_LINGER_S``).
        self.store_linger_s = store_linger_s
        self.heartbeat_s = heartbeat_s
        # Published decisions in flight to the store: (visible at, publisher, worker, digests).
        self._wire: deque[tuple[float, int, str, bytes]] = deque()
        # Published load, whenever it changes: (visible at, publisher, worker, (its
        # requests in flight there, those waiting for a first byte, their uncached
        # tokens), when its decoding ones there end, in seconds from the change).
        self._work_wire: deque[tuple[float, int, str, tuple[int, int, int], list[float]]] = deque()
        self._now = 0.0
        self._in_bytes = index_in_bytes
        # Per replica, its index budgets (serve's IndexBudget) and index, when budgeted by
        # the engines: routing on bytes, the bytes per token are learned as serve does.
        self._plans: list[tuple[IndexBudget, Any] | None] = []
        if self.shared:
            self.indexes = [
                cast(DigestIndex, self._index(max_tree_size, worker_budgets, DigestIndex))
                for _ in range(replicas)
            ]
            for k, ix in enumerate(self.indexes):
                ix.on_insert = self._publisher(k)
            self.policies = [make(cast(PrefixIndex, ix)) for ix in self.indexes]
        else:
            self.policies = [
                make(self._index(max_tree_size, worker_budgets)) for _ in range(replicas)
            ]
        # Per replica: the workers whose load changed since its last write, when the
        # oldest of those changes came (its wait ends at the latest with the replica's
        # next heartbeat), and whether a write is due at the end of the current step (a
        # decision published, or a change that found the oldest waiting long enough).
        self._dirty: list[set[str]] = [set() for _ in self.policies]
        self._first_change: list[float | None] = [None] * len(self.policies)
        self._decided = [False] * len(self.policies)
        self.peer: list[dict[str, int]] = [dict.fromkeys(self.names, 0) for _ in self.policies]
        self.loads: list[dict[str, int]] = [dict.fromkeys(self.names, 0) for _ in self.policies]
        self.others: list[dict[str, int]] = [dict.fromkeys(self.names, 0) for _ in self.policies]
        # Per replica, the others' requests waiting for a first byte and their prefill
        # tokens per worker (summed), and each other's last published values.
        self.peer_pending = [dict.fromkeys(self.names, 0) for _ in self.policies]
        self.peer_prefill = [dict.fromkeys(self.names, 0) for _ in self.policies]
        self._heard: list[dict[tuple[int, str], tuple[int, int, int]]] = [{} for _ in self.policies]
        # Per replica, the others' decoding requests' ends per worker (merged), and each
        # other's last published list (``SharedLoad``'s ends, in virtual time).
        self.peer_ends: list[dict[str, list[tuple[float]]]] = [{} for _ in self.policies]
        self._heard_ends: list[dict[tuple[int, str], list[tuple[float]]]] = [
            {} for _ in self.policies
        ]
        self.learner = learner
        # Decisions by reason, over every replica (serve's kvroute_routing_decisions_total).
        self.reasons: Counter[str] = Counter()
        self.work = [LoadModel() for _ in self.policies]
        for pol, model in zip(self.policies, self.work, strict=True):
            if learner is not None:
                model.capacities = learner.capacities
                model.capacity_floors = learner.floors
            model.fixed_capacity = getattr(pol, "worker_capacity", None)
            k = self.policies.index(pol)
            model.others = self.others[k]
            model.clock = self._clock
            if self.shared:  # as serve does with its StateStore
                model.peer = self.peer[k]
                model.peer_pending = self.peer_pending[k]
                model.peer_prefill = self.peer_prefill[k]
                model.peer_ends = self.peer_ends[k]
                model.on_change = self._work_publisher(k)
            budgeted = self._plans[k]
            if budgeted is not None and kv_waits:
                # The engines' KV capacities, as serve reads them: the work model
                # predicts waits for room (unless the simulated engines never wait).
                model.kv_capacity = budgeted[0].kv_units
            if getattr(pol, "work", None) is not None:
                pol.work = model  # type: ignore[attr-defined]
            for w in self.names:
                model.add_worker(w)
        for pol in self.policies:
            for w in self.names:
                pol.on_worker_added(w)
            if learner is not None and hasattr(pol, "capacities"):
                pol.capacities = learner.capacities
            if hasattr(pol, "others"):
                pol.others = self.others[self.policies.index(pol)]
            if events is not None:
                if not hasattr(pol, "precise"):
                    raise ValueError(f"{pol.name}: only cache_aware has a precise mode")
                pol.precise = events
        self._next = 0
        # request -> (replica, its decision, its work): released when the request ends.
        self._open: dict[int, tuple[int, Decision, Ticket]] = {}

    def _index(
        self,
        max_tree_size: int | None,
        budgets: Sequence[int] | None,
        kind: Callable[[int | None], Any] = PrefixIndex,
    ) -> Any:
        """A replica's index (``kind``: ``PrefixIndex``, or ``DigestIndex`` with a store),
        budgeted as serve budgets it: ``max_tree_size`` when given (``--max-tree-size``),
        else each worker's KV capacity as its engine reports it (``budgets``, in tokens),
        through serve's own ``IndexBudget``; neither: unbounded."""
        if max_tree_size is not None or budgets is None:
            self._plans.append(None)
            return kind(max_tree_size)
        if len(budgets) != len(self.names):
            raise ValueError("worker_budgets must give one budget per worker")
        plan = IndexBudget(
            TREE_SIZE_FALLBACK,
            MAX_TOTAL_TREE_SIZE,
            index_in_bytes=self._in_bytes,
            learn_scale=True,
            follows=self.shared,
        )
        plan.reported.update(zip(self.names, budgets, strict=True))
        index = kind(plan.budget_for("", 1))
        plan.apply(index, self.names)
        self._plans.append((plan, index))
        return index

    def _publisher(self, k: int) -> Callable[[str, bytes], None]:
        def publish(worker: str, digests: bytes) -> None:
            self._wire.append((self._now + self.store_delay_s, k, worker, digests))
            self._decided[k] = True  # the load changes waiting go with it (``_wrote``)

        return publish

    def _work_publisher(self, k: int) -> Callable[[str], None]:
        def publish(worker: str) -> None:
            if self.store_linger_s <= 0.0:
                self._send_load(k, worker, self._now)
                return
            self._dirty[k].add(worker)
            first = self._first_change[k]
            if first is None:
                self._first_change[k] = self._now
            elif self._now - first >= self.store_linger_s:
                self._decided[k] = True  # written at the end of this step (``_wrote``)

        return publish

    def _next_beat(self, k: int, t: float) -> float:
        """Replica ``k``'s first heartbeat after ``t`` (the replicas' beats spread
        evenly over an interval)."""
        hb = self.heartbeat_s
        phase = hb * k / len(self.policies)
        return phase + (math.floor((t - phase) / hb) + 1) * hb

    def _send_load(self, k: int, worker: str, now: float) -> None:
        """Replica ``k``'s load on ``worker`` as of ``now``, written then."""
        st = self.work[k].state(worker)
        at = now + self.store_delay_s
        load = (st.requests, len(st.pending), st.prefill_tokens)
        # As serve publishes them: seconds from now, read at delivery on the
        # receiver's clock (so they arrive the store's delay late, as there).
        ends = self.work[k].decoding_ends(worker, now)
        wire = self._work_wire
        entry = (at, k, worker, load, ends)
        if wire and wire[-1][0] > at:  # a linger's end, written before a later change
            insort(wire, entry, key=itemgetter(0))
        else:
            wire.append(entry)

    def _write_load(self, k: int, now: float) -> None:
        """Replica ``k`` writes every load change waiting, as of ``now``."""
        for worker in sorted(self._dirty[k]):
            self._send_load(k, worker, now)
        self._dirty[k].clear()
        self._first_change[k] = None

    def _lingered(self, now: float) -> None:
        """Before handling an event at ``now``: the replicas whose wait ended by then
        write their changes at that end (nothing of theirs changed since: every change
        goes through an event, and this runs first)."""
        ends = [
            (self._next_beat(k, f), k) for k, f in enumerate(self._first_change) if f is not None
        ]
        for until, k in sorted(ends):
            if until <= now:
                self._write_load(k, until)

    def _wrote(self, k: int, now: float) -> None:
        """After replica ``k``'s step: a decision it published, or a change that found
        the oldest waiting ``store_linger_s`` old, took the waiting load changes along
        (serve: written together at the end of the event-loop turn)."""
        if self._decided[k]:
            self._decided[k] = False
            if self._dirty[k]:
                self._write_load(k, now)

    def _sync(self, now: float) -> None:
        """Deliver the decisions and the load changes visible by ``now``."""
        wire = self._wire
        while wire and wire[0][0] <= now:
            _, k, worker, digests = wire.popleft()
            for j, ix in enumerate(self.indexes):
                if j != k:
                    ix.insert_digests(worker, digests)
        work = self._work_wire
        while work and work[0][0] <= now:
            at, k, worker, load, ends = work.popleft()
            for j, heard in enumerate(self._heard):
                if j != k:
                    was = heard.get((k, worker), (0, 0, 0))
                    heard[k, worker] = load
                    self.peer[j][worker] += load[0] - was[0]
                    before = self.peer_pending[j][worker]
                    self.peer_pending[j][worker] = after = before + load[1] - was[1]
                    self.work[j].peer_queue_moved(worker, before, after, load[2] != was[2], at)
                    self.peer_prefill[j][worker] += load[2] - was[2]
                    heard_ends = self._heard_ends[j]
                    heard_ends[k, worker] = [(at + d,) for d in ends]
                    merged = sorted(
                        e for (i, w), got in heard_ends.items() if w == worker for e in got
                    )
                    if merged:
                        self.peer_ends[j][worker] = merged
                    else:
                        self.peer_ends[j].pop(worker, None)

    def _clock(self) -> float:
        """The virtual time of the event being handled (the work models' clock)."""
        return self._now

    def route(self, r: int, request: RouteRequest, now: float = 0.0, output_len: int = 1) -> str:
        """The next replica in turn routes request ``r`` and reserves its load and its
        predicted work (``output_len``: the request's ``max_tokens``)."""
        k = self._next
        self._next = (k + 1) % len(self.policies)
        loads = self.loads[k]
        seen = loads
        self._now = now
        if self.shared:
            self._lingered(now)
            self._sync(now)
            peer = self.peer[k]
            seen = {w: n + peer[w] for w, n in loads.items()}
        decision = self.policies[k].select(request, seen)
        self.reasons[decision.reason] += 1
        loads[decision.worker] += 1
        cached = decision.cached_tokens
        if cached is None:
            cached = decision.matched_tokens
        model = self.work[k]
        n = len(request.tokens)
        ticket = model.reserve(
            decision.worker, n - cached, output_len, now, cached, kv=decision.kv_tokens
        )
        self._open[r] = (k, decision, ticket)
        if self.shared:
            self._wrote(k, now)
        return decision.worker

    def ticket(self, r: int) -> Ticket | None:
        opened = self._open.get(r)
        return opened[2] if opened is not None else None

    def first_byte(self, r: int, now: float) -> None:
        """Request ``r``'s first token came out (its prefill work is done)."""
        opened = self._open.get(r)
        if opened is not None:
            self._now = now
            if self.shared:
                self._lingered(now)
            opened[2].first_byte(now)
            if self.shared:
                self._wrote(opened[0], now)

    def done(self, r: int, now: float = 0.0, output_tokens: int | None = None) -> None:
        """Request ``r`` ended: its replica releases the load (bypass requests: nothing)."""
        opened = self._open.pop(r, None)
        if opened is None:
            return
        k, decision, ticket = opened
        self._now = now
        if self.shared:
            self._lingered(now)
        ticket.end(now, output_tokens)
        if self.shared:
            self._wrote(k, now)
        budgeted = self._plans[k]
        if budgeted is not None:  # the simulated engines count the IDs it was routed as
            plan, index = budgeted
            if plan.observe(ticket.prompt_tokens, ticket.prompt_tokens):
                plan.apply(index, self.names)
            if self.shared:
                self._agree_scale()
        self.loads[k][decision.worker] -= 1
        if decision.ticket is not None:
            self.policies[k].on_done(decision)
        if self.shared:
            self._wrote(k, now)

    def _agree_scale(self) -> None:
        """With a store: every replica budgets with the oldest one's learned scale."""
        oldest = next((p[0].learned for p in self._plans if p and p[0].learned), None)
        if oldest is None:
            return
        for budgeted in self._plans:
            if budgeted is not None and budgeted[0].adopt(oldest):
                budgeted[0].apply(budgeted[1], self.names)

    def poll(
        self,
        engine: Sequence[int],
        waiting: Sequence[int] | None = None,
        kv_usage: Sequence[float] | None = None,
    ) -> None:
        """Each engine's running + waiting count (per worker, in ``names`` order) as
        the replicas read it: what each holds beyond a replica's own requests (and, with a
        store, beyond the others' it knows of). ``waiting``: the waiting part, per worker,
        and ``kv_usage`` each KV cache's use (0..1, vLLM's ``kv_cache_usage_perc``; both
        feed the work models)."""
        for i, (w, held) in enumerate(zip(self.names, engine, strict=True)):
            self.poll_one(
                w,
                held,
                waiting[i] if waiting is not None else None,
                kv_usage[i] if kv_usage is not None else None,
            )

    def poll_one(
        self, worker: str, held: int, waiting: int | None, kv_usage: float | None = None
    ) -> None:
        """``poll`` for one worker (``held``: its engine's running + waiting count)."""
        for loads, others, peer, model in zip(
            self.loads, self.others, self.peer, self.work, strict=True
        ):
            others[worker] = max(0, held - loads[worker] - peer[worker])
            if waiting is not None:
                model.observe_engine(worker, held - waiting, waiting, kv_usage)

    def routed_to(self, worker: str) -> int:
        """Requests in flight on ``worker`` as the replicas see them (theirs and, with a
        store, the others' they know of): the most any replica sees."""
        return max(
            loads[worker] + peer[worker] for loads, peer in zip(self.loads, self.peer, strict=True)
        )

    def in_flight(self) -> int:
        return sum(sum(loads.values()) for loads in self.loads)
