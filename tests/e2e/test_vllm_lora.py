"""LoRA adapters on real vLLM (CPU build, tiny random model): the slow suite.

Two replicas of the tiny model with ``--enable-lora``: A serves the adapters ``sql`` and
``chat``, B serves ``sql`` only (and lets adapters be unloaded at run time). A
``kvroute serve`` in front reads what each serves from ``/v1/models``. Judged by vLLM's
own accounting: an adapter request reaches only replicas that serve it (B answers 404
for ``chat``); the same prompt under the base model and under an adapter shares no KV in
vLLM (``cached_tokens`` 0) and the router predicts no hit across them; an adapter
unloaded from B leaves B's rotation for it.

Needs the engine (docs/real-engine.md) and ``peft`` in it (``.engine/bin/pip install
peft``) to build the adapters (``bench/engine/make_lora.py``).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine_support import engine_or_skip
from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from support import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


serve = engine_or_skip()
_peft = subprocess.run(
    [str(serve.ENGINE_PYTHON), "-c", "import peft"], capture_output=True, check=False
)
if _peft.returncode != 0:
    pytest.skip(
        "peft is not installed in .engine (.engine/bin/pip install peft)", allow_module_level=True
    )


def adapters() -> dict[str, Path]:
    out = {name: serve.ENGINE / f"lora-{name}" for name in ("sql", "chat")}
    if not all((p / "adapter_config.json").exists() for p in out.values()):
        subprocess.run(
            [
                str(serve.ENGINE_PYTHON),
                str(ROOT / "bench/engine/make_lora.py"),
                "--model",
                str(serve.MODEL),
                "--out",
                *map(str, out.values()),
            ],
            check=True,
            capture_output=True,
        )
    return out


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Server, Server, Server]]:
    lora = adapters()
    common = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    opts_a = serve.ReplicaOptions(
        num_gpu_blocks=120,
        extra_args=[*common, "--lora-modules", f"sql={lora['sql']}", f"chat={lora['chat']}"],
    )
    opts_b = serve.ReplicaOptions(
        num_gpu_blocks=120,
        extra_args=[*common, "--lora-modules", f"sql={lora['sql']}"],
        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    servers: list[Server] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(
                    serve.start_replica,
                    free_port(),
                    core,
                    events_endpoint=None,
                    options=opts,
                    scratch=tempfile.mkdtemp(prefix="vllm-lora-"),
                )
                for core, opts in ((0, opts_a), (1, opts_b))
            ]
            a, b = (f.result() for f in futures)
        servers += [a, b]
        port = free_port()
        argv = kvroute_argv(
            "serve", "--port", str(port), "--worker-urls", a.url, b.url,
            "--health-check-interval-secs", "0.5",
        )  # fmt: skip
        router = start_server("kvroute-lora", argv, port)
        servers.append(router)
        yield router, a, b
    finally:
        for s in reversed(servers):
            s.stop()


def complete(router: Server, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def cache_hits(router: Server) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvroute_routing_decisions_total{") and 'reason="cache_hit"' in line
    )


def prompt(seed: int, n: int = 320) -> list[int]:
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(10 + x % 8000)
    return out


def test_adapters_route_by_what_vllm_serves_and_keep_their_own_cache(
    fleet: tuple[Server, Server, Server],
) -> None:
    router, a, b = fleet

    def models() -> dict[str, list[str]]:
        rows = httpx.get(router.url + "/workers", timeout=10).json()
        return {w["url"]: w["models"] or [] for w in rows}

    wait_for(lambda: all(models().values()), what="the router to read /v1/models")
    assert sorted(models()[a.url]) == ["chat", "sql", "tiny"]
    assert sorted(models()[b.url]) == ["sql", "tiny"]

    # 'chat' only on A: B would answer 404.
    for i in range(4):
        r = complete(router, "chat", prompt(100 + i))
        assert r.headers["x-kvroute-worker"] == a.url

    # One prompt under the base model, then under 'sql': vLLM keeps their KV apart, and
    # the router predicts no hit across them.
    p = prompt(7)
    first = complete(router, "tiny", p)
    again = complete(router, "tiny", p)
    assert (
        cached(again) > 0 and again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    )
    hits = cache_hits(router)
    sql = complete(router, "sql", p)
    assert cached(sql) == 0, "vLLM shares no KV between the base model and an adapter"
    assert cache_hits(router) == hits, "the router predicted no hit across them"
    sql_again = complete(router, "sql", p)
    assert cached(sql_again) > 0 and cache_hits(router) == hits + 1
    assert sql_again.headers["x-kvroute-worker"] == sql.headers["x-kvroute-worker"]

    # 'sql' unloaded from B at run time: B leaves sql's rotation at the next check.
    r = httpx.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=30)
    assert r.status_code == 200, r.text
    wait_for(lambda: "sql" not in models()[b.url], what="B's models to be read again")
    for i in range(4):
        r = complete(router, "sql", prompt(200 + i))
        assert r.headers["x-kvroute-worker"] == a.url
