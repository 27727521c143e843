"""The engine checks of ``kvroute doctor``: settings read from vLLM's ``/metrics`` or
SGLang's server info, the prefix cache seen working on a probe prompt sent twice, and
kvroute's tokens against the engine's ``/tokenize`` (see ``kvroute.fleet.probe``)."""

from __future__ import annotations

import os
from typing import Any

import httpx

from kvroute.fleet.engine_load import sglang_capacity
from kvroute.fleet.probe.report import (
    SAMPLE_CHAT,
    SAMPLE_TEXT,
    SGLANG_EVENTS,
    VLLM_EVENTS,
    WorkerReport,
    counter_total,
    read_metrics,
)
from kvroute.routing.tokenization import PromptTokenizer


def vllm_settings(rep: WorkerReport, metrics: dict[str, list[Any]] | None) -> None:
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
        "this vLLM does not report its --kv-events-config over HTTP (no GET "
        "/kv_event_sources): not checked (for precise mode run kvroute doctor "
        "--kv-events WORKER=ENDPOINT, which listens for them)",
        f"for precise mode: start vLLM with {VLLM_EVENTS}",
    )


def sglang_settings(rep: WorkerReport, info: dict[str, Any]) -> None:
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
    capacity = sglang_capacity(info)
    if capacity is not None:
        rep.add("capacity", "ok", f"runs {capacity} requests at once (server_info)")
    else:
        rep.add(
            "capacity",
            "info",
            "server_info does not say how many requests it runs at once: learned from "
            "its queueing instead",
        )
    if info.get("enable_metrics") is False:
        rep.add(
            "metrics",
            "warn",
            "metrics off: the router cannot see its load (running, waiting, KV usage)",
            "start SGLang with --enable-metrics",
        )


async def probe_cache(
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
    hits = [counter_total(metrics, "vllm:prefix_cache_hits")]
    queries = [counter_total(metrics, "vllm:prefix_cache_queries")]
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
        m = await read_metrics(client, rep.url)
        hits.append(counter_total(m, "vllm:prefix_cache_hits"))
        queries.append(counter_total(m, "vllm:prefix_cache_queries"))
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


async def compare_tokenizer(
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
                _tokenizer_fix(rep),
            )
        else:
            rep.add(
                "tokenizer",
                "warn",
                f"without --tokenizer kvroute routes on UTF-8 bytes, not the model's "
                f"tokens: {detail}",
                f"{_tokenizer_fix(rep)}; precise mode needs it",
            )
        return
    rep.add("tokenizer", "ok", "kvroute's tokens equal the engine's /tokenize on the samples")


def _tokenizer_fix(rep: WorkerReport) -> str:
    """The ``--tokenizer`` to give kvroute: the model ID the engine loaded when it says
    so, else the directory of its model."""
    from kvroute.routing.tokenizer_files import cached_snapshot, has_tokenizer_files, is_model_id

    source = rep.tokenizer_source
    if source is not None and not os.path.isdir(source) and is_model_id(source):
        found = cached_snapshot(source)
        where = (
            "in this host's Hugging Face cache"
            if found is not None and has_tokenizer_files(found)
            else "not in this host's Hugging Face cache: downloaded at start-up unless "
            "HF_HUB_OFFLINE is set"
        )
        return f"give kvroute the model the engine loaded: --tokenizer {source} ({where})"
    where = f"; the engine loaded {source}" if source is not None else ""
    return (
        f"give kvroute the tokenizer of {rep.model}: --tokenizer DIR, or its Hugging Face "
        f"model ID{where}"
    )
