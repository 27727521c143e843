"""The findings ``kvroute doctor`` reports for a worker, and the small HTTP readers the
checks share (see ``kvroute.fleet.probe`` for what is checked)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MAX_SKEW_S = 5.0
SAMPLE_TEXT = "kvroute doctor: Ünïcödé, numbers 12345 and code `x = f(y)`.\nA second line."
SAMPLE_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What does a prefix cache keep?"},
]
VLLM_EVENTS = (
    '--kv-events-config \'{"enable_kv_cache_events":true,"publisher":"zmq",'
    '"endpoint":"tcp://ROUTER_HOST:5557","topic":"kv@WORKER"}\''
)
SGLANG_EVENTS = '--kv-events-config \'{"publisher":"zmq","endpoint":"tcp://*:5557"}\''


@dataclass
class Finding:
    check: str
    status: str  # ok | info | warn | fail
    detail: str
    fix: str = ""


@dataclass
class WorkerReport:
    url: str
    engine: str = "unknown"  # vllm | sglang | unknown
    version: str | None = None
    model: str | None = None
    # What the engine loaded its tokenizer from (vLLM's /v1/models ``root``, SGLang's
    # ``tokenizer_path``): a model ID or a path on the engine's host.
    tokenizer_source: str | None = None
    block_size: int | None = None
    findings: list[Finding] = field(default_factory=list)
    # vLLM's GET /kv_event_sources answer (None: not served), read by ``kvroute doctor``.
    kv_event_sources: bytes | None = field(default=None, repr=False)

    def add(self, check: str, status: str, detail: str, fix: str = "") -> None:
        self.findings.append(Finding(check, status, detail, fix))

    @property
    def failed(self) -> bool:
        return any(f.status == "fail" for f in self.findings)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["kv_event_sources"]
        return out


async def get_body(
    client: httpx.AsyncClient, url: str, limit_s: float | None = None
) -> bytes | None:
    """The body of a 200 answer to ``GET url`` (within ``limit_s``, default: the
    client's timeout), else None."""
    try:
        r = await client.get(url, timeout=httpx.USE_CLIENT_DEFAULT if limit_s is None else limit_s)
    except httpx.HTTPError:
        return None
    return r.content if r.status_code == 200 else None


async def get_json(client: httpx.AsyncClient, url: str) -> Any:
    """The JSON answer of ``GET url``, or None when it is not a 200 JSON answer."""
    try:
        r = await client.get(url)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def read_metrics(client: httpx.AsyncClient, base: str) -> dict[str, list[Any]] | None:
    """``/metrics`` as sample name -> samples (a counter's under ``NAME_total``: the
    parser does not always pair ``vllm:`` families with their samples), None when not
    served."""
    try:
        r = await client.get(base + "/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, list[Any]] = {}
    try:
        for fam in text_string_to_metric_families(r.text):
            for sample in fam.samples:
                out.setdefault(sample.name, []).append(sample)
    except ValueError:
        return None
    return out


def counter_total(metrics: dict[str, list[Any]] | None, family: str) -> float | None:
    name = family + "_total"
    if metrics is None or name not in metrics:
        return None
    return float(sum(s.value for s in metrics[name]))
