"""Forwarding: read and check the request, run its attempts, stream the answer back.

Which worker failures are retried, and how, is ``kvroute.service.attempts``; copies of a
request that broke two workers are refused here at once (``kvroute.service.quarantine``).

What is not retried: an answer the worker gave (except 502/503/504 and a retryable 500,
see ``attempts``), passed through unchanged with its body, and a stream that already
sent bytes to the client: if the worker dies mid-stream the client receives an SSE
``error`` event and the stream ends.

Every path releases the reservation exactly once: the response object owns it and
releases it in ``finally`` whether the stream completes, fails, times out or the client
goes away (which also closes the upstream response).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import re
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvroute.errors import (
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    UpstreamError,
    error_body,
)
from kvroute.fleet.models import (
    generate_adapter,
    partition_token,
    request_salt,
    requested_model,
)
from kvroute.fleet.registry import Registry, Reservation
from kvroute.routing.decide_first import Prompt, eligible
from kvroute.routing.load import Ticket, max_tokens_of
from kvroute.routing.policies.base import RouteRequest
from kvroute.routing.tokenization import byte_tokens
from kvroute.service.attempts import Attempts, Job, answer_chunks, usage
from kvroute.service.early import EarlyRouting
from kvroute.service.h1pool import raw_headers
from kvroute.service.incoming import Incoming
from kvroute.service.quarantine import fingerprint, output_tokens
from kvroute.service.routes import for_index

if TYPE_CHECKING:
    from kvroute.service.state import RouterState

log = logging.getLogger("kvroute.service.proxy")

# Worker answer headers passed on to the client (besides the router's own).
PASS_HEADERS = frozenset((b"content-type", b"cache-control"))
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


def new_request_id() -> str:
    """A fresh request ID: 96 random bits as 24 hex digits. From ``random`` (reseeded
    in a forked child), not ``os.urandom``: an ID must be unique, not secret, and
    ``os.urandom`` is a ``getrandom`` system call per request."""
    return f"{random.getrandbits(96):024x}"


# Scope key of the server's own ``send`` when the access log wraps it (``accesslog``).
# A stream's later chunks go through it, past every wrapper between the log and the
# response: none of kvroute's transforms a body (no middleware; Starlette's exception
# handling only notes that the response started).
RAW_SEND = "kvroute.raw_send"


class ProxyStream(Response):
    """A streamed upstream answer; ``cleanup`` runs once whatever ends the response.

    Each chunk of ``body`` goes to the client as it comes. A client that leaves ends the
    stream at once (the upstream request is closed, so the engine stops generating):
    a listener task waits for the ``http.disconnect`` message and cancels the sending
    task, whose cancellation is then absorbed. This is what Starlette's
    ``StreamingResponse`` does for ASGI 2.3 servers (uvicorn), without its task group: an
    anyio task group, two tasks and their wrappers on every stream, and two more frames
    resumed for every chunk."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        status_code: int,
        raw_headers: list[tuple[bytes, bytes]],
        cleanup: Callable[[], Any],
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.body_iterator = body
        self.status_code = status_code
        self.raw_headers = raw_headers
        self.background = None
        self._cleanup = cleanup
        self._draining = draining
        self._ended = False  # sent to the end (or given up): a disconnect no longer cancels
        self._gone = False  # the client left mid-stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        listener = asyncio.ensure_future(_disconnected(receive))

        def left(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None and not self._ended:
                self._gone = True
                task.cancel()

        listener.add_done_callback(left)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            out, rest = send, scope.get(RAW_SEND, send)
            async for chunk in self.body_iterator:
                await out({"type": "http.response.body", "body": chunk, "more_body": True})
                if chunk:  # the access log saw the first bytes: the rest may go around it
                    out = rest
            self._ended = True
            await out({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if self._gone:
                task.uncancel()  # the client left: nothing more to send, nothing failed
            elif self._draining():
                # The shutdown grace period ran out mid-stream: end the stream with an
                # error event the client can see (after a blank line, in case the last
                # chunk ended mid-event) rather than a bare cut and a logged traceback.
                msg = "the router is shutting down and the stream outlived its grace period"
                event = error_body(msg, "service_unavailable", "shutting_down")
                await send({"type": "http.response.body", "body": b"\n\ndata: " + event + b"\n\n"})
            else:
                raise
        finally:
            self._ended = True
            listener.cancel()
            # Cancelled in ``send``, the body's generator is left at a yield: close it
            # now rather than when it is collected.
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                await self._cleanup()


async def _disconnected(receive: Receive) -> None:
    """Return when the client has disconnected (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Incoming, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (413 past it), read off the ASGI
    ``receive`` channel directly."""
    declared = request.headers.get(b"content-length")
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


def check_model(registry: Registry, model: str | None) -> None:
    """404, naming the models served, when no worker can serve ``model``."""
    if not registry.model_routable(model):
        names = ", ".join(sorted(registry.known_models())) or "none"
        raise NotFoundError(
            f"the model {model!r} does not exist; available models: {names}",
            code="model_not_found",
        )


def session_key(request: Incoming, body: dict[str, Any]) -> str | None:
    for h in (b"x-session-id", b"x-user-id"):
        v = request.header(h)
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
        self.attempts = Attempts(state)
        self.early = EarlyRouting(state) if EarlyRouting.applies(state) else None

    def _headers(self, request: Incoming) -> dict[str, str]:
        out = {"content-type": "application/json"}
        accept = request.header(b"accept")
        if accept:
            out["accept"] = accept
        # One ID follows the request through the logs, the worker and the answer: the
        # client's own when it is a sane token, else a fresh one.
        rid = request.header(b"x-request-id")
        out["x-request-id"] = (
            rid if rid is not None and REQUEST_ID_RE.fullmatch(rid) else new_request_id()
        )
        settings = self.s.settings
        if settings.worker_api_key:
            out["authorization"] = f"Bearer {settings.worker_api_key}"
        elif not settings.api_key:
            # Without a router key, the client's credentials are meant for the workers.
            auth = request.header(b"authorization")
            if auth:
                out["authorization"] = auth
        return out

    async def forward(self, request: Incoming, kind: str, path: str) -> Response:
        s = self.s
        t0 = time.perf_counter()
        body = await read_body(request, s.settings.max_body_bytes)
        obj = parse_object(body)
        stream = obj.get("stream") is True
        model = self._model(kind, obj)
        index_kind, index_obj = for_index(kind, obj)
        early: Prompt | None = None  # decide first: the prompt's rest is encoded after
        if s.policy.needs_tokens:
            if self.early is not None and eligible(s.policy):
                wrap = functools.partial(self._partitioned, kind, obj, model)
                tokens, early = await self.early.tokens(index_kind, index_obj, model, wrap)
            else:
                tokens = await s.tokenizer_for(model).tokens_for(index_kind, index_obj)
                tokens = self._partitioned(kind, obj, model, tokens)
            if len(tokens) == 0:
                raise BadRequestError("the prompt is empty")
            request.note("prompt_tokens", len(tokens))  # for the access log
        else:
            s.tokenizer_for(model).check(index_kind, index_obj)
            tokens = ()
        key = session_key(request, obj) if s.policy.needs_session else None
        headers = self._headers(request)
        rid = headers["x-request-id"]
        # Hashed only when something is quarantined (else on a failure, in ``attempts``).
        fp = fingerprint(tokens, body) if len(s.quarantine) else None
        if fp is not None and s.quarantine.holds(fp):
            s.metrics.quarantine_refused.inc()
            raise UpstreamError(
                f"request {rid} is a copy of a request that broke the connection to two "
                "workers; refused for now",
                code="request_quarantined",
            )
        n_prompt = len(tokens) if len(tokens) else len(body) // 4
        job = Job(
            kind=kind,
            path=path,
            body=body,
            headers=headers,
            rid=rid,
            route=RouteRequest(tokens=tokens, session_key=key),
            fingerprint=fp,
            first_byte_s=self.attempts.first_byte_secs(n_prompt, output_tokens(obj), stream),
            deadline=time.monotonic() + s.settings.request_timeout_secs,
            stream=stream,
            t0=t0,
            model=model,
            expected_out=s.work.expected_output(max_tokens_of(obj)),
        )
        if early is not None and self.early is not None:
            job.on_decision = self.early.after_decision(job, early, kind, obj, wrap, model)
        elif s.recorder is not None:
            s.recorder.record(kind, obj, tokens)  # queued, never waits (--record)
        answer = await self.attempts.run(job)
        upstream, decision, res = answer.upstream, answer.decision, answer.reservation
        source = "precise" if decision.precise else "approximate"
        raw = [(b"x-kvroute-worker", decision.worker.encode()), (b"x-request-id", rid.encode())]
        for name, value in raw_headers(upstream):
            name = name.lower()
            if name in PASS_HEADERS:
                raw.append((name, value))
        if answer.streaming:
            return ProxyStream(
                self._relay(
                    upstream,
                    decision.worker,
                    rid,
                    job.deadline,
                    decision.matched_tokens,
                    source,
                    answer.ticket,
                ),
                upstream.status_code,
                raw,
                self._closer(upstream, res, kind, t0, upstream.status_code),
                lambda: s.draining,
            )
        res.release()  # the answer is complete and its connection released
        self._done(kind, upstream.status_code, t0)
        content = answer.content
        if upstream.status_code == 200:
            self._count_reuse(answer.reported, decision.matched_tokens, source)
        raw.append((b"content-length", str(len(content)).encode()))
        return RawResponse(content, upstream.status_code, raw)

    def _model(self, kind: str, obj: dict[str, Any]) -> str | None:
        """The model the request asks for, refused with 404 when no worker serves it."""
        s = self.s
        try:
            model = requested_model(kind, obj, s.settings.default_model)
        except ValueError as e:
            raise BadRequestError(str(e)) from None
        check_model(s.registry, model)
        s.metrics.model_requests_by[(s.metrics.model_label(model),)].inc()
        return model

    def _partitioned(
        self, kind: str, obj: dict[str, Any], model: str | None, tokens: Sequence[int]
    ) -> Sequence[int]:
        """``tokens`` behind the partition token of the request's adapter and cache salt
        (``kvroute.fleet.models``), or unchanged in the base model's unsalted partition;
        as bytes for a byte-token index (``byte_tokens``)."""
        adapter = generate_adapter(obj) if kind == "generate" else None
        if adapter is None and self.s.registry.is_adapter(model):
            adapter = model
        token = partition_token(adapter, request_salt(obj))
        if self.s.byte_tokens:
            return byte_tokens(tokens, token)
        if token is None:
            return tokens
        out = array("I", (token,))
        out.extend(tokens)
        return out

    def _count_reuse(
        self, reported: tuple[int | None, int | None], predicted: int, source: str
    ) -> None:
        prompt, cached = reported
        if cached is not None:
            m = self.s.metrics
            m.predicted_by[(source,)].inc(predicted)
            m.reported_by[(source,)].inc(cached)
            if prompt is not None:  # the workers' hit rate on /status
                m.reported_prompt_by[(source,)].inc(prompt)

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
        ticket: Ticket,
    ) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout_at(
                asyncio.get_running_loop().time() + (deadline - time.monotonic())
            ):
                async for chunk in answer_chunks(upstream):
                    if ticket.first_at is None:
                        ticket.first_byte(time.monotonic())
                    if b'"prompt_tokens"' in chunk:  # the usage event
                        reported = usage(ticket, chunk, self.s.budget)
                        self._count_reuse(reported, predicted, source)
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
