"""``kvroute doctor`` against real vLLM (CPU build, tiny local model): the slow suite.

Run with ``.venv/bin/pytest -m slow tests/e2e/test_doctor_vllm.py`` after installing the
engine (docs/real-engine.md) and building the model (``bench/engine/make_tiny_model.py``). One
replica configured right (prefix caching, KV events to a socket doctor binds), one with
``--no-enable-prefix-caching``: the first passes every check, the second must be fixed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engine_support import engine_or_skip
from kvroute.eval.procs import Server, free_port, kvroute_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


serve = engine_or_skip()


def test_doctor_on_real_vllm(tmp_path: Path, processes: list[Server]) -> None:
    events = f"tcp://127.0.0.1:{free_port()}"
    opts = serve.ReplicaOptions(num_gpu_blocks=None, max_model_len=2048)
    good = serve.start_replica(
        free_port(),
        0,
        events_endpoint=events,
        topic="kv",
        options=opts,
        scratch=str(tmp_path / "good"),
    )
    processes.append(good)
    off_opts = serve.ReplicaOptions(
        num_gpu_blocks=None, max_model_len=2048, extra_args=["--no-enable-prefix-caching"]
    )
    off = serve.start_replica(
        free_port(), 1, events_endpoint=None, options=off_opts, scratch=str(tmp_path / "off")
    )
    processes.append(off)
    done = subprocess.run(
        kvroute_argv(
            "doctor",
            good.url,
            off.url,
            "--json",
            "--tokenizer",
            str(serve.MODEL),
            "--kv-events",
            f"{good.url}={events};bind;topic=kv",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    by_url = {w["url"]: w for w in report["workers"]}
    g = {f["check"]: f for f in by_url[good.url]["findings"]}
    assert by_url[good.url]["engine"] == "vllm" and by_url[good.url]["model"] == "tiny"
    assert by_url[good.url]["block_size"] == 32
    for check in ("health", "prefix_cache", "cached_tokens", "tokenizer", "kv_events"):
        assert g[check]["status"] == "ok", g[check]
    o = {f["check"]: f for f in by_url[off.url]["findings"]}
    assert o["prefix_cache"]["status"] == "fail"
    assert "--enable-prefix-caching" in o["prefix_cache"]["fix"]
    assert o["tokenizer"]["status"] == "ok"
