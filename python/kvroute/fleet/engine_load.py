"""Each worker's capacity: reported by its engine, or learned from the load it reports.

cache_aware's saturation guard passes over a cache holder that already runs as many
requests as it can, so a hot prefix grows a second home instead of a queue. It needs
each worker's capacity: how many requests the engine runs at once before new ones wait
(vLLM's ``max_num_seqs`` or its KV-cache limit, SGLang's ``max_running_requests``).

SGLang publishes it: ``GET /get_server_info`` carries, per data-parallel rank, the
scheduler's ``effective_max_running_requests_per_dp`` in ``internal_states`` (the
``max_running_requests`` server argument, when set, in older versions). Read once when
a worker is first seen healthy (``parse_sglang_capacity``), it is the worker's capacity
from its first request on, each worker its own size.

vLLM does not publish ``max_num_seqs`` over HTTP, but every engine publishes its running
and waiting counts in Prometheus ``/metrics``. A worker seen with requests waiting is
running all it can, so its running count at that moment is its capacity; the largest
such count seen is kept (a momentary KV-cache limit may show a smaller one first).
Until a worker has been seen queueing, it has no capacity and the guard leaves it be:
that is SGLang's rule, unchanged, for fleets that never saturate. The most it was seen
running with nothing waiting is kept as well (a floor of its capacity): the work model
assumes a worker not yet seen queueing runs as many as the others learned, unless it
was seen running more.
"""

from __future__ import annotations

import re
from typing import TypeGuard

import orjson

# vLLM and SGLang gauge names for running and waiting requests.
_GAUGES = re.compile(
    rb"^(vllm:num_requests_running|vllm:num_requests_waiting|"
    rb"sglang:num_running_reqs|sglang:num_queue_reqs)(?:\{[^}\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)
_RUNNING = (b"vllm:num_requests_running", b"sglang:num_running_reqs")
# KV cache usage, 0..1: vLLM (current and older name), SGLang.
_KV = re.compile(
    rb"^(?:vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc|sglang:token_usage)"
    rb"(?:\{[^}\n]*\})?[ \t]+(\S+)",
    re.MULTILINE,
)


def parse_engine_load(text: bytes) -> tuple[int, int] | None:
    """(running, waiting) summed over every series of a Prometheus text exposition,
    or None when it has neither vLLM's nor SGLang's gauges."""
    running = waiting = 0.0
    found = False
    for name, value in _GAUGES.findall(text):
        try:
            v = float(value)
        except ValueError:
            continue
        if v != v or v < 0:  # NaN or nonsense
            continue
        found = True
        if name in _RUNNING:
            running += v
        else:
            waiting += v
    return (int(running), int(waiting)) if found else None


def parse_kv_usage(text: bytes) -> float | None:
    """The highest KV cache usage (0..1) over the series of a Prometheus exposition
    (vLLM ``kv_cache_usage_perc``, SGLang ``token_usage``), or None when absent."""
    best: float | None = None
    for value in _KV.findall(text):
        try:
            v = float(value)
        except ValueError:
            continue
        if 0.0 <= v <= 1.0 and (best is None or v > best):
            best = v
    return best


_PER_RANK = "effective_max_running_requests_per_dp"


def parse_sglang_capacity(body: bytes) -> int | None:
    """Requests an SGLang server runs at once, from the body of its
    ``GET /get_server_info`` (``sglang_capacity``); None if it is not JSON."""
    try:
        return sglang_capacity(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def sglang_capacity(info: object) -> int | None:
    """Requests an SGLang server runs at once, from its parsed ``/get_server_info``:
    the sum over its data-parallel ranks (``internal_states``) of each one's
    ``effective_max_running_requests_per_dp``; without those (older versions), the
    ``max_running_requests`` server argument when it was set. None when neither is a
    positive integer (vLLM, which has no such endpoint; an engine still loading)."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        total = 0
        for state in states:
            per = state.get(_PER_RANK) if isinstance(state, dict) else None
            if not positive_int(per):
                break  # a rank without it: the sum would fall short
            total += per
        else:
            return total
    value = info.get("max_running_requests")
    return value if positive_int(value) else None


def positive_int(value: object) -> TypeGuard[int]:
    """An int above 0, not a bool (JSON from an engine)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def others_load(running: int, waiting: int, own: int) -> int:
    """Requests an engine holds that this router did not send (other router replicas',
    clients that bypass it), from one /metrics reading and this router's in-flight
    count at that moment (never negative: the router also counts requests still on the
    wire or finishing their answer)."""
    return max(0, running + waiting - own)


# Readings of /get_server_info tried per worker appearance before its capacity is left
# to learning (vLLM answers 404: three requests per worker, once).
REPORT_ATTEMPTS = 3


class CapacityLearner:
    """Per-worker capacity, stated by the operator (``stated``), reported (``report``)
    or learned from (running, waiting) observations.

    ``capacities``: what the operator stated or an engine reported it runs at once
    (both stand), else what it was seen
    running while requests waited (it runs no more at once). ``floors``: the most it was
    seen running with nothing waiting (it runs at least that many), kept for the workers
    not yet seen queueing, whose capacity the work model otherwise takes from the others
    (``LoadModel.typical_capacity``): a worker seen running more than that is not like
    them. A worker seen running more than its learned capacity with nothing waiting (its
    engine was reconfigured, or was short of KV memory when it queued) has the larger
    count learned instead; a reported capacity stands."""

    def __init__(self, stated: dict[str, int] | None = None) -> None:
        # ``stated``: capacities the operator gave per worker (--worker-max-running);
        # they stand as reported ones do, and are not asked of the engine.
        self.stated: dict[str, int] = dict(stated or {})
        self.capacities: dict[str, int] = dict(self.stated)
        self.floors: dict[str, int] = {}
        self.reported: dict[str, int] = {}
        self._asked: dict[str, int] = {}

    def wants_report(self, worker: str) -> bool:
        """Is ``worker``'s engine to be asked for its capacity (not reported yet, fewer
        than ``REPORT_ATTEMPTS`` readings tried since it appeared)? Counts the ask."""
        if worker in self.reported or worker in self.stated:
            return False
        asked = self._asked.get(worker, 0)
        if asked >= REPORT_ATTEMPTS:
            return False
        self._asked[worker] = asked + 1
        return True

    def report(self, worker: str, capacity: int) -> None:
        """The engine says it runs ``capacity`` requests at once: its capacity from now
        on. A queue below it (KV memory short) does not lower it; the work model reads
        a full KV cache itself."""
        self.reported[worker] = capacity
        self.capacities[worker] = capacity

    def observe(self, worker: str, running: int, waiting: int) -> None:
        if running <= 0:
            return
        if worker in self.reported or worker in self.stated:
            if running > self.floors.get(worker, 0):
                self.floors[worker] = running
            return
        cap = self.capacities.get(worker, 0)
        if waiting > 0:
            if running > cap:
                self.capacities[worker] = running
            return
        if running > self.floors.get(worker, 0):
            self.floors[worker] = running
        if cap and running > cap:
            self.capacities[worker] = running

    def forget(self, worker: str) -> None:
        """A worker left or restarted: its engine may come back configured otherwise."""
        self.capacities.pop(worker, None)
        self.floors.pop(worker, None)
        self.reported.pop(worker, None)
        self._asked.pop(worker, None)
        if worker in self.stated:
            self.capacities[worker] = self.stated[worker]
