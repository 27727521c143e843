"""Workload generators: deterministic request lists from a seed.

Every generator returns ``list[Request]`` sorted by arrival time. Token IDs are drawn
uniformly below ``VOCAB`` (150,000, the size of a modern tokenizer's vocabulary), so two
independently drawn segments never share a block by accident.

* ``gsp``: SGLang's generated-shared-prefix benchmark. ``groups`` system prompts of
  ``system_len`` tokens, each followed by a unique question of ``question_len`` tokens;
  ``prompts_per_group`` requests per group under uniform popularity (exact counts), or the
  same total drawn from a Zipf law over groups (``popularity="zipf"``, exponent
  ``zipf_s``). Requests are shuffled.
* ``multiturn``: ``conversations`` chats of ``turns`` turns; turn ``k``'s prompt is turn
  ``k-1``'s prompt + its answer (``output_len`` tokens) + a new user message of
  ``user_len`` tokens; the first turn starts with a per-conversation system prompt.
  Turn ``k`` of every conversation comes before turn ``k+1`` of any (shuffled within a
  round), so a conversation's turns arrive in order. ``sigma`` > 0 makes lengths
  heavy-tailed: each system prompt and each user message is drawn log-normal with median
  ``system_len`` / ``user_len`` and shape ``sigma`` (p99 / median = exp(2.33 sigma): 10x at
  sigma ~ 1), capped at ``max_len`` tokens; a conversation ends early once its next
  prompt would pass ``max_len``.
* ``mooncake``: replay of a Mooncake trace (JSONL: ``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``). Each hash id maps to a fixed block of 512 token IDs
  drawn from ``(seed, id)``; the last block is cut to ``input_length``. Arrival time is
  ``timestamp / 1000 / time_scale``.
* ``llmd``: llm-d's long-shared-prefix, high-cache-pressure case: ``gsp`` with 150 groups
  x 5 prompts, 6,000-token system prompts, 1,200-token questions, 1,000 output tokens.
* ``rag``: retrieval-augmented questions, two levels of sharing: every prompt is one
  system prompt of ``system_len`` tokens shared by all, then one of ``documents``
  documents (lengths uniform in [``doc_len`` / 2, 3 ``doc_len`` / 2]; which one drawn
  from a Zipf law of exponent ``zipf_s``, so a few documents are hot and many are read
  once), then a unique question of ``question_len`` tokens. ``requests`` in all. Every
  worker soon holds the system prompt, so a new document's request matches a few
  hundred tokens everywhere (a match ratio near SGLang's 0.3 threshold) and its
  document only where it was read before.

Arrival processes (``arrivals``): ``"burst"`` (everything at t=0), ``"poisson"`` at
``rate`` requests/s (exponential gaps, order kept), or ``"trace"`` (keep the timestamps).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

VOCAB = 150_000
MOONCAKE_BLOCK = 512
WORKLOADS = ("gsp", "multiturn", "mooncake", "llmd", "rag")

Tokens = npt.NDArray[np.uint32]


@dataclass(slots=True)
class Request:
    arrival_s: float
    tokens: Tokens
    output_len: int
    group: int


def _draw(rng: np.random.Generator, n: int) -> Tokens:
    return rng.integers(0, VOCAB, n, dtype=np.uint32)


def with_arrivals(
    requests: list[Request], process: str = "burst", rate: float = 0.0, seed: int = 0
) -> list[Request]:
    """Set arrival times in list order: ``burst``, ``poisson`` (``rate``/s) or ``trace``."""
    if process == "trace":
        return sorted(requests, key=lambda r: r.arrival_s)
    if process == "burst":
        for r in requests:
            r.arrival_s = 0.0
        return requests
    if process == "poisson":
        if rate <= 0:
            raise ValueError("poisson arrivals need rate > 0")
        gaps = np.random.default_rng([seed, 7]).exponential(1.0 / rate, len(requests))
        times = np.cumsum(gaps) - gaps[0] if len(requests) else gaps
        for r, t in zip(requests, times.tolist(), strict=True):
            r.arrival_s = t
        return requests
    raise ValueError(f"unknown arrival process {process!r}: burst, poisson or trace")


def gsp(
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    *,
    popularity: str = "uniform",
    zipf_s: float = 1.1,
    seed: int = 0,
    arrivals: str = "burst",
    rate: float = 0.0,
) -> list[Request]:
    """Generated-shared-prefix requests (see module docstring)."""
    if groups < 1 or prompts_per_group < 1:
        raise ValueError("groups and prompts_per_group must be >= 1")
    rng = np.random.default_rng([seed, 1])
    systems = [_draw(rng, system_len) for _ in range(groups)]
    total = groups * prompts_per_group
    if popularity == "uniform":
        group_of = np.repeat(np.arange(groups), prompts_per_group)
    elif popularity == "zipf":
        weights = 1.0 / np.arange(1, groups + 1, dtype=np.float64) ** zipf_s
        group_of = rng.choice(groups, size=total, p=weights / weights.sum())
    else:
        raise ValueError(f"unknown popularity {popularity!r}: uniform or zipf")
    rng.shuffle(group_of)
    questions = _draw(rng, total * question_len).reshape(total, question_len)
    out = [
        Request(0.0, np.concatenate((systems[g], questions[i])), output_len, int(g))
        for i, g in enumerate(group_of.tolist())
    ]
    return with_arrivals(out, arrivals, rate, seed)


def llmd(
    groups: int = 150,
    prompts_per_group: int = 5,
    system_len: int = 6000,
    question_len: int = 1200,
    output_len: int = 1000,
    **kw: object,
) -> list[Request]:
    """llm-d's long shared prefix, high cache pressure workload (``gsp`` shape)."""
    return gsp(groups, prompts_per_group, system_len, question_len, output_len, **kw)  # type: ignore[arg-type]


def rag(
    documents: int = 200,
    requests: int = 1200,
    system_len: int = 1000,
    doc_len: int = 3000,
    question_len: int = 80,
    output_len: int = 150,
    *,
    zipf_s: float = 0.9,
    seed: int = 0,
    arrivals: str = "burst",
    rate: float = 0.0,
) -> list[Request]:
    """Retrieval-augmented questions over a shared system prompt (module docstring)."""
    if documents < 1 or requests < 0 or doc_len < 2:
        raise ValueError("documents must be >= 1, requests >= 0 and doc_len >= 2")
    rng = np.random.default_rng([seed, 4])
    system = _draw(rng, system_len)
    lens = rng.integers(doc_len // 2, doc_len * 3 // 2 + 1, documents)
    docs = [_draw(rng, int(n)) for n in lens.tolist()]
    weights = 1.0 / np.arange(1, documents + 1, dtype=np.float64) ** zipf_s
    picks = rng.choice(documents, size=requests, p=weights / weights.sum())
    out = [
        Request(0.0, np.concatenate((system, docs[d], _draw(rng, question_len))), output_len, d)
        for d in picks.tolist()
    ]
    return with_arrivals(out, arrivals, rate, seed)


def multiturn(
    conversations: int = 32,
    turns: int = 6,
    system_len: int = 1024,
    user_len: int = 128,
    output_len: int = 256,
    *,
    sigma: float = 0.0,
    max_len: int = 131_072,
    seed: int = 0,
    arrivals: str = "burst",
    rate: float = 0.0,
) -> list[Request]:
    """Multi-turn chats whose every turn extends the previous one (see module docstring)."""
    if conversations < 1 or turns < 1:
        raise ValueError("conversations and turns must be >= 1")
    if sigma < 0 or max_len < 1:
        raise ValueError("sigma must be >= 0 and max_len >= 1")
    rng = np.random.default_rng([seed, 2])

    def length(median: int) -> int:
        if sigma == 0:
            return median
        return int(min(max_len, max(1, round(median * rng.lognormal(0.0, sigma)))))

    history = [_draw(rng, length(system_len)) for _ in range(conversations)]
    out: list[Request] = []
    for _turn in range(turns):
        order = rng.permutation(conversations).tolist()
        for c in order:
            user = length(user_len)
            if sigma and len(history[c]) + user > max_len:
                continue  # this conversation has outgrown the context
            prompt = np.concatenate((history[c], _draw(rng, user)))
            out.append(Request(0.0, prompt, output_len, c))
            # The next turn carries this turn's answer (what the model said) in its prompt.
            history[c] = np.concatenate((prompt, _draw(rng, output_len)))
    return with_arrivals(out, arrivals, rate, seed)


def previous_turns(requests: Sequence[Request]) -> list[int | None]:
    """For each request, the index of the one before it in its conversation (the same
    ``group`` >= 0, in list order), or None: a conversation's first turn, or a one-off
    prompt (``group`` < 0). For workloads whose groups are conversations (``multiturn``)."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for i, req in enumerate(requests):
        if req.group < 0:
            out.append(None)
            continue
        out.append(last.get(req.group))
        last[req.group] = i
    return out


class _BlockBook:
    """hash id -> its fixed 512 tokens, drawn from (seed, id) and memoised."""

    def __init__(self, seed: int, block_len: int) -> None:
        self.seed = seed
        self.block_len = block_len
        self._blocks: dict[int, Tokens] = {}

    def get(self, hid: int) -> Tokens:
        b = self._blocks.get(hid)
        if b is None:
            b = _draw(np.random.default_rng([self.seed, 3, hid]), self.block_len)
            self._blocks[hid] = b
        return b


def read_trace(path: str | Path, limit: int | None = None) -> list[dict[str, object]]:
    """The JSON objects of a Mooncake-format JSONL trace (blank lines skipped)."""
    rows: list[dict[str, object]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def mooncake(
    path: str | Path,
    *,
    seed: int = 0,
    time_scale: float = 1.0,
    limit: int | None = None,
    block_len: int = MOONCAKE_BLOCK,
    arrivals: str = "trace",
    rate: float = 0.0,
) -> list[Request]:
    """Replay a Mooncake trace (see module docstring)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    return from_trace_rows(
        read_trace(path, limit),
        seed=seed,
        time_scale=time_scale,
        block_len=block_len,
        arrivals=arrivals,
        rate=rate,
    )


def from_trace_rows(
    rows: Iterable[dict[str, object]],
    *,
    seed: int = 0,
    time_scale: float = 1.0,
    block_len: int = MOONCAKE_BLOCK,
    arrivals: str = "trace",
    rate: float = 0.0,
) -> list[Request]:
    book = _BlockBook(seed, block_len)
    out: list[Request] = []
    for row in rows:
        hids = [int(h) for h in row["hash_ids"]]  # type: ignore[attr-defined]
        n_in = int(row.get("input_length", len(hids) * block_len))  # type: ignore[call-overload]
        if hids:
            tokens = np.concatenate([book.get(h) for h in hids])[:n_in]
        else:
            tokens = np.empty(0, dtype=np.uint32)
        ts = float(row.get("timestamp", 0.0)) / 1000.0 / time_scale  # type: ignore[arg-type]
        out_len = max(int(row.get("output_length", 1)), 1)  # type: ignore[call-overload]
        out.append(Request(ts, tokens, out_len, hids[0] if hids else -1))
    return with_arrivals(out, arrivals, rate, seed)


def build(name: str, **kw: object) -> list[Request]:
    """A workload by name (``WORKLOADS``); ``mooncake`` needs ``path``."""
    if name == "gsp":
        return gsp(**kw)  # type: ignore[arg-type]
    if name == "llmd":
        return llmd(**kw)  # type: ignore[arg-type]
    if name == "multiturn":
        return multiturn(**kw)  # type: ignore[arg-type]
    if name == "mooncake":
        return mooncake(**kw)  # type: ignore[arg-type]
    if name == "rag":
        return rag(**kw)  # type: ignore[arg-type]
    raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
