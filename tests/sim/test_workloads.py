"""Workload generators (kvroute.sim.workloads): shapes, determinism, trace replay."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvroute.sim import workloads as wl

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def same(a: list[wl.Request], b: list[wl.Request]) -> bool:
    return len(a) == len(b) and all(
        x.arrival_s == y.arrival_s
        and x.output_len == y.output_len
        and x.group == y.group
        and np.array_equal(x.tokens, y.tokens)
        for x, y in zip(a, b, strict=True)
    )


def test_gsp_shape_and_sharing() -> None:
    reqs = wl.gsp(groups=4, prompts_per_group=3, system_len=64, question_len=8, output_len=5)
    assert len(reqs) == 12
    assert Counter(r.group for r in reqs) == {0: 3, 1: 3, 2: 3, 3: 3}
    for r in reqs:
        assert r.tokens.dtype == np.uint32 and len(r.tokens) == 72
        assert r.output_len == 5 and r.arrival_s == 0.0
        assert int(r.tokens.max()) < wl.VOCAB
    by_group: dict[int, list[wl.Request]] = {}
    for r in reqs:
        by_group.setdefault(r.group, []).append(r)
    for rs in by_group.values():
        assert all(np.array_equal(rs[0].tokens[:64], r.tokens[:64]) for r in rs)
        assert not np.array_equal(rs[0].tokens[64:], rs[1].tokens[64:])
    assert not np.array_equal(by_group[0][0].tokens[:64], by_group[1][0].tokens[:64])
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled


def test_gsp_defaults_and_determinism() -> None:
    a = wl.gsp(seed=3)
    assert len(a) == 64 * 16 and len(a[0].tokens) == 2048 + 128 and a[0].output_len == 256
    assert same(a, wl.gsp(seed=3))
    assert not same(a, wl.gsp(seed=4))


def test_gsp_zipf_is_skewed() -> None:
    reqs = wl.gsp(
        groups=16, prompts_per_group=20, system_len=8, question_len=4, popularity="zipf", seed=1
    )
    counts = Counter(r.group for r in reqs)
    assert len(reqs) == 320
    assert counts.most_common(1)[0][1] > 3 * 20
    with pytest.raises(ValueError):
        wl.gsp(popularity="nope")


def test_poisson_arrivals() -> None:
    reqs = wl.gsp(
        groups=8,
        prompts_per_group=25,
        system_len=8,
        question_len=4,
        arrivals="poisson",
        rate=100.0,
        seed=2,
    )
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[0] == 0.0
    assert 1.0 < times[-1] < 4.0  # 200 requests at 100/s: about 2 s
    with pytest.raises(ValueError):
        wl.gsp(arrivals="poisson", rate=0.0)


def test_llmd_shape() -> None:
    reqs = wl.llmd(groups=3, prompts_per_group=2)
    assert len(reqs) == 6 and len(reqs[0].tokens) == 7200 and reqs[0].output_len == 1000


def test_rag_shares_the_system_prompt_everywhere_and_documents_by_popularity() -> None:
    reqs = wl.rag(documents=50, requests=400, system_len=100, doc_len=300, question_len=10)
    assert len(reqs) == 400
    system = reqs[0].tokens[:100]
    by_doc: dict[int, list[wl.Request]] = {}
    for r in reqs:
        assert np.array_equal(r.tokens[:100], system)
        assert 100 + 150 + 10 <= len(r.tokens) <= 100 + 450 + 10
        by_doc.setdefault(r.group, []).append(r)
    for group in by_doc.values():  # one document per group, its own question each
        doc = group[0].tokens[100:-10]
        assert all(np.array_equal(r.tokens[100:-10], doc) for r in group)
        assert len({r.tokens[-10:].tobytes() for r in group}) == len(group)
    counts = sorted((len(g) for g in by_doc.values()), reverse=True)
    assert counts[0] >= 5 * counts[len(counts) // 2]  # Zipf: a few hot documents
    assert same(wl.rag(seed=3, requests=50), wl.rag(seed=3, requests=50))
    assert len(wl.build("rag", documents=5, requests=7)) == 7
    with pytest.raises(ValueError):
        wl.rag(documents=0)


def test_multiturn_extends_previous_turn() -> None:
    reqs = wl.multiturn(conversations=3, turns=4, system_len=32, user_len=8, output_len=5, seed=1)
    assert len(reqs) == 12
    by_conv: dict[int, list[wl.Request]] = {}
    for r in reqs:
        by_conv.setdefault(r.group, []).append(r)
    for turns in by_conv.values():
        assert [len(t.tokens) for t in turns] == [40, 53, 66, 79]
        for prev, nxt in itertools.pairwise(turns):
            assert np.array_equal(nxt.tokens[: len(prev.tokens)], prev.tokens)
    assert same(
        reqs,
        wl.multiturn(conversations=3, turns=4, system_len=32, user_len=8, output_len=5, seed=1),
    )


def test_mooncake_replay(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1300, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 200, "output_length": 1, "hash_ids": [5]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = wl.mooncake(path, seed=9, time_scale=2.0)
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.75]  # sorted, ms / 1000 / scale
    a, c, b = reqs
    assert len(a.tokens) == 1000 and len(b.tokens) == 1300 and len(c.tokens) == 200
    assert np.array_equal(a.tokens, b.tokens[:1000])  # chained ids share the prefix
    assert not np.array_equal(a.tokens[:200], c.tokens)
    assert a.output_len == 7 and a.group == 0
    again = wl.mooncake(path, seed=9, time_scale=2.0)
    assert same(reqs, again)
    other = wl.mooncake(path, seed=10, time_scale=2.0)
    assert not np.array_equal(other[0].tokens, a.tokens)


@pytest.mark.skipif(not TRACE.exists(), reason="shared Mooncake trace not present")
def test_mooncake_shared_trace() -> None:
    reqs = wl.mooncake(TRACE, limit=200)
    assert len(reqs) == 200
    rows = wl.read_trace(TRACE, 200)
    assert sum(len(r.tokens) for r in reqs) == sum(int(r["input_length"]) for r in rows)  # type: ignore[call-overload]
    assert all(int(r.tokens.max()) < wl.VOCAB for r in reqs)


def test_build_by_name() -> None:
    assert len(wl.build("gsp", groups=2, prompts_per_group=2, system_len=4, question_len=4)) == 4
    with pytest.raises(ValueError):
        wl.build("nope")
