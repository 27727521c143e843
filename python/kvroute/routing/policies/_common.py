"""Helpers shared by policies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from math import isfinite

from kvroute._native import PrefixIndex, TokenIds
from kvroute.routing.policies.base import Decision, NoWorkerError

# Predicted times closer than this are a tie: the model is not that precise, and a
# few-token partial match (``"group 1..."`` vs ``"group 2..."``) must not send every
# new prefix to the same worker.
TIE_ABS_S = 0.001
TIE_REL = 0.02


def tie_window(best: float) -> float:
    """How far above the best predicted time a worker still ties with it."""
    return max(TIE_ABS_S, TIE_REL * best)


class TieBreaker:
    """Least-loaded choice whose ties rotate instead of always naming the first worker.

    With an idle fleet every worker ties at load 0; picking the first one would send
    every new prefix to the same worker (a weakness seen in other routers).

    ``per_worker`` (the default): among tied workers the one chosen longest ago wins,
    so successive new prefixes land on different workers. The rotation is per worker,
    not a shared cursor: requests for different models tie over different sets of
    workers, and a cursor advanced by one set falls into step with the other's order
    (every request of one model on one worker of its set). ``per_worker=False``: one
    cursor walks whatever set is tied (the rotation of earlier kvroute versions, kept
    for ``--load-metric requests``, whose decisions must stay exactly as they were).
    """

    __slots__ = ("_last", "_turn", "per_worker")

    def __init__(self, per_worker: bool = True) -> None:
        self.per_worker = per_worker
        self._turn = 0
        self._last: dict[str, int] = {}

    def least_loaded(
        self, loads: Mapping[str, int] | Mapping[str, float], among: Iterable[str] | None = None
    ) -> str:
        candidates = list(loads) if among is None else [w for w in among if w in loads]
        if not candidates:
            raise NoWorkerError("no healthy worker")
        best = min(loads[w] for w in candidates)
        self._turn += 1
        if not self.per_worker:
            tied = [w for w in candidates if loads[w] == best]
            return tied[self._turn % len(tied)]
        last = self._last
        choice = min((w for w in candidates if loads[w] == best), key=lambda w: last.get(w, -1))
        last[choice] = self._turn
        if len(last) > 4096:  # workers that left long ago
            self._last = {w: t for w, t in last.items() if w in loads}
        return choice

    def least_by(self, scores: Mapping[str, float], loads: Mapping[str, int]) -> str:
        """The worker of lowest score (a predicted time); among scores within the tie
        window of the best (``tie_window``), the fewest requests in flight (their
        decode will compete for slots later), then rotation."""
        if not scores:
            raise NoWorkerError("no healthy worker")
        if len(scores) == 1 and self.per_worker and isfinite(next(iter(scores.values()))):
            # One candidate (a single cache holder): it ties with itself.
            (choice,) = scores
            self._turn += 1
            self._last[choice] = self._turn
            if len(self._last) > 4096:
                self._last = {choice: self._turn}
            return choice
        best = min(scores.values())
        tie = max(TIE_ABS_S, TIE_REL * best)  # tie_window(best)
        if not self.per_worker:
            tied = {w: loads.get(w, 0) for w, t in scores.items() if t - best <= tie}
            return self.least_loaded(tied)
        # ``least_loaded`` over the tied workers in one pass (it runs at every decision,
        # up to three times): the fewest in flight, then chosen longest ago, then first.
        last = self._last
        choice = ""
        key = (0, 0)
        n = 0
        for w, t in scores.items():
            if t - best <= tie:
                k = (loads.get(w, 0), last.get(w, -1))
                if not n or k < key:
                    choice, key = w, k
                n += 1
        if not n:  # no finite prediction ties with the best one
            raise NoWorkerError("no healthy worker")
        self._turn += 1
        last[choice] = self._turn
        if len(last) > 4096:  # workers that left long ago (as ``least_loaded`` prunes)
            self._last = {
                w: turn for w, turn in last.items() if w in scores and scores[w] - best <= tie
            }
        return choice


class PendingPrompts:
    """Prompts routed and not yet ended, each under its own ticket ``<worker>\\0<n>`` in
    an unbounded index of the routing index's kind (bytes or token IDs): what an engine
    holds whatever the router's budgeted index forgot, since it never evicts the blocks
    of a request it is running (``cache_aware``'s module doc). Each prompt is also kept
    whole until its request ends, for the index to record again then
    (``KeepsPromptsInFlight.on_done``). Memory: the prompts in flight."""

    __slots__ = ("_index", "_n", "_prompts")

    def __init__(self, byte_tokens: bool = False) -> None:
        self._index = PrefixIndex(None, byte_tokens=byte_tokens)
        self._n = 0
        # ticket -> the prompt, until its request ends (dropped if the worker refused it,
        # left the fleet or had its cache flushed: it then holds nothing to refresh).
        self._prompts: dict[str, Sequence[int] | TokenIds | bytes] = {}

    def add(self, worker: str, tokens: Sequence[int] | TokenIds | bytes) -> str:
        """Keep ``tokens`` as in flight on ``worker``; the ticket to ``end`` it with."""
        self._n += 1
        ticket = f"{worker}\0{self._n}"
        self._index.insert(ticket, tokens)
        self._prompts[ticket] = tokens
        return ticket

    def end(self, ticket: str) -> Sequence[int] | TokenIds | bytes | None:
        """The request ended: no longer in flight. Its prompt, unless ``forget`` dropped it."""
        self._index.remove_worker(ticket)
        return self._prompts.pop(ticket, None)

    def forget(self, ticket: str) -> None:
        """The worker does not hold this prompt (it refused it): nothing to refresh."""
        self._prompts.pop(ticket, None)

    def forget_worker(self, worker: str | None = None) -> None:
        """``worker`` (None: every worker) left or lost its cache: its prompts in flight
        are not refreshed when they end (they still count as in flight until then)."""
        if worker is None:
            self._prompts.clear()
            return
        head = f"{worker}\0"
        for ticket in [t for t in self._prompts if t.startswith(head)]:
            del self._prompts[ticket]

    def per_worker(self, tokens: Sequence[int] | TokenIds | bytes) -> dict[str, int]:
        """Per worker, the longest prefix of ``tokens`` a prompt in flight there shares."""
        out: dict[str, int] = {}
        for ticket, n in self._index.match(tokens).items():
            w = ticket.partition("\0")[0]
            if n > out.get(w, 0):
                out[w] = n
        return out

    @staticmethod
    def raised(matches: Mapping[str, int], in_flight: Mapping[str, int]) -> dict[str, int] | None:
        """``matches`` (the index's, per worker) with each raised to what is in flight
        there (``per_worker``), or None when nothing in flight raises any."""
        per: dict[str, int] | None = None
        for w, n in in_flight.items():
            if n > matches.get(w, 0):
                if per is None:
                    per = dict(matches)
                per[w] = n
        return per

    def tickets(self) -> list[str]:
        """The tickets not yet ended (for tests and checks)."""
        return self._index.workers()

    def __len__(self) -> int:
        return len(self.tickets())


class KeepsPromptsInFlight:
    """For a policy keeping its prompts in flight in ``_pending``: when to keep them
    (``_budget_evicted``), ``on_done`` ends the decision's ticket, ``prompts_in_flight``
    counts them (``/metrics``, ``/status``); a worker removed or every cache flushed
    drops them from the index and from what ``on_done`` records again."""

    _pending: PendingPrompts
    index: PrefixIndex
    pending_prompts: bool

    def _budget_evicted(self) -> bool:
        """Are prompts in flight kept now: ``pending_prompts`` on and the index's budget
        has evicted (from the first eviction on; before it, the index holds them all)."""
        return self.pending_prompts and self.index.evicted_tokens > 0

    @property
    def prompts_in_flight(self) -> int:
        """Prompts kept as in flight now."""
        return len(self._pending)

    def on_done(self, decision: Decision) -> None:
        """The request ended: its prompt leaves the prompts in flight and is recorded in
        the index again, now. An engine keeps a running request's blocks whatever else
        it evicts and, when the request ends, puts them last in its eviction order
        (vLLM frees them most recent last, SGLang's radix cache stamps them then). The
        index stamped the prompt when it was routed; where the budget binds, the prompts
        routed while it ran had pushed it out, and the next turn of a conversation, sent
        when this answer ended, was taken for a miss at the worker still holding it all
        (``docs/studies/work-aware.md``, "Closed-loop conversations").
        With a shared store the refresh is published like a decision, so the replicas'
        indexes evict alike."""
        if decision.ticket is not None:
            prompt = self._pending.end(decision.ticket)
            if prompt is not None:
                self.index.insert(decision.worker, prompt)

    def on_worker_removed(self, worker: str) -> None:
        self.index.remove_worker(worker)
        self._pending.forget_worker(worker)

    def clear(self) -> None:
        self.index.clear()
        self._pending.forget_worker()

    def on_rejected(self, decision: Decision, tokens: Sequence[int]) -> None:
        """The worker refused the prompt: it does not hold what was inserted for it."""
        if decision.held_before is not None:
            self.index.rollback(decision.worker, tokens, decision.held_before)
        if decision.ticket is not None:
            self._pending.forget(decision.ticket)
