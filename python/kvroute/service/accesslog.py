"""The access log: one line per HTTP request at info level, on the ``kvroute.access`` logger.

Fields (also as structured fields with ``--log-format json``):

* ``request_id``: the client's ``X-Request-ID`` when it is a sane token, else a fresh
  one, given here to the request before anything else reads it: the worker sees the
  same ID, and every answer, errors included, carries it back;
* ``method``, ``route`` (the path, without the query string), ``status``: the status
  sent; 499 when none was (the client went away first, or the request was cancelled at
  shutdown); 500 when the handler failed before answering;
* ``worker``: the worker that answered (``X-Kvroute-Worker``), ``-`` when none did;
* ``prompt_tokens``: tokens the router routed on (bytes without ``--tokenizer``), ``-``
  when it did not tokenize (pass-through routes, policies that ignore the prompt, or a
  request rejected before);
* ``ttft_ms``: time from the request's arrival to the first answer byte sent to the
  client (for a stream, its first chunk: the time to first token as the client sees it);
* ``latency_ms``: until the last byte.

Never logged: bodies (prompt text), headers other than those two, query strings
(where a misconfigured client puts keys). Probes and scrapes (``/health``,
``/readiness``, ``/metrics``) are not logged. ``--no-access-log`` turns it off, and so
does a log level above info.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvroute.service.proxy import RAW_SEND, REQUEST_ID_RE, new_request_id

log = logging.getLogger("kvroute.access")

QUIET = frozenset(("/health", "/readiness", "/metrics"))
# Whether each record carries the fields as attributes too (``--log-format json`` reads
# them; the text format only the message). ``setup_logging`` sets it for its format.
FIELDS = True
MAX_ROUTE = 256


def wanted(scope: Scope) -> bool:
    return scope["path"] not in QUIET and log.isEnabledFor(logging.INFO)


def _printable(path: str) -> str:
    """The path as one safe line: a decoded ``%0A`` must not start a forged log line."""
    path = path[:MAX_ROUTE]
    if path.isprintable():
        return path
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in path)


async def record(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run ``app`` on one HTTP request and log it when it ends, however it ends."""
    t0 = time.perf_counter()
    rid = _request_id(scope)
    status = 0
    first = 0.0
    worker = "-"

    async def watch(message: Message) -> None:
        nonlocal status, first, worker
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = message.get("headers", [])
            for name, value in headers:
                if name == b"x-kvroute-worker":
                    worker = value.decode("latin-1")
            if all(name != b"x-request-id" for name, _ in headers):
                message["headers"] = [*headers, (b"x-request-id", rid.encode())]
        elif not first and message.get("body"):
            first = time.perf_counter()
        await send(message)

    # The server's own ``send``: once the head and the first body bytes went through
    # ``watch`` it has all it records, and a streamed answer's later chunks (one per
    # token) may skip it (``ProxyStream``).
    scope[RAW_SEND] = send
    try:
        await app(scope, receive, watch)
    except asyncio.CancelledError:
        status = status or 499
        raise
    except BaseException:
        status = status or 500
        raise
    finally:
        end = time.perf_counter()
        _emit(scope, rid, status or 499, worker, t0, first, end)


def _request_id(scope: Scope) -> str:
    """The client's request ID if it is a sane token, else a fresh one, which then
    replaces the client's header so that the forwarder sends the same ID on."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for name, value in headers:
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if REQUEST_ID_RE.fullmatch(given):
                return given
            break
    rid = new_request_id()
    scope["headers"] = [h for h in headers if h[0] != b"x-request-id"]
    scope["headers"].append((b"x-request-id", rid.encode()))
    return rid


def _emit(
    scope: Scope, rid: str, status: int, worker: str, t0: float, first: float, end: float
) -> None:
    tokens = scope.get("state", {}).get("prompt_tokens")
    route = _printable(scope["path"])
    ttft = round((first - t0) * 1000, 2) if first else None
    latency = round((end - t0) * 1000, 2)
    log.info(
        "%s %s %s %d worker=%s prompt_tokens=%s ttft_ms=%s latency_ms=%s",
        rid,
        scope["method"],
        route,
        status,
        worker,
        "-" if tokens is None else tokens,
        "-" if ttft is None else ttft,
        latency,
        extra=(
            {
                "request_id": rid,
                "method": scope["method"],
                "route": route,
                "status": status,
                "worker": None if worker == "-" else worker,
                "prompt_tokens": tokens,
                "ttft_ms": ttft,
                "latency_ms": latency,
            }
            if FIELDS
            else None
        ),
    )
