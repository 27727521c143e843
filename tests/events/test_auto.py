"""``--kv-events auto``: where an engine says it publishes, and what kvroute follows."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kvroute.config import Settings
from kvroute.events import KvEventSource, KvEventsSpecError
from kvroute.events.auto import (
    ASK_ATTEMPTS,
    AutoEvents,
    explicit,
    is_auto,
    sglang_config,
    source_for,
    vllm_config,
)

# vLLM 0.32's GET /kv_event_sources with --kv-events-config
# '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",
#   "replay_endpoint":"tcp://*:5558","topic":"kv"}' (the fields of its KVEventsConfig).
VLLM = {
    "0": {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv",
    }
}


def test_vllm_answer_becomes_the_source_an_operator_would_write() -> None:
    config = vllm_config(orjson.dumps(VLLM))
    assert config is not None
    assert source_for("http://10.0.0.7:8000", config) == KvEventSource(
        "http://10.0.0.7:8000", "tcp://10.0.0.7:5557", "kv", "tcp://10.0.0.7:5558", bind=False
    )
    assert vllm_config(b"{}") is None, "events off: nothing to follow"
    two = {"0": VLLM["0"], "1": {**VLLM["0"], "endpoint": "tcp://*:5558"}}
    with pytest.raises(KvEventsSpecError, match="data-parallel"):
        vllm_config(orjson.dumps(two))
    for bad in (b"not json", b"[1, 2]"):
        with pytest.raises(KvEventsSpecError):
            vllm_config(bad)


def test_sglang_server_info_carries_its_config_as_a_json_string() -> None:
    info = {
        "dp_size": 1,
        "kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}',
    }
    config = sglang_config(orjson.dumps(info))
    assert config is not None
    assert source_for("http://sgl-0.sgl.svc:30000", config) == KvEventSource(
        "http://sgl-0.sgl.svc:30000", "tcp://sgl-0.sgl.svc:5557", None, None, bind=False
    ), "no topic: every message on that socket is the worker's"
    assert sglang_config(orjson.dumps({"kv_events_config": None})) is None
    assert sglang_config(b"<html>") is None, "not SGLang"
    dp = {**info, "dp_size": 2, "enable_dp_attention": True}
    with pytest.raises(KvEventsSpecError, match="data-parallel"):
        sglang_config(orjson.dumps(dp))
    with pytest.raises(KvEventsSpecError, match="not JSON"):
        sglang_config(orjson.dumps({"kv_events_config": "{oops"}))


@pytest.mark.parametrize(
    ("endpoint", "worker", "expected"),
    [
        ("tcp://*:6000", "http://[fd00::5]:8000", "tcp://[fd00::5]:6000"),
        ("tcp://[::]:6000", "http://10.1.2.3:8000", "tcp://10.1.2.3:6000"),
        ("ipc:///run/vllm/events.sock", "http://10.1.2.3:8000", "ipc:///run/vllm/events.sock"),
    ],
)
def test_endpoints_the_engine_binds_are_reached_at_the_worker(
    endpoint: str, worker: str, expected: str
) -> None:
    source = source_for(worker, {"publisher": "zmq", "endpoint": endpoint})
    assert source is not None and source.endpoint == expected and not source.bind


def test_engines_that_connect_out_or_publish_nothing_are_not_followed() -> None:
    with pytest.raises(KvEventsSpecError, match="connects out") as e:
        source_for("http://10.0.0.7:8000", {"publisher": "zmq", "endpoint": "tcp://router:5557"})
    assert "--kv-events 'http://10.0.0.7:8000=tcp://router:5557;bind'" in str(e.value)
    with pytest.raises(KvEventsSpecError, match="in-process"):
        source_for("http://a:1", {"endpoint": "inproc://events"})
    with pytest.raises(KvEventsSpecError, match="not zmq"):
        source_for("http://a:1", {"publisher": "kafka", "endpoint": "tcp://*:1"})
    assert source_for("http://a:1", {"publisher": "null"}) is None
    assert source_for("http://a:1", {"enable_kv_cache_events": False}) is None


def test_auto_is_one_of_the_kv_events_values() -> None:
    values = ["auto", "http://a:1=tcp://a:5557"]
    assert is_auto(values) and explicit(values) == ["http://a:1=tcp://a:5557"]
    assert not is_auto(["http://a:1=tcp://a:5557"])
    # Needs a tokenizer like any precise mode (events carry token IDs).
    with pytest.raises(Exception, match="--kv-events needs --tokenizer"):
        Settings(kv_events=["auto"]).validate()


class _Subscriber:
    """What AutoEvents drives: KvEventSubscriber's sources, add and remove."""

    def __init__(self) -> None:
        self.sources: dict[str, KvEventSource] = {}

    def add_source(self, source: KvEventSource) -> None:
        self.sources[source.worker] = source

    def remove_source(self, worker: str) -> None:
        self.sources.pop(worker, None)


def test_each_worker_is_asked_a_bounded_number_of_times_and_dropped_when_gone() -> None:
    answers = {
        ("http://v:1", "/kv_event_sources"): orjson.dumps(VLLM),
        ("http://s:1", "/kv_event_sources"): None,  # SGLang: 404
        ("http://s:1", "/get_server_info"): orjson.dumps(
            {"kv_events_config": '{"endpoint": "tcp://*:7000", "topic": "t"}'}
        ),
        ("http://off:1", "/kv_event_sources"): b"{}",
        ("http://off:1", "/get_server_info"): None,
    }
    asked: list[tuple[str, str]] = []

    async def read(worker: str, path: str) -> bytes | None:
        asked.append((worker, path))
        return answers.get((worker, path))

    sub = _Subscriber()
    sub.sources["http://fixed:1"] = KvEventSource("http://fixed:1", "tcp://x:1")
    auto = AutoEvents(sub)  # type: ignore[arg-type]

    async def run() -> None:
        for _ in range(ASK_ATTEMPTS + 3):
            for w in ("http://v:1", "http://s:1", "http://off:1", "http://fixed:1"):
                await auto.follow(w, read)

    asyncio.run(run())
    assert sub.sources["http://v:1"].endpoint == "tcp://v:5557"
    assert sub.sources["http://s:1"].endpoint == "tcp://s:7000"
    assert "http://off:1" not in sub.sources
    assert asked.count(("http://v:1", "/kv_event_sources")) == 1, "followed: not asked again"
    assert asked.count(("http://off:1", "/kv_event_sources")) == ASK_ATTEMPTS
    assert not any(w == "http://fixed:1" for w, _ in asked), "explicit values win"
    asyncio.run(auto.prune(["http://s:1", "http://fixed:1"]))
    assert set(sub.sources) == {"http://s:1", "http://fixed:1"}
    asyncio.run(auto.follow("http://off:1", read))  # gone and back: asked again
    assert asked.count(("http://off:1", "/kv_event_sources")) == ASK_ATTEMPTS + 1
    for _ in range(ASK_ATTEMPTS):
        asyncio.run(auto.follow("http://off:1", read))
    auto.forget("http://off:1")  # down, then back: its engine may have changed
    asyncio.run(auto.follow("http://off:1", read))
    assert asked.count(("http://off:1", "/kv_event_sources")) == 2 * ASK_ATTEMPTS + 1
