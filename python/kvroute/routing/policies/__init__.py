"""Routing policies. ``create_policy(name, index, **settings)`` builds one by name.

Every policy implements ``kvroute.routing.policies.base.Policy``; the router and the fleet
simulator call the same objects.
"""

from __future__ import annotations

from typing import Any

from kvroute._native import PrefixIndex
from kvroute.routing.policies.base import Decision, NoWorkerError, Policy, RouteRequest

POLICY_NAMES = (
    "cache_aware",
    "min_ttft",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "consistent_hash",
    "prefix_hash",
)

__all__ = ["POLICY_NAMES", "Decision", "NoWorkerError", "Policy", "RouteRequest", "create_policy"]


def create_policy(name: str, index: PrefixIndex, **settings: Any) -> Policy:
    """Build the policy ``name``. Unknown settings for that policy are ignored.

    Settings: ``cache_threshold`` (0.3), ``balance_abs_threshold`` (64),
    ``balance_rel_threshold`` (1.5), ``prefix_hash_tokens`` (256),
    ``bounded_load_factor`` (1.25), ``worker_capacity`` (None: no saturation guard),
    ``seed`` (None: random), ``load_metric`` ("work"; cache_aware's "least loaded":
    predicted wait, or "requests": in-flight counts), ``router_temperature`` (0.0;
    min_ttft's softmax temperature in seconds), ``pending_prompts`` (True; min_ttft and cache_aware
    on the work metric: prompts in flight are matched where the index's budget evicted
    them).
    """
    if name == "cache_aware":
        from kvroute.routing.policies.cache_aware import CacheAware

        return CacheAware(
            index,
            cache_threshold=settings.get("cache_threshold", 0.3),
            balance_abs_threshold=settings.get("balance_abs_threshold", 64),
            balance_rel_threshold=settings.get("balance_rel_threshold", 1.5),
            worker_capacity=settings.get("worker_capacity"),
            load_metric=settings.get("load_metric", "work"),
            pending_prompts=settings.get("pending_prompts", True),
        )
    if name == "min_ttft":
        from kvroute.routing.policies.min_ttft import MinTtft

        return MinTtft(
            index,
            temperature=settings.get("router_temperature", 0.0),
            seed=settings.get("seed"),
            pending_prompts=settings.get("pending_prompts", True),
        )
    if name == "round_robin":
        from kvroute.routing.policies.round_robin import RoundRobin

        return RoundRobin()
    if name == "random":
        from kvroute.routing.policies.random_policy import RandomPolicy

        return RandomPolicy(seed=settings.get("seed"))
    if name == "power_of_two":
        from kvroute.routing.policies.power_of_two import PowerOfTwo

        return PowerOfTwo(seed=settings.get("seed"))
    if name == "least_load":
        from kvroute.routing.policies.least_load import LeastLoad

        return LeastLoad()
    if name == "consistent_hash":
        from kvroute.routing.policies.consistent_hash import ConsistentHash

        return ConsistentHash(
            prefix_tokens=settings.get("prefix_hash_tokens", 256),
            load_factor=settings.get("bounded_load_factor", 1.25),
        )
    if name == "prefix_hash":
        from kvroute.routing.policies.prefix_hash import PrefixHash

        return PrefixHash(
            prefix_tokens=settings.get("prefix_hash_tokens", 256),
            load_factor=settings.get("bounded_load_factor", 1.25),
        )
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}")
