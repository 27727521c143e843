"""The --record writer: chained block hashes, rotation within bounds, never blocking."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from kvroute.service.recorder import RotatingWriter, TraceRecorder, hash_ids, output_length


def test_hash_ids_are_chained_per_512_token_block() -> None:
    salt = b"s" * 16
    a = list(range(1200))
    b = a[:1024] + [7] * 176  # same first two blocks, different third
    c = [9, *a[1:]]  # differs in the first token: every id differs (chained)
    ha, hb, hc = hash_ids(a, salt), hash_ids(b, salt), hash_ids(c, salt)
    assert len(ha) == 3  # two full blocks and a partial one
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert all(x != y for x, y in zip(ha, hc, strict=True))
    assert hash_ids(a, b"t" * 16) != ha  # keyed: another run's ids differ


def test_output_length_from_the_body() -> None:
    assert output_length("chat", {"max_completion_tokens": 5, "max_tokens": 9}) == 5
    assert output_length("completions", {"max_tokens": 9}) == 9
    assert output_length("generate", {"sampling_params": {"max_new_tokens": 4}}) == 4
    assert output_length("chat", {"max_tokens": "x"}) == 0


def test_rotation_keeps_the_files_within_bounds(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    w = RotatingWriter(str(path), max_bytes=1000, max_files=3)
    for i in range(500):
        w.write(json.dumps({"i": i}).encode() + b"\n")
    w.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    assert all((tmp_path / f).stat().st_size <= 1000 for f in files)
    newest = [json.loads(x)["i"] for x in path.read_text().splitlines()]
    older = [json.loads(x)["i"] for x in (tmp_path / "t.jsonl.1").read_text().splitlines()]
    assert newest[-1] == 499 and older[-1] == newest[0] - 1


def test_record_never_waits_for_a_stalled_writer(tmp_path: Path) -> None:
    rec = TraceRecorder(str(tmp_path / "t.jsonl"), None, queue_size=4)
    gate = threading.Event()
    original = rec.writer.write

    def stalled(line: bytes) -> None:
        gate.wait(30)
        original(line)

    rec.writer.write = stalled  # type: ignore[method-assign]
    body = {"prompt": "hello " * 200, "max_tokens": 2}
    for _ in range(50):  # would hang here if record() waited for the writer
        rec.record("completions", body, ())
    assert rec.dropped >= 50 - 4 - 1  # the queue holds 4, the writer holds at most 1
    gate.set()
    rec.close()
    rows = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(rows) == rec.written == 50 - rec.dropped
    assert rows[0]["input_length"] == len(("hello " * 200).encode())
    assert rows[0]["output_length"] == 2
