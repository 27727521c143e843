"""Workloads as chat text, for routers and workers that tokenize it themselves.

The workloads (``kvroute.sim.workloads``) are token-ID sequences with a known prefix
structure. Sent as token IDs, a router never runs its tokenizer; to measure what a
tokenizing router does with real text (segment cache, template rendering, decide
first), each workload token becomes a word of a real tokenizer's vocabulary (an entry
that is a space and ASCII letters, so the text has about as many tokens as the
workload) and each request becomes a chat whose messages follow the workload's
structure:

* ``gsp`` / ``llmd``: a system message (the group's shared prompt, ``system_len``
  tokens) and a user message (the question).
* ``multiturn``: the conversation's system message, then user and assistant messages
  of ``user_len`` and ``output_len`` tokens in turn, ending with the new user message.
* ``mooncake``: one user message (the trace's hash blocks, in order).

Equal token prefixes give equal text prefixes, so the sharing structure is kept; the
worker's cache (``sim-worker --tokenizer``) counts the rendered chat's real tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(slots=True)
class ChatRequest:
    """A workload request as chat messages (``tokens``: the workload's own IDs)."""

    arrival_s: float
    tokens: Any
    output_len: int
    messages: list[dict[str, str]]


def word_list(tokenizer_dir: str, limit: int = 8192) -> list[str]:
    """Vocabulary entries that are one space and 3-10 ASCII letters (GPT-2 byte-level
    spelling: ``Ġ`` + letters), in ID order."""
    vocab = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(
        (i, t[1:])
        for t, i in vocab.items()
        if t.startswith("Ġ") and 3 <= len(t) - 1 <= 10 and t[1:].isascii() and t[1:].isalpha()
    )
    return [" " + w for _, w in words[:limit]]


def _text(tokens: Any, words: list[str]) -> str:
    ids = np.asarray(tokens, dtype=np.int64) % len(words)
    return "".join(words[i] for i in ids.tolist()).lstrip()


def _roles(workload: str, n: int, params: dict[str, int]) -> list[tuple[str, int, int]]:
    """(role, start, end) spans of a prompt of ``n`` tokens."""
    if workload in ("gsp", "llmd"):
        s = min(params["system_len"], n)
        return [("system", 0, s), ("user", s, n)]
    if workload == "multiturn":
        spans = [("system", 0, min(params["system_len"], n))]
        at, user = spans[0][2], True
        while at < n:
            size = params["user_len"] if user else params["output_len"]
            spans.append(("user" if user else "assistant", at, min(at + size, n)))
            at, user = at + size, not user
        return spans
    return [("user", 0, n)]


def as_chat(
    requests: list[Any], workload: str, words: list[str], **params: int
) -> list[ChatRequest]:
    """``requests`` (``sim.workloads.Request``) as chats (structure: module docstring)."""
    out = []
    for r in requests:
        spans = _roles(workload, len(r.tokens), params)
        messages = [
            {"role": role, "content": _text(r.tokens[a:b], words)} for role, a, b in spans if b > a
        ]
        out.append(ChatRequest(r.arrival_s, r.tokens, r.output_len, messages))
    return out
