"""``kvroute serve``: run the router in front of SGLang or vLLM workers."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from types import FrameType
from typing import TYPE_CHECKING

from kvroute.config import (
    DISCOVERY_MODES,
    SECRETS,
    ConfigError,
    Settings,
    parse_worker_capacity,
    resolve_secret,
)
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
    d = p.add_argument_group("service discovery")
    d.add_argument(
        "--service-discovery",
        default="static",
        choices=DISCOVERY_MODES,
        help="where the fleet comes from besides --worker-urls: 'dns' re-resolves "
        "--dns-name, 'k8s' watches the EndpointSlices matching --selector. Workers that "
        "appear join; workers that vanish drain (in-flight requests finish) and leave",
    )
    d.add_argument(
        "--dns-name",
        default=None,
        metavar="NAME",
        help="dns: name whose A/AAAA records are the workers (a headless Service); "
        "a name starting with '_' is looked up as SRV (targets and ports)",
    )
    d.add_argument(
        "--dns-interval-secs",
        type=float,
        default=10.0,
        help="dns: how often the name is resolved again",
    )
    d.add_argument(
        "--dns-server",
        default=None,
        metavar="HOST:PORT",
        help="dns: ask this server instead of the system's resolvers",
    )
    d.add_argument(
        "--selector",
        default=None,
        metavar="KEY=VALUE[,...]",
        help="k8s: label selector of the EndpointSlices to watch (a Service's labels are "
        "copied to its slices; kubernetes.io/service-name=NAME picks one Service)",
    )
    d.add_argument(
        "--namespace",
        default=None,
        help="k8s: namespace to watch (default: the pod's own, else the kubeconfig "
        "context's, else 'default')",
    )
    d.add_argument(
        "--worker-port",
        type=int,
        default=None,
        metavar="PORT",
        help="dns/k8s: the workers' HTTP port (worker URL = http://ADDRESS:PORT)",
    )
    g.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES, help="routing policy")
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|MODEL_ID",
        help="the model's tokenizer, as the engines load it: a Hugging Face tokenizer "
        "directory (tokenizer.json + tokenizer_config.json with the chat template), or "
        "a model ID (Qwen/Qwen3-8B) found in the local Hugging Face cache (HF_HUB_CACHE, "
        "HF_HOME), else its tokenizer files alone downloaded there unless HF_HUB_OFFLINE "
        "is set. Without it the router routes on the UTF-8 bytes of the prompt",
    )
    g.add_argument(
        "--model-tokenizer",
        action="append",
        default=[],
        metavar="MODEL=DIR|MODEL_ID",
        help="the tokenizer of one model of a fleet serving several base models (the "
        "request's model field; an adapter takes its base model's), found as --tokenizer "
        "is; repeat per model. Models not named use --tokenizer (or UTF-8 bytes)",
    )
    g.add_argument(
        "--tokenizer-revision",
        default=None,
        metavar="REV",
        help="with a model ID: the branch, tag or commit to use (default: main), as the "
        "engines' own tokenizer revision",
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
        "of a queue. auto (default): each worker's capacity as its engine reports it "
        "(SGLang's /get_server_info, read at its first health check), else learned from "
        "its /metrics (vLLM/SGLang running and waiting counts, read with each health "
        "check) once it is seen queueing; N: the engines' max running batch, for every "
        "worker; off: SGLang's rule alone",
    )
    g.add_argument(
        "--worker-max-running",
        action="append",
        default=[],
        metavar="URL=N",
        help="a worker's capacity as its engine is configured (vLLM --max-num-seqs, "
        "SGLang --max-running-requests), for fleets whose workers differ in it: vLLM "
        "does not publish it, and a larger worker not yet seen queueing is otherwise "
        "taken for the size learned on the others; repeat per worker. With "
        "--worker-capacity auto",
    )
    g.add_argument(
        "--load-metric",
        default="work",
        choices=("work", "requests"),
        help="cache_aware: what 'least loaded' means when it picks a worker on a miss, "
        "on an imbalanced fleet, among equal matches and for the saturation guard. work "
        "(default): the least predicted time to first token for this request (queued "
        "prefill tokens and its own uncached tokens over each worker's learned prefill "
        "speed, plus the wait for a slot); requests: the fewest requests in flight "
        "(SGLang's rule exactly). The imbalance thresholds count requests either way",
    )
    g.add_argument(
        "--router-temperature",
        type=float,
        default=0.0,
        metavar="SECS",
        help="min_ttft: 0 (default) picks the worker of least predicted TTFT; T > 0 "
        "samples one with probability proportional to exp(-(TTFT - best) / T)",
    )
    g.add_argument(
        "--max-tree-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="cached tokens remembered per worker; least recently used prefixes are "
        "evicted past it. Default: each worker's KV capacity as its engine reports it "
        "(else --tree-size-fallback)",
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
        metavar="URL=ENDPOINT|auto",
        help="precise mode: route on the engine's own KV cache events. "
        "'WORKER_URL=tcp://host:port[;topic=T][;replay=tcp://...][;bind]', "
        "one per worker, or 'auto': every worker, static or discovered, where its "
        "engine says it publishes them (vLLM's GET /kv_event_sources, SGLang's "
        "kv_events_config), explicit values winning (see docs/precise-mode.md)",
    )
    m = p.add_argument_group("models and adapters")
    m.add_argument(
        "--default-model",
        default=None,
        metavar="NAME",
        help="the model of requests that name none (SGLang's /generate): they go to the "
        "workers serving it. Default: any worker. Set it when the fleet serves several "
        "models",
    )
    m.add_argument(
        "--worker-models",
        action="append",
        default=[],
        metavar="URL=MODEL[,MODEL...]",
        help="the models (base model and LoRA adapters) a worker serves, instead of "
        "reading its GET /v1/models at start and after each health check; repeat per "
        "worker. A worker whose models are unknown takes requests for any model",
    )
    g.add_argument(
        "--state-store",
        default=None,
        metavar="URL",
        help="router replicas share their routing decisions (block digests, never "
        "prompts), their load per worker and the worker list through Redis: "
        "redis://[:password@]host:port/db, rediss:// (TLS), "
        "unix://[:password@]/path/to/redis.sock?db=N (a Redis on this host), or "
        "redis+sentinel://[:password@]host:port[,host:port...]/SERVICE[/db] (the "
        "primary the sentinels name, followed across failovers). Redis "
        "being down or slow never fails or delays a request: routing falls back to "
        "local state (see docs/several-routers.md)",
    )
    g.add_argument(
        "--state-store-heartbeat-secs",
        type=float,
        default=0.5,
        help="--state-store: how often a router shares its load and reads the others'; "
        "a router silent for 4 heartbeats (at least 2 s) is dropped with its load; a "
        "load change no later change took along is written by the next heartbeat",
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
        "--ssl-certfile",
        default=None,
        metavar="PEM",
        help="serve HTTPS with this certificate (chain), PEM; the key in it or in "
        "--ssl-keyfile. Without it the router speaks plain HTTP (behind a TLS proxy)",
    )
    n.add_argument(
        "--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key, PEM"
    )
    n.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="PEM",
        help="with --ssl-certfile: clients must present a certificate signed by one of "
        "these CAs (mutual TLS)",
    )
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
        help="cap on the wait for a worker's first response byte, after which the worker "
        "is marked down and the request retried elsewhere; the deadline of each request is "
        "derived from its prompt size (see --first-byte-floor-secs) and never longer",
    )
    n.add_argument(
        "--first-byte-floor-secs",
        type=float,
        default=60.0,
        help="least time a request waits for a worker's first byte (unless the cap "
        "--first-byte-timeout-secs is lower): its deadline is this plus the prompt at a "
        "slow prefill rate (100 tokens/s), plus its output at 2 tokens/s when not "
        "streamed, at most the cap (docs/failure-semantics.md)",
    )
    n.add_argument(
        "--max-connections",
        type=int,
        default=0,
        help="client connections served at once; past it new requests get a 503 "
        "(0: half the open-file limit, which is raised to its hard maximum at start)",
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
        "--quarantine-secs",
        type=float,
        default=300.0,
        help="a request that broke the connection to two workers gets a 502 and its copies "
        "(same prompt tokens) are refused this long (0: off)",
    )
    r.add_argument(
        "--failure-cooldown-secs",
        type=float,
        default=5.0,
        help="a worker that failed a request (connection refused, reset) sits out at "
        "least this long, even if its health endpoint still answers",
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
    rec = p.add_argument_group("recording (kvroute analyze / simulate --trace replay it)")
    rec.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="write the routed traffic to FILE as a Mooncake-format trace: per request "
        "the time, prompt and output lengths and chained hashes of its 512-token "
        "blocks (never text or token IDs); written by a background thread, never "
        "delaying a request (dropped and counted in kvroute_record_dropped_total when "
        "it falls behind)",
    )
    rec.add_argument(
        "--record-max-bytes",
        type=int,
        default=100 * 2**20,
        help="rotate FILE past this size: FILE becomes FILE.1, FILE.1 FILE.2, ...",
    )
    rec.add_argument(
        "--record-max-files",
        type=int,
        default=5,
        help="files kept in all, FILE included (the oldest is deleted)",
    )
    s = p.add_argument_group("security and logs")
    s.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' (also from --api-key-file "
        "or KVROUTE_API_KEY, which keep it out of the process list)",
    )
    s.add_argument(
        "--admin-api-key",
        default=None,
        help="key for POST/DELETE /workers and /flush_cache (also from "
        "--admin-api-key-file or KVROUTE_ADMIN_API_KEY). Without it they take the "
        "--api-key when one is set, else are open on loopback only",
    )
    s.add_argument(
        "--worker-api-key",
        default=None,
        help="Bearer key sent to workers (also from --worker-api-key-file or "
        "KVROUTE_WORKER_API_KEY; default: forward the client's Authorization when no "
        "--api-key is set)",
    )
    for name in ("api-key", "admin-api-key", "worker-api-key"):
        s.add_argument(
            f"--{name}-file",
            default=None,
            metavar="PATH",
            help=f"read --{name} from this file (surrounding whitespace stripped)",
        )
    u = p.add_argument_group("untrusted requests (docs/security.md)")
    u.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template (and any chat_template_kwargs) from requests, as "
        "vLLM's flag of the same name; without it such requests get 400 and only "
        "enable_thinking, thinking and reasoning_effort may be set. Every render is "
        "sandboxed and bounded either way",
    )
    u.add_argument(
        "--chat-template-timeout-secs",
        type=float,
        default=2.0,
        help="longest a chat template render may take (400 past it); renders run off "
        "the event loop, also bounded in steps and output size by the body's size",
    )
    u.add_argument(
        "--token-id-prompts",
        action="store_true",
        help="clients send prompts as the engines' token IDs (input_ids, token-list "
        "prompts), or the engines' tokens are the prompts' UTF-8 bytes (kvroute "
        "sim-worker without --tokenizer): lets --kv-events run without --tokenizer",
    )
    u.add_argument(
        "--tokenizer-cache-size",
        type=int,
        default=8192,
        help="entries of the tokenizer's segment cache (pieces of text between special "
        "tokens, with their IDs)",
    )
    u.add_argument(
        "--decide-first",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="route a prompt on its known start (segment-cached text and the first "
        "words of the new text) when the rest provably cannot change the decision, and "
        "encode the rest after forwarding; applies to cache_aware with --load-metric "
        "requests, without --kv-events or --state-store (elsewhere the exact length "
        "matters), with the fast BPE; decisions are identical either way "
        "(docs/tokenization.md)",
    )
    u.add_argument(
        "--tokenizer-cache-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="memory bound of the tokenizer's segment cache (text and IDs)",
    )
    u.add_argument(
        "--tree-size-fallback",
        type=int,
        default=4_000_000,
        metavar="TOKENS",
        help="index budget of a worker whose engine reports no KV capacity (vLLM "
        "cache_config_info, SGLang max_total_num_tokens). Routing on bytes, every "
        "budget counts 4 bytes per token until the answers' usage shows how many",
    )
    u.add_argument(
        "--max-total-tree-size",
        type=int,
        default=64_000_000,
        metavar="ENTRIES",
        help="process-wide cap of the index (all workers; ~5.3 bytes each): a worker's "
        "budget is at most its equal share",
    )
    u.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        help="request line + headers larger than this get 431",
    )
    u.add_argument(
        "--header-timeout-secs",
        type=float,
        default=10.0,
        help="a request's headers must arrive within this (408 / close past it)",
    )
    u.add_argument(
        "--body-timeout-secs",
        type=float,
        default=30.0,
        help="longest pause in a request body still expected (408 past it)",
    )
    u.add_argument(
        "--keep-alive-timeout-secs",
        type=float,
        default=5.0,
        help="idle client connections are closed after this",
    )
    u.add_argument(
        "--worker-url-allow",
        action="append",
        default=[],
        metavar="CIDR|HOSTGLOB",
        help="workers added at run time (POST /workers) must match one of these "
        "(10.0.0.0/8, *.svc.cluster.local); without any, all but link-local addresses "
        "(169.254.169.254, the cloud metadata service) are accepted",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level",
    )
    s.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text: one readable line per record; json: one JSON object per line "
        "(timestamp, level, logger, message and the record's fields), for log "
        "collectors. uvicorn's own records use the same format",
    )
    s.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one info line per request: request ID, method, route, status, worker, "
        "prompt tokens, time to first byte and latency (never bodies or keys); "
        "health checks and metric scrapes are not logged",
    )

    c = p.add_argument_group("config file and environment")
    c.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML (.toml) or YAML (.yaml) file of settings, keys named as these flags "
        "('worker-urls = [...]'); every flag can also come from KVROUTE_<FLAG_NAME> "
        "(KVROUTE_WORKER_URLS, KVROUTE_CONFIG). Precedence: flag > environment > file > "
        "default",
    )
    c.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings (as a config file, secrets masked) and exit",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    fields = Settings.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["worker_capacity"], values["learn_capacity"] = parse_worker_capacity(
        args.worker_capacity
    )
    for name in SECRETS:
        values[name] = resolve_secret(name, values.get(name), getattr(args, f"{name}_file", None))
    return Settings(**values).validate()


def check_settings(settings: Settings) -> None:
    """Start-up checks that need more than the settings themselves. Raises ConfigError."""
    if settings.kv_events:
        from kvroute.events import KvEventsSpecError, parse_kv_events
        from kvroute.events.auto import explicit

        try:
            parse_kv_events(explicit(settings.kv_events))
        except KvEventsSpecError as e:
            raise ConfigError(str(e)) from None
    from kvroute.fleet.urls import parse_allow_pattern

    for pattern in settings.worker_url_allow:
        try:
            parse_allow_pattern(pattern)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    listener_tls(settings)


def listener_tls(settings: Settings) -> ssl.SSLContext | None:
    """The listener's TLS context (None: plain HTTP), built at start-up so that a missing
    file, a key that does not match its certificate or a bad CA file is one line and
    exit status 2 rather than a traceback when uvicorn starts. Raises ConfigError."""
    cert, key, ca = settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs
    if cert is None:
        if key is not None or ca is not None:
            raise ConfigError("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as e:
        raise ConfigError(f"--ssl-certfile/--ssl-keyfile: no such file {e.filename!r}") from None
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(
            f"--ssl-certfile {cert!r}: cannot load the certificate and its key ({e})"
        ) from None
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=ca)
        except FileNotFoundError:
            raise ConfigError(f"--ssl-ca-certs {ca!r}: no such file") from None
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ssl-ca-certs {ca!r}: not a CA bundle ({e})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def build_app(settings: Settings) -> FastAPI:
    """The app, with a bad tokenizer directory or chat template as a ConfigError."""
    from kvroute.routing.tokenizer_files import TokenizerLoadError
    from kvroute.service.app import create_app

    try:
        return create_app(settings)
    except TokenizerLoadError as e:
        raise ConfigError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    # Every bad setting is one line on stderr and exit status 2, never a traceback.
    from kvroute.commands.config_file import Layered, command_argv

    layered = None
    try:
        layered = Layered(configure, args, command_argv(sys.argv[1:]), dict(os.environ))
        args = layered.namespace(args)
        settings = settings_from_args(args)
        check_settings(settings)
    except ConfigError as e:
        message = layered.blame(str(e)) if layered is not None else str(e)
        print(f"kvroute serve: error: {message}", file=sys.stderr)
        return 2
    if args.print_config:
        print(layered.describe(), end="")
        return 0
    from kvroute.commands._logs import setup_logging

    setup_logging(settings.log_level, settings.log_format)
    log = logging.getLogger("kvroute")
    try:
        app = build_app(settings)
    except ConfigError as e:
        print(f"kvroute serve: error: {e}", file=sys.stderr)
        return 2
    from kvroute.service.limits import default_max_connections, raise_open_file_limit

    open_files = raise_open_file_limit()
    if not settings.max_connections:
        settings.max_connections = default_max_connections(open_files)
    log.info(
        "open-file limit %d; up to %d client connections (--max-connections)",
        open_files,
        settings.max_connections,
    )
    state = app.state.router
    if state.tokenizer.uses_bytes and state.tokenizers:
        log.info(
            "models without --model-tokenizer (%s have one) route on the UTF-8 bytes of prompts",
            ", ".join(sorted(state.tokenizers)),
        )
    elif state.tokenizer.uses_bytes:
        log.warning(
            "no --tokenizer: routing on the UTF-8 bytes of prompts, not on the "
            "engine's tokens (prefixes still line up; match lengths are in bytes)"
        )
    log.info(
        "kvroute on %s://%s:%d, policy %s, %d worker(s), discovery %s",
        "https" if settings.ssl_certfile else "http",
        settings.host,
        settings.port,
        settings.policy,
        len(settings.worker_urls),
        settings.service_discovery,
    )
    serve(app, settings)
    return 0


def serve(app: FastAPI, settings: Settings) -> None:
    """Run uvicorn, telling the app when SIGTERM/SIGINT starts the drain."""
    import uvicorn

    from kvroute.commands._logs import uvicorn_log_config
    from kvroute.service.connections import guarded_protocol
    from kvroute.service.limits import install_busy_answer

    state: RouterState = app.state.router
    install_busy_answer()

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=guarded_protocol(
            settings.max_header_bytes, settings.header_timeout_secs, settings.body_timeout_secs
        ),
        timeout_keep_alive=settings.keep_alive_timeout_secs,  # type: ignore[arg-type]
        # uvicorn's records go through the handler set up above (same format); its own
        # access log stays off, the router writes a richer one (service/accesslog.py).
        log_config=uvicorn_log_config(settings.log_level),
        access_log=False,
        limit_concurrency=settings.max_connections or None,
        # uvicorn hands this to asyncio.wait_for, which takes fractions of a second too.
        timeout_graceful_shutdown=settings.shutdown_grace_secs,  # type: ignore[arg-type]
        # HTTPS (the scheme requests see); the context is ``listener_tls``'s, below.
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
    tls = listener_tls(settings)
    if tls is not None:
        load = config.load

        def load_with_tls() -> None:
            load()
            # Python's server defaults (TLS 1.2 and up, its ciphers) and the client
            # certificate check, rather than uvicorn's own context.
            config.ssl = tls

        config.load = load_with_tls  # type: ignore[method-assign]
    DrainingServer(config).run()
