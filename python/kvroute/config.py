"""Router settings: one validated object built once at start-up.

Names and defaults follow SGLang's router where the meaning is the same
(``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvroute.routing.policies import POLICY_NAMES


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


def normalize_worker_url(url: str) -> str:
    """Validate a worker URL (http/https, host, optional port) and strip a trailing '/'."""
    if not isinstance(url, str) or not url:
        raise ConfigError("worker URL must be a non-empty string")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"worker URL {url!r}: scheme must be http or https")
    if not parts.hostname:
        raise ConfigError(f"worker URL {url!r}: missing host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ConfigError(f"worker URL {url!r}: {e}") from None
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"worker URL {url!r}: no credentials, query or fragment allowed")
    return url.strip().rstrip("/")


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed ``redis://[:password@]host:port/db`` or ``rediss://`` URL."""

    url: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError("--state-store must be redis://[:password@]host:port/db or rediss://")
        if not parts.hostname:
            raise ConfigError("--state-store: missing host")
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ConfigError("--state-store: bad port") from None
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise ConfigError("--state-store: the path must be a database number (/0)")

    @property
    def redacted(self) -> str:
        """The URL with any password replaced (what logs and /status show)."""
        parts = urlsplit(self.url)
        if parts.password is None and parts.username is None:
            return self.url
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        user = parts.username or ""
        return f"{parts.scheme}://{user}:***@{host}{port}{parts.path}"

    def __repr__(self) -> str:
        return f"StoreURL({self.redacted!r})"


@dataclass
class Settings:
    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000
    tokenizer: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int | None = None
    eviction_interval_secs: float = 60.0
    request_timeout_secs: float = 1800.0
    first_byte_timeout_secs: float = 600.0
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
    api_key: str | None = None
    admin_api_key: str | None = None
    worker_api_key: str | None = None
    log_level: str = "info"
    tokenizer_cache_size: int = 8192
    kv_events: list[str] = field(default_factory=list)
    # Router replicas sharing routing state, load and workers (kvroute.fleet.shared).
    state_store: str | None = field(default=None, repr=False)  # may hold a password
    state_store_heartbeat_secs: float = 0.5
    state_store_stream_len: int = 2000

    def validate(self) -> Settings:
        self.worker_urls = [normalize_worker_url(u) for u in self.worker_urls]
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ConfigError("--worker-urls lists the same URL twice")
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
            raise ConfigError(f"--tokenizer {self.tokenizer!r}: no such directory")
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
        if self.bounded_load_factor < 1.0:
            raise ConfigError("--bounded-load-factor must be >= 1.0")
        if self.state_store is not None:
            StoreURL(self.state_store)  # raises ConfigError, never echoing the URL
        if self.state_store_heartbeat_secs <= 0:
            raise ConfigError("--state-store-heartbeat-secs must be > 0")
        if self.state_store_stream_len < 100:
            raise ConfigError("--state-store-stream-len must be >= 100")
        if self.log_level.lower() not in ("debug", "info", "warning", "warn", "error", "critical"):
            raise ConfigError(f"unknown --log-level {self.log_level!r}")
        return self

    @property
    def loopback_only(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")
