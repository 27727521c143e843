"""One request's attempts: choose a worker, send, and decide what a failure means.

Each attempt reserves load on the chosen worker, sends the body and waits for the
answer to begin (for a non-streamed one, to be complete). Nothing has reached the client
yet, so a failure can still be retried on another worker (never one that already failed
this request), at most ``--max-retries`` times. What a failure says:

* **the worker's fault** (``worker``): connection refused, connect timeout, no first
  byte within the attempt's deadline (``kvroute.service.quarantine.first_byte_secs``).
  The worker is marked down (passively: it also sits out ``--failure-cooldown-secs``).
* **maybe the request's** (``request``): the connection reset or closed while this
  request was in flight. One bad request can do that to every worker (a query of
  death), so it blames no worker by itself: the registry marks a worker down only when
  *different* requests fail on it. The request is retried once elsewhere; failing the
  same way again, the client gets a 502 naming the request ID and the request's
  fingerprint is quarantined.
* **moved** (``worker_down``): the worker left rotation (health check, circuit breaker,
  failures of other requests) while this request waited on it; the attempt is
  cancelled upstream at once and the request goes elsewhere.
* **a 5xx answer**: 502, 503, 504, and a 500 carrying ``Retry-After``, are retried on
  another worker while retries remain; past them the last such answer passes through.
  Every other answer (2xx, 4xx, other 5xx) passes through unchanged.

An answer of 400 or more, or a failed attempt, undoes the policy's prediction that the
worker now caches the prompt (``Policy.on_rejected``) and is not counted as served.

Each attempt is made among the healthy workers that serve the request's model
(``kvroute.fleet.models``), and reserves the request's predicted work on its worker
(``kvroute.routing.load``: a ``Ticket`` ended with the load reservation, exactly once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from kvroute.errors import BadRequestError, GatewayTimeoutError, UnavailableError, UpstreamError
from kvroute.fleet.registry import Reservation
from kvroute.routing.load import Ticket
from kvroute.routing.policies.base import Decision, NoWorkerError, RouteRequest
from kvroute.service.deadlines import Deadlines
from kvroute.service.h1pool import raw_headers, read_whole
from kvroute.service.quarantine import fingerprint, first_byte_secs

if TYPE_CHECKING:
    from kvroute.fleet.budget import IndexBudget
    from kvroute.service.state import RouterState

log = logging.getLogger("kvroute.service.proxy")

# Could not reach the worker at all: the worker's fault.
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout)
# The connection broke while this request was on it: the worker's or the request's.
BROKEN = (httpx.ReadError, httpx.WriteError, httpx.WriteTimeout, httpx.RemoteProtocolError)
RETRYABLE_STATUS = frozenset((502, 503, 504))
# Request-tied failures allowed before the request is quarantined (the first retries).
REQUEST_FAILURES_ALLOWED = 1
# A stream's first-byte deadline may shrink to the floor plus this times its predicted
# time to first token (``first_byte_deadline``): generous, the prior may be 4x off.
LEARNED_MARGIN = 8.0
# The counts an answer reports (OpenAI's ``usage``, SGLang's ``meta_info``): read in one
# pass from the ``usage`` key on (the answer's end), or over the whole answer without it.
USAGE_FIELDS_RE = re.compile(rb'"(prompt_tokens|completion_tokens|cached_tokens)"\s*:\s*(\d+)')


@dataclass(slots=True)
class Answer:
    """A worker's answer, head received (and the whole body unless ``streaming``)."""

    upstream: httpx.Response
    decision: Decision
    reservation: Reservation
    content: bytes
    streaming: bool
    ticket: Ticket  # the request's predicted work on the worker
    # A whole answer's usage as reported: (prompt_tokens, cached_tokens), None if absent.
    reported: tuple[int | None, int | None] = (None, None)

    @property
    def status(self) -> int:
        return self.upstream.status_code


@dataclass(slots=True)
class Failed:
    blame: str  # "worker" | "request" | "worker_down"
    what: str


@dataclass(slots=True)
class Job:
    """What every attempt of one request shares."""

    kind: str
    path: str
    body: bytes
    headers: dict[str, str]
    rid: str
    route: RouteRequest
    fingerprint: int | None  # None until needed (see ``fp``)
    first_byte_s: float
    deadline: float  # time.monotonic() by which the whole request must end
    stream: bool
    t0: float
    model: str | None = None  # only workers serving it are tried
    expected_out: int = 0  # output tokens the work model expects
    # Chooses among the loads instead of the policy (routes with no prefix to follow).
    pick: Callable[[dict[str, int]], str] | None = None
    # Told each decision (decide first: where the rest of the prompt goes).
    on_decision: Callable[[Decision], None] | None = None

    def fp(self) -> int:
        """The request's fingerprint for quarantine (``kvroute.service.quarantine``)."""
        if self.fingerprint is None:
            self.fingerprint = fingerprint(self.route.tokens, self.body)
        return self.fingerprint


def retryable_answer(upstream: httpx.Response) -> bool:
    status = upstream.status_code
    return status in RETRYABLE_STATUS or (status == 500 and "retry-after" in upstream.headers)


class Attempts:
    def __init__(self, state: RouterState) -> None:
        self.s = state
        self._deadlines: Deadlines | None = None  # the attempts' timeouts (one timer)

    def first_byte_secs(self, prompt_tokens: int, output_tokens: int | None, stream: bool) -> float:
        st = self.s.settings
        return first_byte_secs(
            prompt_tokens,
            floor_s=st.first_byte_floor_secs,
            cap_s=st.first_byte_timeout_secs,
            output_tokens=output_tokens,
            streaming=stream,
        )

    async def run(self, job: Job) -> Answer:
        """The first answer that is not retried; raises a ``RouterError`` otherwise."""
        s = self.s
        tried: set[str] = set()
        request_failures = 0
        last_error = "no healthy worker"
        last_answer: Answer | None = None
        for attempt in range(s.settings.max_retries + 1):
            loads = s.registry.loads(exclude=tried, model=job.model)
            if not loads:
                if job.model is not None and not tried:
                    last_error = f"no healthy worker serves model {job.model!r}"
                break
            decision = self._choose(job, loads, attempt)
            if decision is None:
                break
            if job.on_decision is not None:
                job.on_decision(decision)
            on_release = None
            if decision.ticket is not None:  # the policy tracks the request until it ends
                on_release = functools.partial(s.policy.on_done, decision)
            # The request's predicted work, released with the reservation (exactly once).
            ticket = self._reserve_work(job, decision)
            res = s.registry.reserve(decision.worker, releaser(ticket, on_release))
            if s.edge is not None:
                s.edge.after_reserve(decision.worker)
            outcome = await self._attempt(job, decision, res, ticket)
            s.settle_tails()  # decide first: the whole prompt, for what follows
            worker = decision.worker
            tried.add(worker)
            if isinstance(outcome, Answer):
                if outcome.status >= 400:
                    self._rejected(job, decision)
                if not retryable_answer(outcome.upstream) or attempt == s.settings.max_retries:
                    return outcome
                log.warning("%s: %s answered %d; retrying", job.rid, worker, outcome.status)
                s.metrics.retries.labels("upstream_5xx").inc()
                outcome.reservation.release()
                last_answer = outcome
                last_error = f"{worker}: HTTP {outcome.status}"
                continue
            self._rejected(job, decision)
            last_error = f"{worker}: {outcome.what}"
            s.metrics.worker_failures.labels(worker, outcome.what).inc()
            if outcome.blame == "worker":
                log.warning(
                    "%s: %s failed before the first byte (%s)", job.rid, worker, outcome.what
                )
                s.registry.mark_down(worker, f"{outcome.what} before the first byte", passive=True)
                reason = "worker_failed"
            elif outcome.blame == "worker_down":
                log.warning(
                    "%s: %s left rotation (%s); moving the request", job.rid, worker, outcome.what
                )
                reason = "worker_down"
            else:
                request_failures += 1
                log.warning(
                    "%s: connection to %s broke in flight (%s)", job.rid, worker, outcome.what
                )
                s.registry.record_request_failure(worker, job.fp(), outcome.what)
                if request_failures > REQUEST_FAILURES_ALLOWED:
                    s.quarantine.add(job.fp())
                    s.metrics.quarantined.inc()
                    ttl = s.settings.quarantine_secs
                    raise UpstreamError(
                        f"request {job.rid} broke the connection to {request_failures} "
                        f"workers ({outcome.what}); it is not retried"
                        + (f", and copies of it are refused for {ttl:g}s" if ttl else ""),
                        code="request_failed_on_workers",
                    )
                reason = "request_failed"
            s.metrics.retries.labels(reason).inc()
            await self._backoff(attempt)
        if last_answer is not None:
            return last_answer  # every retry answered 5xx: the last answer, unchanged
        raise UnavailableError(f"no healthy worker could take the request ({last_error})")

    def _choose(self, job: Job, loads: dict[str, int], attempt: int) -> Decision | None:
        s = self.s
        if job.pick is not None:
            return Decision(job.pick(loads), "least_load")
        s.settle_tails()  # prompts routed early are in the index before this
        try:
            decision = s.policy.select(job.route, loads)
        except NoWorkerError:
            return None
        except (ValueError, TypeError) as e:
            raise BadRequestError(str(e)) from None
        source = "precise" if decision.precise else "approximate"
        s.metrics.decisions_by[s.policy.name, decision.reason, source].inc()
        n = len(job.route.tokens)
        if s.policy.name == "cache_aware" and n:
            s.metrics.matched_ratio_fast.observe(decision.matched_tokens / n)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s %s -> %s (%s, %s, matched %d of %d tokens, attempt %d)",
                job.rid,
                job.kind,
                decision.worker,
                decision.reason,
                source,
                decision.matched_tokens,
                n,
                attempt + 1,
            )
        return decision

    def _reserve_work(self, job: Job, decision: Decision) -> Ticket:
        cached = decision.cached_tokens
        if cached is None:
            cached = decision.matched_tokens
        prompt = len(job.route.tokens)
        # Only a stream's first byte is a prefill time (a deadline to shorten, a speed
        # to learn): a whole answer's ticket needs no predicted time to first token.
        return self.s.work.reserve(
            decision.worker,
            prompt - cached,
            job.expected_out,
            time.monotonic(),
            cached,
            predict=job.stream,
            kv=decision.kv_tokens,
        )

    def _rejected(self, job: Job, decision: Decision) -> None:
        """The worker did not take the request: undo the prediction and the count."""
        self.s.policy.on_rejected(decision, job.route.tokens)
        self.s.registry.unserve(decision.worker)

    async def _attempt(
        self, job: Job, decision: Decision, res: Reservation, ticket: Ticket
    ) -> Answer | Failed:
        """One try on ``decision.worker``; the reservation is released unless answered."""
        s = self.s
        worker = decision.worker
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        first_byte_at = start + first_byte_deadline(
            job.first_byte_s, ticket.predicted, job.stream, s.settings.first_byte_floor_secs
        )
        upstream: httpx.Response | None = None
        left: list[str] = []
        deadlines = self._deadlines
        if deadlines is None or deadlines.loop is not loop:
            deadlines = self._deadlines = Deadlines(loop)
        # Until the answer is complete (streams: until it begins) nothing reached the
        # client, so the request can still move if the worker leaves rotation.
        scope = deadlines.at(loop.time() + min(first_byte_at, job.deadline) - start)

        def on_leave(reason: str) -> None:
            left.append(reason)
            # Already past the scope (closing a failed attempt): nothing to cancel.
            with contextlib.suppress(RuntimeError):
                scope.reschedule(loop.time())

        s.registry.watch(worker, on_leave)
        try:
            async with scope:
                upstream = await s.forward.post(worker + job.path, job.body, job.headers)
                s.registry.answered(worker)
                scope.reschedule(loop.time() + job.deadline - time.monotonic())
                s.registry.record_status(worker, upstream.status_code)
                s.metrics.ttfb_by[(job.kind,)].observe(time.perf_counter() - job.t0)
                streaming = job.stream and upstream.status_code == 200
                content = b""
                reported: tuple[int | None, int | None] = (None, None)
                if not streaming:  # a whole answer: not a prefill time to learn from
                    ticket.first_byte(time.monotonic(), learn=False)
                    content = await read_answer(upstream)
                    reported = usage(ticket, content, s.budget)
                s.registry.unwatch(worker, on_leave)
                return Answer(upstream, decision, res, content, streaming, ticket, reported)
        except TimeoutError:
            await abandon(upstream, res)
            if left:
                return Failed("worker_down", left[0])
            if upstream is None and first_byte_at < job.deadline:
                return Failed("worker", "first_byte_timeout")
            what = "no answer" if upstream is None else "the worker did not finish"
            raise GatewayTimeoutError(
                f"{what} within {s.settings.request_timeout_secs:g}s"
            ) from None
        except UNREACHABLE as e:
            await abandon(upstream, res)
            return Failed("worker", type(e).__name__)
        except httpx.ReadTimeout:  # the client's own cap (--first-byte-timeout-secs)
            await abandon(upstream, res)
            return Failed("worker", "first_byte_timeout")
        except BROKEN as e:
            await abandon(upstream, res)
            return Failed("request", type(e).__name__)
        except httpx.InvalidURL:
            await abandon(upstream, res)
            return Failed("worker", "invalid_url")
        except httpx.HTTPError as e:
            await abandon(upstream, res)
            if upstream is not None:
                raise
            # Not the worker's fault (e.g. our connection pool is exhausted): no retry
            # storm, no worker marked down.
            raise UnavailableError(f"could not reach a worker: {type(e).__name__}") from None
        except BaseException:
            await abandon(upstream, res)
            raise
        finally:
            s.registry.unwatch(worker, on_leave)

    async def _backoff(self, attempt: int) -> None:
        delay = self.s.settings.retry_backoff_secs * (2**attempt)
        if delay > 0:
            await asyncio.sleep(delay)


def first_byte_deadline(
    size_based_s: float, predicted_s: float, stream: bool, floor_s: float
) -> float:
    """Seconds an attempt waits for its worker's first byte: the deadline from the
    prompt's size at a conservative rate (``size_based_s``, already between the floor
    and ``--first-byte-timeout-secs``) or, for a stream when shorter, the floor plus
    ``LEARNED_MARGIN`` times the time to first token the work model predicts on this
    worker (``kvroute.routing.load``: its learned prefill speed and the work queued
    ahead). A hung worker holding a long prompt is then given up on in about a minute
    instead of at the cap; a non-streamed answer's first byte comes with its last, so
    it keeps the size-based deadline, which counts the output."""
    if not stream or not predicted_s > 0:
        return size_based_s
    return min(size_based_s, floor_s + LEARNED_MARGIN * predicted_s)


async def abandon(upstream: httpx.Response | None, res: Reservation) -> None:
    """A failed attempt: close its answer (and connection), release its load."""
    try:
        if upstream is not None:
            await upstream.aclose()
    finally:
        res.release()


def answer_chunks(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The answer's chunks as they arrive: decoded by httpx when the worker set a
    Content-Encoding, else straight off the transport's stream (the router sends no
    Accept-Encoding; this skips httpx's decoder and chunker chain, 3x cheaper)."""
    for name, _ in raw_headers(upstream):
        if name.lower() == b"content-encoding":
            return upstream.aiter_bytes()
    return upstream.stream.__aiter__()  # type: ignore[union-attr]


async def read_answer(upstream: httpx.Response) -> bytes:
    """The whole answer (see ``answer_chunks``); the response is closed after."""
    whole = await read_whole(upstream)  # the worker connections' own answers
    if whole is not None:
        return whole
    try:
        parts = [chunk async for chunk in answer_chunks(upstream)]
    finally:
        await upstream.aclose()
    return parts[0] if len(parts) == 1 else b"".join(parts)


def releaser(ticket: Ticket, then: Callable[[], Any] | None) -> Callable[[], None]:
    """The reservation's release hook: the request's work ends with it, then ``then``."""

    def release() -> None:
        ticket.end(time.monotonic())
        if then is not None:
            then()

    return release


def usage_fields(data: bytes) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) as ``data`` (an answer, or a
    stream's event) reports them, each None when absent; the first of each counts."""
    at = data.find(b'"usage"')
    prompt = completion = cached = None
    for name, value in USAGE_FIELDS_RE.findall(data, at if at >= 0 else 0):
        if name == b"prompt_tokens":
            if prompt is None:
                prompt = int(value)
        elif name == b"completion_tokens":
            if completion is None:
                completion = int(value)
        elif cached is None:
            cached = int(value)
    return prompt, completion, cached


def usage(
    ticket: Ticket, data: bytes, budget: IndexBudget | None = None
) -> tuple[int | None, int | None]:
    """What an answer's ``usage`` tells the work model: output tokens, and the prompt
    tokens the engine really prefilled (when it counts prompt tokens as the router does:
    same tokenizer); and the index ``budget``, how many tokens its prompt was. Returns
    the reported (prompt_tokens, cached_tokens), for the predicted-against-reported
    reuse counts (read once, here)."""
    prompt, ticket.output_tokens, cached = usage_fields(data)
    if budget is not None:
        budget.observe(ticket.prompt_tokens, prompt)
    if prompt is not None and cached is not None and prompt == ticket.prompt_tokens:
        ticket.reported_uncached = max(0, prompt - cached)
    return prompt, cached
