"""kvroute: a cache-aware router for fleets of LLM inference servers.

The prefix indexes (``PrefixIndex``, ``BlockIndex``) are Rust (``kvroute._native``); the
router, the policies, the simulated workers and the benchmarks are Python. The package is
grouped by concern, one room per folder; dependencies point one way (commands -> service
-> fleet / routing / events -> the native index), and no module imports one that imports
it back (``tests/test_architecture.py`` checks both).

``service/``
    The HTTP service. ``app`` builds the FastAPI app (lifespan, endpoints, auth);
    ``fastpath`` hands POSTs to the proxied paths (``routes``) straight to the handler
    (as an ``incoming.Incoming``), every request through the ``accesslog``; ``state``
    holds what one app owns (registry, policy, index, tokenizer, client, metrics);
    ``proxy`` forwards a request and streams the answer back; ``attempts`` runs its
    tries on workers and decides what a failure means (retry, move, quarantine:
    ``quarantine``; their timeouts: ``deadlines``); ``passthrough`` forwards the routes
    with no prefix to follow by least load; ``upstream`` and ``h1pool`` are the
    per-worker connection pools; ``admission`` bounds concurrency and ``limits``
    connections; ``openapi`` is the schema; ``metrics`` (``fastmetrics``) and ``status``
    are what an operator reads; ``connections`` bounds client connections (header size and time,
    body pauses).
``fleet/``
    The workers as the router sees them: ``registry`` (load reservations, health state,
    circuit breaker), ``health`` (active checks, engines' load read after them),
    ``engine_load`` (parsing engines' /metrics, learned capacities), ``discovery``
    (DNS / Kubernetes sources, ``reconcile``: new workers join, vanished ones drain),
    ``budget`` (the index's per-worker budgets from the engines' reported KV capacity),
    ``urls`` (which worker URLs may be added at run time), ``models`` (what each
    worker serves, cache partitions), ``shared`` (router replicas sharing decisions,
    load and workers through Redis).
``routing/``
    How a worker is chosen: ``policies/`` (one module per policy; ``cache_aware`` is the
    default), ``load`` (the work model: prefill and decode in flight per worker, learned
    speeds, predicted time to first token; shared with the simulator) and
    ``tokenization`` (a request -> the token IDs the engine will see), ``templates``
    (chat templates rendered in a bounded sandbox, off the event loop),
    ``template_cache`` (the model's template rendered once per conversation shape) and
    ``decide_first`` / ``partial`` (routing on a prompt's known start when the rest
    cannot change the decision).
``events/``
    Precise mode: engines' KV cache events decoded, tracked per worker and fed to a
    ``BlockIndex`` that the policy matches on.
``sim/``
    GPU-free stand-ins: the simulated worker (``kvroute sim-worker``), the fleet
    simulation in virtual time (same policy code as the router), workloads.
``eval/``
    Measuring routers: the routing-quality harness, load generation, process helpers and
    the peer routers.
``commands/``
    One module per CLI command (``kvroute serve``, ``simulate``, ``demo``, ...), wired by
    ``kvroute.cli``.
``config``, ``errors``
    The foundation every room may use: validated settings, and the errors the router
    answers with (OpenAI's error shape).

The request path: ``service.fastpath`` -> ``service.app`` (auth, admission) ->
``service.proxy`` (body read, ``routing.tokenization`` -> token IDs) ->
``service.attempts`` -> ``routing.policies`` (match in the native index, choose a
worker, reserve its load in ``fleet.registry``) -> ``service.upstream`` / ``h1pool``
(send, stream back; a failure retried, moved or quarantined) -> the reservation
released however the request ends.
"""

from kvroute._native import BlockIndex, PrefixIndex, UnknownParentError

__all__ = ["BlockIndex", "PrefixIndex", "UnknownParentError", "__version__"]
__version__ = "0.1.0"
