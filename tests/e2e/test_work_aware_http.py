"""min_ttft over HTTP: the router as a real process in front of two ``kvroute sim-worker``
processes, one ten times slower at prefill than the other."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from support import start_router


def sim_worker(tmp_path: Path, prefill_tps: int) -> Server:
    port = free_port()
    argv = kvroute_argv(
        "sim-worker",
        "--port",
        str(port),
        "--prefill-tokens-per-s",
        str(prefill_tps),
        "--decode-ms-per-token",
        "1",
        "--time-scale",
        "5",
    )
    return start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path))


def test_min_ttft_serves_learns_the_slow_worker_and_releases_its_work(
    tmp_path: Path, processes: list[Server]
) -> None:
    fast = sim_worker(tmp_path, 20_000)
    processes.append(fast)
    slow = sim_worker(tmp_path, 2_000)
    processes.append(slow)
    # The slow worker first: before anything is learned both tie, and ties go to the
    # worker chosen longest ago, so it gets the samples that tell its speed before the
    # fast one's learned rate draws the traffic away.
    router = start_router([slow.url, fast.url], tmp_path, "--policy", "min_ttft")
    processes.append(router)
    served: Counter[str] = Counter()
    with httpx.Client(base_url=router.url, timeout=60) as c:
        for i in range(14):
            # Distinct prompts of 1,000 to 4,000 bytes (tokens: no tokenizer).
            text = f"request {i:03d} " + "lorem ipsum dolor " * (50 + 40 * (i % 5))
            body = {"prompt": text, "max_tokens": 4, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                data = b"".join(r.iter_raw())
            assert data.count(b"data: ") >= 2 and b"[DONE]" in data
            served[r.headers["x-kvroute-worker"]] += 1
        workers = {w["url"]: w for w in c.get("/workers").json()}
        metrics = c.get("/metrics").text
    # Every reservation of predicted work came back.
    for w in workers.values():
        assert w["in_flight"] == 0
        work = w["work"]
        assert (work["prefill_tokens_queued"], work["requests"], work["decode_tokens"]) == (0, 0, 0)
        assert work["kv_tokens_in_flight"] == 0
        # The KV capacity the sim worker reports (vLLM's cache_config_info) reached the
        # work model: waits for room in the cache are predicted.
        assert work["kv_capacity_tokens"] > 0
    # Speeds were learned from first bytes, and the slow worker is seen as slow.
    assert workers[slow.url]["work"]["prefill_samples"] >= 3
    assert workers[fast.url]["work"]["prefill_samples"] >= 3
    fast_t = workers[fast.url]["work"]
    slow_t = workers[slow.url]["work"]
    cost = lambda t: t["prefill_overhead_ms"] + 2500 * 1000 / t["prefill_tokens_per_s"]  # noqa: E731
    assert cost(slow_t) > 3 * cost(fast_t)
    assert served[fast.url] > 2 * served[slow.url]
    assert 'kvroute_routing_decisions_total{policy="min_ttft"' in metrics
    assert "kvroute_ttft_prediction_ratio_count 14.0" in metrics
    assert "kvroute_worker_prefill_tokens_per_s" in metrics
    # The decode line (alone, per request beside it): streamed answers taught it.
    assert "kvroute_worker_decode_ms_per_token_per_request" in metrics
    assert all(w["work"]["decode_ms_per_token_alone"] > 0 for w in workers.values())
    # Idle at the end: nothing in flight, so no worker's times are stretched.
    assert all(w["work"]["occupancy_stretch"] == 1.0 for w in workers.values())
    assert f'kvroute_worker_occupancy_stretch{{worker="{fast.url}"}} 1.0' in metrics
