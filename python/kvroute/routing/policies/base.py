"""The contract every routing policy implements.

A policy is a pure decision function over (request tokens, per-worker load). The
router (``kvroute.service.app``) and the fleet simulator (``kvroute.sim.fleet``) call the same
policy objects, so what the simulator predicts is what the router does.

Calling convention (single-threaded, no ``await`` between the two steps):

1. ``decision = policy.select(request, loads)`` where ``loads`` maps every *healthy*
   worker URL to its in-flight request count as reserved by the caller.
2. The caller reserves one unit of load on ``decision.worker`` immediately, before any
   other request is routed, so a burst cannot all see the same idle worker.
3. When the request ends (whatever ends it), the caller releases the reservation and
   calls ``policy.on_done(decision)`` once.

``select`` may update the policy's own state (round-robin cursor, the prefix index:
``cache_aware`` inserts the request's tokens for the chosen worker). It raises
``NoWorkerError`` when ``loads`` is empty.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Reason = Literal[
    "cache_hit",  # routed to the worker with the longest prefix match (rate above threshold)
    "cache_miss",  # match rate at or below threshold: least-loaded worker
    "imbalance",  # fleet imbalanced: least-loaded worker regardless of cache
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "session",  # consistent_hash: the key's home worker
    "prefix_hash",  # prefix_hash: the prefix's home worker
    "overflow",  # bounded-load policies: home worker full, next one on the ring
]


class NoWorkerError(RuntimeError):
    """No healthy worker is available to take the request."""


@dataclass(slots=True)
class RouteRequest:
    """What a policy sees of a request.

    ``tokens``: the prompt as the engine will see it (token IDs, or UTF-8 bytes of the
    rendered text when no tokenizer is configured); any sequence or u32 buffer that
    ``PrefixIndex`` accepts. ``session_key``: affinity key for ``consistent_hash``
    (from ``x-session-id`` / ``x-user-id`` headers or the body's ``user``), or None.
    """

    tokens: Sequence[int]
    session_key: str | None = None


@dataclass(slots=True)
class Decision:
    worker: str
    reason: Reason
    matched_tokens: int = 0
    # True when the match came from engine KV events (precise mode), not predictions.
    precise: bool = False
    # Set when the policy keeps state for the request until ``on_done`` (precise mode).
    ticket: str | None = None
    # Prompt tokens the chosen worker is predicted to hold (None: the policy did not look;
    # the caller then takes ``matched_tokens``). The work model reserves the rest.
    cached_tokens: int | None = None
    # Prompt tokens the request will keep in the chosen worker's KV cache beyond what
    # the router's other requests in flight there keep (None: not known; the work model
    # then takes the uncached ones).
    kv_tokens: int | None = None
    # Tokens of the prompt the worker held before this decision recorded it (the index
    # insert), or None when nothing was recorded: what ``on_rejected`` rolls back to.
    held_before: int | None = None


class Policy(ABC):
    """Base class of all routing policies. Subclasses set ``name``."""

    name: str = ""
    # False for policies that never look at the prompt: the router then skips
    # tokenization (it still validates the body).
    needs_tokens: bool = True
    # True for policies that read ``RouteRequest.session_key`` (else it is not looked up).
    needs_session: bool = False

    @abstractmethod
    def select(self, request: RouteRequest, loads: Mapping[str, int]) -> Decision:
        """Choose a worker among the keys of ``loads`` (healthy workers only)."""

    def on_done(self, decision: Decision) -> None:  # noqa: B027 - optional hook
        """Called once when the request ``decision`` routed has ended, however it ended
        (the caller releases its load reservation at the same moment)."""

    def on_rejected(self, decision: Decision, tokens: Sequence[int]) -> None:  # noqa: B027
        """Called when the worker did not take the request (an error answer, or the
        attempt failed before any output): undo what ``select`` recorded about it."""

    def on_worker_added(self, worker: str) -> None:  # noqa: B027 - optional hook
        """Called when a worker joins the fleet."""

    def on_worker_removed(self, worker: str) -> None:  # noqa: B027 - optional hook
        """Called when a worker leaves (removed or marked dead); drop its state."""

    def clear(self) -> None:  # noqa: B027 - optional hook
        """Forget learned cache state (after a cache flush on the workers)."""
