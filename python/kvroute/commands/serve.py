"""``kvroute serve``: run the router in front of SGLang or vLLM workers."""

from __future__ import annotations

import argparse
import logging
import sys
from types import FrameType
from typing import TYPE_CHECKING

from kvroute.config import ConfigError, Settings, parse_worker_capacity
from kvroute.routing.policies import POLICY_NAMES

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvroute.service.state import RouterState


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    g = p.add_argument_group("fleet and routing")
    g.add_argument(
        "--worker-urls",
        nargs="*",
        default=[],
        metavar="URL",
        help="base URLs of the workers (http://host:port); more can be added at "
        "run time with POST /workers",
    )
    g.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES, help="routing policy")
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="Hugging Face tokenizer directory (tokenizer.json + "
        "tokenizer_config.json with the chat template), loaded offline. "
        "Without it the router routes on the UTF-8 bytes of the prompt",
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=0.3,
        help="cache_aware: minimum matched-prefix ratio to follow the cache",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=64,
        help="cache_aware: the fleet is imbalanced when max-min in-flight exceeds "
        "this (and the relative threshold)",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="cache_aware: ... and max exceeds this times min",
    )
    g.add_argument(
        "--worker-capacity",
        default="auto",
        metavar="auto|off|N",
        help="cache_aware saturation guard: a cache holder already running as many "
        "requests as it can is passed over, so a hot prefix grows a second home instead "
        "of a queue. auto (default): each worker's capacity is learned from its engine's "
        "/metrics (vLLM/SGLang running and waiting counts, read with each health check) "
        "once it is seen queueing; N: the engines' max running batch, for every worker; "
        "off: SGLang's rule alone",
    )
    g.add_argument(
        "--max-tree-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="cached tokens remembered per worker (mirror the engine's KV capacity); "
        "least recently used prefixes are evicted past it. Default: unbounded",
    )
    g.add_argument(
        "--eviction-interval-secs",
        type=float,
        default=60.0,
        help="accepted for compatibility with SGLang's router; eviction here runs "
        "at insert time, so no periodic sweep is needed",
    )
    g.add_argument(
        "--prefix-hash-tokens",
        type=int,
        default=256,
        help="prefix_hash / consistent_hash: tokens hashed to find the home worker",
    )
    g.add_argument(
        "--bounded-load-factor",
        type=float,
        default=1.25,
        help="prefix_hash / consistent_hash: skip a home worker above this times the mean load",
    )
    g.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="precise mode: route on the engine's own KV cache events. "
        "'WORKER_URL=tcp://host:port[;topic=T][;replay=tcp://...][;bind]', "
        "one per worker (see docs/precise-mode.md)",
    )
    g.add_argument(
        "--state-store",
        default=None,
        metavar="URL",
        help="router replicas share their routing decisions (block digests, never "
        "prompts), their load per worker and the worker list through Redis: "
        "redis://[:password@]host:port/db or rediss:// (TLS). Redis being down or slow "
        "never fails or delays a request: routing falls back to local state "
        "(see docs/several-routers.md)",
    )
    g.add_argument(
        "--state-store-heartbeat-secs",
        type=float,
        default=0.5,
        help="--state-store: how often a router shares its load and reads the others'; "
        "a router silent for 4 heartbeats (at least 2 s) is dropped with its load",
    )
    g.add_argument(
        "--state-store-stream-len",
        type=int,
        default=2000,
        help="--state-store: entries kept in the Redis stream (MAXLEN ~; an entry holds up "
        "to 64 routing decisions, about 1 KB each for a 2,000-token prompt) for routers "
        "that restart or fall behind to catch up from",
    )
    n = p.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on")
    n.add_argument("--port", type=int, default=30000, help="port to listen on")
    n.add_argument(
        "--request-timeout-secs",
        type=float,
        default=1800.0,
        help="longest a request may take end to end",
    )
    n.add_argument(
        "--first-byte-timeout-secs",
        type=float,
        default=600.0,
        help="longest wait for a worker's first response byte before the worker "
        "is marked down and the request retried elsewhere",
    )
    n.add_argument(
        "--connect-timeout-secs",
        type=float,
        default=5.0,
        help="TCP connect timeout towards workers",
    )
    r = p.add_argument_group("reliability")
    r.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="retries on other workers for failures before the first byte",
    )
    r.add_argument(
        "--retry-backoff-secs",
        type=float,
        default=0.0,
        help="base delay between retries (doubles each time)",
    )
    r.add_argument(
        "--health-check-interval-secs",
        type=float,
        default=5.0,
        help="period of active health checks",
    )
    r.add_argument(
        "--health-check-timeout-secs", type=float, default=2.0, help="timeout of one health check"
    )
    r.add_argument("--health-check-endpoint", default="/health", help="path checked")
    r.add_argument(
        "--health-failure-threshold",
        type=int,
        default=2,
        help="consecutive failed checks that take a worker out of rotation",
    )
    r.add_argument(
        "--health-success-threshold",
        type=int,
        default=1,
        help="consecutive good checks that bring it back",
    )
    r.add_argument(
        "--circuit-breaker-failures",
        type=int,
        default=10,
        help="consecutive 5xx answers that open a worker's circuit",
    )
    r.add_argument(
        "--circuit-breaker-cooldown-secs",
        type=float,
        default=10.0,
        help="how long an open circuit keeps the worker out",
    )
    r.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=0,
        help="requests in flight through the router (0 = unlimited)",
    )
    r.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for a slot before 429",
    )
    r.add_argument(
        "--queue-timeout-secs", type=float, default=30.0, help="longest wait for a slot before 429"
    )
    r.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="largest request body accepted (413 past it)",
    )
    r.add_argument(
        "--shutdown-grace-secs",
        type=float,
        default=30.0,
        help="on SIGTERM, time given to in-flight requests to finish",
    )
    s = p.add_argument_group("security and logs")
    s.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer KEY'")
    s.add_argument(
        "--admin-api-key",
        default=None,
        help="key for POST/DELETE /workers and /flush_cache (without it those "
        "are only open when listening on loopback)",
    )
    s.add_argument(
        "--worker-api-key",
        default=None,
        help="Bearer key sent to workers (default: forward the client's "
        "Authorization when no --api-key is set)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    fields = Settings.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["worker_capacity"], values["learn_capacity"] = parse_worker_capacity(
        args.worker_capacity
    )
    return Settings(**values).validate()


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        if settings.kv_events:
            from kvroute.events import KvEventsSpecError, parse_kv_events

            try:
                parse_kv_events(settings.kv_events)
            except KvEventsSpecError as e:
                raise ConfigError(str(e)) from None
    except ConfigError as e:
        print(f"kvroute serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log = logging.getLogger("kvroute")
    from kvroute.service.app import create_app

    app = create_app(settings)
    state = app.state.router
    if state.tokenizer.uses_bytes:
        log.warning(
            "no --tokenizer: routing on the UTF-8 bytes of prompts, not on the "
            "engine's tokens (prefixes still line up; match lengths are in bytes)"
        )
    log.info(
        "kvroute on http://%s:%d, policy %s, %d worker(s)",
        settings.host,
        settings.port,
        settings.policy,
        len(settings.worker_urls),
    )
    serve(app, settings)
    return 0


def serve(app: FastAPI, settings: Settings) -> None:
    """Run uvicorn, telling the app when SIGTERM/SIGINT starts the drain."""
    import uvicorn

    state: RouterState = app.state.router

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level if settings.log_level != "info" else "warning",
        access_log=False,
        # uvicorn hands this to asyncio.wait_for, which takes fractions of a second too.
        timeout_graceful_shutdown=settings.shutdown_grace_secs,  # type: ignore[arg-type]
    )
    DrainingServer(config).run()
