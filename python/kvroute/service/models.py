"""Which models each worker serves, for the pass-through routes.

A fleet often mixes generation workers with embedding or reranking ones, and a request
for an embedding model sent to a chat worker fails. Pass-through requests that name a
``model`` (a JSON body with a string ``model``) therefore go to the least loaded of the
workers that list that model in their ``/v1/models``; when none does (lists not known
yet, or the name is unknown everywhere) every healthy worker stays eligible, and the
worker's own answer (for instance vLLM's 404 for an unknown model) reaches the client
as it would without a router.

Lists are fetched on demand. A request waits only for workers never asked yet (all at
once, at most ``FETCH_TIMEOUT_SECS``); a list older than ``TTL_SECS`` is used as it is
while a new one is fetched in the background. One fetch per worker is in flight
whatever the number of requests, and a fetch that fails keeps the previous list.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import httpx

TTL_SECS = 30.0
FETCH_TIMEOUT_SECS = 2.0


class ModelDirectory:
    def __init__(
        self,
        client: Callable[[], httpx.AsyncClient],
        headers: dict[str, str],
        ttl_s: float = TTL_SECS,
    ) -> None:
        self._client = client
        self._headers = headers
        self._ttl = ttl_s
        self._models: dict[str, frozenset[str]] = {}
        self._fresh_until: dict[str, float] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}

    async def eligible(self, model: str, loads: Mapping[str, int]) -> Mapping[str, int]:
        """The part of ``loads`` whose workers serve ``model``, or all of it if none does."""
        now = time.monotonic()
        unknown = []
        for u in loads:
            until = self._fresh_until.get(u)
            if until is None:
                unknown.append(asyncio.shield(self._refresh(u)))
            elif until <= now:
                self._refresh(u)
        if unknown:
            await asyncio.gather(*unknown)
        serving = {u: n for u, n in loads.items() if model in self._models.get(u, ())}
        return serving or loads

    def _refresh(self, url: str) -> asyncio.Task[None]:
        task = self._fetching.get(url)
        if task is None:
            task = self._fetching[url] = asyncio.ensure_future(self._fetch(url))
        return task

    async def _fetch(self, url: str) -> None:
        try:
            r = await self._client().get(
                url + "/v1/models", headers=self._headers, timeout=FETCH_TIMEOUT_SECS
            )
            data = r.json().get("data", []) if r.status_code == 200 else None
            if isinstance(data, list):
                self._models[url] = frozenset(
                    m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)
                )
        except (httpx.HTTPError, ValueError, AttributeError):
            pass  # keep what was known; the worker stays eligible by the fallback
        finally:
            self._fresh_until[url] = time.monotonic() + self._ttl
            self._fetching.pop(url, None)
