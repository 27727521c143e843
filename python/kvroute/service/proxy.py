"""Forwarding: choose a worker, send the body unchanged, stream the answer back.

What is retried: a failure before any response byte came back from the worker
(connection refused or reset, connect timeout, first-byte timeout, a body cut short on
a non-streaming answer). The worker is marked down at once, its load reservation
released, and the request goes to another healthy worker chosen by the policy among
the rest; never to a worker that already failed it. At most ``max_retries`` retries.

What is not retried: an answer the worker gave (any status, passed through unchanged
with its body), and a stream that already sent bytes to the client: if the worker
dies mid-stream the client receives an SSE ``error`` event and the stream ends.

Every path releases the reservation exactly once: the response object owns it and
releases it in ``finally`` whether the stream completes, fails, times out or the client
goes away (which also closes the upstream response).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvroute.errors import (
    BadRequestError,
    GatewayTimeoutError,
    PayloadTooLargeError,
    UnavailableError,
    error_body,
)
from kvroute.fleet.registry import Reservation
from kvroute.routing.policies.base import NoWorkerError, RouteRequest

if TYPE_CHECKING:
    from kvroute.service.state import RouterState

log = logging.getLogger("kvroute.service.proxy")

# Failures that prove the worker never processed the request's answer for us.
RETRYABLE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadTimeout,
    httpx.WriteError,
    httpx.WriteTimeout,
    httpx.ReadError,
    httpx.RemoteProtocolError,
)
# Worker answer headers passed on to the client (besides the router's own).
PASS_HEADERS = frozenset((b"content-type", b"cache-control"))
CACHED_RE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
PROMPT_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


class ProxyStream(StreamingResponse):
    """A streamed upstream answer; ``cleanup`` runs once whatever ends the response."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        status_code: int,
        raw_headers: list[tuple[bytes, bytes]],
        cleanup: Callable[[], Any],
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(body, status_code=status_code)
        self.raw_headers = raw_headers
        self._cleanup = cleanup
        self._draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            if not self._draining():
                raise
            # The shutdown grace period ran out mid-stream: end the stream with an error
            # event the client can see (after a blank line, in case the last chunk ended
            # mid-event) rather than a bare cut and a logged traceback.
            msg = "the router is shutting down and the stream outlived its grace period"
            event = error_body(msg, "service_unavailable", "shutting_down")
            await send({"type": "http.response.body", "body": b"\n\ndata: " + event + b"\n\n"})
        finally:
            await self._cleanup()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (413 past it), read off the ASGI
    ``receive`` channel directly."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body over {limit} bytes")
    chunks = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(f"request body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def answer_chunks(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The answer's chunks as they arrive: decoded by httpx when the worker set a
    Content-Encoding, else straight off the transport's stream (the router sends no
    Accept-Encoding; this skips httpx's decoder and chunker chain, 3x cheaper)."""
    if "content-encoding" in upstream.headers:
        return upstream.aiter_bytes()
    return upstream.stream.__aiter__()  # type: ignore[union-attr]


async def read_answer(upstream: httpx.Response) -> bytes:
    """The whole answer (see ``answer_chunks``); the response is closed after."""
    try:
        parts = [chunk async for chunk in answer_chunks(upstream)]
    finally:
        await upstream.aclose()
    return parts[0] if len(parts) == 1 else b"".join(parts)


def parse_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequestError("request body is empty; expected a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequestError("request body must be a JSON object")
    return obj


def session_key(request: Request, body: dict[str, Any]) -> str | None:
    for h in ("x-session-id", "x-user-id"):
        v = request.headers.get(h)
        if v:
            return v
    user = body.get("user")
    return user if isinstance(user, str) and user else None


class RawResponse(Response):
    """A complete answer with its header list already built (``Response`` would encode
    a dict of headers again)."""

    def __init__(self, content: bytes, status_code: int, raw: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status_code
        self.body = content
        self.background = None
        self.raw_headers = raw


class Forwarder:
    def __init__(self, state: RouterState) -> None:
        self.s = state

    def _headers(self, request: Request) -> dict[str, str]:
        out = {"content-type": "application/json"}
        accept = request.headers.get("accept")
        if accept:
            out["accept"] = accept
        # One ID follows the request through the logs, the worker and the answer: the
        # client's own when it is a sane token, else a fresh one.
        rid = request.headers.get("x-request-id", "")
        out["x-request-id"] = rid if REQUEST_ID_RE.fullmatch(rid) else os.urandom(12).hex()
        settings = self.s.settings
        if settings.worker_api_key:
            out["authorization"] = f"Bearer {settings.worker_api_key}"
        elif not settings.api_key and request.headers.get("authorization"):
            # Without a router key, the client's credentials are meant for the workers.
            out["authorization"] = request.headers["authorization"]
        return out

    async def forward(self, request: Request, kind: str, path: str) -> Response:
        s = self.s
        t0 = time.perf_counter()
        body = await read_body(request, s.settings.max_body_bytes)
        obj = parse_object(body)
        stream = obj.get("stream") is True
        if s.policy.needs_tokens:
            tokens: Sequence[int] = await s.tokenizer.tokens_for(kind, obj)
            if len(tokens) == 0:
                raise BadRequestError("the prompt is empty")
        else:
            s.tokenizer.check(kind, obj)
            tokens = ()
        key = session_key(request, obj) if s.policy.needs_session else None
        route_req = RouteRequest(tokens=tokens, session_key=key)
        headers = self._headers(request)
        rid = headers["x-request-id"]
        tried: set[str] = set()
        last_error = "no healthy worker"
        deadline = time.monotonic() + s.settings.request_timeout_secs
        for attempt in range(s.settings.max_retries + 1):
            loads = s.registry.loads(exclude=tried)
            if not loads:
                break
            try:
                decision = s.policy.select(route_req, loads)
            except NoWorkerError:
                break
            except (ValueError, TypeError) as e:
                raise BadRequestError(str(e)) from None
            on_release = None
            if decision.ticket is not None:  # the policy tracks the request until it ends
                on_release = functools.partial(s.policy.on_done, decision)
            res = s.registry.reserve(decision.worker, on_release)
            source = "precise" if decision.precise else "approximate"
            s.metrics.decisions_by[s.policy.name, decision.reason, source].inc()
            if s.recorder is not None and attempt == 0:
                s.recorder.record(kind, obj, tokens)  # queued, never waits (--record)
            if s.policy.name == "cache_aware":
                s.metrics.matched_ratio.observe(decision.matched_tokens / len(tokens))
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s %s -> %s (%s, %s, matched %d of %d tokens, attempt %d)",
                    rid,
                    kind,
                    decision.worker,
                    decision.reason,
                    source,
                    decision.matched_tokens,
                    len(tokens),
                    attempt + 1,
                )
            url = decision.worker + path
            upstream: httpx.Response | None = None
            content = b""
            streaming = False
            try:
                # --request-timeout-secs bounds the whole request, the wait for the first
                # byte included (the first-byte timeout may be the longer of the two), and
                # reading a complete answer; a stream's relay keeps to the same deadline.
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                    upstream = await s.forward.post(url, body, headers)
                    s.registry.record_status(decision.worker, upstream.status_code)
                    s.metrics.ttfb_by[(kind,)].observe(time.perf_counter() - t0)
                    streaming = stream and upstream.status_code == 200
                    if not streaming:
                        content = await read_answer(upstream)
            except TimeoutError:
                await self._abandon(upstream, res)
                what = "no answer" if upstream is None else "the worker did not finish"
                raise GatewayTimeoutError(
                    f"{what} within {s.settings.request_timeout_secs:g}s"
                ) from None
            except RETRYABLE as e:
                await self._abandon(upstream, res)
                last_error = self._worker_failed(decision.worker, e, rid)
                tried.add(decision.worker)
                await self._backoff(attempt)
                continue
            except httpx.HTTPError as e:
                await self._abandon(upstream, res)
                if upstream is not None:
                    raise
                # Not the worker's fault (e.g. our connection pool is exhausted): no retry
                # storm, no worker marked down.
                raise UnavailableError(f"could not reach a worker: {type(e).__name__}") from None
            except BaseException:
                await self._abandon(upstream, res)
                raise
            raw = [(b"x-kvroute-worker", decision.worker.encode()), (b"x-request-id", rid.encode())]
            for name, value in upstream.headers.raw:
                name = name.lower()
                if name in PASS_HEADERS:
                    raw.append((name, value))
            if streaming:
                return ProxyStream(
                    self._relay(
                        upstream, decision.worker, rid, deadline, decision.matched_tokens, source
                    ),
                    upstream.status_code,
                    raw,
                    self._closer(upstream, res, kind, t0, upstream.status_code),
                    lambda: s.draining,
                )
            res.release()  # the answer is complete and its connection released
            self._done(kind, upstream.status_code, t0)
            if upstream.status_code == 200:
                self._reuse(content, decision.matched_tokens, source)
            raw.append((b"content-length", str(len(content)).encode()))
            return RawResponse(content, upstream.status_code, raw)
        raise UnavailableError(f"no healthy worker could take the request ({last_error})")

    @staticmethod
    async def _abandon(upstream: httpx.Response | None, res: Reservation) -> None:
        """A failed attempt: close its answer (and connection), release its load."""
        try:
            if upstream is not None:
                await upstream.aclose()
        finally:
            res.release()

    def _reuse(self, data: bytes, predicted: int, source: str) -> None:
        """Count predicted against reported prefix reuse when the answer reports it."""
        at = data.find(b'"cached_tokens"')
        m = CACHED_RE.match(data, at) if at >= 0 else None
        if m is not None:
            self.s.metrics.predicted_by[(source,)].inc(predicted)
            self.s.metrics.reported_by[(source,)].inc(int(m.group(1)))
            p = PROMPT_RE.search(data)
            if p is not None:  # the workers' hit rate on /status
                self.s.metrics.reported_prompt_by[(source,)].inc(int(p.group(1)))

    def _worker_failed(self, worker: str, e: BaseException, rid: str) -> str:
        kind = type(e).__name__
        log.warning("%s: %s failed before the first byte (%s)", rid, worker, kind)
        self.s.metrics.worker_failures.labels(worker, kind).inc()
        self.s.metrics.retries.labels(kind).inc()
        self.s.registry.mark_down(worker, f"{kind} before the first byte", passive=True)
        return f"{worker}: {kind}"

    async def _backoff(self, attempt: int) -> None:
        delay = self.s.settings.retry_backoff_secs * (2**attempt)
        if delay > 0:
            await asyncio.sleep(delay)

    def _done(self, kind: str, status: int, t0: float) -> None:
        self.s.metrics.requests_by[kind, str(status)].inc()
        self.s.metrics.latency_by[(kind,)].observe(time.perf_counter() - t0)

    def _closer(
        self, upstream: httpx.Response, res: Reservation, kind: str, t0: float, status: int
    ) -> Callable[[], Any]:
        async def close() -> None:
            try:
                await upstream.aclose()
            finally:
                res.release()
                self._done(kind, status, t0)

        return close

    async def _relay(
        self,
        upstream: httpx.Response,
        worker: str,
        rid: str,
        deadline: float,
        predicted: int,
        source: str,
    ) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout_at(
                asyncio.get_running_loop().time() + (deadline - time.monotonic())
            ):
                async for chunk in answer_chunks(upstream):
                    if b'"cached_tokens"' in chunk:
                        self._reuse(chunk, predicted, source)
                    yield chunk
        except (httpx.HTTPError, TimeoutError) as e:
            # Bytes already reached the client: no retry. Tell it in-band and end.
            name = type(e).__name__
            log.warning("%s: stream from %s broke: %s", rid, worker, name)
            self.s.metrics.worker_failures.labels(worker, f"stream_{name}").inc()
            if not isinstance(e, TimeoutError):
                self.s.registry.mark_down(worker, f"{name} mid-stream", passive=True)
            msg = f"upstream worker failed mid-stream ({name})"
            yield b"data: " + error_body(msg, "upstream_error", "stream_interrupted") + b"\n\n"
