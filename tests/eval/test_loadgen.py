"""The load generator (kvroute.eval.loadgen): closed-loop conversations over HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvroute.eval.loadgen import replay
from kvroute.sim import workloads as wl
from support import start_sim_worker


def test_a_turn_is_sent_once_the_answer_before_it_has_ended(tmp_path: Path) -> None:
    # Every turn drawn at t=0. Open loop they all leave at once; with ``after`` each
    # waits for the answer it holds, so one conversation's turns run one at a time.
    worker = start_sim_worker(tmp_path, "--decode-ms-per-token", "2")
    try:
        reqs = wl.multiturn(3, 3, 64, 16, 8, seed=2)
        before = wl.previous_turns(reqs)
        assert before.count(None) == 3
        open_loop, _ = asyncio.run(replay(worker.url, reqs, as_text=False))
        closed, _ = asyncio.run(replay(worker.url, reqs, as_text=False, after=before))
    finally:
        worker.stop()
    assert {o.status for o in open_loop + closed} == {200}
    assert max(o.sent_s for o in open_loop) < min(o.sent_s + o.e2e_s for o in open_loop)
    for i, b in enumerate(before):
        if b is not None:
            assert closed[i].sent_s >= closed[b].sent_s + closed[b].e2e_s
    with pytest.raises(ValueError, match="one predecessor"):
        asyncio.run(replay(worker.url, reqs, after=before[:-1]))


def test_a_request_that_carries_an_id_is_sent_with_it() -> None:
    from kvroute.eval.loadgen import _headers

    plain = wl.multiturn(1, 1, 8, 4, 2, seed=0)[0]
    assert "x-request-id" not in _headers(plain)

    class Tagged:
        arrival_s, tokens, output_len, request_id = 0.0, [1, 2], 1, "g3-a0.5000"

    assert _headers(Tagged())["x-request-id"] == "g3-a0.5000"
