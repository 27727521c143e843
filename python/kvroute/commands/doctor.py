"""``kvroute doctor URL...``: check a fleet before routing to it.

For each worker: reachable and healthy, which engine and model, prefix caching on (and
seen working on a probe prompt sent twice), cached tokens reported, KV events, the
tokenizer kvroute would use against the engine's own ``/tokenize``, clock skew
(``kvroute.fleet.probe`` has the details). Across the fleet: one model, one block size.
With ``--kv-events`` (the ``serve`` syntax), it listens on those endpoints while the
probes run and checks that each worker's events arrive. With ``--state-store``, it
checks that Redis as the routers would use it (``kvroute.fleet.shared.server``).

Prints what to fix with the engine flags that fix it. Exit code 0 when nothing must be
fixed (warnings allowed), 1 when something must, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

STATUS_MARK = {"ok": "ok  ", "info": "info", "warn": "WARN", "fail": "FAIL"}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("urls", nargs="*", metavar="URL", help="worker base URLs")
    p.add_argument(
        "--state-store",
        default=None,
        metavar="URL",
        help="as kvroute serve's --state-store: check that Redis (reachable with these "
        "credentials, a version and mode the routers can use, its round trip, every "
        "command they send allowed, the routers live there)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|MODEL_ID",
        help="the tokenizer you give kvroute serve (a directory or a Hugging Face model "
        "ID, found as serve finds it); compared with each engine's POST /tokenize on "
        "sample texts (without it: UTF-8 bytes, as serve)",
    )
    p.add_argument(
        "--model-tokenizer",
        action="append",
        default=[],
        metavar="MODEL=DIR|MODEL_ID",
        help="as kvroute serve's --model-tokenizer: each engine serving MODEL is "
        "compared with that tokenizer (repeat per model)",
    )
    p.add_argument(
        "--tokenizer-revision",
        default=None,
        metavar="REV",
        help="with a model ID: as kvroute serve's --tokenizer-revision",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT|auto",
        help="as kvroute serve's --kv-events: listen there while probing and check each "
        "worker's KV events arrive; auto: where each engine says it publishes them "
        "(vLLM's GET /kv_event_sources, SGLang's kv_events_config), as serve would",
    )
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per HTTP call (default %(default)s)"
    )
    p.add_argument(
        "--events-wait",
        type=float,
        default=5.0,
        help="with --kv-events: how long to wait for a worker's first events after the "
        "probes, sending it a fresh prompt every half second (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable report")


def run(args: argparse.Namespace) -> int:
    from kvroute.config import ConfigError, normalize_worker_url, parse_model_tokenizers
    from kvroute.routing.tokenization import PromptTokenizer
    from kvroute.routing.tokenizer_files import resolve_tokenizer

    store = None
    try:
        if not args.urls and args.state_store is None:
            raise ConfigError("give worker URLs, --state-store, or both")
        if args.state_store is not None:
            from kvroute.config import StoreURL

            store = StoreURL(args.state_store)
        urls = [normalize_worker_url(u) for u in args.urls]
        directory = None
        if args.tokenizer is not None:
            directory = resolve_tokenizer(args.tokenizer, args.tokenizer_revision)
        elif args.tokenizer_revision is not None:
            raise ConfigError("--tokenizer-revision needs --tokenizer MODEL_ID")
        tokenizer = PromptTokenizer(directory)
        per_model = {
            model: PromptTokenizer(resolve_tokenizer(spec))
            for model, spec in parse_model_tokenizers(args.model_tokenizer).items()
        }
        subscriber, tracker = _listen(args.kv_events, urls, args.timeout)
    except (ConfigError, OSError, ValueError) as e:
        print(f"kvroute doctor: error: {e}", file=sys.stderr)
        return 2
    try:
        given = args.tokenizer is not None
        reports = asyncio.run(_probe_all(urls, tokenizer, given, args, per_model))
        for rep in reports:
            if rep.kv_event_sources is not None:
                _vllm_events(rep, rep.kv_event_sources)
        if subscriber is not None:
            _check_events(reports, tracker, args.events_wait, args.timeout)
    finally:
        if subscriber is not None:
            subscriber.stop()
    fleet = _fleet_findings(reports)
    stored = []
    if store is not None:
        from kvroute.fleet.shared.server import check

        stored = asyncio.run(check(store, args.timeout))
    failed = any(r.failed for r in reports) or any(f.status == "fail" for f in (*fleet, *stored))
    if args.json:
        report: dict[str, Any] = {
            "ok": not failed,
            "workers": [r.as_json() for r in reports],
            "fleet": [vars(f) for f in fleet],
        }
        if store is not None:
            report["state_store"] = [vars(f) for f in stored]
        print(json.dumps(report, indent=2))
    else:
        _print(reports, fleet, failed, stored)
    return 1 if failed else 0


def _listen(specs: list[str], urls: list[str], timeout_s: float = 30.0) -> tuple[Any, Any]:
    if not specs:
        return None, None
    from kvroute._native import BlockIndex
    from kvroute.events import EventTracker, KvEventSubscriber, parse_kv_events
    from kvroute.events.auto import explicit, is_auto

    sources = parse_kv_events(explicit(specs), urls)
    if is_auto(specs):
        given = {s.worker for s in sources}
        sources += _reported_sources([u for u in urls if u not in given], timeout_s)
    tracker = EventTracker(BlockIndex())
    subscriber = KvEventSubscriber(sources, tracker)
    subscriber.start()
    time.sleep(0.5)  # engines that connect to us retry every 100 ms: let them join
    return subscriber, tracker


def _vllm_events(rep: Any, body: bytes) -> None:
    """Where vLLM says it publishes its KV events (its ``GET /kv_event_sources``)."""
    from kvroute.events.auto import source_for, vllm_config
    from kvroute.events.spec import KvEventsSpecError
    from kvroute.fleet.probe import VLLM_EVENTS

    rep.findings = [f for f in rep.findings if f.check != "kv_events"]
    try:
        config = vllm_config(body)
        source = source_for(rep.url, config) if config is not None else None
    except KvEventsSpecError as e:
        rep.add(
            "kv_events",
            "warn",
            f"--kv-events auto cannot follow its KV events: {e}",
            "bind the publisher on the engine (endpoint tcp://*:PORT), one rank per URL",
        )
        return
    if source is None:
        rep.add(
            "kv_events",
            "info",
            "KV events off (approximate mode only)",
            f"for precise mode: start vLLM with {VLLM_EVENTS}",
        )
        return
    replay = f", replay {source.replay_endpoint}" if source.replay_endpoint else ", no replay"
    rep.add(
        "kv_events",
        "ok",
        f"publishes KV events at {source.endpoint}{replay} (GET /kv_event_sources): "
        "kvroute serve --kv-events auto follows them",
    )


def _reported_sources(urls: list[str], timeout_s: float) -> list[Any]:
    """``--kv-events auto``: where each engine says it publishes (as ``serve`` asks it);
    a worker that says nothing followable is left out (its probe reports why)."""
    import httpx

    from kvroute.events.auto import source_from_answers
    from kvroute.events.spec import KvEventsSpecError
    from kvroute.fleet.probe.report import get_body

    async def ask(client: httpx.AsyncClient, url: str) -> Any:
        sources = await get_body(client, url + "/kv_event_sources")
        info = await get_body(client, url + "/get_server_info")
        try:
            return source_from_answers(url, sources, info)
        except KvEventsSpecError:
            return None

    async def ask_all() -> list[Any]:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return list(await asyncio.gather(*(ask(client, u) for u in urls)))

    return [s for s in asyncio.run(ask_all()) if s is not None]


async def _probe_all(
    urls: list[str], tokenizer: Any, given: bool, args: Any, per_model: Any = None
) -> list[Any]:
    import httpx

    from kvroute.fleet.probe import probe_worker

    async with httpx.AsyncClient(timeout=args.timeout) as client:
        return list(
            await asyncio.gather(
                *(probe_worker(client, u, tokenizer, given, per_model) for u in urls)
            )
        )


def _check_events(reports: list[Any], tracker: Any, wait_s: float, timeout_s: float) -> None:
    """Each worker with a --kv-events source must have sent events during the probes.

    A worker that has sent none yet gets a fresh prompt every half second until the wait
    ends: an engine's PUB socket drops what it publishes before its connection to us is
    up, so the first probes may have gone out before it was."""
    import httpx

    from kvroute.fleet.probe import VLLM_EVENTS

    deadline = time.monotonic() + wait_s
    watched = {r.url: r.model for r in reports if r.url in tracker.snapshot()}
    with httpx.Client(timeout=timeout_s) as client:
        while time.monotonic() < deadline:
            snap = tracker.snapshot()
            silent = [w for w in watched if int(snap[w]["events_received"]) == 0]
            if not silent:
                break
            for url in silent:
                prompt = f"doctor events {os.urandom(6).hex()} " + "x " * 512
                body = {"model": watched[url], "prompt": prompt, "max_tokens": 1}
                with contextlib.suppress(httpx.HTTPError):
                    client.post(url + "/v1/completions", json=body)
            time.sleep(0.5)
    snap = tracker.snapshot()
    for rep in reports:
        if rep.url not in snap:
            continue
        rep.findings = [f for f in rep.findings if f.check != "kv_events"]
        n = int(snap[rep.url]["events_received"])
        if n > 0:
            rep.add("kv_events", "ok", f"{n} KV events received during the probes")
        else:
            rep.add(
                "kv_events",
                "fail",
                "no KV event arrived during the probes (events off, wrong endpoint or "
                "topic, or no prefix cache)",
                f"start the engine with {VLLM_EVENTS} (SGLang: --kv-events-config with the "
                "same endpoint) and give kvroute the matching --kv-events URL=ENDPOINT",
            )


def _fleet_findings(reports: list[Any]) -> list[Any]:
    from kvroute.fleet.probe import Finding

    out = []
    models = {r.model for r in reports if r.model}
    if len(models) > 1:
        out.append(
            Finding(
                "model",
                "fail",
                f"workers serve different models: {sorted(models)}",
                "a fleet routed as one must serve one model",
            )
        )
    sizes = {r.block_size for r in reports if r.block_size}
    if len(sizes) > 1:
        out.append(
            Finding(
                "block_size",
                "warn",
                f"block sizes differ: {sorted(sizes)} (cache reuse is per block)",
                "start every engine with the same --block-size (SGLang: --page-size)",
            )
        )
    engines = {(r.engine, r.version) for r in reports if r.engine != "unknown"}
    if len(engines) > 1:
        out.append(Finding("engine", "info", f"mixed engines/versions: {sorted(engines)}"))
    return out


def _print(reports: list[Any], fleet: list[Any], failed: bool, stored: list[Any]) -> None:
    fixes: list[str] = []
    for rep in reports:
        what = f"{rep.engine} {rep.version or ''}".strip()
        print(f"{rep.url}  ({what}, model {rep.model})")
        for f in rep.findings:
            print(f"  [{STATUS_MARK[f.status]}] {f.check}: {f.detail}")
            if f.fix and f.status in ("warn", "fail"):
                fixes.append(f"{rep.url}: {f.fix}")
    for title, found in (("fleet", fleet), ("state store", stored)):
        if found:
            print(title)
        for f in found:
            print(f"  [{STATUS_MARK[f.status]}] {f.check}: {f.detail}")
            if f.fix and f.status in ("warn", "fail"):
                fixes.append(f"{title}: {f.fix}")
    print()
    if fixes:
        print("to fix:")
        for line in dict.fromkeys(fixes):
            print(f"  - {line}")
    print("verdict: " + ("something must be fixed before routing" if failed else "ready to route"))
