"""The whole configuration (`GatewayConfig`, the file's top level) and its fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from tokenweir.common.http.door_limits import HttpLimits
from tokenweir.gateway.config.base import (
    ENV_NAME,
    ENV_PREFIX,
    FOREVER_S,
    MEMBER_KEY_PREFIX,
    STRICT,
    member_key_env_error,
)
from tokenweir.gateway.config.batches import BatchesConfig
from tokenweir.gateway.config.discovery import DiscoveryConfig
from tokenweir.gateway.config.engine import BundledEngineConfig
from tokenweir.gateway.config.observability import EventsConfig, TracingConfig
from tokenweir.gateway.config.routing import AliasConfig, routes_error
from tokenweir.gateway.config.state import StateConfig
from tokenweir.gateway.config.upstreams import BreakerConfig, PoolConfig, TimeoutConfig


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Gateway processes on `port` (`serve --workers N`); N > 1 needs state_url (limits shared through Redis).
    workers: int = 1
    store_url: str = "sqlite:///./data/tokenweir.db"
    state_url: str | None = None  # redis://host:6379/0: limits shared by several gateway replicas; None: in-process
    state: StateConfig = field(default_factory=StateConfig)
    pools: list[PoolConfig] = field(default_factory=list)
    aliases: list[AliasConfig] = field(default_factory=list)  # public names over weighted variants (pools)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)  # members found by DNS (`discover: true`)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # OpenTelemetry; off by default
    batches: BatchesConfig = field(default_factory=BatchesConfig)  # /v1/files and /v1/batches (OpenAI batch jobs)
    engine: BundledEngineConfig = field(default_factory=BundledEngineConfig)
    # The gateway's HTTP server, per connection: head size, field count and deadline, body pauses, idle
    # keep-alive, open connections per process (common/http/door_limits.py).
    http: HttpLimits = field(default_factory=HttpLimits)
    default_max_tokens: int = 1024  # when neither the request nor the team's cap says
    max_body_bytes: int = 4 * 1024 * 1024
    load_poll_interval_s: float = 1.0
    # How often each replica checks the store for pools and aliases changed through the admin API (or a rollout)
    routing_poll_interval_s: float = 1.0
    # With state_url: how often each replica shares the prompt prefixes it sent to each engine with the other replicas
    # (and learns theirs) through Redis, so all of them route a team to the engine holding its prefix. 0: off.
    prefix_index_sync_s: float = 0.2
    auth_cache_ttl_s: float = 1.0
    usage_flush_interval_s: float = 2.0
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long, then are cut (and billed)
    log_level: str = "info"
    access_log: bool = False
    # /metrics lists team ids and budgets: when set, a scrape needs `Authorization: Bearer <metrics_token>`.
    metrics_token: str | None = None
    # Env variables a member's api_key_env may name besides TOKENWEIR_MEMBER_KEY_* and TOKENWEIR_ENGINE_API_KEY
    # (e.g. [OPENAI_API_KEY]): the gateway sends their values to members' addresses. Never a TOKENWEIR_* name.
    api_key_envs: list[str] = field(default_factory=list)

    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers: at least 1")
        for name in self.api_key_envs:
            if not ENV_NAME.fullmatch(name) or name.startswith(ENV_PREFIX):
                raise ValueError(
                    f"api_key_envs: {name!r} is not an env variable a member's key may be read from (letters, digits "
                    f"and _, not a gateway's own {ENV_PREFIX}* name: name a key {MEMBER_KEY_PREFIX}<NAME> instead)"
                )
        for pool in self.pools:
            for upstream in pool.upstreams:
                if upstream.api_key_env and (error := member_key_env_error(upstream.api_key_env, self.api_key_envs)):
                    raise ValueError(f"pool {pool.model}, upstream {upstream.name}: {error}")
        if not 0 <= self.prefix_index_sync_s < FOREVER_S:
            raise ValueError(f"prefix_index_sync_s: seconds >= 0 (0: off), got {self.prefix_index_sync_s!r}")
        if (error := routes_error(self.pools, self.aliases)) is not None:
            raise ValueError(error)

    def pool(self, model: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.model == model), None)


def config_digest(config: GatewayConfig) -> str:
    """A short fingerprint of a configuration (every setting, secrets included: only their hash shows), for the
    config_info metric: two processes with one digest run the same settings."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:12]
