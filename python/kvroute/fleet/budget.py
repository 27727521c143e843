"""The index's memory budget, derived from what the engines report.

The router predicts what each worker caches; a worker cannot cache more tokens than its
KV cache holds, so that capacity is the natural per-worker budget of the index:

* vLLM publishes it in ``/metrics`` as the labels of ``vllm:cache_config_info``
  (``num_gpu_blocks`` x ``block_size`` tokens);
* SGLang answers ``GET /get_server_info`` with ``max_total_num_tokens``.

Until a worker reports (or when it never does: a stub, an older engine), its budget is
the fallback, ``--tree-size-fallback`` tokens. Without a tokenizer the index counts UTF-8
bytes, so token counts are scaled by the bytes per engine token: ``BYTES_PER_TOKEN`` at
first, then what the answers show (``observe``: the bytes each prompt was routed as,
against the ``usage.prompt_tokens`` its engine reported; a decayed ratio of sums, used
after ``MIN_SAMPLES`` answers, in steps of 1/8, changed only when it moves by 10% or
more). English prose runs about 4 bytes per token, code and other scripts otherwise,
and a budget scaled wrong holds 4x too much or too little. With a shared store every
replica must set the same budgets (they apply each other's inserts and must evict
alike), so each learns from its own answers but uses one scale: the one the oldest live
router that has learned one publishes with its heartbeat (``follows``, ``adopt``;
``kvroute.fleet.shared.heartbeat``). A
process-wide cap (``--max-total-tree-size``, in index entries, ~5.3 bytes each measured
with unique 256-token prompts) bounds the sum: each worker gets at most its share of it.
``--max-tree-size`` replaces all of this with one fixed budget per worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Protocol

import httpx
import orjson

from kvroute.fleet.engine_load import positive_int

log = logging.getLogger("kvroute.fleet.budget")

BYTES_PER_TOKEN = 4
_ATTEMPTS = 3  # readings tried per worker before it keeps the fallback
MIN_SAMPLES = 32  # answers seen before the learned bytes per token replace the default
_DECAY = 0.99  # per answer: the ratio follows the last few hundred answers
_STEP = 8  # the learned scale moves in 1/8 units per token ...
_MOVE = 0.1  # ... and only when the ratio is 10% off the scale in use
_MAX_SCALE = 64  # bytes per token at most, learned or read from the store

_CACHE_CONFIG = re.compile(rb"^vllm:cache_config_info\{([^}\n]*)\}", re.MULTILINE)
_LABEL = re.compile(rb'(\w+)="([^"]*)"')


def parse_vllm_cache_config(metrics: bytes) -> int | None:
    """KV capacity in tokens from vLLM's ``vllm:cache_config_info`` labels, or None."""
    m = _CACHE_CONFIG.search(metrics)
    if m is None:
        return None
    labels = dict(_LABEL.findall(m.group(1)))
    try:
        blocks = int(labels[b"num_gpu_blocks"])
        size = int(labels[b"block_size"])
    except (KeyError, ValueError):
        return None
    return blocks * size if blocks > 0 and size > 0 else None


def parse_sglang_server_info(body: bytes) -> int | None:
    """KV capacity in tokens from SGLang's ``/get_server_info``, or None."""
    try:
        info = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    value = info.get("max_total_num_tokens") if isinstance(info, dict) else None
    return value if positive_int(value) else None


class Budgeted(Protocol):
    """The index calls the budget makes (``kvroute.PrefixIndex``)."""

    def set_worker_budget(self, worker: str, max_tokens: int | None) -> int: ...
    def worker_budget(self, worker: str) -> int | None: ...


class IndexBudget:
    """Per-worker budgets: reported capacity (or the fallback), scaled to index units,
    each at most an equal share of the process-wide cap."""

    def __init__(
        self,
        fallback_tokens: int,
        total_cap: int,
        *,
        index_in_bytes: bool,
        learn_scale: bool = False,
        follows: bool = False,
    ) -> None:
        self.fallback_tokens = fallback_tokens
        self.total_cap = total_cap
        self.in_bytes = index_in_bytes
        # Index entries per engine token; learned from answers when ``learn_scale``.
        self.scale: float = BYTES_PER_TOKEN if index_in_bytes else 1
        self.learning = index_in_bytes and learn_scale
        # With a shared store: ``scale`` is set by ``adopt`` only (the replicas' common
        # one), and what this router's answers show is ``learned``, for the others.
        self.follows = follows
        self.learned: float | None = None  # once MIN_SAMPLES answers came
        self._units = 0.0
        self._tokens = 0.0
        self.samples = 0
        self.reported: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self.budgets: dict[str, int] = {}
        # Each reporting worker's KV capacity in index units (its reported tokens times
        # ``scale``, not capped): the room the work model predicts waits for
        # (``LoadModel.kv_capacity``). Kept by ``apply``.
        self.kv_units: dict[str, int] = {}

    def budget_for(self, worker: str, fleet_size: int) -> int:
        tokens = self.reported.get(worker, self.fallback_tokens)
        return max(1, min(int(tokens * self.scale), self.total_cap // max(1, fleet_size)))

    @property
    def bytes_per_token(self) -> float | None:
        """Routing on bytes, the bytes per engine token the budgets count; else None."""
        return self.scale if self.in_bytes else None

    def observe(self, units: int, tokens: int | None) -> bool:
        """One answer: its prompt was routed as ``units`` index entries and its engine
        counted ``tokens`` (``usage.prompt_tokens``). Moves ``learned`` when learning,
        and ``scale`` with it unless it ``follows``; the budgets follow at the next
        ``apply``. True: ``scale`` moved."""
        if not self.learning or units <= 0 or not tokens or tokens <= 0:
            return False
        self._units = self._units * _DECAY + units
        self._tokens = self._tokens * _DECAY + tokens
        self.samples += 1
        if self.samples < MIN_SAMPLES:
            return False
        step = min(_MAX_SCALE, max(1, round(self._units / self._tokens * _STEP)) / _STEP)
        was = self.scale if self.learned is None else self.learned
        if abs(step - was) < _MOVE * was:
            step = was
        elif self.follows:
            log.info("this router's answers: %.3g bytes per token (was %.3g)", step, was)
        self.learned = step = float(step)
        if self.follows or step == self.scale:
            return False
        log.info("index budgets: %.3g bytes per token (was %.3g)", step, self.scale)
        self.scale = step
        return True

    def adopt(self, scale: float, source: str = "") -> bool:
        """With a shared store: use ``scale`` (the one the replicas agree on, read from
        the store: rounded to the learning's steps; ignored unless it is one of them).
        True: ``scale`` moved."""
        if not (self.follows and self.in_bytes):
            return False
        step = round(scale * _STEP) / _STEP if math.isfinite(scale) else 0.0
        if not (1 / _STEP <= step <= _MAX_SCALE) or step == self.scale:
            return False
        log.info(
            "index budgets: %.3g bytes per token (was %.3g), as %s learned",
            step,
            self.scale,
            source or "the oldest router",
        )
        self.scale = step
        return True

    def apply(self, index: Budgeted, workers: Iterable[str]) -> None:
        """Set every worker's budget in ``index`` (call when the fleet or a reading
        changes); a smaller budget evicts at once."""
        urls = list(workers)
        for url in [u for u in self.budgets if u not in urls]:
            self.budgets.pop(url)
            self.attempts.pop(url, None)
            self.reported.pop(url, None)
        units = self.kv_units
        for url in [u for u in units if u not in self.reported]:
            del units[url]
        for url in urls:
            tokens = self.reported.get(url)
            if tokens is not None:
                units[url] = int(tokens * self.scale)
            budget = self.budget_for(url, len(urls))
            # Asked of the index itself: a worker it forgot (down, then back) is set again.
            if index.worker_budget(url) != budget:
                index.set_worker_budget(url, budget)
            self.budgets[url] = budget

    def wants_reading(self, worker: str) -> bool:
        return worker not in self.reported and self.attempts.get(worker, 0) < _ATTEMPTS


async def read_capacity(client: httpx.AsyncClient, url: str, timeout_s: float) -> int | None:
    """The worker's KV capacity in tokens, from vLLM's metrics or SGLang's server info."""
    for path, parse in (
        ("/metrics", parse_vllm_cache_config),
        ("/get_server_info", parse_sglang_server_info),
    ):
        try:
            r = await client.get(url + path, timeout=timeout_s)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            found = parse(r.content)
            if found is not None:
                return found
    return None


async def budget_loop(
    budget: IndexBudget,
    index: Budgeted,
    client: Callable[[], httpx.AsyncClient],
    current: Callable[[], Iterable[str]],
    *,
    interval: float,
    timeout_s: float,
) -> None:
    """Keep ``index``'s per-worker budgets in step with the fleet (``current()`` gives
    the worker URLs) and with what the engines report (each read up to 3 times);
    ``client()`` gives the router's current upstream client."""
    while True:
        urls = list(current())
        budget.apply(index, urls)
        todo = [u for u in urls if budget.wants_reading(u)]

        async def read(url: str) -> None:
            budget.attempts[url] = budget.attempts.get(url, 0) + 1
            tokens = await read_capacity(client(), url, timeout_s)
            if tokens is not None:
                budget.reported[url] = tokens
                log.info("%s reports a KV capacity of %d tokens", url, tokens)

        if todo:
            await asyncio.gather(*(read(u) for u in todo))
            budget.apply(index, urls)
        await asyncio.sleep(interval)
