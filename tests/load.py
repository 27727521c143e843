"""A bounded background load for end-to-end tests: a few client threads sending
completions (half of them streamed, so a cut connection shows as a client error) until
stopped, counting answers and errors."""

from __future__ import annotations

import itertools
import threading

import httpx


class Load:
    """``with Load(url) as load: ...``; afterwards ``load.ok`` and ``load.errors``."""

    def __init__(self, router_url: str, clients: int = 4, max_requests: int = 5000) -> None:
        self.url = router_url
        self.clients = clients
        self.max_requests = max_requests  # a bound, whatever happens to the stop signal
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Load:
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=30, trust_env=False) as client:
            while not self._stop.is_set():
                n = next(self._count)
                if n >= self.max_requests:
                    return
                body = {
                    "model": "sim",
                    "prompt": f"shared system prompt {n % 7} " * 20 + f"question {n}",
                    "max_tokens": 8,
                    "stream": n % 2 == 0,
                }
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                        text = b"".join(r.iter_bytes())
                    good = r.status_code == 200 and (
                        not body["stream"] or text.rstrip().endswith(b"data: [DONE]")
                    )
                    detail = f"HTTP {r.status_code} {text[:200]!r}"
                except httpx.HTTPError as e:
                    good, detail = False, f"{type(e).__name__}: {e}"
                with self._lock:
                    if good:
                        self.ok += 1
                    else:
                        self.errors.append(detail)
