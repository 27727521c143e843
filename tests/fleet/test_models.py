"""Models per worker, eligibility and cache partitions (``kvroute.fleet.models``)."""

from __future__ import annotations

from array import array

import pytest

from kvroute import PrefixIndex
from kvroute.config import ConfigError, Settings
from kvroute.fleet.models import (
    PARTITION_BASE,
    ModelLabels,
    ServedModel,
    listing,
    named_models,
    parse_models,
    partition_token,
    requested_model,
)
from kvroute.fleet.registry import Registry

VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "qwen", "object": "model", "root": "/models/qwen", "parent": None},
        {"id": "qwen-sql", "object": "model", "root": "/lora/sql", "parent": "qwen"},
    ],
}


def test_parse_models_reads_vllm_adapters() -> None:
    models = parse_models(VLLM_MODELS)
    assert models is not None
    assert [(m.id, m.parent, m.is_adapter) for m in models] == [
        ("qwen", None, False),
        ("qwen-sql", "qwen", True),
    ]
    assert parse_models({"detail": "Not Found"}) is None
    assert parse_models([1, 2]) is None
    assert parse_models({"data": [{"id": 3}, {"id": ""}, "x"]}) == []


def test_named_models_first_is_base() -> None:
    models = named_models(["base", "a1", "a2"])
    assert [(m.id, m.parent) for m in models] == [("base", None), ("a1", "base"), ("a2", "base")]


def test_partition_token_outside_any_vocabulary_and_stable() -> None:
    assert partition_token(None, None) is None
    tokens = {
        partition_token("a", None),
        partition_token(None, "s"),
        partition_token("a", "s"),
        partition_token("b", None),
    }
    assert None not in tokens and len(tokens) == 4
    assert all(t is not None and PARTITION_BASE <= t <= 0xFFFF_FFFF for t in tokens)
    assert partition_token("a", "s") == partition_token("a", "s")


def test_no_match_across_partitions_one_budget_per_worker() -> None:
    index = PrefixIndex(300)
    prompt = list(range(1, 101))

    def keyed(adapter: str | None, salt: str | None) -> array[int]:
        t = partition_token(adapter, salt)
        return array("I", ([t] if t is not None else []) + prompt)

    index.insert("w", keyed("sql", None))
    assert index.match(keyed("sql", None)) == {"w": 101}
    assert index.match(keyed(None, None)).get("w", 0) == 0
    assert index.match(keyed("chat", None)).get("w", 0) == 0
    assert index.match(keyed("sql", "tenant-b")).get("w", 0) == 0
    # Three partitions of 101 tokens exceed the worker's 300: the oldest is evicted.
    index.insert("w", keyed(None, None))
    index.insert("w", keyed("chat", None))
    assert index.cached_tokens("w") <= 300
    assert index.match(keyed("sql", None)).get("w", 0) < 101


def test_requested_model() -> None:
    assert requested_model("chat", {"model": "m"}, None) == "m"
    assert requested_model("chat", {}, "d") == "d"
    assert requested_model("generate", {"model": "m"}, "d") == "d"
    with pytest.raises(ValueError):
        requested_model("completions", {"model": 5}, None)


def test_model_labels_are_bounded() -> None:
    label = ModelLabels(2)
    assert [label(m) for m in ("a", "b", "c", "a", None)] == ["a", "b", "other", "a", "default"]


def _registry(*specs: str) -> Registry:
    return Registry(Settings(worker_models=list(specs)).validate())


def test_registry_routes_only_to_workers_serving_the_model() -> None:
    reg = _registry("http://a:1=alpha,alpha-sql")
    for url in ("http://a:1", "http://b:1", "http://c:1"):
        reg.add(url)
        reg.record_check(url, True)  # its first health check: traffic from now on
    reg.set_models("http://b:1", [ServedModel("beta")])
    # c's models are unknown: it serves anything until its /v1/models answers.
    assert set(reg.loads(model="alpha-sql")) == {"http://a:1", "http://c:1"}
    assert set(reg.loads(model="beta")) == {"http://b:1", "http://c:1"}
    assert set(reg.loads()) == {"http://a:1", "http://b:1", "http://c:1"}
    assert reg.model_routable("gamma")
    reg.set_models("http://c:1", [ServedModel("beta")])
    assert not reg.model_routable("gamma")
    assert set(reg.loads(model="alpha")) == {"http://a:1"}
    assert reg.is_adapter("alpha-sql") and not reg.is_adapter("alpha")
    # What the operator set is never overridden by a read from the worker.
    reg.set_models("http://a:1", [ServedModel("zeta")])
    assert set(reg.workers["http://a:1"].models or {}) == {"alpha", "alpha-sql"}


def test_listing_each_model_once() -> None:
    models = [ServedModel("a"), ServedModel("b", "a"), ServedModel("a")]
    assert [m["id"] for m in listing(models)] == ["a", "b"]


def test_bad_worker_models_setting() -> None:
    with pytest.raises(ConfigError, match="URL=MODEL"):
        Settings(worker_models=["http://a:1"]).validate()
    with pytest.raises(ConfigError, match="scheme"):
        Settings(worker_models=["ftp://a:1=m"]).validate()
