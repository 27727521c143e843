"""The routers kvroute is compared with: SGLang's and vLLM's, from PyPI.

Each lives in its own virtual environment under ``.peers/`` (see ``install_hint``) so
its dependencies never mix with kvroute's. ``start_peer`` launches one in front of a
list of worker URLs on loopback and waits until it answers; benchmarks stop it by PID.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvroute.eval.procs import Server, free_port, start_server


@dataclass(frozen=True)
class Peer:
    name: str
    venv: str
    package: str

    def python(self, root: Path) -> Path:
        return root / ".peers" / self.venv / "bin" / "python"

    def installed(self, root: Path) -> bool:
        return self.python(root).exists()

    def install_hint(self) -> str:
        return (
            f"python3 -m venv .peers/{self.venv} && "
            f".peers/{self.venv}/bin/pip install {self.package}"
        )


SGLANG = Peer("sglang-router", "sgl", "'sglang-router>=0.3,<0.4'")
VLLM = Peer("vllm-router", "vllm", "'vllm-router>=0.1,<0.2'")
PEERS = {"sglang": SGLANG, "vllm": VLLM}


def peer_argv(
    peer: Peer,
    root: Path,
    port: int,
    metrics_port: int,
    workers: list[str],
    policy: str = "cache_aware",
) -> list[str]:
    common = [
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-urls", *workers, "--policy", policy,
    ]  # fmt: skip
    if peer is SGLANG:
        return [str(peer.python(root)), "-m", "sglang_router.launch_router", *common,
                "--log-level", "warn"]  # fmt: skip
    exe = peer.python(root).parent / "vllm-router"
    return [str(exe), *common, "--log-level", "warning"]


def start_peer(
    peer: Peer,
    root: Path,
    workers: list[str],
    *,
    policy: str = "cache_aware",
    log_dir: str | None = None,
    timeout_s: float = 60.0,
) -> Server:
    """Start ``peer`` in front of ``workers`` and wait for its /health."""
    if not peer.installed(root):
        raise FileNotFoundError(f"{peer.name} is not installed; run: {peer.install_hint()}")
    port, metrics_port = free_port(), free_port()
    env = {
        # The SGLang router tries to fetch a tokenizer from the model hub for each worker;
        # keep that attempt on loopback so it fails fast (no hub is reachable here).
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_OFFLINE": "1",
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
    }
    return start_server(
        peer.name,
        peer_argv(peer, root, port, metrics_port, workers, policy),
        port,
        timeout_s=timeout_s,
        env=env,
        log_dir=log_dir,
    )
