"""Decide first, finish tokenizing after: route on the known start of a prompt when the
rest cannot change the decision.

A prompt reaches the router as text. Its start is usually in the tokenizer's segment
cache (system prompt, earlier turns: IDs at once); the new text must be BPE-encoded.
``PromptTokenizer.partial`` returns a ``Prompt``: the known IDs ``K`` (the cached start
plus the first pre-tokenizer pieces of the new text, split exactly by the fast BPE) and
an upper bound ``hi`` on the number ``T`` of tokens still to encode (every token covers
at least one byte, so ``T`` is at most the rest's UTF-8 length).

The rule (``early``), for ``cache_aware`` on request counts (``--load-metric requests``)
without precise mode; every other policy gets whole prompts:

1. ``m_w`` = the index's match of ``K`` for each worker ``w`` (token-exact). If the
   longest reaches the end of ``K``, the rest could extend it: encode first.
2. Otherwise each worker's match on the whole prompt ``P`` is ``m_w`` too: a prefix
   tree's match stops where the prompt and the stored prefix part, and that point lies
   inside ``K``. So the longest match, its holders, the healthy fallback, the tie-break
   among loads, the saturation guard and the imbalance test come out the same.
3. What is left is the prompt's length, in ``matched / length > cache_threshold``, for
   ``matched`` the longest match and the longest healthy one. The policy, handed ``K``,
   divides by ``|K|``; on ``P`` it would divide by ``|K| + T``. The side of the threshold
   is the same for every ``T`` in ``[0, hi]`` when it is the same at ``|K|`` and at
   ``|K| + hi`` (the ratio falls as the length grows): then decide on ``K``. When it is
   above at ``|K|`` only (a short start after a short common header), a start of
   ``ceil(matched / threshold)`` tokens is below at both ends, so the head is lengthened
   once to that and the rule asked again (the matches stay: they end inside ``K``);
   otherwise encode first.
4. The decision inserts ``K`` for the chosen worker; the rest is encoded after the
   request is sent (off the event loop when long), and ``P`` is inserted for that worker
   and becomes the request's route (a retry routes on the whole prompt). Before any
   later decision, every pending rest is finished and inserted (``settle``), so each
   decision sees the index it would have seen without deciding first.

Not for the work metric (``--load-metric work``, the default): there the least-loaded
choice weighs each worker's *uncached* tokens over its own prefill rate and reserves
that work for the next decisions, so the prompt's exact length can change a decision.
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Prompt:
    """A prompt's IDs as far as they are known without encoding new text.

    ``known``: the exact IDs of the prompt's start (all of it when ``pending`` is
    empty); ``pending``: distinct texts still to encode; ``hi``: a bound on the tokens
    after ``known``; the rest: how ``finish`` assembles the whole prompt."""

    known: array.array[int]
    pending: list[str] = field(default_factory=list)
    hi: int = 0
    parts: list[str | array.array[int]] = field(default_factory=list)
    first: int = -1  # parts[first]: the first piece to encode, whose head ends ``known``
    head: int = 0  # IDs of that head
    rest: str | None = None  # that piece after its head (None: not split)
    after: int = 0  # the bound on the tokens of the parts after that piece

    @property
    def complete(self) -> bool:
        return not self.pending


def eligible(policy: Any) -> bool:
    """Whether ``policy`` can decide on a prompt's start (module docstring)."""
    return (
        getattr(policy, "name", None) == "cache_aware"
        and getattr(policy, "load_metric", None) == "requests"
        and getattr(policy, "precise", None) is None
    )


def verdict(policy: Any, known: Any, hi: int, loads: Mapping[str, int]) -> int:
    """0 when deciding on ``known`` (the start of a prompt with at most ``hi`` more
    tokens) gives the decision the whole prompt would get; -1 when the rest could
    change it; ``L`` > 0 when it could only because ``known`` is short: a start of at
    least ``L`` tokens (a longer head, ``PromptTokenizer.lengthen``) would do. Call it
    right before ``select``, with no ``await`` between."""
    n = len(known)
    if n == 0:
        return -1
    per: dict[str, int] = policy.index.match(known)
    best = max(per.values(), default=0)
    if best >= n:
        return -1
    healthy = max((m for w, m in per.items() if w in loads), default=0)
    t = policy.cache_threshold
    need = 0
    for m in (best, healthy):
        if (m / n > t) != (m / (n + hi) > t):
            # Above the threshold at |K| only: from ceil(m / t) tokens on, below at both
            # ends (a longer start keeps the matches: they end inside K).
            if t <= 0 or m / (n + hi) > t:
                return -1
            need = max(need, math.ceil(m / t))
    return need


def early(policy: Any, known: Any, hi: int, loads: Mapping[str, int]) -> bool:
    """``verdict`` is 0: decide on ``known``."""
    return verdict(policy, known, hi, loads) == 0


def decide_on(
    tokenizer: Any,
    prompt: Prompt,
    policy: Any,
    loads: Mapping[str, int],
    wrap: Callable[[array.array[int]], Any] | None = None,
) -> tuple[Prompt, Any] | None:
    """(the prompt, the tokens to route on) when its known start decides (``verdict``;
    once lengthened when it was only too short), else None: encode first. ``wrap``: what
    the caller routes on for given IDs (a partition token in front)."""
    known = wrap(prompt.known) if wrap else prompt.known
    v = verdict(policy, known, prompt.hi, loads)
    if v > 0:
        longer = tokenizer.lengthen(prompt, v - (len(known) - len(prompt.known)))
        if longer is None:
            return None
        prompt = longer
        known = wrap(prompt.known) if wrap else prompt.known
        v = verdict(policy, known, prompt.hi, loads)
    return (prompt, known) if v == 0 else None


class Tails:
    """Rests of prompts routed early, not yet inserted (rule, step 4)."""

    def __init__(self) -> None:
        self._open: list[Tail] = []
        self.early = 0
        self.encoded_first = 0

    def add(self, tail: Tail) -> None:
        self._open.append(tail)

    def settle(self) -> None:
        """Finish and insert every open rest (synchronously; before a decision)."""
        while self._open:
            self._open.pop(0).settle()

    def drop(self, tail: Tail) -> None:
        if tail in self._open:
            self._open.remove(tail)

    @property
    def open(self) -> int:
        return len(self._open)


@dataclass(slots=True, eq=False)
class Tail:
    """One early-routed prompt: ``finish`` gives the whole prompt's IDs; ``done`` takes
    them (insert for the chosen worker, set the request's route)."""

    finish: Callable[[], array.array[int]]
    done: Callable[[array.array[int]], None]
    ids: array.array[int] | None = None
    settled: bool = False

    def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        if self.ids is None:
            self.ids = self.finish()
        self.done(self.ids)
