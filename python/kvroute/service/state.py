"""The router's state: one object holding the fleet, the policy, the index, the tokenizer,
the shared upstream client and the metrics, built once per app (``build_state``).

The request handler (``kvroute.service.app``) and the forwarder (``kvroute.service.proxy``)
both read it; neither imports the other through it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httpx

from kvroute._native import PrefixIndex
from kvroute.config import (
    ConfigError,
    Settings,
    parse_model_tokenizers,
    parse_worker_max_running,
)
from kvroute.fleet.budget import IndexBudget
from kvroute.fleet.engine_load import CapacityLearner
from kvroute.fleet.health import EdgeReads, read_body
from kvroute.fleet.models import adapter_partition
from kvroute.fleet.registry import Registry
from kvroute.routing.load import LoadModel
from kvroute.routing.policies import Policy, create_policy
from kvroute.routing.tokenization import PromptTokenizer
from kvroute.routing.tokenizer_files import resolve_tokenizer
from kvroute.service.admission import Admission
from kvroute.service.metrics import RouterMetrics
from kvroute.service.quarantine import Quarantine
from kvroute.service.upstream import Forward, PerWorkerPools

log = logging.getLogger("kvroute")


@dataclass
class RouterState:
    settings: Settings
    # A DigestIndex (same methods) with --state-store, so peers' decisions apply to it.
    index: PrefixIndex
    policy: Policy
    registry: Registry
    tokenizer: PromptTokenizer  # the default one (--tokenizer, or UTF-8 bytes)
    metrics: RouterMetrics
    admission: Admission
    quarantine: Quarantine
    client: httpx.AsyncClient = field(init=False)
    pools: PerWorkerPools | None = None  # the client's per-worker transport
    forward: Forward = field(init=False)  # inference requests: straight to ``pools``
    started: float = field(default_factory=time.time)
    events: Any = None  # kvroute.events.EventTracker in precise mode
    capacity: CapacityLearner | None = None  # learned worker capacities (guard on auto)
    # Saturation guard on: engines' /metrics read after each health check, and per worker
    # the requests its engine holds that this router did not send (``others_load``).
    polls_engine: bool = False
    # With capacities learned: engine readings between checks at a worker's high-water
    # mark (kvroute.fleet.health.EdgeReads).
    edge: EdgeReads | None = None
    others: dict[str, int] = field(default_factory=dict)
    # Work in flight and learned speed per worker (kvroute.routing.load); the proxy
    # reserves each routed request's predicted work here, work-aware policies read it.
    work: LoadModel = field(default_factory=LoadModel)
    subscriber: Any = None
    # The health loop's hooks (--kv-events auto: kvroute.events.auto.AutoEvents).
    on_healthy: Callable[[str], Awaitable[None]] | None = None
    after_round: Callable[[list[str]], Awaitable[None]] | None = None
    budget: IndexBudget | None = None  # default index budgets (no --max-tree-size)
    store: Any = None  # kvroute.fleet.shared.StateStore with --state-store
    # Set by ``kvroute serve`` on SIGTERM: the server stops accepting and, once the grace
    # period runs out, cancels what is still in flight.
    draining: bool = False
    recorder: Any = None  # kvroute.service.recorder.TraceRecorder with --record
    # --model-tokenizer: the tokenizer of each model named there (``tokenizer_for``).
    tokenizers: dict[str, PromptTokenizer] = field(default_factory=dict)

    def tokenizer_for(self, model: str | None) -> PromptTokenizer:
        """The tokenizer of requests for ``model``: its own (--model-tokenizer), its base
        model's for a LoRA adapter, else the default one."""
        tokenizers = self.tokenizers
        if not tokenizers or model is None:
            return self.tokenizer
        tok = tokenizers.get(model)
        if tok is None:
            served = self.registry.known_models().get(model)
            if served is not None and served.is_adapter and served.parent is not None:
                tok = tokenizers.get(served.parent)
        return self.tokenizer if tok is None else tok

    @functools.cached_property
    def all_tokenizers(self) -> tuple[PromptTokenizer, ...]:
        """Every tokenizer requests may use, each once, the default first (fixed at
        start-up: computed once)."""
        out = [self.tokenizer]
        for tok in self.tokenizers.values():
            if all(tok is not t for t in out):
                out.append(tok)
        return tuple(out)

    def settle_tails(self) -> None:
        """Decide first: every prompt routed early is in the index (each tokenizer's)."""
        for tok in self.all_tokenizers:
            tok.tails.settle()

    @functools.cached_property
    def byte_tokens(self) -> bool:
        """The index holds bytes (``PrefixIndex(byte_tokens=True)``): requests' tokens
        are given to it as ``kvroute.routing.tokenization.byte_tokens`` makes them. Read
        on every request; the index is built once, so it is asked once."""
        return isinstance(self.index, PrefixIndex) and self.index.byte_tokens

    async def use_transport(self, transport: httpx.AsyncBaseTransport) -> None:
        """Send all upstream traffic through ``transport`` (tests: a mock worker); the
        client it replaces is closed. The workers count as having answered a health
        check (the start-up round went through the real client, not the mock)."""
        await self.client.aclose()
        self.client = httpx.AsyncClient(transport=transport)
        self.forward = Forward(self.client, transport)
        for url, worker in self.registry.workers.items():
            worker.healthy = None
            self.registry.record_check(url, True)

    def snapshot(self) -> dict[str, Any]:
        snap = {
            "workers": self.workers_json(),
            "index": {
                **self.index.stats(),
                "bytes_per_token": None if self.budget is None else self.budget.bytes_per_token,
                "prompts_in_flight": getattr(self.policy, "prompts_in_flight", None),
            },
            "tokenizer": _summed([t.cache_stats() for t in self.all_tokenizers]),
            "ttft_predictions": self.metrics.prediction_stats() if self.metrics else None,
            "asyncio_tasks": _task_count(),
        }
        if self.store is not None:
            snap["routers"] = self.routers_json()
        return snap

    def routers_json(self) -> list[dict[str, Any]]:
        """Live router replicas sharing this store (this one included, ``self``)."""
        store = self.store
        if store is None:
            return []
        return [{**info, "self": rid == store.id} for rid, info in sorted(store.routers.items())]

    def workers_json(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "url": w.url,
                # None until the first health check answered.
                "healthy": None if w.healthy is None else w.available(now),
                "in_flight": w.in_flight,
                "cached_tokens": self.index.cached_tokens(w.url),
                "index_budget": self.index.worker_budget(w.url),
                "requests_served": w.served,
                "failures": w.failed,
                "down_reason": w.down_reason or None,
                "draining": w.draining,
                "circuit_open": now < w.circuit_open_until,
                "half_open": w.half_open and now >= w.circuit_open_until,
                "mode": self.events.mode(w.url) if self.events is not None else "approximate",
                # Where its KV events are read (given, or as its engine said: auto).
                "kv_events": self._event_endpoint(w.url),
                "capacity": self.worker_capacity(w.url),
                "capacity_source": self.capacity_source(w.url),
                # The most its engine was seen running with nothing waiting (learned).
                "capacity_floor": (
                    self.capacity.floors.get(w.url) if self.capacity is not None else None
                ),
                "external_load": self.others.get(w.url) if self.polls_engine else None,
                "models": sorted(w.models) if w.models is not None else None,
                "work": self.work.snapshot(w.url),
                **self._peer_json(w.url),
            }
            for w in self.registry.workers.values()
        ]

    def _event_endpoint(self, url: str) -> str | None:
        source = self.subscriber.sources.get(url) if self.subscriber is not None else None
        return source.endpoint if source is not None else None

    def _peer_json(self, url: str) -> dict[str, Any]:
        if self.store is None:
            return {}
        store = self.store
        shared = store.shared_load
        return {
            "peer_in_flight": store.peer_load.get(url, 0),
            # The other routers' requests there still waiting for a first byte, and
            # their uncached prompt tokens (what the work model predicts on).
            "peer_prefill_requests": shared.pending.get(url, 0) if shared else None,
            "peer_prefill_tokens": shared.tokens.get(url, 0) if shared else None,
            # Their decoding requests there whose expected end they published (a full
            # worker's slot frees at those ends).
            "peer_decoding": len(shared.ends.get(url, ())) if shared else None,
        }

    def worker_capacity(self, url: str) -> int | None:
        """The saturation guard's capacity for ``url``: fixed, learned, or None."""
        if self.settings.worker_capacity is not None:
            return self.settings.worker_capacity
        return self.capacity.capacities.get(url) if self.capacity is not None else None

    def capacity_source(self, url: str) -> str | None:
        """Where ``worker_capacity`` comes from: ``fixed`` (--worker-capacity N),
        ``stated`` (--worker-max-running), ``reported`` (the engine's
        /get_server_info), ``learned`` (seen queueing), or None (unknown)."""
        if self.settings.worker_capacity is not None:
            return "fixed"
        learner = self.capacity
        if learner is None or url not in learner.capacities:
            return None
        if url in learner.stated:
            return "stated"
        return "reported" if url in learner.reported else "learned"


def _task_count() -> int:
    """Tasks alive on the running loop (a leak shows as growth at steady load); 0 off-loop."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


def _summed(stats: list[dict[str, float]]) -> dict[str, float]:
    """Several tokenizers' cache counters as one (the hit rate over all of them)."""
    if len(stats) == 1:
        return stats[0]
    out = {k: sum(s[k] for s in stats) for k in stats[0]}
    total = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / total if total else 0.0
    return out


def load_tokenizers(
    settings: Settings, tokenizer: PromptTokenizer | None = None
) -> tuple[PromptTokenizer, dict[str, PromptTokenizer]]:
    """The default tokenizer (``tokenizer`` if given) and one per --model-tokenizer
    model; a model ID is resolved to its snapshot in the Hugging Face cache, downloaded
    if need be. Models whose tokenizers resolve to one directory share one tokenizer."""
    loaded: dict[str, PromptTokenizer] = {}

    def load(spec: str | None, revision: str | None, flag: str) -> PromptTokenizer:
        directory = spec
        if spec is not None:
            directory = resolve_tokenizer(spec, revision)
            if directory != spec:
                log.info("%s%s: %s", flag, spec, directory)
        key = "" if directory is None else os.path.realpath(directory)
        if key not in loaded:
            loaded[key] = PromptTokenizer(
                directory,
                settings.tokenizer_cache_size,
                cache_bytes=settings.tokenizer_cache_bytes,
                trust_request_chat_template=settings.trust_request_chat_template,
                template_timeout_s=settings.chat_template_timeout_secs,
                native_segments=not settings.decide_first,
            )
        return loaded[key]

    if tokenizer is None:
        tokenizer = load(settings.tokenizer, settings.tokenizer_revision, "--tokenizer ")
    elif tokenizer.tokenizer_dir is not None:
        loaded[os.path.realpath(tokenizer.tokenizer_dir)] = tokenizer
    per_model = {
        model: load(spec, None, f"--model-tokenizer {model}=")
        for model, spec in parse_model_tokenizers(settings.model_tokenizer).items()
    }
    return tokenizer, per_model


def build_state(settings: Settings, tokenizer: PromptTokenizer | None = None) -> RouterState:
    tokenizer, per_model = load_tokenizers(settings, tokenizer)
    every = [tokenizer, *per_model.values()]
    budget = None
    index: Any
    if settings.max_tree_size is None:
        budget = IndexBudget(
            settings.tree_size_fallback,
            settings.max_total_tree_size,
            index_in_bytes=all(t.uses_bytes for t in every),
            learn_scale=True,
            # Replicas sharing a store must set the same budgets: one scale for all.
            follows=bool(settings.state_store),
        )
    # Until a worker has its own budget, the fallback (capped) applies.
    size = settings.max_tree_size if budget is None else budget.budget_for("", 1)
    # Without a tokenizer, prompts are UTF-8 bytes: kept a byte each (a quarter of the
    # memory a walk reads), unless the store's digests or the engines' events (token IDs
    # and u32 partition tokens) key the index, or the clients send token IDs.
    byte_tokens = all(t.uses_bytes for t in every) and not (
        settings.state_store or settings.kv_events or settings.token_id_prompts
    )
    if settings.state_store:
        from kvroute.fleet.shared import DigestIndex

        # Replicas evict alike: they read the same engines, so each worker gets the same
        # budget on every replica.
        index = DigestIndex(size)
    else:
        index = PrefixIndex(size, byte_tokens=byte_tokens)
    policy = create_policy(
        settings.policy,
        cast(PrefixIndex, index),  # DigestIndex: the same methods, duck-typed
        cache_threshold=settings.cache_threshold,
        balance_abs_threshold=settings.balance_abs_threshold,
        balance_rel_threshold=settings.balance_rel_threshold,
        prefix_hash_tokens=settings.prefix_hash_tokens,
        bounded_load_factor=settings.bounded_load_factor,
        worker_capacity=settings.worker_capacity,
        load_metric=settings.load_metric,
        router_temperature=settings.router_temperature,
    )
    work = LoadModel()
    work.fixed_capacity = settings.worker_capacity
    work.clock = time.monotonic  # the clock the request path reserves with
    uses_work = getattr(policy, "work", None) is not None
    if uses_work:
        policy.work = work  # type: ignore[attr-defined]

    def added(url: str) -> None:
        policy.on_worker_added(url)
        work.add_worker(url)

    registry = Registry(settings, on_down=policy.on_worker_removed, on_added=added)
    state = RouterState(
        settings=settings,
        index=index,
        policy=policy,
        registry=registry,
        tokenizer=tokenizer,
        tokenizers=per_model,
        metrics=None,  # type: ignore[arg-type]  # set below: it needs the state
        admission=Admission(
            settings.max_concurrent_requests,
            settings.max_queued_requests,
            settings.queue_timeout_secs,
        ),
        quarantine=Quarantine(settings.quarantine_secs),
    )
    state.work = work
    state.metrics = RouterMetrics(state.snapshot)
    work.on_observe = state.metrics.observe_prediction
    state.admission.on_reject = lambda reason: state.metrics.rejected.labels(reason).inc()
    learns = settings.learn_capacity and settings.worker_capacity is None
    if learns and (hasattr(policy, "capacities") or uses_work):
        setup_capacity_learning(state)
    guarded = hasattr(policy, "others") or uses_work
    if guarded and (learns or settings.worker_capacity is not None):
        state.polls_engine = True
        if state.capacity is not None and uses_work:
            # The work model's (SGLang's rule, --load-metric requests, stays as it was).
            state.edge = EdgeReads(
                state,
                on_read=state.metrics.edge_reads.inc,
                blind_s=settings.health_check_interval_secs,
            )
        if hasattr(policy, "others"):
            policy.others = state.others
        work.others = state.others

        def forget(url: str) -> None:
            state.others.pop(url, None)

        _chain_on_down(state, forget)
    _chain_on_down(state, work.remove_worker)
    if settings.kv_events:
        setup_precise(state)
    if settings.record:
        setup_recording(state)
    if budget is not None:
        setup_budget(state, budget)
    for url in settings.worker_urls:
        registry.add(url)
    if settings.state_store:
        setup_store(state)
    return state


def setup_budget(state: RouterState, budget: IndexBudget) -> None:
    """Default index budgets (``kvroute.fleet.budget``): re-applied whenever a worker
    is added or removed; engines' readings are taken by ``budget_loop`` in the lifespan."""
    state.budget = budget
    # The engines' KV capacities, as reported: the work model's wait for KV room.
    state.work.kv_capacity = budget.kv_units
    registry = state.registry

    def reapply(_: str) -> None:
        budget.apply(state.index, list(registry.workers))

    previous = registry._on_added

    def on_added(url: str) -> None:
        if previous is not None:
            previous(url)
        reapply(url)

    registry._on_added = on_added
    _chain_on_down(state, reapply)


def setup_store(state: RouterState) -> None:
    """--state-store: share decisions, load and workers with the other routers (the
    store's task starts in the app's lifespan)."""
    from kvroute import __version__
    from kvroute.fleet.shared import DigestIndex, StateStore, StoreURL
    from kvroute.fleet.shared.metrics import StoreCollector

    s = state.settings
    store = StateStore(
        StoreURL(cast(str, s.state_store)),
        state.registry,
        state.index if isinstance(state.index, DigestIndex) else None,
        router_url=f"http://{s.host}:{s.port}",
        version=__version__,
        heartbeat_s=s.state_store_heartbeat_secs,
        stream_len=s.state_store_stream_len,
        work=state.work,
        keying=keying(state),
        budget=state.budget,
    )
    state.store = store
    state.registry.peer_load = store.peer_load
    state.work.peer = store.peer_load
    state.metrics.registry.register(StoreCollector(store))


def keying(state: RouterState) -> str:
    """What this router's index keys are made of (``PromptTokenizer.keying``), with
    every --model-tokenizer model's: replicas compare it before applying each other's
    decisions."""
    if not state.tokenizers:
        return state.tokenizer.keying
    parts = [state.tokenizer.keying] + [
        f"{model}={tok.keying}" for model, tok in sorted(state.tokenizers.items())
    ]
    return "models:" + hashlib.blake2b(";".join(parts).encode(), digest_size=6).hexdigest()


def _chain_on_down(state: RouterState, hook: Callable[[str], None]) -> None:
    """Also call ``hook`` when a worker goes down or is removed."""
    previous = state.registry._on_down

    def on_down(url: str) -> None:
        if previous is not None:
            previous(url)
        hook(url)

    state.registry._on_down = on_down


def setup_capacity_learning(state: RouterState) -> None:
    """Saturation guard on ``auto``: capacities learned from the engines' /metrics."""
    stated = dict(parse_worker_max_running(spec) for spec in state.settings.worker_max_running)
    learner = CapacityLearner(stated)
    state.capacity = learner
    if hasattr(state.policy, "capacities"):
        state.policy.capacities = learner.capacities
    state.work.capacities = learner.capacities
    state.work.capacity_floors = learner.floors
    _chain_on_down(state, learner.forget)


def setup_recording(state: RouterState) -> None:
    """--record: routed requests go to a background trace writer (started now)."""
    from kvroute.service.recorder import RecorderCollector, TraceRecorder

    s = state.settings
    assert s.record is not None
    # The directory the tokenizer was loaded from (a model ID resolved to its snapshot).
    state.recorder = TraceRecorder(
        s.record,
        state.tokenizer.tokenizer_dir,
        max_bytes=s.record_max_bytes,
        max_files=s.record_max_files,
    )
    state.metrics.registry.register(RecorderCollector(state.recorder))


def setup_precise(state: RouterState) -> None:
    """Precise mode: feed a BlockIndex from the engines' KV events (started in lifespan)."""
    from kvroute._native import BlockIndex
    from kvroute.events import (
        EventTracker,
        KvEventSubscriber,
        PreciseView,
        parse_kv_events,
        register_kv_event_metrics,
    )
    from kvroute.events.auto import AutoEvents, explicit, is_auto

    sources = parse_kv_events(explicit(state.settings.kv_events))
    unknown = [s.worker for s in sources if s.worker not in state.settings.worker_urls]
    if unknown:
        raise ConfigError(f"--kv-events names workers not in --worker-urls: {unknown}")
    # Blocks of each LoRA adapter in its own partition, as the approximate index keeps
    # them (the router puts the same partition token before the adapter's requests).
    tracker = EventTracker(BlockIndex(), partition_of=adapter_partition)
    state.events = tracker
    state.subscriber = KvEventSubscriber(sources, tracker)
    if is_auto(state.settings.kv_events):
        auto = AutoEvents(state.subscriber)  # explicit sources are in it: never asked

        async def follow(url: str) -> None:
            await auto.follow(url, lambda u, path: read_body(state, u, path))

        state.on_healthy = follow
        state.after_round = auto.prune
        _chain_on_down(state, auto.forget)
    register_kv_event_metrics(state.metrics.registry, tracker, state.subscriber)
    if hasattr(state.policy, "precise"):
        state.policy.precise = PreciseView(tracker)
    _chain_on_down(state, tracker.reset)
