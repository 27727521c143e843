"""Decide first in the request path (``--decide-first``): route on a prompt's known start
when the rest cannot change the decision, finish the prompt after the send.

The rule and why it keeps every decision are in ``kvroute.routing.decide_first``; the
tokenizer side is ``kvroute.routing.partial``. Here: where it applies (the fast BPE, no
engine events, no shared store, ``cache_aware`` on request counts, nothing quarantined),
the rule asked with no ``await`` before the decision, and the rest finished after it: a
short rest in a loop callback once the request's task has yielded at its send, a long
one (``offload``) in a thread; then the whole prompt is inserted for the
chosen worker and becomes the request's route (and is recorded with ``--record``).
``Attempts`` settles every pending rest before each decision and after each attempt.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvroute.routing.decide_first import Prompt, Tail, decide_on
from kvroute.routing.policies.base import Decision
from kvroute.routing.tokenization import PromptTokenizer, offload

if TYPE_CHECKING:
    from kvroute.service.attempts import Job
    from kvroute.service.state import RouterState

# What the request routes on for given IDs (its partition token in front, or as is).
Wrap = Callable[["array[int]"], Sequence[int]]


class EarlyRouting:
    def __init__(self, state: RouterState) -> None:
        self.s = state
        self._tasks: set[asyncio.Task[None]] = set()  # long rests being encoded

    @staticmethod
    def applies(state: RouterState) -> bool:
        """--decide-first with the fast BPE, without engine events or a shared store
        (other routers would see the known start before the whole prompt)."""
        st = state.settings
        # With a tokenizer per model, the prompts of a model without the fast BPE come
        # back whole from ``partial`` and are routed as without decide first.
        fast = any(t.fast for t in state.all_tokenizers)
        return bool(st.decide_first and fast and not st.kv_events and not st.state_store)

    async def tokens(
        self, route: str, body: dict[str, Any], model: str | None, wrap: Wrap
    ) -> tuple[Sequence[int], Prompt | None]:
        """The tokens to route on, and the prompt when they are only its start."""
        s = self.s
        tok = s.tokenizer_for(model)
        prompt = await tok.partial(route, body)
        if not prompt.complete:
            # Every earlier early prompt is in the index before the rule looks at it;
            # from here to the decision there is no await, so the rule sees its state.
            s.settle_tails()
            loads = s.registry.loads(exclude=set(), model=model)
            start = None
            if not len(s.quarantine) and loads:  # fingerprints are of whole prompts
                start = decide_on(tok, prompt, s.policy, loads, wrap)
            if start is not None:
                tok.tails.early += 1
                return start[1], start[0]
            tok.tails.encoded_first += 1
        return wrap(await tok.finish_async(prompt)), None

    def after_decision(
        self,
        job: Job,
        prompt: Prompt,
        kind: str,
        obj: dict[str, Any],
        wrap: Wrap,
        model: str | None = None,
    ) -> Callable[[Decision], None]:
        """What the first decision of an early-routed request starts (module doc);
        ``model``: the request's, whose tokenizer encodes the rest."""
        s = self.s
        tok = s.tokenizer_for(model)
        started = False

        def decided(decision: Decision) -> None:
            nonlocal started
            if started:
                return  # a retry: the rest already follows the first decision
            started = True

            def done(ids: array[int]) -> None:
                whole = wrap(ids)
                s.policy.index.insert(decision.worker, whole)  # type: ignore[attr-defined]
                job.route.tokens = whole
                if s.recorder is not None:
                    s.recorder.record(kind, obj, whole)

            tail = Tail(lambda: tok.finish(prompt), done)
            tok.tails.add(tail)
            loop = asyncio.get_running_loop()
            if not offload(prompt.pending, tok.encode_ns):
                loop.call_soon(self._settle, tok, tail)  # cheaper than a task or a thread hop
                return
            task = loop.create_task(self._finish(tok, tail, prompt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return decided

    @staticmethod
    def _settle(tok: PromptTokenizer, tail: Tail) -> None:
        tok.tails.drop(tail)
        tail.settle()

    async def _finish(self, tok: PromptTokenizer, tail: Tail, prompt: Prompt) -> None:
        await asyncio.sleep(0)  # the request's send goes first
        try:
            tail.ids = await asyncio.to_thread(tok.finish, prompt)
        finally:
            self._settle(tok, tail)
