"""Discrete-event simulation of a fleet in virtual time: the real policies, simulated workers.

The router side is the production code: ``kvroute.routing.policies.create_policy`` with a real
``PrefixIndex``, called exactly as the router calls it (``select`` with the in-flight
load of every worker, then one unit of load reserved on the chosen worker at once;
released when the request completes). The workers are ``PrefixCache`` + ``CostModel``,
the same pieces ``kvroute sim-worker`` runs, advanced by a heap of completion events
instead of sleeps:

* at most ``max_batch`` requests run per worker, and only as many as its KV cache holds
  the prompts of (``PrefixCache.fits``; ``FleetConfig.kv_admission``, on by default);
  the rest wait FIFO;
* a request admitted to run looks up and pins its prompt blocks (hit = leading blocks
  cached), then waits for the worker's prefill engine (one prefill at a time, FIFO),
  which takes ``cost.prefill_s(uncached)``; its first token is out at the end of it;
* the remaining tokens come at ``cost.decode_interval_s(batch)`` where ``batch`` is the
  number running on the worker when it was admitted (decode batching, approximated);
* each time the sequence (prompt + output) fills a block, an event stores and pins it
  (``PrefixCache.grow``), evicting as admission does: generated tokens take capacity
  from cached prompts as in vLLM (``FleetConfig.output_blocks``, on by default);
* completion unpins the blocks, releases the load and admits the waiting requests, from
  the head, while each fits.

Heterogeneous fleets: ``FleetConfig.worker_costs`` gives each worker its own cost model
(``heterogeneous`` builds one with some workers slower at prefill).

Work and TTFT predictions (``kvroute.routing.load``): the router tier reserves each routed
request's predicted work at decision time and is told its first token (a heap event at
that virtual time) and its end, as ``serve`` is by the proxy, so the work-aware policies
learn each worker's speed here exactly as they would in production. Per run the row's
``extra`` also reports what the work model is judged on: ``queue_wait_p99`` (TTFT minus
the request's own prefill time: the time it waited behind others), ``busy_max_over_mean``
(the busiest worker's prefill-busy seconds over the fleet mean) and ``ttft_mae_s`` /
``ttft_ratio_p50`` (predicted vs simulated TTFT of routed requests).

Precise mode: a policy written ``cache_aware+events`` gets a ``BlockIndex`` that every
worker's cache reports into as it stores, evicts and clears blocks (the events the sim
worker publishes, applied at once: no wire, no loss, no delay), and routes on it as the
router does with ``--kv-events`` and every worker ``precise``. The HTTP benchmark shows
the delay: a block is known only once its event crossed ZMQ.

Router replicas and traffic that bypasses the router (``FleetConfig.router_replicas``,
``bypass_fraction``): ``kvroute.sim.routers``. Engine restarts (``restart_every_s``):
every ``restart_every_s`` of virtual time the next worker in turn loses its whole cache
(``PrefixCache.clear``, published as ``AllBlocksCleared``); its running requests carry
on, so the router's health checks see nothing (an engine back before the next check, or
a prefix-cache reset): the approximate index keeps what it predicted there.

Block keys of every request's whole sequence (prompt, then the output the simulated
engine generates) are computed once (``prepare``) and reused by every policy run.
The upper bound is one infinite cache shared by the whole fleet: the leading blocks of
each prompt already seen in an earlier prompt, over all prompt tokens.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from kvroute._native import PrefixIndex
from kvroute.fleet.engine_load import CapacityLearner
from kvroute.fleet.health import EDGE_READ_GAP_S
from kvroute.fleet.shared.publishing import LOAD_LINGER_S
from kvroute.routing.policies.base import Policy, RouteRequest
from kvroute.sim.cache import Handle, PrefixCache, block_keys_batch, sequence
from kvroute.sim.cost import DEFAULT_BLOCK_SIZE, DEFAULT_CAPACITY_TOKENS, CostModel
from kvroute.sim.report import ResultRow, summarize
from kvroute.sim.routers import InstantEvents, PolicyFactory, RouterTier, bypass_plan
from kvroute.sim.workloads import Request, previous_turns

EVENTS_SUFFIX = "+events"


@dataclass(slots=True)
class FleetConfig:
    workers: int = 8
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    cost: CostModel = field(default_factory=CostModel)
    # The router's --max-tree-size (tokens per worker in its index). None: as serve
    # without it, each worker's budget is the KV capacity its engine reports
    # (``capacity_tokens``; kvroute.fleet.budget), or unbounded if ``engine_budgets``
    # is off (serve before it read the engines).
    max_tree_size: int | None = None
    engine_budgets: bool = True
    # The prompts' IDs are UTF-8 bytes (serve without --tokenizer): serve then counts
    # each reported token as 4 index entries (kvroute.fleet.budget.BYTES_PER_TOKEN) until
    # the answers show how many (here: one, as the simulated engines count these IDs).
    index_in_bytes: bool = False
    policy_settings: dict[str, Any] = field(default_factory=dict)
    # cache_aware learns each worker's capacity when it is first seen queueing: at once
    # (the engine observed at each arrival routed to it), or (``learn_at_polls``) as the
    # router does, only when one of its /metrics polls (every ``engine_poll_s``) finds
    # the worker with requests waiting. Over HTTP a queue that forms and drains between
    # two polls teaches nothing, and until a worker's capacity is known the work model
    # assumes the largest learned on another (none: no wait for a slot there).
    learn_capacity: bool = False
    learn_at_polls: bool = False
    # With ``learn_capacity``: every engine tells its capacity from the start, as
    # SGLang's /get_server_info does (serve reads it at a worker's first check); the
    # learning above then only matters for engines that do not (vLLM).
    capacity_reported: bool = False
    # Generated tokens take cache blocks (vLLM); off: only prompts are cached.
    output_blocks: bool = True
    # A request starts only when its prompt's blocks fit beside the running requests'
    # (vLLM, SGLang); off: whenever a decode slot is free (the model before).
    kv_admission: bool = True
    # What the approximate index cannot see (kvroute.sim.routers): independent router
    # replicas dealt requests in turn; a fraction of requests sent straight to a random
    # worker (chosen from ``seed``); a worker's cache lost every this many seconds.
    router_replicas: int = 1
    bypass_fraction: float = 0.0
    restart_every_s: float | None = None
    # With the saturation guard on, the router reads each engine's running/waiting
    # counts this often (serve: after each health check, every 5 s by default), and
    # the guard adds what an engine holds beyond the replica's own requests (other
    # replicas', bypass traffic). None: never.
    engine_poll_s: float | None = 5.0
    # With ``learn_at_polls``: a worker whose capacity is not learned has its engine
    # read again as soon as the requests routed to it exceed the most it was seen
    # running with nothing waiting, at most once per this many seconds (serve's
    # ``kvroute.fleet.health.EDGE_READ_GAP_S``; as serve, only for policies on the work
    # model). None: only the periodic polls.
    edge_read_gap_s: float | None = EDGE_READ_GAP_S
    # Each router knows every worker's prefill speed from the start (its cost model's
    # line, ``LoadModel.know``) instead of learning it from first bytes: what knowing
    # the speeds would change.
    known_speeds: bool = False
    # Per worker cost models (heterogeneous fleet); None: ``cost`` for every worker.
    worker_costs: tuple[CostModel, ...] | None = None
    # Replicas share decisions and load through a store (--state-store) whose entries
    # reach the others this much later; None: no store (kvroute.sim.routers).
    state_store_delay_s: float | None = None
    state_store_heartbeat_s: float = 0.5
    # With a store: a load change alone is written with the replica's next decision, or
    # with its first change made this long after it, or by its next heartbeat (serve's
    # ``LOAD_LINGER_S``; 0: each change written at once).
    state_store_linger_s: float = LOAD_LINGER_S
    # Requests of one group are the turns of one conversation (``workloads.multiturn``),
    # and a turn's prompt holds the answer to the one before: it is sent at its drawn
    # arrival time or when that answer has ended, whichever is later, as a chat client
    # or an agent sends it. Off: every request at its drawn time (open loop), so a
    # conversation can have several of its turns in flight at once. Groups below 0
    # (one-off prompts) are never chained.
    causal_turns: bool = False
    seed: int = 0

    def costs(self) -> list[CostModel]:
        if self.worker_costs is None:
            return [self.cost] * self.workers
        if len(self.worker_costs) != self.workers:
            raise ValueError("worker_costs must give one cost model per worker")
        return list(self.worker_costs)


def heterogeneous(cost: CostModel, workers: int, slow: int, factor: float) -> tuple[CostModel, ...]:
    """``workers`` cost models, the last ``slow`` of them prefilling at ``factor`` x speed."""
    if not 0 <= slow <= workers or factor <= 0:
        raise ValueError("slow workers must be within [0, workers] and factor > 0")
    slowed = replace(cost, prefill_tokens_per_s=cost.prefill_tokens_per_s * factor)
    return tuple(cost if i < workers - slow else slowed for i in range(workers))


@dataclass(slots=True)
class Prepared:
    """A workload sorted by arrival, with the block keys of each request's sequence
    (``cache.sequence``: prompt, then output) computed once; the prompt's come first."""

    requests: list[Request]
    keys: list[np.ndarray]
    block_size: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)


def prepare(
    requests: Sequence[Request], block_size: int = DEFAULT_BLOCK_SIZE, chunk: int = 1024
) -> Prepared:
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    keys: list[np.ndarray] = []
    for i in range(0, len(reqs), chunk):  # sequences built a chunk at a time (memory)
        seqs = [sequence(r.tokens, r.output_len) for r in reqs[i : i + chunk]]
        keys += block_keys_batch(seqs, block_size)
    return Prepared(reqs, keys, block_size)


def upper_bound(prep: Prepared) -> float:
    """Hit rate of one infinite cache shared by the fleet (blocks seen before / tokens).

    A key names its whole prefix and every prompt adds all its keys, so the set of keys
    seen is prefix-closed: the leading blocks seen before are found by binary search, and
    only the keys after them are new.
    """
    seen: set[int] = set()
    bs = prep.block_size
    hit = total = 0
    for req, keys in zip(prep.requests, prep.keys, strict=True):
        n = len(req.tokens)
        total += n
        keys = keys[: n // bs]  # the prompt's blocks
        lo, hi = 0, len(keys)  # keys[:lo] seen, keys[hi:] not seen
        while lo < hi:
            mid = (lo + hi) // 2
            if int(keys[mid]) in seen:
                lo = mid + 1
            else:
                hi = mid
        hit += min(lo, max(n - 1, 0) // bs) * bs
        seen.update(keys[lo:].tolist())
    return hit / total if total else 0.0


def worker_names(n: int) -> list[str]:
    return [f"http://sim-{i}:8000" for i in range(n)]


def _factory(policy: str | PolicyFactory, cfg: FleetConfig) -> tuple[str, PolicyFactory]:
    if not isinstance(policy, str):
        return getattr(policy, "name", "custom"), policy
    from kvroute.routing.policies import create_policy

    name = policy.removesuffix(EVENTS_SUFFIX)
    settings = dict(cfg.policy_settings)
    seed = settings.pop("seed", 0)
    seeds = itertools.count(seed or 0)  # router replicas: one seed each

    def make(index: PrefixIndex) -> Policy:
        return create_policy(name, index, seed=None if seed is None else next(seeds), **settings)

    return name, make


def simulate(
    prep: Prepared,
    policy: str | PolicyFactory,
    cfg: FleetConfig,
    *,
    name: str | None = None,
    record: bool = False,
) -> ResultRow:
    """Run ``prep`` through a fresh fleet routed by ``policy``; one result row.

    ``record``: also return, in ``extra``, each request's worker index (``assigned``),
    cached prompt tokens (``cached``), TTFT and end-to-end time in seconds (``ttft``,
    ``e2e``) and when it was sent (``sent``: its drawn arrival, or later with
    ``causal_turns``), in the order of ``prep.requests`` (to compare with the HTTP path).
    """
    if prep.block_size != cfg.block_size:
        raise ValueError("workload prepared with a different block size")
    pname, make = _factory(policy, cfg)
    names = worker_names(cfg.workers)
    widx = {w: i for i, w in enumerate(names)}
    nw = cfg.workers
    events: InstantEvents | None = None
    if isinstance(policy, str) and policy.endswith(EVENTS_SUFFIX):
        events = InstantEvents(names)
        pname = policy
        caches = [events.cache(w, cfg.capacity_tokens, cfg.block_size) for w in names]
    else:
        caches = [PrefixCache(cfg.capacity_tokens, cfg.block_size) for _ in range(nw)]
    learner = CapacityLearner() if cfg.learn_capacity else None
    tier = RouterTier(
        make,
        names,
        replicas=cfg.router_replicas,
        max_tree_size=cfg.max_tree_size,
        worker_budgets=[cfg.capacity_tokens] * nw if cfg.engine_budgets else None,
        index_in_bytes=cfg.index_in_bytes,
        learner=learner,
        events=events,
        store_delay_s=cfg.state_store_delay_s,
        store_linger_s=cfg.state_store_linger_s,
        heartbeat_s=cfg.state_store_heartbeat_s,
        kv_waits=cfg.kv_admission,
    )
    costs = cfg.costs()
    if learner is not None and cfg.capacity_reported:
        for wname, cost in zip(names, costs, strict=True):
            learner.report(wname, cost.max_batch)
    if cfg.known_speeds:
        for model in tier.work:
            for wname, cost in zip(names, costs, strict=True):
                model.know(wname, cost.overhead_s, cost.prefill_tokens_per_s)
    running = [0] * nw
    queues: list[deque[int]] = [deque() for _ in range(nw)]
    prefill_free = [0.0] * nw
    per_worker = [0] * nw
    slotq = [0] * nw

    reqs = prep.requests
    keys = prep.keys
    nreq = len(reqs)
    arrivals = [r.arrival_s for r in reqs]  # when each request is sent
    # Causal turns: each turn's next one in its conversation, sent once it has ended.
    follows: dict[int, int] = {}
    if cfg.causal_turns:
        for turn, before in enumerate(previous_turns(reqs)):
            if before is not None:
                follows[before] = turn
    # (time, request): requests to send; a next turn is pushed when its predecessor ends.
    chained = set(follows.values())
    sends = [(arrivals[r], r) for r in range(nreq) if r not in chained]
    heapq.heapify(sends)
    assigned = [0] * nreq
    handles: list[Handle | None] = [None] * nreq
    ttft = [0.0] * nreq
    e2e = [0.0] * nreq
    cached_total = 0
    cached_per: list[int] = [0] * nreq if record else []
    # (time, request, worker): the request's next block fill, or its completion;
    # (time, request, -1 - worker): its first token (routed requests: the work model).
    heap: list[tuple[float, int, int]] = []
    predicted = [float("nan")] * nreq
    own_prefill = [0.0] * nreq
    busy = [0.0] * nw
    first_at = [0.0] * nreq
    interval = [0.0] * nreq
    done_at = [0.0] * nreq
    route = tier.route
    bypass = bypass_plan(nreq, cfg.bypass_fraction, nw, cfg.seed)
    routed = sum(1 for b in bypass if b < 0)
    restart_every = cfg.restart_every_s
    if restart_every is not None and restart_every <= 0:
        raise ValueError("restart interval must be > 0")
    next_restart = restart_every if restart_every is not None else float("inf")
    guard_on = cfg.learn_capacity or cfg.policy_settings.get("worker_capacity") is not None
    poll_every = cfg.engine_poll_s if guard_on else None
    if poll_every is not None and poll_every <= 0:
        raise ValueError("engine poll interval must be > 0")
    next_poll = poll_every if poll_every is not None else float("inf")
    edge_gap = cfg.edge_read_gap_s if guard_on and cfg.learn_at_polls else None
    if not any(getattr(p, "work", None) is not None for p in tier.policies):
        edge_gap = None  # serve reads at high-water marks for the work model only
    edge_read = [-float("inf")] * nw
    restarts = 0
    decision_ns = 0
    perf = time.perf_counter_ns
    output_blocks = cfg.output_blocks
    kv_admission = cfg.kv_admission
    bs = cfg.block_size

    def can_start(w: int, r: int) -> bool:
        """A free slot on ``w`` and, with KV admission, room for the prompt's blocks."""
        if running[w] >= costs[w].max_batch:
            return False
        return not kv_admission or caches[w].fits(keys[r], len(reqs[r].tokens))

    def schedule(r: int, w: int) -> None:
        """Push the request's next event: its next block fill, if before completion."""
        h = handles[r]
        fill = caches[w].next_fill(h) if h is not None else None
        if fill is not None:
            # The KV of output token k is computed when token k + 1 comes out.
            t = first_at[r] + (fill - len(reqs[r].tokens)) * interval[r]
            if t < done_at[r]:
                heapq.heappush(heap, (t, r, w))
                return
        heapq.heappush(heap, (done_at[r], r, w))

    def admit(w: int, r: int, now: float) -> None:
        nonlocal cached_total
        req = reqs[r]
        n = len(req.tokens)
        rkeys = keys[r] if output_blocks else keys[r][: n // bs]
        seq = None
        if events is not None:
            seq = sequence(req.tokens, req.output_len if output_blocks else 1)
        cached, handle = caches[w].admit_keys(rkeys.tolist(), n, seq)
        handles[r] = handle
        ticket = tier.ticket(r)
        if ticket is not None:  # what the engine reports in usage.cached_tokens
            ticket.reported_uncached = n - cached
        cached_total += cached
        if record:
            cached_per[r] = cached
        running[w] += 1
        cost = costs[w]
        start = prefill_free[w] if prefill_free[w] > now else now
        own = cost.prefill_s(n - cached)
        own_prefill[r] = own
        busy[w] += own
        first = start + own
        prefill_free[w] = first
        first_at[r] = first
        interval[r] = cost.decode_interval_s(running[w])
        done = first + cost.decode_s(req.output_len, running[w])
        done_at[r] = done
        ttft[r] = first - arrivals[r]
        e2e[r] = done - arrivals[r]
        if bypass[r] < 0:
            heapq.heappush(heap, (first, r, -1 - w))
        schedule(r, w)

    while sends or heap:
        upcoming = min(heap[0][0] if heap else np.inf, sends[0][0] if sends else np.inf)
        if next_poll <= upcoming:
            if learner is not None and cfg.learn_at_polls:
                for i in range(nw):
                    learner.observe(names[i], running[i], len(queues[i]))
            tier.poll(
                [running[i] + len(queues[i]) for i in range(nw)],
                [len(q) for q in queues],
                [c.usage() for c in caches],
            )
            next_poll += cast(float, poll_every)
            continue
        if next_restart <= upcoming:
            caches[restarts % nw].clear()  # AllBlocksCleared; running requests carry on
            restarts += 1
            next_restart += cast(float, restart_every)
            continue
        if heap and (not sends or heap[0][0] <= sends[0][0]):
            now, r, w = heapq.heappop(heap)
            if w < 0:
                tier.first_byte(r, now)
                continue
            h = handles[r]
            if h is not None:
                n = len(reqs[r].tokens)
                if now < done_at[r]:
                    fill = caches[w].next_fill(h)
                    caches[w].grow(h, fill if fill is not None else n)
                    schedule(r, w)
                    continue
                caches[w].grow(h, n + reqs[r].output_len - 1)
                caches[w].release(h)
                handles[r] = None
            running[w] -= 1
            tier.done(r, now, reqs[r].output_len)
            queue = queues[w]
            while queue and can_start(w, queue[0]):
                admit(w, queue.popleft(), now)
            after = follows.get(r)
            if after is not None:
                arrivals[after] = max(arrivals[after], now)
                heapq.heappush(sends, (arrivals[after], after))
            continue
        now, r = heapq.heappop(sends)
        w = bypass[r]
        if w < 0:
            t0 = perf()
            worker = route(
                r, RouteRequest(tokens=cast(Sequence[int], reqs[r].tokens)), now, reqs[r].output_len
            )
            decision_ns += perf() - t0
            w = widx[worker]
            ticket = tier.ticket(r)
            if ticket is not None:
                predicted[r] = ticket.predicted
        assigned[r] = w
        per_worker[w] += 1
        if not queues[w] and can_start(w, r):
            admit(w, r, now)
        else:
            slotq[w] += 1
            queues[w].append(r)
        if learner is not None and not cfg.learn_at_polls:
            learner.observe(names[w], running[w], len(queues[w]))
        elif learner is not None and edge_gap is not None:
            name = names[w]
            if (
                name not in learner.capacities
                and tier.routed_to(name) > learner.floors.get(name, 0)
                and now - edge_read[w] >= edge_gap
            ):
                edge_read[w] = now
                learner.observe(name, running[w], len(queues[w]))
                tier.poll_one(name, running[w] + len(queues[w]), len(queues[w]), caches[w].usage())

    extra: dict[str, Any] = {
        "final_inflight": tier.in_flight(),
        "final_running": sum(running),
        "pinned_blocks": sum(c.pinned_blocks for c in caches),
        "workers": nw,
        "router_replicas": cfg.router_replicas,
        "bypassed": nreq - routed,
        "restarts": restarts,
        "slot_queued": slotq,
        "per_worker": list(per_worker),
        "decisions": dict(tier.reasons),
        **work_report(ttft, own_prefill, busy, predicted),
        "prefill_tokens_per_s_learned": [round(tier.work[0].prefill_rate(x), 1) for x in names],
        "final_work": sum(
            st.prefill_tokens + st.requests + st.decode_tokens + st.kv_tokens + len(st.kv)
            for m in tier.work
            for st in m.workers.values()
        ),
    }
    if record:
        extra["assigned"] = assigned
        extra["cached"] = cached_per
        extra["ttft"] = ttft
        extra["sent"] = arrivals
        extra["e2e"] = e2e
    prompt_tokens = prep.prompt_tokens
    output_tokens = sum(r.output_len for r in reqs)
    end = max((arrivals[i] + e2e[i] for i in range(nreq)), default=0.0)
    duration = end - (arrivals[0] if nreq else 0.0)
    return summarize(
        name or pname,
        ttft_s=ttft,
        e2e_s=e2e,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_total,
        output_tokens=output_tokens,
        duration_s=duration,
        per_worker=per_worker,
        decision_us=decision_ns / 1000 / routed if routed else 0.0,
        extra=extra,
    )


def compare(
    requests: Sequence[Request],
    policies: Sequence[str | PolicyFactory],
    cfg: FleetConfig,
    *,
    progress: Callable[[str, float], None] | None = None,
) -> tuple[list[ResultRow], float]:
    """Every policy on the same requests (keys computed once); rows and the upper bound."""
    prep = prepare(requests, cfg.block_size)
    rows = []
    for p in policies:
        t0 = time.perf_counter()
        row = simulate(prep, p, cfg)
        row.extra["wall_s"] = time.perf_counter() - t0
        if progress is not None:
            progress(row.name, row.extra["wall_s"])
        rows.append(row)
    return rows, upper_bound(prep)


def work_report(
    ttft: Sequence[float],
    own_prefill: Sequence[float],
    busy: Sequence[float],
    predicted: Sequence[float],
) -> dict[str, float]:
    """Queue wait p99, busiest worker's prefill-busy time over the mean, and how well
    TTFT was predicted (routed requests only): mean absolute error and median ratio."""
    t = np.asarray(ttft, dtype=np.float64)
    wait = t - np.asarray(own_prefill, dtype=np.float64)
    b = np.asarray(busy, dtype=np.float64)
    p = np.asarray(predicted, dtype=np.float64)
    seen = ~np.isnan(p)
    out = {
        "queue_wait_p99": float(np.percentile(wait, 99)) if len(wait) else float("nan"),
        "busy_max_over_mean": float(b.max() / b.mean()) if len(b) and b.mean() > 0 else 0.0,
        "ttft_mae_s": float("nan"),
        "ttft_ratio_p50": float("nan"),
    }
    if seen.any():
        out["ttft_mae_s"] = float(np.mean(np.abs(p[seen] - t[seen])))
        ok = seen & (t > 0)
        if ok.any():
            out["ttft_ratio_p50"] = float(np.median(p[ok] / t[ok]))
    return out
