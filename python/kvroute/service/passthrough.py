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
from typing import TYPE_CHECKING

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response

from kvroute.errors import GatewayTimeoutError, NotFoundError, UnavailableError, error_body
from kvroute.service.proxy import (
    PASS_HEADERS,
    RETRYABLE,
    Forwarder,
    ProxyStream,
    RawResponse,
    answer_chunks,
    read_answer,
    read_body,
)

if TYPE_CHECKING:
    pass

_rng = random.Random()


def least_loaded(loads: dict[str, int]) -> str:
    """The worker with the fewest requests in flight; a random one among equals."""
    low = min(loads.values())
    return _rng.choice([u for u, n in loads.items() if n == low])


def model_of(body: bytes) -> str | None:
    """The ``model`` of a JSON object body, else None (multipart, not JSON, no model)."""
    if not body.lstrip()[:1] == b"{":
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) and model else None


class PassThrough(Forwarder):
    """Least-load forwarding with the bodies untouched (the Forwarder's retry rules)."""

    async def forward(self, request: Request, kind: str, path: str) -> Response:
        s = self.s
        t0 = time.perf_counter()
        body = await read_body(request, s.settings.max_body_bytes)
        headers = self._headers(request)
        content_type = request.headers.get("content-type")
        if content_type:
            headers["content-type"] = content_type
        else:
            del headers["content-type"]
        rid = headers["x-request-id"]
        model = model_of(body)
        if not s.registry.model_routable(model):
            names = ", ".join(sorted(s.registry.known_models())) or "none"
            raise NotFoundError(
                f"the model {model!r} does not exist; available models: {names}",
                code="model_not_found",
            )
        tried: set[str] = set()
        last_error = "no healthy worker"
        deadline = time.monotonic() + s.settings.request_timeout_secs
        for attempt in range(s.settings.max_retries + 1):
            loads = s.registry.loads(exclude=tried, model=model)
            if not loads:
                break
            worker = least_loaded(loads)
            res = s.registry.reserve(worker)
            upstream: httpx.Response | None = None
            content = b""
            streaming = False
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                    upstream = await s.forward.post(worker + path, body, headers)
                    s.registry.record_status(worker, upstream.status_code)
                    s.metrics.ttfb_by[(kind,)].observe(time.perf_counter() - t0)
                    ctype = upstream.headers.get("content-type", "")
                    streaming = ctype.startswith("text/event-stream")
                    if not streaming:
                        content = await read_answer(upstream)
            except TimeoutError:
                await self._abandon(upstream, res)
                raise GatewayTimeoutError(
                    f"no answer within {s.settings.request_timeout_secs:g}s"
                ) from None
            except RETRYABLE as e:
                await self._abandon(upstream, res)
                last_error = self._worker_failed(worker, e, rid)
                tried.add(worker)
                await self._backoff(attempt)
                continue
            except httpx.HTTPError as e:
                await self._abandon(upstream, res)
                raise UnavailableError(f"could not reach a worker: {type(e).__name__}") from None
            except BaseException:
                await self._abandon(upstream, res)
                raise
            raw = [(b"x-kvroute-worker", worker.encode()), (b"x-request-id", rid.encode())]
            raw += [(k.lower(), v) for k, v in upstream.headers.raw if k.lower() in PASS_HEADERS]
            status = upstream.status_code
            if streaming:
                return ProxyStream(
                    self._relay_raw(upstream, worker, deadline),
                    status,
                    raw,
                    self._closer(upstream, res, kind, t0, status),
                    lambda: s.draining,
                )
            res.release()
            self._done(kind, status, t0)
            raw.append((b"content-length", str(len(content)).encode()))
            return RawResponse(content, status, raw)
        raise UnavailableError(f"no healthy worker could take the request ({last_error})")

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
