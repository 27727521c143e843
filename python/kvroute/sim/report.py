"""Result rows and their rendering (Markdown table, JSON), shared by ``kvroute simulate``,
``kvroute analyze`` and the HTTP routing-quality benchmark.

A row is one router/policy run on one workload. ``summarize`` builds a row from raw
per-request samples, so the simulator and the HTTP benchmark compute the same numbers
the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import orjson


@dataclass(slots=True)
class ResultRow:
    name: str
    requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    throughput: float  # output tokens / s
    max_load: int  # requests sent to the busiest worker
    mean_load: float  # requests per worker
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0
    decision_us: float | None = None  # mean wall time of policy.select, simulator only
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        return self.max_load / self.mean_load if self.mean_load else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["imbalance"] = self.imbalance
        return d


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(
    name: str,
    *,
    ttft_s: Sequence[float] | np.ndarray,
    e2e_s: Sequence[float] | np.ndarray,
    prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    duration_s: float,
    per_worker: Iterable[int],
    errors: int = 0,
    decision_us: float | None = None,
    extra: dict[str, Any] | None = None,
) -> ResultRow:
    """One row from per-request samples and totals; ``per_worker`` counts every worker
    (zeros included) so that the mean is over the whole fleet."""
    counts = list(per_worker)
    ttft = np.asarray(ttft_s, dtype=np.float64)
    e2e = np.asarray(e2e_s, dtype=np.float64)
    return ResultRow(
        name=name,
        requests=len(ttft),
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p99=percentile(e2e, 99),
        throughput=output_tokens / duration_s if duration_s > 0 else 0.0,
        max_load=max(counts) if counts else 0,
        mean_load=sum(counts) / len(counts) if counts else 0.0,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=output_tokens,
        errors=errors,
        decision_us=decision_us,
        extra=dict(extra or {}),
    )


def _f(x: float, digits: int = 3) -> str:
    return "-" if x != x else f"{x:.{digits}f}"  # NaN -> "-"


def markdown_table(rows: Sequence[ResultRow], upper_bound: float | None = None) -> str:
    """The side-by-side table: one line per router/policy, plus the upper bound."""
    show_decision = any(r.decision_us is not None for r in rows)
    head = [
        "router/policy",
        "hit rate",
        "TTFT p50/p90/p99 (s)",
        "e2e p50/p99 (s)",
        "throughput (tok/s)",
        "max/mean load",
    ]
    if show_decision:
        head.append("decision (µs)")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [
            r.name,
            f"{r.hit_rate:.1%}",
            f"{_f(r.ttft_p50)} / {_f(r.ttft_p90)} / {_f(r.ttft_p99)}",
            f"{_f(r.e2e_p50, 2)} / {_f(r.e2e_p99, 2)}",
            f"{r.throughput:,.0f}",
            f"{r.max_load} / {r.mean_load:.1f} ({r.imbalance:.2f}x)",
        ]
        if show_decision:
            cells.append("-" if r.decision_us is None else f"{r.decision_us:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    if upper_bound is not None:
        pad = [""] * (len(head) - 2)
        lines.append(
            "| "
            + " | ".join(["upper bound (one infinite cache)", f"{upper_bound:.1%}", *pad])
            + " |"
        )
    return "\n".join(lines)


def to_json(rows: Sequence[ResultRow], upper_bound: float | None = None, **meta: Any) -> str:
    """Rows as JSON: ``{"rows": [...], "upper_bound": x, **meta}`` (NaN -> null)."""
    doc: dict[str, Any] = {**meta, "upper_bound": upper_bound, "rows": [r.to_dict() for r in rows]}
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
