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
import time
from collections.abc import Mapping

import httpx

from kvroute.fleet.probe.checks import (
    compare_tokenizer,
    probe_cache,
    sglang_settings,
    vllm_settings,
)
from kvroute.fleet.probe.report import (
    MAX_SKEW_S,
    SGLANG_EVENTS,
    VLLM_EVENTS,
    Finding,
    WorkerReport,
    get_body,
    get_json,
    read_metrics,
)
from kvroute.routing.tokenization import PromptTokenizer

__all__ = [
    "SGLANG_EVENTS",
    "VLLM_EVENTS",
    "Finding",
    "WorkerReport",
    "clock_skew",
    "probe_worker",
]


def clock_skew(date_header: str | None, now: float) -> float | None:
    """Seconds the worker's clock is ahead of ours (negative: behind), from ``Date``."""
    if not date_header:
        return None
    try:
        return email.utils.parsedate_to_datetime(date_header).timestamp() - now
    except (TypeError, ValueError):
        return None


async def probe_worker(
    client: httpx.AsyncClient,
    url: str,
    tokenizer: PromptTokenizer,
    tokenizer_given: bool,
    per_model: Mapping[str, PromptTokenizer] | None = None,
) -> WorkerReport:
    """Every check of one worker (module doc). ``per_model``: the tokenizers of
    ``--model-tokenizer``, compared with the engines serving those models."""
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

    version = await get_json(client, url + "/version")
    server_info = None
    if isinstance(version, dict) and "version" in version:
        rep.engine, rep.version = "vllm", str(version["version"])
    else:
        server_info = await get_json(client, url + "/get_server_info")
        if isinstance(server_info, dict):
            rep.engine, rep.version = "sglang", str(server_info.get("version"))
    models = await get_json(client, url + "/v1/models")
    max_len = None
    if isinstance(models, dict) and models.get("data"):
        rep.model = str(models["data"][0].get("id"))
        max_len = models["data"][0].get("max_model_len")
        root = models["data"][0].get("root")
        rep.tokenizer_source = root if isinstance(root, str) and root else None
    elif isinstance(server_info, dict):
        rep.model = server_info.get("model_path")
    if isinstance(server_info, dict):
        source = server_info.get("tokenizer_path") or server_info.get("model_path")
        if isinstance(source, str) and source:
            rep.tokenizer_source = source
    if rep.engine == "unknown":
        rep.add(
            "engine",
            "warn",
            "neither vLLM's /version nor SGLang's /get_server_info answers",
            "kvroute supports vLLM and SGLang (OpenAI-compatible servers work, unchecked)",
        )
    else:
        rep.add("engine", "ok", f"{rep.engine} {rep.version}, model {rep.model}")

    metrics = await read_metrics(client, url)
    if rep.engine == "sglang":
        sglang_settings(rep, server_info or {})
    else:
        vllm_settings(rep, metrics)
        rep.kv_event_sources = await get_body(client, url + "/kv_event_sources")
    await probe_cache(client, rep, metrics, max_len)
    own = per_model.get(rep.model) if per_model and rep.model is not None else None
    await compare_tokenizer(client, rep, own or tokenizer, own is not None or tokenizer_given)
    return rep
