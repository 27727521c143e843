"""Learning each worker's capacity from the load its engine reports.

cache_aware's saturation guard passes over a cache holder that already runs as many
requests as it can, so a hot prefix grows a second home instead of a queue. It needs
each worker's capacity: how many requests the engine runs at once before new ones wait
(vLLM's ``max_num_seqs`` or its KV-cache limit, SGLang's ``max_running_requests``).
Engines do not publish that number over HTTP, but they do publish their running and
waiting counts in Prometheus ``/metrics``. A worker seen with requests waiting is
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


def others_load(running: int, waiting: int, own: int) -> int:
    """Requests an engine holds that this router did not send (other router replicas',
    clients that bypass it), from one /metrics reading and this router's in-flight
    count at that moment (never negative: the router also counts requests still on the
    wire or finishing their answer)."""
    return max(0, running + waiting - own)


class CapacityLearner:
    """Per-worker capacity learned from (running, waiting) observations.

    ``capacities``: what an engine was seen running while requests waited (it runs no
    more at once). ``floors``: the most it was seen running with nothing waiting (it runs
    at least that many), kept for the workers not yet seen queueing, whose capacity the
    work model otherwise takes from the others (``LoadModel.typical_capacity``): a worker
    seen running more than that is not like them. A worker seen running more than its
    learned capacity with nothing waiting (its engine was reconfigured, or was short of
    KV memory when it queued) has the larger count learned instead."""

    def __init__(self) -> None:
        self.capacities: dict[str, int] = {}
        self.floors: dict[str, int] = {}

    def observe(self, worker: str, running: int, waiting: int) -> None:
        if running <= 0:
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
