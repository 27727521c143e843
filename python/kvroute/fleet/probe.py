"""What ``kvroute doctor`` learns from one worker over HTTP, as a list of findings.

Each finding is ``ok``, ``info``, ``warn`` or ``fail`` (something must be fixed before
routing), with the exact engine flag that fixes it. What is checked, and how:

* reachable and healthy: ``GET /health`` answers 200; its ``Date`` header gives the
  clock skew (1 s resolution, so only skews past ``MAX_SKEW_S`` are reported).
* what it is: vLLM serves ``GET /version``; SGLang ``GET /get_server_info`` (its
  ServerArgs: ``version``, ``disable_radix_cache``, ``kv_events_config``,
  ``enable_metrics``). The model from ``GET /v1/models`` (or ``/get_model_info``).
* prefix caching: vLLM's ``vllm:cache_config_info`` gauge carries ``enable_prefix_caching``
  and ``block_size`` as labels; then one probe prompt (a few blocks long, with a random
  nonce so no earlier cache state counts) is sent twice and ``vllm:prefix_cache_hits``
  must grow on the second send. SGLang: ``disable_radix_cache``. Either way the second
  answer must report ``usage.prompt_tokens_details.cached_tokens`` (kvroute compares
  its predictions with it).
* KV events: SGLang reports ``kv_events_config``; vLLM does not expose
  ``--kv-events-config`` over HTTP at all, so it can only be seen by subscribing
  (``kvroute doctor --kv-events``, done by the command, not here).
* tokenizer: the engine's ``POST /tokenize`` on a sample text and a sample chat, compared
  token for token with what kvroute computes (``PromptTokenizer``).
"""

from __future__ import annotations

import email.utils
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvroute.routing.tokenization import PromptTokenizer

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
    block_size: int | None = None
    findings: list[Finding] = field(default_factory=list)

    def add(self, check: str, status: str, detail: str, fix: str = "") -> None:
        self.findings.append(Finding(check, status, detail, fix))

    @property
    def failed(self) -> bool:
        return any(f.status == "fail" for f in self.findings)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


async def _get_json(client: httpx.AsyncClient, url: str) -> Any:
    """The JSON answer of ``GET url``, or None when it is not a 200 JSON answer."""
    try:
        r = await client.get(url)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _metrics(client: httpx.AsyncClient, base: str) -> dict[str, list[Any]] | None:
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


def _total(metrics: dict[str, list[Any]] | None, family: str) -> float | None:
    name = family + "_total"
    if metrics is None or name not in metrics:
        return None
    return float(sum(s.value for s in metrics[name]))


def clock_skew(date_header: str | None, now: float) -> float | None:
    """Seconds the worker's clock is ahead of ours (negative: behind), from ``Date``."""
    if not date_header:
        return None
    try:
        return email.utils.parsedate_to_datetime(date_header).timestamp() - now
    except (TypeError, ValueError):
        return None


async def probe_worker(
    client: httpx.AsyncClient, url: str, tokenizer: PromptTokenizer, tokenizer_given: bool
) -> WorkerReport:
    rep = WorkerReport(url)
    before = time.time()
    try:
        health = await client.get(url + "/health")
    except httpx.HTTPError as e:
        rep.add(
            "reachable",
            "fail",
            f"no answer from {url}/health ({type(e).__name__})",
            "check the URL; start the engine with --host 0.0.0.0 --port PORT so the "
            "router can reach it",
        )
        return rep
    rep.add("reachable", "ok", f"answers in {time.time() - before:.2f} s")
    if health.status_code == 200:
        rep.add("health", "ok", "GET /health: 200")
    else:
        rep.add(
            "health",
            "fail",
            f"GET /health: {health.status_code}",
            "the engine is not ready (still loading, or failing): see its log",
        )
    skew = clock_skew(health.headers.get("date"), (before + time.time()) / 2)
    if skew is None:
        rep.add("clock", "info", "no Date header: clock skew unknown")
    elif abs(skew) > MAX_SKEW_S:
        rep.add(
            "clock",
            "warn",
            f"clock {skew:+.0f} s off the router's (KV event timestamps, logs and traces "
            "will disagree)",
            "synchronise the hosts' clocks (NTP: chrony or systemd-timesyncd)",
        )
    else:
        rep.add("clock", "ok", f"within {MAX_SKEW_S:g} s of the router's ({skew:+.1f} s)")

    version = await _get_json(client, url + "/version")
    server_info = None
    if isinstance(version, dict) and "version" in version:
        rep.engine, rep.version = "vllm", str(version["version"])
    else:
        server_info = await _get_json(client, url + "/get_server_info")
        if isinstance(server_info, dict):
            rep.engine, rep.version = "sglang", str(server_info.get("version"))
    models = await _get_json(client, url + "/v1/models")
    max_len = None
    if isinstance(models, dict) and models.get("data"):
        rep.model = str(models["data"][0].get("id"))
        max_len = models["data"][0].get("max_model_len")
    elif isinstance(server_info, dict):
        rep.model = server_info.get("model_path")
    if rep.engine == "unknown":
        rep.add(
            "engine",
            "warn",
            "neither vLLM's /version nor SGLang's /get_server_info answers",
            "kvroute supports vLLM and SGLang (OpenAI-compatible servers work, unchecked)",
        )
    else:
        rep.add("engine", "ok", f"{rep.engine} {rep.version}, model {rep.model}")

    metrics = await _metrics(client, url)
    if rep.engine == "sglang":
        _sglang_settings(rep, server_info or {})
    else:
        _vllm_settings(rep, metrics)
    await _probe_cache(client, rep, metrics, max_len)
    await _compare_tokenizer(client, rep, tokenizer, tokenizer_given)
    return rep


def _vllm_settings(rep: WorkerReport, metrics: dict[str, list[Any]] | None) -> None:
    if metrics is None:
        rep.add(
            "metrics",
            "warn",
            "no /metrics: the saturation guard cannot learn the worker's capacity",
            "serve vLLM's /metrics (on by default; do not disable the stats logging)",
        )
        return
    rep.add("metrics", "ok", "GET /metrics answers with vLLM's series")
    info = metrics.get("vllm:cache_config_info")
    labels = info[0].labels if info else {}
    if "block_size" in labels and labels["block_size"].isdigit():
        rep.block_size = int(labels["block_size"])
    if labels.get("enable_prefix_caching") == "False":
        rep.add(
            "prefix_cache",
            "fail",
            "vllm:cache_config_info says enable_prefix_caching=False",
            "start vLLM with --enable-prefix-caching (and without --no-enable-prefix-caching)",
        )
    rep.add(
        "kv_events",
        "info",
        "vLLM does not report --kv-events-config over HTTP: not checked (for precise "
        "mode run kvroute doctor --kv-events WORKER=ENDPOINT, which listens for them)",
        f"for precise mode: start vLLM with {VLLM_EVENTS}",
    )


def _sglang_settings(rep: WorkerReport, info: dict[str, Any]) -> None:
    if isinstance(info.get("page_size"), int):
        rep.block_size = info["page_size"]
    if info.get("disable_radix_cache"):
        rep.add(
            "prefix_cache",
            "fail",
            "server_info says disable_radix_cache=true",
            "start SGLang without --disable-radix-cache",
        )
    else:
        rep.add("prefix_cache", "ok", "radix cache on (server_info)")
    if info.get("kv_events_config"):
        rep.add("kv_events", "ok", f"kv_events_config={info['kv_events_config']}")
    else:
        rep.add(
            "kv_events",
            "info",
            "KV events off (approximate mode only)",
            f"for precise mode: start SGLang with {SGLANG_EVENTS}",
        )
    if info.get("enable_metrics") is False:
        rep.add(
            "metrics",
            "warn",
            "metrics off: the saturation guard cannot learn the worker's capacity",
            "start SGLang with --enable-metrics",
        )


async def _probe_cache(
    client: httpx.AsyncClient,
    rep: WorkerReport,
    metrics: dict[str, list[Any]] | None,
    max_len: Any,
) -> None:
    """Send one prompt twice; the second must hit the prefix cache."""
    block = rep.block_size or 16
    words = max(8 * block, 256)
    if isinstance(max_len, int):
        words = min(words, max_len // 2)
    nonce = os.urandom(6).hex()
    prompt = f"doctor probe {nonce}: " + " ".join(f"w{i % 97}" for i in range(words))
    body = {"model": rep.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    answers = []
    hits = [_total(metrics, "vllm:prefix_cache_hits")]
    queries = [_total(metrics, "vllm:prefix_cache_queries")]
    for _ in range(2):
        try:
            r = await client.post(rep.url + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            rep.add("probe", "fail", f"POST /v1/completions failed ({type(e).__name__})")
            return
        if r.status_code != 200:
            rep.add(
                "probe",
                "fail",
                f"POST /v1/completions: {r.status_code} {r.text[:200]}",
                "the worker must serve the OpenAI completions API for model " + str(rep.model),
            )
            return
        answers.append(r.json())
        m = await _metrics(client, rep.url)
        hits.append(_total(m, "vllm:prefix_cache_hits"))
        queries.append(_total(m, "vllm:prefix_cache_queries"))
    details = (answers[1].get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    known = any(f.check == "prefix_cache" for f in rep.findings)
    if known or rep.engine == "sglang":
        pass
    elif None not in hits and None not in queries:
        h1, h2 = float(hits[1] or 0), float(hits[2] or 0)
        if queries[2] == queries[0]:
            rep.add(
                "prefix_cache",
                "fail",
                "vllm:prefix_cache_queries did not move after two requests: no prefix cache",
                "start vLLM with --enable-prefix-caching",
            )
        elif h2 - h1 > 0:
            rep.add(
                "prefix_cache",
                "ok",
                f"the repeated probe hit {h2 - h1:.0f} cached tokens (vllm:prefix_cache_hits)",
            )
        else:
            rep.add(
                "prefix_cache",
                "fail",
                "the same prompt sent twice hit nothing (vllm:prefix_cache_hits unchanged)",
                "start vLLM with --enable-prefix-caching; check the cache is not too small "
                "(--gpu-memory-utilization, --num-gpu-blocks-override)",
            )
    else:
        rep.add(
            "prefix_cache",
            "warn",
            "no vllm:prefix_cache_* counters on /metrics: prefix caching not verified",
            "start vLLM with --enable-prefix-caching",
        )
    if cached is None:
        flag = (
            "--enable-cache-report" if rep.engine == "sglang" else "--enable-prompt-tokens-details"
        )
        rep.add(
            "cached_tokens",
            "warn",
            "answers do not report usage.prompt_tokens_details.cached_tokens: kvroute "
            "cannot compare its predictions with the engine's cache",
            f"start the engine with {flag}",
        )
    else:
        rep.add("cached_tokens", "ok", f"answers report cached_tokens ({cached} on the repeat)")


async def _compare_tokenizer(
    client: httpx.AsyncClient,
    rep: WorkerReport,
    tokenizer: PromptTokenizer,
    tokenizer_given: bool,
) -> None:
    samples: list[tuple[str, dict[str, Any], str]] = [
        ("completions", {"prompt": SAMPLE_TEXT}, "text")
    ]
    if tokenizer_given:
        samples.append(("chat", {"messages": SAMPLE_CHAT}, "chat"))
    for route, body, what in samples:
        try:
            r = await client.post(rep.url + "/tokenize", json={"model": rep.model, **body})
        except httpx.HTTPError:
            r = None
        tokens = r.json().get("tokens") if r is not None and r.status_code == 200 else None
        if not isinstance(tokens, list):
            rep.add("tokenizer", "info", "the engine offers no POST /tokenize: not compared")
            return
        try:
            ours = list(await tokenizer.tokens_for(route, dict(body)))
        except Exception as e:  # a template error is a finding, not a crash
            rep.add("tokenizer", "fail", f"kvroute cannot tokenize the sample {what}: {e}")
            return
        if ours == tokens:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ours, tokens, strict=False)) if a != b), None)
        where = f"first difference at token {at if at is not None else min(len(ours), len(tokens))}"
        detail = f"the sample {what}: kvroute {len(ours)} tokens, engine {len(tokens)} ({where})"
        if tokenizer_given:
            rep.add(
                "tokenizer",
                "fail",
                f"--tokenizer does not match the served model: {detail}",
                f"give kvroute the tokenizer directory of {rep.model} (--tokenizer DIR)",
            )
        else:
            rep.add(
                "tokenizer",
                "warn",
                f"without --tokenizer kvroute routes on UTF-8 bytes, not the model's "
                f"tokens: {detail}",
                f"give kvroute the tokenizer directory of {rep.model} (--tokenizer DIR); "
                "precise mode needs it",
            )
        return
    rep.add("tokenizer", "ok", "kvroute's tokens equal the engine's /tokenize on the samples")
