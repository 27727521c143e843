"""Admission control: bounded concurrency with a bounded wait queue.

``--max-concurrent-requests`` (0 = unlimited) requests run at once; up to
``--max-queued-requests`` more wait, each at most ``--queue-timeout-secs``; past either
bound the request gets 429 with ``Retry-After: 1``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvroute.errors import OverloadedError


class Admission:
    """Bounded concurrency with a bounded wait queue (0 = unlimited)."""

    def __init__(self, limit: int, queue: int, timeout_s: float) -> None:
        self.limit = limit
        self.queue = queue
        self.timeout_s = timeout_s
        self.active = 0
        self.waiting = 0
        self._cond = asyncio.Condition()
        # Told why a request was turned away ("queue_full", "queue_timeout"): metrics.
        self.on_reject: Callable[[str], None] = lambda reason: None

    def try_acquire(self) -> bool:
        """Take a slot now if one is free and nobody queues (no await); False: queue
        with ``acquire``."""
        if self.limit <= 0 or (self.active < self.limit and self.waiting == 0):
            self.active += 1
            return True
        return False

    def try_release(self) -> bool:
        """Give the slot back now when nobody waits for one (no await); False: the
        caller awaits ``release``, which wakes a waiter. (A queued request counts in
        ``waiting`` from before it waits until it holds a slot or gives up.)"""
        if self.limit <= 0 or self.waiting == 0:
            self.active -= 1
            return True
        return False

    async def acquire(self) -> None:
        if self.limit <= 0:
            self.active += 1
            return
        if self.active < self.limit and self.waiting == 0:
            self.active += 1
            return
        if self.waiting >= self.queue:
            self.on_reject("queue_full")
            raise OverloadedError(
                "router at capacity and its wait queue is full", headers={"Retry-After": "1"}
            )
        self.waiting += 1
        try:
            async with self._cond:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self.active < self.limit), self.timeout_s
                )
                self.active += 1
        except TimeoutError:
            self.on_reject("queue_timeout")
            raise OverloadedError(
                "timed out waiting for a free slot", headers={"Retry-After": "1"}
            ) from None
        finally:
            self.waiting -= 1

    async def release(self) -> None:
        self.active -= 1
        if self.limit > 0:
            async with self._cond:
                self._cond.notify()
