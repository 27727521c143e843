"""Replay a workload against an HTTP endpoint and measure what clients see.

Used by ``kvroute demo`` and ``bench/routing_quality.py``. Each request is sent at its
arrival time (scaled by ``time_scale``) as a streaming ``/v1/completions`` call whose
``prompt`` is the token-ID list, so every router and worker sees exactly the same
tokens whatever tokenizer they carry. Time to first token is measured at the first
streamed chunk that carries text; cached prompt tokens come from the worker's own
``usage.prompt_tokens_details.cached_tokens`` (passed through by every router), so a
router is judged by the workers' accounting, not by its own claims.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import numpy as np
import orjson


class ReplayRequest(Protocol):
    """What the load generator needs of a workload request."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def tokens(self) -> Any: ...  # Sequence[int] or a uint32 array
    @property
    def output_len(self) -> int: ...


@dataclass(slots=True)
class Outcome:
    status: int
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    error: str = ""
    sent_s: float = 0.0  # when it was sent, seconds from the replay's start (wall time)


def tokens_to_text(tokens: Sequence[int]) -> str:
    """One printable ASCII character per token: routers that work on text (SGLang's and
    vLLM's route on characters) and workers that count UTF-8 bytes then see exactly the
    same prefix structure, with the same lengths, as token-level routing would."""
    arr = np.asarray(tokens, dtype=np.uint32)
    return ((arr % 94) + 33).astype(np.uint8).tobytes().decode("ascii")


def _body(req: ReplayRequest, model: str, as_text: bool) -> bytes:
    body = {
        # A request may name its own model (a mixed fleet) and vLLM's cache_salt.
        "model": getattr(req, "model", None) or model,
        "prompt": tokens_to_text(req.tokens) if as_text else list(map(int, req.tokens)),
        "max_tokens": int(req.output_len),
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    salt = getattr(req, "cache_salt", None)
    if salt:
        body["cache_salt"] = salt
    return orjson.dumps(body)


def _headers(req: ReplayRequest) -> dict[str, str]:
    """A request may carry its own ID (``request_id``): the router's logs name it."""
    rid = getattr(req, "request_id", None)
    if rid:
        return {"content-type": "application/json", "x-request-id": rid}
    return {"content-type": "application/json"}


async def _one(
    client: httpx.AsyncClient, url: str, req: ReplayRequest, model: str, as_text: bool
) -> Outcome:
    start = time.perf_counter()
    ttft = float("nan")
    usage: dict[str, Any] = {}
    try:
        async with client.stream(
            "POST",
            url + "/v1/completions",
            content=_body(req, model, as_text),
            headers=_headers(req),
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                end = time.perf_counter() - start
                return Outcome(resp.status_code, end, end, len(req.tokens), 0, 0, text)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = orjson.loads(data)
                if ttft != ttft and any(c.get("text") for c in chunk.get("choices") or []):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as e:
        end = time.perf_counter() - start
        return Outcome(0, end, end, len(req.tokens), 0, 0, f"{type(e).__name__}: {e}")
    end = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        status=200,
        ttft_s=ttft if ttft == ttft else end,
        e2e_s=end,
        prompt_tokens=int(usage.get("prompt_tokens", len(req.tokens))),
        cached_tokens=int(details.get("cached_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens", 0)),
    )


async def replay(
    url: str | Sequence[str],
    requests: Sequence[ReplayRequest],
    *,
    time_scale: float = 1.0,
    model: str = "sim",
    max_in_flight: int = 1024,
    timeout_s: float = 600.0,
    on_done: Callable[[], None] | None = None,
    as_text: bool = True,
    after: Sequence[int | None] | None = None,
) -> tuple[list[Outcome], float]:
    """Send ``requests`` to ``url`` at their arrival times divided by ``time_scale``.

    Several URLs (router replicas): request ``i`` goes to ``url[i % len(url)]``.

    Returns the outcomes (in request order) and the wall time of the whole replay.
    ``as_text``: send the prompt as text (one character per token, see
    ``tokens_to_text``) rather than as a token-ID list.
    ``max_in_flight`` bounds open connections; arrivals past it wait for a slot.
    ``after`` (closed-loop conversations, ``kvroute.sim.workloads.previous_turns``):
    request ``i`` is sent no sooner than request ``after[i]`` has ended (None: at its
    time alone), as a chat client sends a turn once it has read the answer before it.
    """
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    sem = asyncio.Semaphore(max_in_flight)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False
    ) as client:
        t0 = time.perf_counter()

        urls = [url] if isinstance(url, str) else list(url)
        if after is not None and len(after) != len(requests):
            raise ValueError("after must name one predecessor (or None) per request")
        ended = [asyncio.Event() for _ in requests] if after is not None else []

        async def launch(i: int, req: ReplayRequest) -> Outcome:
            before = after[i] if after is not None else None
            if before is not None:
                await ended[before].wait()
            delay = req.arrival_s / time_scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                async with sem:
                    sent = time.perf_counter() - t0
                    out = await _one(client, urls[i % len(urls)], req, model, as_text)
                    out.sent_s = sent
            finally:
                if ended:
                    ended[i].set()
            if on_done is not None:
                on_done()
            return out

        outcomes = await asyncio.gather(*(launch(i, r) for i, r in enumerate(requests)))
        return list(outcomes), time.perf_counter() - t0
