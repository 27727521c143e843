"""Router settings: one validated object built once at start-up.

Names and defaults follow SGLang's router where the meaning is the same
(``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import parse_qsl, urlsplit

from kvroute.routing.policies import POLICY_NAMES

T = TypeVar("T")

DISCOVERY_MODES = ("static", "dns", "k8s")


class ConfigError(ValueError):
    """A setting is invalid; the message says which and why."""


def parse_worker_capacity(value: str) -> tuple[int | None, bool]:
    """``--worker-capacity`` as (fixed capacity, learn from the engines): ``auto``
    learns, ``off`` disables the guard, ``N`` fixes it for every worker."""
    v = value.strip().lower()
    if v == "auto":
        return None, True
    if v == "off":
        return None, False
    try:
        n = int(v)
    except ValueError:
        raise ConfigError(
            f"--worker-capacity must be 'auto', 'off' or a number >= 1, got {value!r}"
        ) from None
    if n < 1:
        raise ConfigError("--worker-capacity must be >= 1 (or 'off')")
    return n, False


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_WORKER_URL = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://"
    rf"(?P<host>\[[0-9A-Fa-f:.]+\]|{_LABEL}(?:\.{_LABEL})*)"
    r"(?::(?P<port>[0-9]{1,5}))?"
    # RFC 3986 path characters (unreserved, percent-encoded, sub-delims, ':', '@').
    r"(?P<path>(?:/(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})*)*)"
)


def normalize_worker_url(url: str) -> str:
    """A worker URL parsed strictly: ``http(s)://host[:port][/path]`` where host is a
    DNS name, an IPv4 address or a bracketed IPv6 address, and port in 1..65535; no
    credentials, query or fragment. Returns it with scheme and host lower-cased and no
    trailing '/'; raises ConfigError saying what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("worker URL must be a non-empty string")
    shown = repr(url[:200])
    m = _WORKER_URL.fullmatch(url.strip())
    if m is None:
        raise ConfigError(
            f"worker URL {shown} does not parse: expected http(s)://host[:port][/path] "
            "(IPv6 hosts in brackets; no credentials, query or fragment)"
        )
    scheme, host, port = m["scheme"].lower(), m["host"].lower(), m["port"]
    if scheme not in ("http", "https"):
        raise ConfigError(f"worker URL {shown}: scheme must be http or https")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(f"worker URL {shown}: {host} is not an IPv6 address") from None
    elif host.replace(".", "").isdigit():
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(f"worker URL {shown}: {host} is not an IPv4 address") from None
    if port is not None and not 1 <= int(port) <= 65535:
        raise ConfigError(f"worker URL {shown}: port must be in 1..65535")
    netloc = host if port is None else f"{host}:{int(port)}"
    return f"{scheme}://{netloc}{m['path']}".rstrip("/")


def parse_worker_models(spec: str) -> tuple[str, list[str]]:
    """``--worker-models URL=MODEL[,MODEL...]`` as (url, models); ValueError if malformed."""
    url, sep, names = spec.partition("=")
    models = [n.strip() for n in names.split(",") if n.strip()]
    if not sep or not url or not models:
        raise ValueError(
            f"--worker-models {spec!r}: expected URL=MODEL[,MODEL...], e.g. "
            "http://10.0.0.1:8000=qwen3-8b,qwen3-8b-sql-lora"
        )
    return url, models


def parse_model_tokenizers(specs: list[str]) -> dict[str, str]:
    """``--model-tokenizer MODEL=DIR|MODEL_ID`` (repeated) as {model: tokenizer};
    ConfigError for a malformed one, a model named twice, or a tokenizer that is
    neither a directory nor a Hugging Face model ID."""
    from kvroute.routing.tokenizer_files import is_model_id

    out: dict[str, str] = {}
    for spec in specs:
        model, sep, tok = (x.strip() for x in spec.partition("="))
        if not sep or not model or not tok:
            raise ConfigError(
                f"--model-tokenizer {spec!r}: expected MODEL=DIR or MODEL=MODEL_ID, e.g. "
                "llama-3.1-8b=meta-llama/Llama-3.1-8B-Instruct"
            )
        if model in out:
            raise ConfigError(f"--model-tokenizer: model {model!r} is given twice")
        if not os.path.isdir(tok) and not is_model_id(tok):
            raise ConfigError(
                f"--model-tokenizer {spec!r}: {tok!r} is no directory (nor a Hugging Face model ID)"
            )
        out[model] = tok
    return out


def parse_worker_max_running(spec: str) -> tuple[str, int]:
    """``--worker-max-running URL=N`` as (url, N); ValueError if malformed."""
    url, sep, count = spec.rpartition("=")
    try:
        n = int(count.strip())
    except ValueError:
        n = 0
    if not sep or not url or n < 1:
        raise ValueError(
            f"--worker-max-running {spec[:200]!r}: expected URL=N with N >= 1 (the "
            "engine's --max-num-seqs or --max-running-requests), e.g. "
            "http://10.0.0.1:8000=256"
        )
    return url, n


def _by_worker(specs: list[str], parse: Callable[[str], tuple[str, T]]) -> dict[str, T]:
    """Per-worker ``URL=VALUE`` settings by normalized URL (the last one wins);
    ConfigError saying what is wrong."""
    out: dict[str, T] = {}
    for spec in specs:
        try:
            url, value = parse(spec)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        out[normalize_worker_url(url)] = value
    return out


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed ``redis://[:password@]host:port/db``, ``rediss://`` (TLS) or
    ``unix://[:password@]/path/to/redis.sock?db=N`` (a Redis on the router's own host,
    through its Unix socket) URL."""

    url: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme == "redis+sentinel":
            self.sentinel()  # raises ConfigError
            return
        if parts.scheme == "unix":
            if not parts.path or parts.path == "/":
                raise ConfigError(
                    "--state-store: unix:// needs the socket's path "
                    "(unix:///run/redis/redis.sock?db=0)"
                )
            if parts.hostname:
                raise ConfigError(
                    "--state-store: a unix:// URL has no host; the socket's path starts "
                    "with a third slash (unix:///run/redis/redis.sock)"
                )
            db = _query(parts.query).get("db", "0")
            if not db.isdigit():
                raise ConfigError("--state-store: the database must be a number (?db=0)")
            return
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError(
                "--state-store must be redis://[:password@]host:port/db, rediss:// (TLS), "
                "unix:///path/to/redis.sock?db=N or "
                "redis+sentinel://[:password@]host:port[,host:port...]/SERVICE[/db]"
            )
        if not parts.hostname:
            raise ConfigError("--state-store: missing host")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ConfigError("--state-store: bad port") from None
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise ConfigError("--state-store: the path must be a database number (/0)")

    def sentinel(self) -> tuple[list[tuple[str, int]], str, int, str | None]:
        """A ``redis+sentinel://`` URL's (sentinels, service name, db, password): the
        password is the primary's (``?sentinel_password=`` for the sentinels'). Raises
        ConfigError, never echoing the URL."""
        parts = urlsplit(self.url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        sentinels = []
        for item in hosts.split(","):
            host, sep, port = item.strip().rpartition(":")
            if not sep:
                host, port = port, "26379"
            host = host.strip("[]")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    "--state-store: redis+sentinel:// needs host:port of each sentinel, "
                    "comma-separated"
                )
            sentinels.append((host, int(port)))
        path = [x for x in parts.path.split("/") if x]
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ConfigError(
                "--state-store: redis+sentinel:// needs the primary's service name, then "
                "optionally a database number: /mymaster/0"
            )
        password = userinfo.partition(":")[2] if userinfo else None
        return sentinels, path[0], int(path[1]) if len(path) == 2 else 0, password or None

    @property
    def redacted(self) -> str:
        """The URL with any password replaced (what logs and /status show): the user
        part's, and ``?password=`` / ``?sentinel_password=`` (redis-py reads the first
        on any scheme). The hosts stay as written (a sentinel URL lists several)."""
        parts = urlsplit(self.url)
        params = _query(parts.query)
        hidden = [k for k in ("password", "sentinel_password") if k in params]
        userinfo, at, hosts = parts.netloc.rpartition("@")
        if not hidden and not at:
            return self.url
        for key in hidden:
            params[key] = "***"
        query = "&".join(f"{k}={v}" for k, v in params.items()) if hidden else parts.query
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}" if at else hosts
        return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")

    def __repr__(self) -> str:
        return f"StoreURL({self.redacted!r})"


def _query(query: str) -> dict[str, str]:
    """A URL's query parameters, the last value of each."""
    return dict(parse_qsl(query, keep_blank_values=True))


@dataclass
class Settings:
    worker_urls: list[str] = field(default_factory=list)
    # Service discovery (kvroute.fleet.discovery): the fleet follows DNS or Kubernetes.
    service_discovery: str = "static"
    dns_name: str | None = None
    dns_server: str | None = None
    dns_interval_secs: float = 10.0
    selector: str | None = None
    namespace: str | None = None
    worker_port: int | None = None
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000
    tokenizer: str | None = None
    # With ``tokenizer`` a Hugging Face model ID: the branch, tag or commit to read
    # (``resolve_tokenizer``, at start-up).
    tokenizer_revision: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int | None = None
    eviction_interval_secs: float = 60.0
    request_timeout_secs: float = 1800.0
    first_byte_timeout_secs: float = 600.0
    # Failure isolation (kvroute.service.attempts, .quarantine): the first-byte
    # deadline's floor, how long a query of death's copies are refused, and the cap on
    # client connections (0: from the file-descriptor limit at start).
    first_byte_floor_secs: float = 60.0
    quarantine_secs: float = 300.0
    max_connections: int = 0
    connect_timeout_secs: float = 5.0
    max_retries: int = 3
    retry_backoff_secs: float = 0.0
    health_check_interval_secs: float = 5.0
    health_check_timeout_secs: float = 2.0
    health_check_endpoint: str = "/health"
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    circuit_breaker_failures: int = 10
    circuit_breaker_cooldown_secs: float = 10.0
    failure_cooldown_secs: float = 5.0
    max_concurrent_requests: int = 0  # 0 = unlimited
    max_queued_requests: int = 1024
    queue_timeout_secs: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    shutdown_grace_secs: float = 30.0
    prefix_hash_tokens: int = 256
    bounded_load_factor: float = 1.25
    # Saturation guard: a fixed capacity for every worker, else (learn_capacity) each
    # worker's capacity learned from its engine's running/waiting counts.
    worker_capacity: int | None = None
    learn_capacity: bool = True
    # Capacities the operator states per worker (``URL=N``), where the engine does not
    # report its own (vLLM's max_num_seqs); on auto, the other workers' as before.
    worker_max_running: list[str] = field(default_factory=list)
    # Work-aware routing (kvroute.routing.load): cache_aware's "least loaded" by
    # predicted wait ("work") or by in-flight requests ("requests"); min_ttft's softmax.
    load_metric: str = "work"
    router_temperature: float = 0.0
    api_key: str | None = None
    admin_api_key: str | None = None
    worker_api_key: str | None = None
    log_level: str = "info"
    log_format: str = "text"  # text | json
    access_log: bool = True
    tokenizer_cache_size: int = 8192
    # Route on the known start of a prompt when the rest cannot change the decision
    # (kvroute.routing.decide_first; cache_aware with --load-metric requests only).
    decide_first: bool = False
    kv_events: list[str] = field(default_factory=list)
    # Models: what a request without ``model`` (SGLang /generate) asks for, and workers'
    # models set by the operator (``URL=MODEL[,MODEL...]``) instead of read from them.
    default_model: str | None = None
    worker_models: list[str] = field(default_factory=list)
    # ``MODEL=DIR|MODEL_ID``: the tokenizer of each model that is not ``tokenizer``'s
    # (a fleet serving several base models; an adapter takes its base model's).
    model_tokenizer: list[str] = field(default_factory=list)
    # --record: the routed traffic as a rotated Mooncake-format trace (service.recorder).
    record: str | None = None
    record_max_bytes: int = 100 * 2**20
    record_max_files: int = 5
    # Untrusted requests (docs/security.md): request chat templates, render bounds,
    # token-ID prompts, index memory, connection limits, run-time worker URLs.
    trust_request_chat_template: bool = False
    chat_template_timeout_secs: float = 2.0
    tokenizer_cache_bytes: int = 64 * 1024 * 1024
    token_id_prompts: bool = False
    tree_size_fallback: int = 4_000_000
    max_total_tree_size: int = 64_000_000
    max_header_bytes: int = 64 * 1024
    header_timeout_secs: float = 10.0
    body_timeout_secs: float = 30.0
    keep_alive_timeout_secs: float = 5.0
    worker_url_allow: list[str] = field(default_factory=list)
    # HTTPS for the router's own listener (and client certificates, with a CA).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    # Router replicas sharing routing state, load and workers (kvroute.fleet.shared).
    state_store: str | None = field(default=None, repr=False)  # may hold a password
    state_store_heartbeat_secs: float = 0.5
    state_store_stream_len: int = 2000

    def validate(self) -> Settings:
        self.worker_urls = [normalize_worker_url(u) for u in self.worker_urls]
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ConfigError("--worker-urls lists the same URL twice")
        self._validate_discovery()
        if self.policy not in POLICY_NAMES:
            raise ConfigError(
                f"unknown policy {self.policy!r}; choose one of: {', '.join(POLICY_NAMES)}"
            )
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ConfigError("--balance-abs-threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ConfigError("--balance-rel-threshold must be >= 1.0")
        if self.max_tree_size is not None and self.max_tree_size <= 0:
            raise ConfigError("--max-tree-size must be a positive number of tokens per worker")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            # A Hugging Face model ID is found (or downloaded) at start-up
            # (``resolve_tokenizer``); anything else names a directory that is not there.
            from kvroute.routing.tokenizer_files import is_model_id

            if not is_model_id(self.tokenizer):
                raise ConfigError(
                    f"--tokenizer {self.tokenizer!r}: no such directory (nor a Hugging Face "
                    "model ID)"
                )
        elif self.tokenizer is not None and not os.access(self.tokenizer, os.R_OK | os.X_OK):
            raise ConfigError(f"--tokenizer {self.tokenizer!r}: directory not readable")
        if self.tokenizer_revision is not None and self.tokenizer is None:
            raise ConfigError("--tokenizer-revision needs --tokenizer MODEL_ID")
        for name in (
            "request_timeout_secs",
            "first_byte_timeout_secs",
            "connect_timeout_secs",
            "health_check_interval_secs",
            "health_check_timeout_secs",
            "queue_timeout_secs",
            "eviction_interval_secs",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.first_byte_floor_secs <= 0:
            raise ConfigError("--first-byte-floor-secs must be > 0")
        if self.quarantine_secs < 0:
            raise ConfigError("--quarantine-secs must be >= 0 (0 turns quarantine off)")
        if self.max_connections < 0:
            raise ConfigError("--max-connections must be >= 0 (0: from the fd limit)")
        if self.failure_cooldown_secs < 0:
            raise ConfigError("--failure-cooldown-secs must be >= 0")
        if self.shutdown_grace_secs < 0:
            raise ConfigError("--shutdown-grace-secs must be >= 0")
        if self.max_retries < 0:
            raise ConfigError("--max-retries must be >= 0")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ConfigError("health check thresholds must be >= 1")
        if not self.health_check_endpoint.startswith("/"):
            raise ConfigError("--health-check-endpoint must start with '/'")
        if self.max_concurrent_requests < 0 or self.max_queued_requests < 0:
            raise ConfigError("--max-concurrent-requests and --max-queued-requests must be >= 0")
        if self.max_body_bytes < 1024:
            raise ConfigError("--max-body-bytes must be at least 1024")
        if self.prefix_hash_tokens < 1:
            raise ConfigError("--prefix-hash-tokens must be >= 1")
        if self.worker_capacity is not None and self.worker_capacity < 1:
            raise ConfigError("--worker-capacity must be >= 1")
        if self.load_metric not in ("work", "requests"):
            raise ConfigError(f"--load-metric must be work or requests, got {self.load_metric!r}")
        if not 0.0 <= self.router_temperature < float("inf"):
            raise ConfigError("--router-temperature must be a number of seconds >= 0")
        if self.bounded_load_factor < 1.0:
            raise ConfigError("--bounded-load-factor must be >= 1.0")
        fixed = _by_worker(self.worker_models, parse_worker_models)
        self.worker_models = [f"{u}={','.join(m)}" for u, m in fixed.items()]
        stated = _by_worker(self.worker_max_running, parse_worker_max_running)
        self.worker_max_running = [f"{u}={n}" for u, n in stated.items()]
        if stated and not (self.learn_capacity and self.worker_capacity is None):
            raise ConfigError(
                "--worker-max-running needs --worker-capacity auto (the default): a fixed "
                "capacity or 'off' applies to every worker"
            )
        if self.default_model is not None and not self.default_model.strip():
            raise ConfigError("--default-model must not be empty")
        parse_model_tokenizers(self.model_tokenizer)
        if (
            self.kv_events
            and self.tokenizer is None
            and not self.model_tokenizer
            and not self.token_id_prompts
        ):
            raise ConfigError(
                "--kv-events needs --tokenizer: the engines' KV events carry token IDs, "
                "so prompts must be tokenized as the engine does (or pass "
                "--token-id-prompts if clients send prompts as token IDs)"
            )
        if self.chat_template_timeout_secs <= 0:
            raise ConfigError("--chat-template-timeout-secs must be > 0")
        if self.tokenizer_cache_bytes < 0 or self.tokenizer_cache_size < 0:
            raise ConfigError("--tokenizer-cache-bytes and --tokenizer-cache-size must be >= 0")
        if self.tree_size_fallback < 1 or self.max_total_tree_size < 1:
            raise ConfigError("--tree-size-fallback and --max-total-tree-size must be >= 1")
        if self.max_header_bytes < 1024:
            raise ConfigError("--max-header-bytes must be at least 1024")
        for name in ("header_timeout_secs", "body_timeout_secs", "keep_alive_timeout_secs"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.state_store is not None:
            StoreURL(self.state_store)  # raises ConfigError, never echoing the URL
        if self.state_store_heartbeat_secs <= 0:
            raise ConfigError("--state-store-heartbeat-secs must be > 0")
        if self.state_store_stream_len < 100:
            raise ConfigError("--state-store-stream-len must be >= 100")
        if self.log_level.lower() not in ("debug", "info", "warning", "warn", "error", "critical"):
            raise ConfigError(f"unknown --log-level {self.log_level!r}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"--log-format must be 'text' or 'json', got {self.log_format!r}")
        if self.record is not None:
            if self.record_max_bytes < 4096 or self.record_max_files < 1:
                raise ConfigError("--record-max-bytes must be >= 4096, --record-max-files >= 1")
            folder = os.path.dirname(os.path.abspath(self.record))
            if not os.path.isdir(folder):
                raise ConfigError(f"--record {self.record!r}: no such directory {folder!r}")
        return self

    def _validate_discovery(self) -> None:
        mode = self.service_discovery
        if mode not in DISCOVERY_MODES:
            raise ConfigError(
                f"unknown --service-discovery {mode!r}; choose one of: {', '.join(DISCOVERY_MODES)}"
            )
        if self.worker_port is not None and not 0 < self.worker_port < 65536:
            raise ConfigError(f"--worker-port must be in 1..65535, got {self.worker_port}")
        if self.dns_interval_secs <= 0:
            raise ConfigError("--dns-interval-secs must be > 0")
        if self.dns_server is not None:
            host, _, port = self.dns_server.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dns-server must be HOST:PORT, got {self.dns_server!r}")
        if mode == "dns":
            if not self.dns_name:
                raise ConfigError("--service-discovery dns needs --dns-name")
            if self.worker_port is None and not self.dns_name.startswith("_"):
                raise ConfigError(
                    "--service-discovery dns needs --worker-port (or an SRV name, '_...')"
                )
        if mode == "k8s":
            if not self.selector or "=" not in self.selector:
                raise ConfigError("--service-discovery k8s needs --selector KEY=VALUE[,...]")
            if self.worker_port is None:
                raise ConfigError("--service-discovery k8s needs --worker-port")

    @property
    def loopback_only(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")


# Secrets: each of these may come from its flag, from a file (``--api-key-file``) or from
# an environment variable; the flag wins, then the file, then the variable.
SECRETS = {
    "api_key": "KVROUTE_API_KEY",
    "admin_api_key": "KVROUTE_ADMIN_API_KEY",
    "worker_api_key": "KVROUTE_WORKER_API_KEY",
}


def resolve_secret(
    name: str, value: str | None, path: str | None, environ: dict[str, str] | None = None
) -> str | None:
    """One secret from its flag value, file or environment variable (see SECRETS).
    Raises ConfigError, never with the secret in the message."""
    flag = "--" + name.replace("_", "-")
    if value is not None and path is not None:
        raise ConfigError(f"give {flag} or {flag}-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise ConfigError(f"{flag}-file {path!r}: cannot read it ({reason})") from None
        if not value:
            raise ConfigError(f"{flag}-file {path!r} is empty")
        return value
    if value is not None:
        if not value.strip():
            raise ConfigError(f"{flag} is empty")
        return value
    env = os.environ if environ is None else environ
    from_env = env.get(SECRETS[name], "").strip()
    return from_env or None
