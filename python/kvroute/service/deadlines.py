"""Attempt deadlines behind one timer per event loop, instead of a timer each.

An attempt (``kvroute.service.attempts``) runs under a deadline scope with the same
contract as ``asyncio.timeout_at``: past its time the task is cancelled and the
scope raises ``TimeoutError``; ``reschedule`` moves it (to now: at once). But
``asyncio.timeout_at`` creates an event-loop timer on entry and another on each
reschedule, and cancels one on exit and on each reschedule: about 5 µs per attempt
under uvloop, for deadlines that almost never fire.

Here a scope's deadline is an entry in a heap shared by the loop's scopes, ordered by
time, with one timer armed for the earliest entry. Entering or rescheduling pushes an
entry (the timer moves only if the new one is earlier than any before), leaving
marks the scope done; entries of scopes that left or moved are dropped when they
reach the top of the heap (each push drops those at the top: requests end in about
the order they start, so the heap stays near the number of attempts in flight) or
when the timer fires, which cancels the tasks of the scopes whose time has come and
re-arms for the earliest live entry.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from types import TracebackType

_ENTERED, _EXPIRED, _DONE = 1, 2, 3


class Deadlines:
    """One event loop's deadline scopes (create it on that loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._heap: list[tuple[float, int, Scope]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def at(self, when: float) -> Scope:
        """A scope ending at ``when`` (loop time), to use with ``async with``."""
        return Scope(self, when)

    def __len__(self) -> int:
        """Entries held (live or not yet dropped)."""
        return len(self._heap)

    def _push(self, entry: Scope) -> None:
        heap = self._heap
        while heap and not heap[0][2]._holds(heap[0][0]):
            heapq.heappop(heap)
        self._seq += 1
        heapq.heappush(heap, (entry.when, self._seq, entry))
        if entry.when < self._timer_at:
            self._arm(entry.when)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        now = self.loop.time()
        heap = self._heap
        while heap:
            when, _, scope = heap[0]
            if not scope._holds(when):
                heapq.heappop(heap)
            elif when <= now:
                heapq.heappop(heap)
                scope._expire()
            else:
                self._arm(when)
                return


class Scope:
    """One deadline: ``async with deadlines.at(when) as scope: ...``."""

    __slots__ = ("_cancelling", "_owner", "_state", "_task", "when")

    def __init__(self, owner: Deadlines, when: float) -> None:
        self._owner = owner
        self.when = when
        self._state = 0
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    def _holds(self, when: float) -> bool:
        """Whether a heap entry for ``when`` is still this scope's deadline."""
        return self._state == _ENTERED and self.when == when

    def _expire(self) -> None:
        if self._state == _ENTERED and self._task is not None:
            self._state = _EXPIRED
            self._task.cancel()

    def reschedule(self, when: float) -> None:
        """Move the deadline (RuntimeError once the scope has expired or ended)."""
        if self._state != _ENTERED:
            raise RuntimeError("the deadline scope is not active")
        self.when = when
        owner = self._owner
        if when <= owner.loop.time():
            owner.loop.call_soon(self._expire)
        else:
            owner._push(self)

    async def __aenter__(self) -> Scope:
        task = asyncio.current_task(self._owner.loop)
        if task is None:
            raise RuntimeError("a deadline scope must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._state = _ENTERED
        self._owner._push(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        expired = self._state == _EXPIRED
        self._state = _DONE
        if expired:
            assert self._task is not None
            # Ours was the cancellation (not the caller's own, which is passed on).
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
