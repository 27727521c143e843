"""The router's HTTP service (FastAPI): endpoints, lifespan, auth and admission.

One shared ``httpx.AsyncClient``, tokenizer and health-check task per app, created in
the lifespan. Request bodies are read as bytes and forwarded unchanged; handlers parse
JSON with orjson only to find the prompt, never through per-request pydantic models.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from kvroute import __version__
from kvroute.config import ConfigError, Settings, normalize_worker_url
from kvroute.errors import (
    BadRequestError,
    ForbiddenError,
    NotFoundError,
    OverloadedError,
    RouterError,
    UnauthorizedError,
    UnprocessableError,
    error_response,
)
from kvroute.fleet.budget import budget_loop
from kvroute.fleet.discovery import start_discovery
from kvroute.fleet.health import check_all, check_worker, health_loop, refresh_models
from kvroute.fleet.models import listing, named_models
from kvroute.fleet.urls import path_worker_url, worker_url_refusal
from kvroute.routing.tokenization import PromptTokenizer
from kvroute.service import openapi
from kvroute.service.fastpath import RouterApp
from kvroute.service.incoming import Incoming
from kvroute.service.passthrough import PassThrough
from kvroute.service.proxy import Forwarder, ProxyStream, parse_object, read_body
from kvroute.service.routes import PASSTHROUGH_KINDS, ROUTES
from kvroute.service.state import build_state
from kvroute.service.status import History, counter_totals
from kvroute.service.status import render as render_status
from kvroute.service.upstream import Forward, create_client

log = logging.getLogger("kvroute.service.app")


def _bearer(request: Request | Incoming) -> str:
    if isinstance(request, Incoming):
        auth = request.header(b"authorization") or ""
    else:
        auth = request.headers.get("authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else ""


def _key_ok(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def create_app(settings: Settings, tokenizer: PromptTokenizer | None = None) -> FastAPI:
    state = build_state(settings, tokenizer)
    history = History(state.metrics)  # /status charts

    probes: set[asyncio.Task[None]] = set()

    def probe(url: str) -> None:
        """Check a worker that just joined at once (admin API, discovery): it takes no
        traffic until its first check, which also reads the models it serves."""
        task = asyncio.create_task(check_worker(state, url))
        probes.add(task)
        task.add_done_callback(probes.discard)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        s = state.settings
        state.client, state.pools = create_client(
            connect_s=s.connect_timeout_secs,
            first_byte_s=s.first_byte_timeout_secs,
            pool_s=s.queue_timeout_secs,
        )
        state.forward = Forward(state.client, state.pools)
        # Workers take no traffic before their first check: check them all before
        # serving (a check times out after --health-check-timeout-secs).
        await check_all(state)
        task = asyncio.create_task(health_loop(state))
        discovery = start_discovery(
            s, state.registry, state.pools.drop if state.pools else None, probe
        )
        sampler = asyncio.create_task(history.run())
        budget_task = None
        if state.budget is not None:
            budget_task = asyncio.create_task(
                budget_loop(
                    state.budget,
                    state.index,
                    lambda: state.client,
                    lambda: list(state.registry.workers),
                    interval=s.health_check_interval_secs,
                    timeout_s=s.health_check_timeout_secs,
                )
            )
        if state.subscriber is not None:
            await asyncio.to_thread(state.subscriber.start)
        if state.store is not None:
            state.store.members.on_removed = release_worker
            state.store.members.on_added = probe
            await state.store.start()
        # What start-up built (tokenizer tables, templates, the app: ~116k objects with
        # the Qwen3 tokenizer) lives as long as the router; out of the collector's
        # reach, a full collection walks only what requests made (67 ms -> <1 ms of
        # event loop held, measured in process).
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            if state.store is not None:
                await state.store.stop()
            if state.subscriber is not None:
                await asyncio.to_thread(state.subscriber.stop)
            for t in (task, discovery, sampler, budget_task):
                if t is not None:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
            if state.edge is not None:
                await state.edge.close()
            await state.client.aclose()
            if state.recorder is not None:
                await asyncio.to_thread(state.recorder.close)

    app = RouterApp(
        title="kvroute", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.router = state
    app.access_log = settings.access_log
    forwarder = Forwarder(state)
    passthrough = PassThrough(state)

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

    def check_api_key(request: Request | Incoming) -> None:
        key = state.settings.api_key
        if key and not _key_ok(_bearer(request), key):
            raise UnauthorizedError("missing or invalid API key (Authorization: Bearer ...)")

    def check_admin(request: Request) -> None:
        key = state.settings.admin_api_key
        if key:
            if not _key_ok(_bearer(request), key):
                raise UnauthorizedError("admin endpoints need the admin API key")
        elif state.settings.api_key:
            # A router with a client key is not open to keyless admin calls, even on
            # loopback: without --admin-api-key the client key opens them.
            if not _key_ok(_bearer(request), state.settings.api_key):
                raise UnauthorizedError("admin endpoints need the API key (no --admin-api-key set)")
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

    admission = state.admission

    async def inference(request: Incoming, kind: str, path: str) -> Response:
        if state.settings.api_key:
            check_api_key(request)
        # A free slot is taken without an await (the common case); else the request
        # queues. Past the shutdown grace period uvicorn cancels the request's task;
        # answered here it becomes a clear 503 instead of uvicorn's bare 500 and a
        # logged traceback.
        if not admission.try_acquire():
            try:
                await admission.acquire()
            except OverloadedError:
                state.metrics.requests.labels(kind, "429").inc()
                raise
            except asyncio.CancelledError:
                if state.draining:
                    return shutting_down(kind)
                raise
        try:
            via = passthrough if kind in PASSTHROUGH_KINDS else forwarder
            response = await via.forward(request, kind, path)
        except RouterError as e:
            await admission.release()
            state.metrics.requests.labels(kind, str(e.status)).inc()
            raise
        except asyncio.CancelledError:
            await admission.release()
            if state.draining:
                return shutting_down(kind)
            raise
        except BaseException:
            await admission.release()
            raise
        if isinstance(response, ProxyStream):
            inner = response._cleanup

            async def cleanup() -> None:
                try:
                    await inner()
                finally:
                    await admission.release()

            response._cleanup = cleanup
        elif not admission.try_release():
            await admission.release()
        return response

    app.inference = inference

    # RouterApp serves these paths directly; registered here too so that the OpenAPI
    # schema lists them (and a mounted app, whose paths differ, still routes them).
    def endpoint(kind: str, worker_path: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return await inference(Incoming(request.scope, request.receive), kind, worker_path)

        handle.__name__ = kind
        return handle

    for route_path, route in ROUTES.items():
        if route.kind in openapi.BODIES:
            body_schema = openapi.body(openapi.BODIES[route.kind])
        elif route_path.startswith("/v1/audio/"):
            body_schema = openapi.UPLOAD_BODY
        else:  # passed through untouched: any JSON object
            body_schema = openapi.body({"type": "object"})
        app.add_api_route(
            route_path,
            endpoint(route.kind, route.worker_path),
            methods=["POST"],
            openapi_extra=body_schema,
            responses=openapi.INFERENCE,
        )

    # ------------------------------------------------------------- fleet

    @app.get("/v1/models", responses=openapi.ROUTES["models"])
    async def models(request: Request) -> Response:
        """Each model the healthy workers serve, once; workers whose models are not
        known yet are asked now."""
        check_api_key(request)
        healthy = [state.registry.workers[u] for u in state.registry.loads()]
        await asyncio.gather(*(refresh_models(state, w.url) for w in healthy if w.models is None))
        served = [m for w in healthy if w.models for m in w.models.values()]
        return JSONResponse({"object": "list", "data": listing(served)})

    @app.get("/health", responses=openapi.ROUTES["health"])
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/readiness", responses=openapi.ROUTES["readiness"])
    async def readiness() -> Response:
        n = state.registry.healthy_count()
        if n == 0:
            return error_response(
                503, "no healthy worker", "service_unavailable", "no_healthy_worker"
            )
        return JSONResponse({"status": "ready", "healthy_workers": n})

    @app.get("/metrics", responses=openapi.ROUTES["metrics"])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/status", responses=openapi.ROUTES["status"])
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
            history=history,
        )
        return HTMLResponse(page)

    @app.get("/workers", responses=openapi.ROUTES["list_workers"])
    async def list_workers(request: Request) -> Response:
        """Every worker (a JSON list, as always). With --state-store, the live routers
        too: ``?include=routers`` answers ``{"workers": [...], "routers": [...]}``, and
        every answer says how many are live (``X-Kvroute-Routers``, ``Link`` to /routers)."""
        check_api_key(request)
        workers = state.workers_json()
        if state.store is None:
            return Response(orjson.dumps(workers), media_type="application/json")
        routers = state.routers_json()
        headers = {"x-kvroute-routers": str(len(routers)), "link": '</routers>; rel="routers"'}
        body: Any = workers
        if request.query_params.get("include") == "routers":
            body = {"workers": workers, "routers": routers}
        return Response(orjson.dumps(body), media_type="application/json", headers=headers)

    @app.post(
        "/workers",
        openapi_extra=openapi.body(openapi.ADD_WORKER),
        responses=openapi.ROUTES["add_worker"],
    )
    async def add_worker(request: Request) -> Response:
        check_admin(request)
        obj = parse_object(await read_body(Incoming(request.scope, request.receive), 64 * 1024))
        try:
            url = normalize_worker_url(obj.get("url"))  # type: ignore[arg-type]
        except ConfigError as e:
            raise UnprocessableError(str(e), code="invalid_worker_url") from None
        names = obj.get("models")
        if names is not None and (
            not isinstance(names, list)
            or not names
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise UnprocessableError(
                "'models' must be a non-empty list of model names (the base model first, "
                "then its LoRA adapters)",
                code="invalid_models",
            )
        refusal = worker_url_refusal(url, state.settings.worker_url_allow)
        if refusal is not None:
            raise ForbiddenError(refusal, code="worker_url_not_allowed")
        kv_events = obj.get("kv_events")
        if kv_events is not None:
            await add_event_source(url, kv_events)
        existed = url in state.registry.workers
        worker = state.registry.add(url)
        if names is not None:
            state.registry.set_models(url, named_models(names), fixed=True)
        if state.store is not None:
            state.store.worker_added(url)
        if not existed:  # no traffic until this first check (and models read) answers
            probe(url)
        return JSONResponse(
            {"url": url, "added": not existed, "healthy": worker.healthy},
            status_code=200 if existed else 201,
        )

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

    @app.delete("/workers/{url:path}", responses=openapi.ROUTES["remove_worker"])
    async def remove_worker(request: Request, url: str) -> Response:
        check_admin(request)
        target = path_worker_url(request.scope)
        with contextlib.suppress(ConfigError):  # spelled differently, same worker
            target = normalize_worker_url(target)
        if state.registry.remove(target) is None:
            raise NotFoundError(f"no worker {target[:200]!r}")
        if state.store is not None:
            state.store.worker_removed(target)
        await release_worker(target)
        return JSONResponse({"url": target, "removed": True})

    async def release_worker(target: str) -> None:
        """What a removed worker held beyond the registry: event source, connections."""
        if state.subscriber is not None and target in state.subscriber.sources:
            await asyncio.to_thread(state.subscriber.remove_source, target)
        if state.pools is not None:
            try:
                await state.pools.drop(target)
            except Exception:  # the worker is gone either way; its pool goes with the GC
                log.exception("closing the connections to %s failed", target)

    @app.get("/routers")
    async def list_routers(request: Request) -> Response:
        """Live router replicas sharing this router's --state-store (empty without)."""
        check_api_key(request)
        return Response(orjson.dumps(state.routers_json()), media_type="application/json")

    @app.post("/flush_cache", responses=openapi.ROUTES["flush_cache"])
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
        if state.store is not None:
            state.store.index_cleared()
        return JSONResponse({"index_cleared": True, "workers": results})

    return app
