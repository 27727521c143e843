"""Forwarding for the routes with no prefix to follow (``routes.ROUTES``, not indexed).

Embeddings, tokenize, score, rerank, pooling, classify and audio go to the healthy
worker with the fewest requests in flight (ties broken at random, so an idle fleet is
still spread), among those that serve the body's ``model`` (``kvroute.fleet.models``: a
model no worker lists gets a 404, as on the generation routes). The body and its
Content-Type are sent byte for byte, so multipart audio uploads keep their boundary; the
body is read whole first, within ``--max-body-bytes``, which is what lets a failure
before the first answer byte be retried on another worker, as on the indexed routes
(same retry budget, same down-marking). A complete answer is read whole as well; a
streamed one (``text/event-stream``, e.g. a streamed transcription) is relayed chunk by
chunk.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from starlette.responses import Response

from kvroute.errors import BadRequestError, error_body
from kvroute.routing.policies.base import RouteRequest
from kvroute.service.attempts import Job, answer_chunks
from kvroute.service.h1pool import raw_headers
from kvroute.service.incoming import Incoming
from kvroute.service.proxy import (
    PASS_HEADERS,
    Forwarder,
    ProxyStream,
    RawResponse,
    check_model,
    read_body,
)

_rng = random.Random()


def least_loaded(loads: dict[str, int]) -> str:
    """The worker with the fewest requests in flight; a random one among equals."""
    low = min(loads.values())
    return _rng.choice([u for u, n in loads.items() if n == low])


def json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, else None (multipart, not JSON)."""
    if not body.lstrip()[:1] == b"{":
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def model_of(obj: dict[str, Any] | None) -> str | None:
    """The body's ``model``, if it names one."""
    model = obj.get("model") if obj is not None else None
    return model if isinstance(model, str) and model else None


class PassThrough(Forwarder):
    """Least-load forwarding with the bodies untouched; the attempts' rules for
    failures (``kvroute.service.attempts``): retries, moves, quarantine, 5xx retries."""

    async def forward(self, request: Incoming, kind: str, path: str) -> Response:
        s = self.s
        t0 = time.perf_counter()
        body = await read_body(request, s.settings.max_body_bytes)
        headers = self._headers(request)
        content_type = request.header(b"content-type")
        if content_type:
            headers["content-type"] = content_type
        else:
            del headers["content-type"]
        rid = headers["x-request-id"]
        obj = json_object(body)
        if obj is None and (content_type or "").startswith("application/json"):
            # The APIs behind these routes all take a JSON object; other content types
            # (multipart audio, anything else) go through unread.
            raise BadRequestError("request body must be a JSON object")
        model = model_of(obj)
        check_model(s.registry, model)
        stream = obj is not None and obj.get("stream") is True
        job = Job(
            kind=kind,
            path=path,
            body=body,
            headers=headers,
            rid=rid,
            route=RouteRequest(tokens=()),
            fingerprint=None,
            first_byte_s=self.attempts.first_byte_secs(len(body) // 4, None, stream),
            deadline=time.monotonic() + s.settings.request_timeout_secs,
            stream=stream,
            t0=t0,
            model=model,
            pick=least_loaded,
        )
        answer = await self.attempts.run(job)
        upstream, worker, res = answer.upstream, answer.decision.worker, answer.reservation
        raw = [(b"x-kvroute-worker", worker.encode()), (b"x-request-id", rid.encode())]
        raw += [(k.lower(), v) for k, v in raw_headers(upstream) if k.lower() in PASS_HEADERS]
        status = upstream.status_code
        if answer.streaming:
            return ProxyStream(
                self._relay_raw(upstream, worker, job.deadline),
                status,
                raw,
                self._closer(upstream, res, kind, t0, status),
                lambda: s.draining,
            )
        res.release()
        self._done(kind, status, t0)
        raw.append((b"content-length", str(len(answer.content)).encode()))
        return RawResponse(answer.content, status, raw)

    async def _relay_raw(
        self, upstream: httpx.Response, worker: str, deadline: float
    ) -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                async for chunk in answer_chunks(upstream):
                    yield chunk
        except (httpx.HTTPError, TimeoutError) as e:
            name = type(e).__name__
            self.s.metrics.worker_failures.labels(worker, f"stream_{name}").inc()
            msg = f"upstream worker failed mid-stream ({name})"
            yield b"\n\ndata: " + error_body(msg, "upstream_error", "stream_interrupted") + b"\n\n"
