"""The router's HTTP service (FastAPI): endpoints, lifespan, auth and admission.

One shared ``httpx.AsyncClient``, tokenizer and health-check task per app, created in
the lifespan. Request bodies are read as bytes and forwarded unchanged; handlers parse
JSON with orjson only to find the prompt, never through per-request pydantic models.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from kvroute import __version__
from kvroute._native import PrefixIndex
from kvroute.admission import Admission
from kvroute.config import ConfigError, Settings, normalize_worker_url
from kvroute.engine_load import CapacityLearner, others_load, parse_engine_load
from kvroute.errors import (
    BadRequestError,
    ForbiddenError,
    NotFoundError,
    OverloadedError,
    RouterError,
    UnauthorizedError,
    error_response,
)
from kvroute.fastpath import INFERENCE_PATHS, RouterApp
from kvroute.metrics import RouterMetrics
from kvroute.policies import Policy, create_policy
from kvroute.proxy import Forwarder, ProxyStream, parse_object, read_body
from kvroute.status import counter_totals
from kvroute.status import render as render_status
from kvroute.tokenization import PromptTokenizer
from kvroute.upstream import Forward, PerWorkerPools, create_client
from kvroute.workers import Registry

log = logging.getLogger("kvroute.app")

OPENAI_BODY = {
    "requestBody": {
        "content": {"application/json": {"schema": {"type": "object"}}},
        "required": True,
    }
}


@dataclass
class RouterState:
    settings: Settings
    index: PrefixIndex
    policy: Policy
    registry: Registry
    tokenizer: PromptTokenizer
    metrics: RouterMetrics
    admission: Admission
    client: httpx.AsyncClient = field(init=False)
    pools: PerWorkerPools | None = None  # the client's per-worker transport
    forward: Forward = field(init=False)  # inference requests: straight to ``pools``
    started: float = field(default_factory=time.time)
    events: Any = None  # kvroute.events.EventTracker in precise mode
    capacity: CapacityLearner | None = None  # learned worker capacities (guard on auto)
    # Saturation guard on: engines' /metrics read after each health check, and per worker
    # the requests its engine holds that this router did not send (``others_load``).
    polls_engine: bool = False
    others: dict[str, int] = field(default_factory=dict)
    subscriber: Any = None
    # Set by ``kvroute serve`` on SIGTERM: the server stops accepting and, once the grace
    # period runs out, cancels what is still in flight.
    draining: bool = False

    async def use_transport(self, transport: httpx.AsyncBaseTransport) -> None:
        """Send all upstream traffic through ``transport`` (tests: a mock worker); the
        client it replaces is closed."""
        await self.client.aclose()
        self.client = httpx.AsyncClient(transport=transport)
        self.forward = Forward(self.client, transport)

    def snapshot(self) -> dict[str, Any]:
        return {
            "workers": self.workers_json(),
            "index": self.index.stats(),
            "tokenizer": self.tokenizer.cache_stats(),
            "asyncio_tasks": _task_count(),
        }

    def workers_json(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "url": w.url,
                "healthy": w.available(now),
                "in_flight": w.in_flight,
                "cached_tokens": self.index.cached_tokens(w.url),
                "requests_served": w.served,
                "failures": w.failed,
                "down_reason": w.down_reason or None,
                "circuit_open": now < w.circuit_open_until,
                "mode": self.events.mode(w.url) if self.events is not None else "approximate",
                "capacity": self.worker_capacity(w.url),
                "external_load": self.others.get(w.url) if self.polls_engine else None,
            }
            for w in self.registry.workers.values()
        ]

    def worker_capacity(self, url: str) -> int | None:
        """The saturation guard's capacity for ``url``: fixed, learned, or None."""
        if self.settings.worker_capacity is not None:
            return self.settings.worker_capacity
        return self.capacity.capacities.get(url) if self.capacity is not None else None


def _task_count() -> int:
    """Tasks alive on the running loop (a leak shows as growth at steady load); 0 off-loop."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


def build_state(settings: Settings, tokenizer: PromptTokenizer | None = None) -> RouterState:
    index = PrefixIndex(settings.max_tree_size)
    policy = create_policy(
        settings.policy,
        index,
        cache_threshold=settings.cache_threshold,
        balance_abs_threshold=settings.balance_abs_threshold,
        balance_rel_threshold=settings.balance_rel_threshold,
        prefix_hash_tokens=settings.prefix_hash_tokens,
        bounded_load_factor=settings.bounded_load_factor,
        worker_capacity=settings.worker_capacity,
    )
    registry = Registry(settings, on_down=policy.on_worker_removed, on_added=policy.on_worker_added)
    state = RouterState(
        settings=settings,
        index=index,
        policy=policy,
        registry=registry,
        tokenizer=tokenizer or PromptTokenizer(settings.tokenizer, settings.tokenizer_cache_size),
        metrics=None,  # type: ignore[arg-type]  # set below: it needs the state
        admission=Admission(
            settings.max_concurrent_requests,
            settings.max_queued_requests,
            settings.queue_timeout_secs,
        ),
    )
    state.metrics = RouterMetrics(state.snapshot)
    state.admission.on_reject = lambda reason: state.metrics.rejected.labels(reason).inc()
    learns = settings.learn_capacity and settings.worker_capacity is None
    if learns and hasattr(policy, "capacities"):
        setup_capacity_learning(state)
    if hasattr(policy, "others") and (learns or settings.worker_capacity is not None):
        state.polls_engine = True
        policy.others = state.others

        def forget(url: str) -> None:
            state.others.pop(url, None)

        _chain_on_down(state, forget)
    if settings.kv_events:
        setup_precise(state)
    for url in settings.worker_urls:
        registry.add(url)
    return state


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
    learner = CapacityLearner()
    state.capacity = learner
    state.policy.capacities = learner.capacities  # type: ignore[attr-defined]
    _chain_on_down(state, learner.forget)


async def poll_engine_load(state: RouterState, url: str) -> None:
    """Read ``url``'s running/waiting counts from its /metrics: the learner's capacity
    and the load its engine holds beyond this router's requests."""
    try:
        r = await state.client.get(
            url + "/metrics", timeout=state.settings.health_check_timeout_secs
        )
    except httpx.HTTPError:
        return
    load = parse_engine_load(r.content) if r.status_code == 200 else None
    if load is None:
        return
    if state.capacity is not None:
        state.capacity.observe(url, *load)
    worker = state.registry.workers.get(url)
    if worker is not None:
        state.others[url] = others_load(*load, worker.in_flight)


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

    sources = parse_kv_events(state.settings.kv_events)
    unknown = [s.worker for s in sources if s.worker not in state.settings.worker_urls]
    if unknown:
        raise ConfigError(f"--kv-events names workers not in --worker-urls: {unknown}")
    tracker = EventTracker(BlockIndex())
    state.events = tracker
    state.subscriber = KvEventSubscriber(sources, tracker)
    register_kv_event_metrics(state.metrics.registry, tracker, state.subscriber)
    if hasattr(state.policy, "precise"):
        state.policy.precise = PreciseView(tracker)
    _chain_on_down(state, tracker.reset)


async def health_loop(state: RouterState) -> None:
    s = state.settings
    while True:
        urls = list(state.registry.workers)

        async def check(url: str) -> None:
            try:
                r = await state.client.get(
                    url + s.health_check_endpoint, timeout=s.health_check_timeout_secs
                )
                state.registry.record_check(url, r.status_code == 200, f"HTTP {r.status_code}")
            except httpx.HTTPError as e:
                state.registry.record_check(url, False, type(e).__name__)
                return
            if state.polls_engine and r.status_code == 200:
                await poll_engine_load(state, url)

        try:
            await asyncio.gather(*(check(u) for u in urls))
        except Exception:  # never let one bad check end health checking
            log.exception("health check round failed")
        await asyncio.sleep(s.health_check_interval_secs)


def _bearer(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else ""


def _key_ok(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def create_app(settings: Settings, tokenizer: PromptTokenizer | None = None) -> FastAPI:
    state = build_state(settings, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        s = state.settings
        state.client, state.pools = create_client(
            connect_s=s.connect_timeout_secs,
            first_byte_s=s.first_byte_timeout_secs,
            pool_s=s.queue_timeout_secs,
        )
        state.forward = Forward(state.client, state.pools)
        task = asyncio.create_task(health_loop(state))
        if state.subscriber is not None:
            await asyncio.to_thread(state.subscriber.start)
        try:
            yield
        finally:
            if state.subscriber is not None:
                await asyncio.to_thread(state.subscriber.stop)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await state.client.aclose()

    app = RouterApp(
        title="kvroute", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.router = state
    forwarder = Forwarder(state)

    # ------------------------------------------------------------- errors

    @app.exception_handler(RouterError)
    async def router_error(_: Request, exc: RouterError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            exc.status_code, str(exc.detail), type_, code, dict(exc.headers or {})
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(400, "invalid request", "invalid_request_error", "invalid_request")

    # ------------------------------------------------------------- auth

    def check_api_key(request: Request) -> None:
        key = state.settings.api_key
        if key and not _key_ok(_bearer(request), key):
            raise UnauthorizedError("missing or invalid API key (Authorization: Bearer ...)")

    def check_admin(request: Request) -> None:
        key = state.settings.admin_api_key
        if key:
            if not _key_ok(_bearer(request), key):
                raise UnauthorizedError("admin endpoints need the admin API key")
        elif not state.settings.loopback_only:
            raise ForbiddenError(
                "admin endpoints are disabled: set --admin-api-key to use them "
                "when the router listens beyond loopback",
                code="admin_disabled",
            )

    # ------------------------------------------------------------- inference

    def shutting_down(kind: str) -> Response:
        state.metrics.requests.labels(kind, "503").inc()
        return error_response(
            503,
            "the router is shutting down and the request outlived its grace period",
            "service_unavailable",
            "shutting_down",
        )

    async def inference(request: Request, kind: str, path: str) -> Response:
        check_api_key(request)
        # Past the shutdown grace period uvicorn cancels the request's task; answered here
        # it becomes a clear 503 instead of uvicorn's bare 500 and a logged traceback.
        try:
            await state.admission.acquire()
        except OverloadedError:
            state.metrics.requests.labels(kind, "429").inc()
            raise
        except asyncio.CancelledError:
            if state.draining:
                return shutting_down(kind)
            raise
        try:
            response = await forwarder.forward(request, kind, path)
        except RouterError as e:
            await state.admission.release()
            state.metrics.requests.labels(kind, str(e.status)).inc()
            raise
        except asyncio.CancelledError:
            await state.admission.release()
            if state.draining:
                return shutting_down(kind)
            raise
        except BaseException:
            await state.admission.release()
            raise
        if isinstance(response, ProxyStream):
            inner = response._cleanup

            async def cleanup() -> None:
                try:
                    await inner()
                finally:
                    await state.admission.release()

            response._cleanup = cleanup
        else:
            await state.admission.release()
        return response

    app.inference = inference

    # RouterApp serves these paths directly; registered here too so that the OpenAPI
    # schema lists them (and a mounted app, whose paths differ, still routes them).
    def endpoint(kind: str, worker_path: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return await inference(request, kind, worker_path)

        handle.__name__ = kind
        return handle

    for route_path, route in INFERENCE_PATHS.items():
        app.add_api_route(route_path, endpoint(*route), methods=["POST"], openapi_extra=OPENAI_BODY)

    # ------------------------------------------------------------- fleet

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_api_key(request)

        async def fetch(url: str) -> list[Any]:
            try:
                r = await state.client.get(url + "/v1/models", timeout=5.0)
                data = r.json().get("data", [])
                return data if isinstance(data, list) else []
            except (httpx.HTTPError, ValueError, AttributeError):
                return []

        seen: dict[str, Any] = {}
        for data in await asyncio.gather(*(fetch(u) for u in state.registry.loads())):
            for m in data:
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    seen.setdefault(m["id"], m)
        return JSONResponse({"object": "list", "data": list(seen.values())})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readiness")
    async def readiness() -> Response:
        n = state.registry.healthy_count()
        if n == 0:
            return error_response(
                503, "no healthy worker", "service_unavailable", "no_healthy_worker"
            )
        return JSONResponse({"status": "ready", "healthy_workers": n})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/status")
    async def status(request: Request) -> Response:
        check_api_key(request)
        m = state.metrics
        page = render_status(
            policy=state.policy.name,
            started=state.started,
            snapshot=state.snapshot(),
            decisions=counter_totals(m.decisions, "reason"),
            predicted=sum(counter_totals(m.predicted_cached, "source").values()),
            reported=sum(counter_totals(m.reported_cached, "source").values()),
        )
        return HTMLResponse(page)

    @app.get("/workers")
    async def list_workers(request: Request) -> Response:
        check_api_key(request)
        return Response(orjson.dumps(state.workers_json()), media_type="application/json")

    @app.post("/workers", openapi_extra=OPENAI_BODY)
    async def add_worker(request: Request) -> Response:
        check_admin(request)
        obj = parse_object(await read_body(request, 64 * 1024))
        try:
            url = normalize_worker_url(obj.get("url"))  # type: ignore[arg-type]
        except ConfigError as e:
            raise BadRequestError(str(e)) from None
        kv_events = obj.get("kv_events")
        if kv_events is not None:
            await add_event_source(url, kv_events)
        existed = url in state.registry.workers
        state.registry.add(url)
        return JSONResponse({"url": url, "added": not existed}, status_code=200 if existed else 201)

    async def add_event_source(url: str, kv_events: Any) -> None:
        """``{"url": ..., "kv_events": "tcp://host:port[;topic=T][;replay=...][;bind]"}``."""
        if state.subscriber is None:
            raise BadRequestError(
                "precise mode is off: start kvroute serve with --kv-events "
                "to add workers with KV events"
            )
        if not isinstance(kv_events, str):
            raise BadRequestError("'kv_events' must be a string like 'tcp://host:port;bind'")
        from kvroute.events import KvEventsSpecError, parse_kv_events_spec

        try:
            source = parse_kv_events_spec(f"{url}={kv_events}")
        except KvEventsSpecError as e:
            raise BadRequestError(str(e)) from None
        try:
            await asyncio.to_thread(state.subscriber.add_source, source)
        except Exception as e:  # a socket that cannot bind/connect is the caller's setting
            raise BadRequestError(f"cannot subscribe to {kv_events!r}: {e}") from None

    @app.delete("/workers/{url:path}")
    async def remove_worker(request: Request, url: str) -> Response:
        check_admin(request)
        target = unquote(url).rstrip("/")
        if state.registry.remove(target) is None:
            raise NotFoundError(f"no worker {target!r}")
        if state.subscriber is not None and target in state.subscriber.sources:
            await asyncio.to_thread(state.subscriber.remove_source, target)
        if state.pools is not None:
            await state.pools.drop(target)
        return JSONResponse({"url": target, "removed": True})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        check_admin(request)
        results: dict[str, int | str] = {}
        for url in list(state.registry.workers):
            try:
                r = await state.client.post(url + "/flush_cache", timeout=10.0)
                if r.status_code == 404:
                    r = await state.client.post(url + "/reset_prefix_cache", timeout=10.0)
                results[url] = r.status_code
            except httpx.HTTPError as e:
                results[url] = type(e).__name__
        state.policy.clear()
        state.index.clear()
        return JSONResponse({"index_cleared": True, "workers": results})

    return app
