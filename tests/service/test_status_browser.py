"""``/status`` rendered by a real browser (headless Chromium, Debian's ``chromium``): the
workers table, the decision counters and the two charts are in the rendered DOM."""

from __future__ import annotations

import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from kvroute.eval.procs import Server, free_port, kvroute_argv, start_server
from kvroute.service.status import SAMPLE_SECS
from support import start_router

# No background traffic: the browser only talks to the router on loopback.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # tests run as root in CI containers
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
)


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    return subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


class Dom(HTMLParser):
    """The rendered page's tables (rows of cell texts), headings and SVG elements."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.headings: list[str] = []
        self.svg: list[tuple[str, dict[str, str | None]]] = []
        self._cell: list[str] | None = None
        self._heading: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag in ("h1", "h2"):
            self._heading = []
        elif tag in ("svg", "polyline", "circle"):
            self.svg.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag in ("h1", "h2") and self._heading is not None:
            self.headings.append("".join(self._heading).strip())
            self._heading = None

    def handle_data(self, data: str) -> None:
        for buf in (self._cell, self._heading):
            if buf is not None:
                buf.append(data)


def test_status_page_in_headless_chromium(tmp_path: Path, processes: list[Server]) -> None:
    probe = chromium(tmp_path, "--dump-dom", "about:blank")
    if probe.returncode != 0 or "<html" not in probe.stdout:
        pytest.skip(f"chromium cannot start here: {probe.stderr.strip()[-300:]}")
    workers = []
    for _ in range(2):
        port = free_port()
        argv = kvroute_argv("sim-worker", "--port", str(port), "--time-scale", "50")
        workers.append(start_server(f"sim-{port}", argv, port, log_dir=str(tmp_path)))
        processes.append(workers[-1])
    router = start_router([w.url for w in workers], tmp_path)
    processes.append(router)
    prompt = "You are a careful assistant. " * 40
    sent = 0
    with httpx.Client(base_url=router.url, timeout=30) as c:
        # Steady traffic until both charts have a line (two sampling intervals in a row
        # with answers), however the samples fall on a busy machine.
        deadline = time.monotonic() + 20 * SAMPLE_SECS
        while time.monotonic() < deadline:
            r = c.post("/v1/completions", json={"prompt": f"{prompt} q{sent}", "max_tokens": 2})
            assert r.status_code == 200
            sent += 1
            if sent % 4 == 0 and c.get("/status").text.count("<polyline") == 2:
                break
            time.sleep(0.2)

    shot = tmp_path / "status.png"
    rendered = chromium(tmp_path, "--dump-dom", router.url + "/status")
    assert rendered.returncode == 0, rendered.stderr[-500:]
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1100,900", router.url + "/status")
    dom = Dom()
    dom.feed(rendered.stdout)

    assert dom.headings[:3] == ["kvroute", "Workers", "Routing decisions"]
    workers_table, decisions_table = dom.tables[0], dom.tables[1]
    assert workers_table[0][:3] == ["url", "health", "mode"]
    assert sorted(row[0] for row in workers_table[1:]) == sorted(w.url for w in workers)
    assert all(row[1] == "up" for row in workers_table[1:])
    served = sum(int(row[workers_table[0].index("served")]) for row in workers_table[1:])
    assert served == sent
    decisions = {row[0]: int(row[1]) for row in decisions_table[1:]}
    assert sum(decisions.values()) == sent and "cache_hit" in decisions
    # Two charts, each with a line: the hit rate and the time to first byte.
    charts = [a for tag, a in dom.svg if tag == "svg"]
    assert [a["aria-label"] for a in charts] == [
        "hit rate (cached / prompt tokens)",
        "time to first byte, mean (s)",
    ]
    assert sum(1 for tag, _ in dom.svg if tag == "polyline") == 2
    assert shot.exists() and shot.stat().st_size > 0
