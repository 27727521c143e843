"""``GET /status``: one HTML page an operator can leave open next to the fleet.

Server-rendered from the same snapshot ``/workers`` and ``/metrics`` read (no scripts,
no assets; the page reloads itself every few seconds): each worker's health, mode, load
and learned capacity, how the policy has been deciding, and whether the cache
predictions hold up against what the workers report.
"""

from __future__ import annotations

import time
from collections import defaultdict
from html import escape
from typing import Any

from prometheus_client import Counter

REFRESH_SECS = 3


def counter_totals(counter: Counter, label: str) -> dict[str, float]:
    """A labelled counter's totals grouped by one label."""
    out: dict[str, float] = defaultdict(float)
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels.get(label, "")] += sample.value
    return dict(out)


def _row(cells: list[Any]) -> str:
    return "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join(_row(r) for r in rows) or _row(["(none)"])
    return f"<table><tr>{th}</tr>{body}</table>"


def _routers(snapshot: dict[str, Any]) -> str:
    """Live router replicas (--state-store), or nothing without a store."""
    if "routers" not in snapshot:
        return ""
    rows = [
        [r.get("id", "?") + (" (this one)" if r.get("self") else ""), r.get("url", "?")]
        for r in snapshot["routers"]
    ]
    return f"<h2>Routers sharing state ({len(rows)} live)</h2>\n" + _table(["id", "url"], rows)


def render(
    *,
    policy: str,
    started: float,
    snapshot: dict[str, Any],
    decisions: dict[str, float],
    predicted: float,
    reported: float,
) -> str:
    workers = snapshot["workers"]
    up = sum(1 for w in workers if w["healthy"])
    worker_rows = [
        [
            w["url"],
            "up" if w["healthy"] else f"down: {w['down_reason'] or 'circuit open'}",
            w["mode"],
            w["in_flight"],
            w["capacity"] if w["capacity"] is not None else "-",
            f"{w['cached_tokens']:,}",
            w["requests_served"],
            w["failures"],
        ]
        for w in workers
    ]
    total = sum(decisions.values())
    decision_rows = [
        [reason, f"{n:,.0f}", f"{n / total:.1%}"]
        for reason, n in sorted(decisions.items(), key=lambda kv: -kv[1])
    ]
    tok = snapshot["tokenizer"]
    index = snapshot["index"]
    reuse = (
        f"predicted {predicted:,.0f} cached prompt tokens, workers reported {reported:,.0f}"
        if predicted or reported
        else "no answer has reported cached tokens yet"
    )
    uptime = int(time.time() - started)
    head = ["url", "health", "mode", "in flight", "capacity", "cached tokens (index)"]
    workers_table = _table([*head, "served", "failures"], worker_rows)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_SECS}">
<title>kvroute status</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;
margin-bottom:1.5em}}td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left}}
th{{background:#f3f3f3}}</style></head><body>
<h1>kvroute</h1>
<p>policy <b>{escape(policy)}</b> · {up} of {len(workers)} workers up · up {uptime} s ·
asyncio tasks {snapshot["asyncio_tasks"]}</p>
<h2>Workers</h2>
{workers_table}
{_routers(snapshot)}<h2>Routing decisions</h2>
{_table(["reason", "requests", "share"], decision_rows)}
<h2>Cache</h2>
<p>{escape(reuse)}</p>
<p>index: {index["nodes"]:,} nodes, {index["memory_bytes"] / 2**20:.1f} MiB,
{index["evicted_tokens"]:,} tokens evicted · tokenizer segment cache: hit rate
{tok["hit_rate"]:.1%} ({tok["hits"]:,} hits, {tok["misses"]:,} misses)</p>
</body></html>"""
