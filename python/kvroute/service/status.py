"""``GET /status``: one HTML page an operator can leave open next to the fleet.

Server-rendered from the same snapshot ``/workers`` and ``/metrics`` read (no scripts,
no assets; the page reloads itself every few seconds): each worker's health, mode, load
and learned capacity, how the policy has been deciding, and whether the cache
predictions hold up against what the workers report.

Two small charts (inline SVG) show the last ``HISTORY_SECS`` of the workers' hit rate
(cached / prompt tokens, as the answers report them) and the mean time to the first
byte (the TTFT of streamed answers). ``History`` samples the router's own counters every
``SAMPLE_SECS`` into a ring buffer (a task of the app's lifespan); each point is the
change between two samples, so a quiet interval shows as a gap, not as a stale value.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from html import escape
from typing import Any

from prometheus_client import Counter, Histogram

REFRESH_SECS = 3
SAMPLE_SECS = 5.0
HISTORY_SECS = 600
CHART_W, CHART_H = 360, 90


@dataclass(slots=True)
class Point:
    at: float  # time.time()
    hit_rate: float | None  # cached / prompt tokens reported in the interval
    ttfb_s: float | None  # mean time to first byte in the interval
    requests: int


def _hist_totals(hist: Histogram) -> tuple[float, float]:
    """(sum, count) of a histogram over all its labels."""
    total = count = 0.0
    for metric in hist.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


class History:
    """A ring buffer of ``Point`` taken from the router's counters."""

    def __init__(self, metrics: Any, size: int = int(HISTORY_SECS / SAMPLE_SECS)) -> None:
        self.metrics = metrics
        self.points: deque[Point] = deque(maxlen=size)
        self._last: tuple[float, float, float, float] | None = None

    def _totals(self) -> tuple[float, float, float, float]:
        m = self.metrics
        cached = sum(counter_totals(m.reported_cached, "source").values())
        prompt = sum(counter_totals(m.reported_prompt, "source").values())
        ttfb_sum, ttfb_count = _hist_totals(m.ttfb)
        return cached, prompt, ttfb_sum, ttfb_count

    def sample(self, now: float | None = None) -> None:
        totals = self._totals()
        if self._last is not None:
            d_cached, d_prompt, d_sum, d_count = (
                a - b for a, b in zip(totals, self._last, strict=True)
            )
            self.points.append(
                Point(
                    time.time() if now is None else now,
                    d_cached / d_prompt if d_prompt > 0 else None,
                    d_sum / d_count if d_count > 0 else None,
                    int(d_count),
                )
            )
        self._last = totals

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_SECS)


def chart(
    title: str, points: list[tuple[float, float | None]], now: float, fmt: str, top: float | None
) -> str:
    """An inline SVG line chart of ``(time, value)`` over the last ``HISTORY_SECS``, the
    newest on the right; a None value (a quiet interval) breaks the line."""
    known = [v for _, v in points if v is not None]
    hi = top if top is not None else (max(known) * 1.1 if known else 0.0) or 1.0
    runs: list[list[tuple[float, float]]] = [[]]
    for at, v in points:
        if v is None:
            runs.append([])
            continue
        x = CHART_W * (1 - min(max(now - at, 0.0), HISTORY_SECS) / HISTORY_SECS)
        y = CHART_H - 4 - (CHART_H - 8) * min(v / hi, 1.0)
        runs[-1].append((x, y))
    body = "".join(
        f'<polyline points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in r)}"/>'
        if len(r) > 1
        else f'<circle cx="{r[0][0]:.1f}" cy="{r[0][1]:.1f}" r="2"/>'
        for r in runs
        if r
    )
    if not known:
        body = f'<text x="8" y="{CHART_H // 2}" class="none">no data yet</text>'
    last = format(known[-1], fmt) if known else "-"
    minutes = HISTORY_SECS // 60
    return (
        f'<figure class="chart"><figcaption>{escape(title)}: <b>{last}</b> '
        f'<span class="scale">(top of the chart {format(hi, fmt)})</span></figcaption>'
        f'<svg role="img" aria-label="{escape(title)}" width="{CHART_W}" height="{CHART_H}" '
        f'viewBox="0 0 {CHART_W} {CHART_H}">{body}</svg>'
        f'<div class="axis"><span>-{minutes} min</span><span>now</span></div></figure>'
    )


def charts(history: History | None) -> str:
    if history is None:
        return ""
    points = list(history.points)
    now = time.time()
    minutes = HISTORY_SECS // 60
    return (
        f'<h2>Last {minutes} minutes</h2><div class="charts">'
        + chart(
            "hit rate (cached / prompt tokens)",
            [(p.at, p.hit_rate) for p in points],
            now,
            ".0%",
            1.0,
        )
        + chart(
            "time to first byte, mean (s)", [(p.at, p.ttfb_s) for p in points], now, ".3f", None
        )
        + "</div>"
    )


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


def _work_cells(work: dict[str, Any] | None) -> list[Any]:
    if work is None:
        return ["-", "-", "-"]
    return [
        f"{work['prefill_tokens_queued']:,}",
        f"{work['predicted_wait_s']:.3f}",
        f"{work['prefill_tokens_per_s']:,.0f} ({work['prefill_samples']} samples)",
    ]


def _capacity(w: dict[str, Any]) -> str:
    """The guard's capacity and where it came from (``-`` while unknown)."""
    if w["capacity"] is None:
        return "-"
    source = w.get("capacity_source")
    return f"{w['capacity']} ({source})" if source else str(w["capacity"])


def _health(w: dict[str, Any]) -> str:
    if w["healthy"] is None:
        return "unknown (first health check pending)"
    if w["healthy"]:
        return "up (half-open: one probe request)" if w.get("half_open") else "up"
    return f"down: {w['down_reason'] or 'circuit open'}"


def _routers(snapshot: dict[str, Any]) -> str:
    """Live router replicas (--state-store), or nothing without a store."""
    if "routers" not in snapshot:
        return ""
    routers = snapshot["routers"]
    mine = next((r.get("index") for r in routers if r.get("self")), None)

    def keyed(r: dict[str, Any]) -> str:
        index = r.get("index", "?")
        if r.get("self") or mine is None or index in ("?", mine):
            return str(index)
        return f"{index} (differs: its decisions are not applied here)"

    def learned(r: dict[str, Any]) -> str:
        per = r.get("bytes_per_token")
        return "-" if per is None else f"{per:g}"

    rows = [
        [
            r.get("id", "?") + (" (this one)" if r.get("self") else ""),
            r.get("url", "?"),
            keyed(r),
            learned(r),
        ]
        for r in routers
    ]
    head = f"<h2>Routers sharing state ({len(rows)} live)</h2>\n"
    cols = ["id", "url", "index keyed on", "bytes per token its answers show"]
    return head + _table(cols, rows)


def _per_token(index: dict[str, Any]) -> str:
    """Routing on bytes: the bytes per engine token the index budgets count."""
    per = index.get("bytes_per_token")
    return "" if per is None else f", budgets at {per:g} bytes per token"


def _in_flight(index: dict[str, Any]) -> str:
    """The prompts kept as in flight beside the index (once its budget has evicted)."""
    n = index.get("prompts_in_flight")
    return "" if not n else f", {n:,} prompts in flight kept"


def render(
    *,
    policy: str,
    started: float,
    snapshot: dict[str, Any],
    decisions: dict[str, float],
    predicted: float,
    reported: float,
    history: History | None = None,
) -> str:
    workers = snapshot["workers"]
    up = sum(1 for w in workers if w["healthy"])
    worker_rows = [
        [
            w["url"],
            _health(w),
            w["mode"],
            w["in_flight"],
            _capacity(w),
            f"{w['cached_tokens']:,}",
            w["requests_served"],
            w["failures"],
            *_work_cells(w.get("work")),
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
    work_head = ["queued prefill tokens", "predicted wait (s)", "prefill tok/s (learned)"]
    workers_table = _table([*head, "served", "failures", *work_head], worker_rows)
    pred = snapshot.get("ttft_predictions") or {"count": 0, "mae_s": 0.0}
    predictions = (
        f"{pred['count']:,.0f} streamed first bytes checked against the work model's "
        f"prediction: mean absolute error {pred['mae_s'] * 1000:,.1f} ms"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_SECS}">
<title>kvroute status</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;
margin-bottom:1.5em}}td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left}}
th{{background:#f3f3f3}}.charts{{display:flex;gap:2em;flex-wrap:wrap}}
.chart{{margin:0}}.chart svg{{border:1px solid #ccc;background:#fafafa}}
.chart polyline{{fill:none;stroke:#2a6fdb;stroke-width:1.5}}.chart circle{{fill:#2a6fdb}}
.chart .none{{fill:#888;font-size:12px}}.scale{{color:#888;font-size:.85em}}
.axis{{display:flex;justify-content:space-between;width:{CHART_W}px;color:#888;
font-size:.8em}}</style>
</head><body>
<h1>kvroute</h1>
<p>policy <b>{escape(policy)}</b> · {up} of {len(workers)} workers up · up {uptime} s ·
asyncio tasks {snapshot["asyncio_tasks"]}</p>
<h2>Workers</h2>
{workers_table}
{_routers(snapshot)}<h2>Routing decisions</h2>
{_table(["reason", "requests", "share"], decision_rows)}
{charts(history)}
<h2>Time to first token</h2>
<p>{escape(predictions)}</p>
<h2>Cache</h2>
<p>{escape(reuse)}</p>
<p>index: {index["nodes"]:,} nodes, {index["memory_bytes"] / 2**20:.1f} MiB,
{index["evicted_tokens"]:,} tokens evicted{_per_token(index)}{_in_flight(index)} ·
tokenizer segment cache: hit rate {tok["hit_rate"]:.1%} ({tok["hits"]:,} hits,
{tok["misses"]:,} misses)</p>
</body></html>"""
