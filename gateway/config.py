"""Gateway configuration: dataclasses loaded from YAML or TOML, then overridden by `TOKENWEIR_*` env vars.

Env names follow the field path: `TOKENWEIR_PORT=9000`, `TOKENWEIR_STORE_URL=...`,
`TOKENWEIR_TIMEOUTS__TTFT_S=30` (double underscore steps into a nested section). Lists and whole sections are
JSON: `TOKENWEIR_ENGINE__EXTRA_ARGS='["--max-num-seqs","8"]'`, `TOKENWEIR_POOLS='[{"model": "m", "upstreams":
[{"base_url": "http://h:8100", "engine": false}]}]'`. One-upstream shortcut: `TOKENWEIR_UPSTREAM_URL`
(+ `TOKENWEIR_UPSTREAM_MODEL`, and `TOKENWEIR_UPSTREAM_TOKENIZER`: a GGUF path or "default" for exact counts).

Strict both ways: an unknown key in the file, or a `TOKENWEIR_*` env var that names no setting (and is not one of
`OTHER_ENV`, nor a member's key, TOKENWEIR_MEMBER_KEY_*), is an error naming it and the closest valid name; a boolean
is one of true/false/1/0/yes/no/on/off.
"""

from __future__ import annotations

import difflib
import hashlib
import ipaddress
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import TypeVar

import orjson
import yaml

from tokenweir.common.engine_flags import API_KEY_ENV, KV_TRANSFER_KEY_ENV
from tokenweir.common.http.door_limits import HttpLimits
from tokenweir.common.tracing import EXPORTERS, exporter_error
from tokenweir.policies.pricing import Prices, price_error
from tokenweir.policies.routing import RouteParams

T = TypeVar("T")
ENV_PREFIX = "TOKENWEIR_"
CACHE_SCOPES = ("team", "key", "shared")  # PoolConfig.cache_scope
# TOKENWEIR_* variables read elsewhere, not settings (TOKENWEIR_TEST_* belong to the test suite).
OTHER_ENV = frozenset(
    {
        "TOKENWEIR_UPSTREAM_URL",  # the one-upstream shortcut, below
        "TOKENWEIR_UPSTREAM_MODEL",
        "TOKENWEIR_UPSTREAM_TOKENIZER",
        "TOKENWEIR_KEY_PEPPER",  # gateway/store/store.py
        "TOKENWEIR_ADMIN_KEY",  # gateway/process/bootstrap.py
        "TOKENWEIR_ATTENTION_BACKEND",  # the engine
        "TOKENWEIR_ENGINE_API_KEY",  # the engine's --api-key (engine/flags.py)
        KV_TRANSFER_KEY_ENV,  # the key serve's engines sign KV transfers with (one given to serve is used)
    }
)
# The env variables a member's `api_key_env` may name: the gateway sends that variable's value to the member's
# address, so never one of its own secrets (its admin key, its store's password). Those named with this prefix, the
# engines' key (TOKENWEIR_ENGINE_API_KEY), and those the config lists in `api_key_envs` (member_key_env_error).
MEMBER_KEY_PREFIX = "TOKENWEIR_MEMBER_KEY_"
_TRUE = ("true", "1", "yes", "on")
_STRICT = {"extra": "forbid"}  # pydantic's config for the sections the admin API reads (pools, aliases)
_FOREVER_S = 10 * 86400.0  # a timeout or backoff longer than this is a mistake
_FALSE = ("false", "0", "no", "off")


@dataclass
class UpstreamConfig:
    """One instance of a pool: our engine or any OpenAI-compatible server."""

    base_url: str
    # What metrics, events, logs and tenants' errors call it; never its address in a tenant's error (a tenant must
    # not learn where the upstreams live). Empty: its pool names it `<model>-<position>`.
    name: str = ""
    # Sent as 'Authorization: Bearer <api_key>' on every call: requests, /abort, /load and /v1/models polls.
    api_key: str | None = field(default=None, repr=False)
    # Or the name of an env variable that holds it (read at load_config), to keep the key out of the config file:
    # TOKENWEIR_MEMBER_KEY_<NAME>, TOKENWEIR_ENGINE_API_KEY, or one listed in the gateway's `api_key_envs`.
    api_key_env: str | None = None
    model: str | None = None  # the upstream's own model name, if it differs from the pool's public name
    engine: bool = True  # ours: poll /load, ask for continuous usage, POST /abort on cancel
    # Disaggregated prefill (our engines): a "prefill" member computes prompts (an engine with --kv-transfer-config
    # kv_producer), a "decode" member fetches their KV and streams (kv_consumer); "both", an ordinary member. A pool
    # with prefill members sends each chat or completion to one of them first, then to a decode member.
    role: str = "both"
    # The model version it serves, for events (`model_revision`) and the model_info metric; unset, our engine's
    # model-file digest (its /load says it).
    revision: str | None = None
    # Requests it serves at once, counted across every gateway replica (leases in the shared state, which lapse when
    # the replica holding them dies); a full member is passed over for the next hop in the plan, and when every
    # member is full the request waits (up to the queue timeout); a mirror to a full shadow member is dropped. A
    # prefill member's short hops are not counted. None: unbounded (LiteLLM's name for it).
    max_parallel_requests: int | None = None
    # Draining: it takes no new requests; those it serves finish (then remove it: DELETE /admin/pools/.../members/..)
    draining: bool = False
    # Discovery: base_url's host is a DNS name for many instances (a Kubernetes headless Service), resolved every
    # `discovery.interval_s`. Each address is a member of its own, `<name>-<address>` (metrics and events carry the
    # address; tenants' errors only the name), at base_url with the address for the host; it takes requests once its
    # /load (engines) or /health answers. An address that vanishes drains, then leaves after `discovery.drain_s`.
    # The admin API drains or removes it as one member, by its own name. (https: the certificate must name the
    # addresses.)
    discover: bool = False

    # The admin API reads this class from JSON (pydantic): unknown keys are refused there as in the file.
    __pydantic_config__ = _STRICT

    def __post_init__(self) -> None:
        who = f"upstream {self.name or self.base_url}"
        if not self.base_url.startswith(("http://", "https://")) or not _plain(self.base_url + self.name):
            raise ValueError(f"{who}: base_url is an http:// or https:// URL; names are plain text")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"{who}: role is both, prefill or decode, got {self.role!r}")
        if self.max_parallel_requests is not None and self.max_parallel_requests < 1:
            raise ValueError(f"{who}: max_parallel_requests >= 1 (or null: unbounded)")
        if self.role != "both" and not self.engine:
            raise ValueError(f"{who}: only our engines take the prefill and decode roles")
        # With or without the /v1 suffix: the gateway appends /v1/... paths itself.
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1").rstrip("/")


@dataclass
class PoolConfig:
    """A public model name served by a set of instances, with fallback models tried after them."""

    model: str
    upstreams: list[UpstreamConfig] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    # Pools with a longer context, tried in order for a prompt that does not fit this pool's (instead of a 400
    # context_length_exceeded): the first whose context fits it serves the request (LiteLLM's name).
    context_window_fallbacks: list[str] = field(default_factory=list)
    # Shadow traffic: this fraction of the pool's chats and completions is also sent to the pool `shadow_pool` once
    # answered, non-stream, asking at most the output tokens the request was billed (gateway/request/shadow.py), at
    # priority 2 (batch); never waited on, never failing or slowing the request; at most SHADOWS_IN_FLIGHT at once per
    # shadow pool per process; billed to no team: its usage and latency go to the tokenweir_gateway_shadow_* metrics.
    shadow_pool: str | None = None
    shadow_fraction: float = 0.0
    tokenizer: str | None = None  # the served model's GGUF ("default": the bundled SmolLM2): exact; else estimate
    max_context: int | None = None  # prompt + max_tokens must fit
    capacity: int = 64  # requests dispatched to the pool at once; the rest wait in its priority queue
    max_queued: int = 1024
    ttft_timeout_s: float | None = None
    total_timeout_s: float | None = None
    # When every hop of the plan failed before its first byte (connection refused, 5xx, 429), go through the plan
    # again up to `retries` times, waiting retry_backoff_s, then twice that, ... (with jitter) within the request's
    # deadline. A hop that failed was never relayed to the client, and an engine's partial work is billed as made.
    retries: int = 0
    retry_backoff_s: float = 0.25
    # External pools: a non-text content part (image, audio, file) is reserved at this many tokens, an upper
    # bound settled to the upstream's usage. Our engines take text only and refuse other parts with a 400.
    non_text_part_tokens: int = 2048
    # Which instance serves a request (policies/routing.py): "prefix" (where its prompt prefix is cached, under a
    # bound on load; needs `tokenizer` for the token ids, else least loaded), "least_loaded", "round_robin".
    # None: "prefix" for a pool of our engines, "least_loaded" (least in flight) for external members.
    route: str | None = None
    route_load_epsilon: float = 0.25  # bounded load: no prefix affinity above (1 + eps) x the mean load
    route_min_bound: int = 6  # ... nor above this many requests (below it an engine's batch has room)
    route_max_waiting: int = 8  # nor for an engine whose queue is longer
    # The prefix score's exchange rates, in prefill tokens a cache hit saves: one request of load costs
    # route_load_cost_tokens, a full KV pool (about to evict) route_kv_cost_tokens.
    route_load_cost_tokens: float = 32.0
    route_kv_cost_tokens: float = 64.0
    prefix_index_entries: int = 100_000  # block hashes this replica remembers for the pool (LRU)
    # Prices in USD per 1M tokens (None: unpriced, costs 0): events carry `cost`, spend budgets count it.
    # Cached prompt tokens cost price_cached_per_1m (None: the input price).
    price_input_per_1m: float | None = None
    price_output_per_1m: float | None = None
    price_cached_per_1m: float | None = None
    # Whether the pool serves /v1/embeddings. None: yes for a pool of external members only (our engine has none).
    embeddings: bool | None = None
    # Whose requests share the upstreams' prefix caches (gateway/request/cache_scope.py: the cache_salt each chat and
    # completion is sent with): "team" (a team's own), "key" (an API key's own), "shared" (no salt: everyone's).
    cache_scope: str = "team"

    __pydantic_config__ = _STRICT

    @property
    def disaggregated(self) -> bool:
        return any(u.role == "prefill" for u in self.upstreams)

    def __post_init__(self) -> None:
        if not 0 < len(self.model) <= 256 or not _plain(self.model):
            raise ValueError(f"pool {self.model!r}: model is 1-256 characters of plain text")
        if self.capacity < 1 or self.max_queued < 0 or self.non_text_part_tokens < 0:
            raise ValueError(f"pool {self.model}: capacity >= 1, max_queued >= 0, non_text_part_tokens >= 0")
        if any(t is not None and not 0 < t < _FOREVER_S for t in (self.ttft_timeout_s, self.total_timeout_s)):
            raise ValueError(f"pool {self.model}: timeouts are seconds > 0")
        if (self.max_context is not None and self.max_context < 1) or not 0 < self.retry_backoff_s < _FOREVER_S:
            raise ValueError(f"pool {self.model}: max_context >= 1 and 0 < retry_backoff_s")
        for i, upstream in enumerate(self.upstreams):
            upstream.name = upstream.name or f"{self.model}-{i}"
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"pool {self.model}: upstream names must differ within a pool, got {names}")
        if self.disaggregated and all(u.role == "prefill" for u in self.upstreams):
            raise ValueError(f"pool {self.model}: prefill members need a decode (or both) member to stream from")
        if not 0 <= self.shadow_fraction <= 1:
            raise ValueError(f"pool {self.model}: shadow_fraction must be in [0, 1]")
        if self.retries < 0 or self.retry_backoff_s <= 0:
            raise ValueError(f"pool {self.model}: retries must be >= 0 and retry_backoff_s > 0")
        try:
            self.route_params()
        except ValueError as e:
            raise ValueError(f"pool {self.model}: {e}") from None
        for name in ("price_input_per_1m", "price_output_per_1m", "price_cached_per_1m"):
            value = getattr(self, name)
            if value is not None and (error := price_error(value)) is not None:
                raise ValueError(f"pool {self.model}: {name}: {error}")
        if self.prefix_index_entries < 1:
            raise ValueError(f"pool {self.model}: prefix_index_entries >= 1")
        if self.cache_scope not in CACHE_SCOPES:
            raise ValueError(f"pool {self.model}: cache_scope must be one of {', '.join(CACHE_SCOPES)}")

    def route_params(self, block_size: int = 16) -> RouteParams:
        """The routing policy's parameters (validated there) for a pool whose engines cache blocks of `block_size`."""
        return RouteParams(
            strategy=self.strategy,
            block_size=block_size,
            load_cost_tokens=self.route_load_cost_tokens,
            kv_cost_tokens=self.route_kv_cost_tokens,
            load_epsilon=self.route_load_epsilon,
            min_bound=self.route_min_bound,
            max_waiting=self.route_max_waiting,
        )

    @property
    def prices(self) -> Prices | None:
        """The pool's prices, None when it has none (its requests cost nothing against spend budgets)."""
        if self.price_input_per_1m is None and self.price_output_per_1m is None:
            return None
        return Prices(self.price_input_per_1m or 0.0, self.price_output_per_1m or 0.0, self.price_cached_per_1m)

    @property
    def strategy(self) -> str:
        if self.route is not None:
            return self.route
        return "prefix" if self.upstreams and all(u.engine for u in self.upstreams) else "least_loaded"


@dataclass
class StateConfig:
    """The shared state backend (Redis): its connection pool, and what to do while it is unreachable."""

    # state_url names one node of a Redis Cluster (any: the others are found from it). Each team's keys share one hash
    # slot, so every script runs on one primary; MOVED / ASK are followed, and a failover answers as an unreachable
    # state (below) until the replica is promoted. Each node has a pool of max_connections, which raises at once
    # when full (the request path does not use it).
    cluster: bool = False
    max_connections: int = 256  # the pool blocks up to pool_timeout_s for a free connection, never raises at once
    pool_timeout_s: float = 2.0
    timeout_s: float = 2.0  # connect and per-command socket timeout
    # fail_closed: 503 state_unavailable + Retry-After; fail_open: admit under this replica's own limits and
    # write the spend to Redis when it returns.
    on_unavailable: str = "fail_closed"
    retry_after_s: int = 2
    # how often each replica checks that Redis still holds its data (an epoch marker); a loss is repaired within
    # about twice this (gateway.state.repair)
    watch_s: float = 1.0
    # How long a replica that died holds on: its concurrency leases lapse lease_s after it stopped renewing them
    # (every lease_s / 3), its budget holds hold_s after they were taken. A hold must outlive the longest request
    # (else a running request's hold is given back early): null is timeouts.queue_s + timeouts.total_s + 60 s, at
    # least 900 s.
    lease_s: float = 60.0
    hold_s: float | None = None

    def __post_init__(self) -> None:
        if self.watch_s <= 0:
            raise ValueError(f"state.watch_s: expected a number of seconds > 0, got {self.watch_s!r}")
        if self.lease_s <= 0 or (self.hold_s is not None and self.hold_s <= 0):
            raise ValueError("state: lease_s > 0 and hold_s > 0 (or null)")
        if self.on_unavailable not in ("fail_closed", "fail_open"):
            raise ValueError(f"state.on_unavailable: expected fail_closed or fail_open, got {self.on_unavailable!r}")
        if self.max_connections < 1 or self.pool_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("state: max_connections >= 1, pool_timeout_s > 0 and timeout_s > 0")


@dataclass
class TimeoutConfig:
    queue_s: float = 30.0
    ttft_s: float = 60.0
    total_s: float = 600.0
    connect_s: float = 5.0


@dataclass
class BreakerConfig:
    failures: int = 3  # consecutive failures that open an instance's circuit
    cooldown_s: float = 10.0  # then one half-open probe is let through


@dataclass
class DiscoveryConfig:
    """How the members marked `discover` find their addresses: their host name resolved every `interval_s` (a
    Kubernetes headless Service's name gives one address per ready pod). A failed resolution, or an answer with no
    address, keeps the addresses known before (logged once): a DNS hiccup never empties a pool. Until its name first
    resolves, such a member is one instance at its name (the connection resolves it)."""

    interval_s: float = 5.0
    # DNS servers asked directly (dnspython), as IP:port or IP (port 53), [IPv6]:port; the name is queried as
    # written (fully qualified: no search domains). Empty: the system's resolver (getaddrinfo: /etc/hosts, and
    # resolv.conf's search domains, as a pod resolves `engine.<namespace>.svc.cluster.local`).
    nameservers: list[str] = field(default_factory=list)
    timeout_s: float = 2.0  # one resolution of one name
    drain_s: float = 30.0  # a vanished address drains this long (no new requests), then leaves the routing table

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < _FOREVER_S or not 0 < self.timeout_s < _FOREVER_S:
            raise ValueError("discovery: interval_s and timeout_s are seconds > 0")
        if not 0 <= self.drain_s < _FOREVER_S:
            raise ValueError("discovery: drain_s is seconds >= 0")
        for server in self.nameservers:
            nameserver_address(server)

    def nameserver_addresses(self) -> list[tuple[str, int]]:
        return [nameserver_address(s) for s in self.nameservers]


def nameserver_address(text: str) -> tuple[str, int]:
    """`IP`, `IP:port` or `[IPv6]:port` as (IP, port); a ValueError naming it otherwise."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest or "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        address, number = ipaddress.ip_address(host), int(port)
    except ValueError:
        address, number = None, 0
    if address is None or not 0 < number < 65536:
        raise ValueError(f"discovery.nameservers: expected IP, IP:port or [IPv6]:port, got {text!r}")
    return str(address), number


@dataclass
class EventsConfig:
    path: str = "./data/events.jsonl"
    max_bytes: int = 64 * 1024 * 1024
    backups: int = 5
    flush_interval_s: float = 0.5  # lines are written at once; this is how often they are fsynced
    # Whose events these are, for the usage watermark (default host:absolute path): unique per gateway process.
    writer_id: str | None = None


@dataclass
class TracingConfig:
    """OpenTelemetry traces of admitted requests (gateway/request/tracing.py), continuing a W3C `traceparent` the
    client sent and passing one to each upstream hop; the trace id goes into the request's event. Off: tokenweir
    imports nothing of opentelemetry."""

    enabled: bool = False
    service_name: str = "tokenweir-gateway"
    # none: spans made (trace ids in events) but not exported; console: printed; otlp: OTLP/HTTP to `endpoint`
    # (needs the opentelemetry-exporter-otlp-proto-http package; null endpoint: the OTEL_EXPORTER_OTLP_* env)
    exporter: str = "none"
    endpoint: str | None = None

    def __post_init__(self) -> None:
        # The name is checked always; the exporter's package when tracing is on, at load: a missing one stops the
        # start with one line (the OTLP exporter is an optional package)
        checked = self.enabled or self.exporter not in EXPORTERS
        if checked and (error := exporter_error(self.exporter)) is not None:
            raise ValueError(f"tracing: {error}")


@dataclass
class BundledEngineConfig:
    """The bundled engine that `tokenweir serve` starts as a child process."""

    enabled: bool = True
    port: int = 8100
    model_path: str | None = None  # GGUF; default: the bundled SmolLM2
    model_name: str = "smollm2-135m"
    startup_timeout_s: float = 300.0
    extra_args: list[str] = field(default_factory=list)
    # replicas > 1: that many engine children on consecutive free ports from `port`, one pool (route: `route`),
    # each restarted with doubling backoff when it exits (`tokenweir serve --engines N`). 1: one child, as before.
    replicas: int = 1
    # Shared out between the replicas (each gets its part); None: the engine's own default per engine, except
    # that replicas > 1 split the machine's CPUs (num_threads = max(1, cpus // replicas) each).
    num_threads: int | None = None  # torch CPU threads in all
    kv_cache_memory: str | None = None  # KV cache bytes in all (CPU), e.g. "1GiB"
    gpu_memory_utilization: float | None = None  # on CUDA, the GPU's share in all (None: the engine's 0.85)
    restart_backoff_s: float = 0.5  # first wait before a restart; doubles while a replica keeps dying young
    restart_max_backoff_s: float = 30.0
    restart_stable_s: float = 30.0  # a replica that ran this long starts over from restart_backoff_s
    # The bundled pool's route strategy (PoolConfig.route): prefix, least_loaded or round_robin; None: prefix.
    route: str | None = None
    cache_scope: str = "team"  # the bundled pool's PoolConfig.cache_scope: team, key or shared
    # Disaggregated prefill (`serve --prefill-engines M`): the first M replicas compute prompts (kv_producer, the
    # pool's prefill members), the others fetch their KV and decode (kv_consumer). 0: every replica does both.
    prefill_replicas: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or (self.num_threads is not None and self.num_threads < 1):
            raise ValueError("engine: replicas >= 1 and num_threads >= 1")
        if not 0 <= self.prefill_replicas < self.replicas and self.prefill_replicas:
            raise ValueError("engine: prefill_replicas leaves at least one of the replicas to decode")
        if self.route is not None and self.route not in ("prefix", "least_loaded", "round_robin"):
            raise ValueError(f"engine.route: expected prefix, least_loaded or round_robin, got {self.route!r}")
        if not 0 < self.restart_backoff_s <= self.restart_max_backoff_s:
            raise ValueError("engine: 0 < restart_backoff_s <= restart_max_backoff_s")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("engine: 0 < gpu_memory_utilization <= 1")

    def role(self, index: int) -> str:
        """The pool role of replica `index`."""
        if not self.prefill_replicas:
            return "both"
        return "prefill" if index < self.prefill_replicas else "decode"


@dataclass
class VariantConfig:
    """One version behind a public model name: the pool that serves it, and its share of the subjects."""

    pool: str
    weight: float = 1.0
    name: str = ""  # what events and metrics call it; default: the pool's name

    __pydantic_config__ = _STRICT

    def __post_init__(self) -> None:
        self.name = self.name or self.pool
        if not 0 <= self.weight < 1e12 or not _plain(self.name) or len(self.name) > 256:
            raise ValueError(f"variant {self.name}: weight must be >= 0; name plain text of up to 256 characters")


@dataclass
class RolloutConfig:
    """A canary rollout of an alias's variant: its share of the subjects (percent) steps up through `steps`, each
    held at least `step_s` seconds, while over the last `window_s` seconds (with at least `min_requests` of each)
    its error rate stays within `max_error_rate_delta` of the baseline variant's and its TTFT p95 and TPOT p95
    within `max_ttft_p95_ratio` / `max_tpot_p95_ratio` times the baseline's (a p95 that far above is a breach only
    when it is also `min_ttft_p95_delta_ms` / `min_tpot_p95_delta_ms` above it). A step waits until latency can be
    judged: 20 latencies of each in the window (policies/canary.py MIN_LATENCY_SAMPLES), even with a smaller
    `min_requests`. A breach, or a canary with no healthy member that failed a request, sets its weight to 0 on
    every replica (rolled back); passing the last step promotes it (100%). The baseline gets what the canary does
    not, and serves a canary's request the canary's pool (and its fallbacks) could not."""

    canary: str  # variant names
    baseline: str
    steps: list[float] = field(default_factory=lambda: [5.0, 25.0, 50.0, 100.0])
    step_s: float = 300.0
    window_s: float = 120.0
    min_requests: int = 20
    max_error_rate_delta: float = 0.05
    max_ttft_p95_ratio: float = 1.5
    max_tpot_p95_ratio: float = 1.5
    min_ttft_p95_delta_ms: float = 50.0  # two fast upstreams' p95s differ by a few ms of noise: no breach
    min_tpot_p95_delta_ms: float = 2.0

    __pydantic_config__ = _STRICT

    def __post_init__(self) -> None:
        if not self.steps or any(not 0 <= s <= 100 for s in self.steps) or sorted(self.steps) != self.steps:
            raise ValueError("rollout.steps: canary shares in percent, 0-100, in increasing order")
        if self.step_s <= 0 or self.window_s <= 0 or self.min_requests < 1:
            raise ValueError("rollout: step_s > 0, window_s > 0, min_requests >= 1")
        if self.max_error_rate_delta < 0 or self.max_ttft_p95_ratio < 1 or self.max_tpot_p95_ratio < 1:
            raise ValueError("rollout: max_error_rate_delta >= 0, max_ttft_p95_ratio >= 1, max_tpot_p95_ratio >= 1")
        if self.min_ttft_p95_delta_ms < 0 or self.min_tpot_p95_delta_ms < 0:
            raise ValueError("rollout: min_ttft_p95_delta_ms >= 0, min_tpot_p95_delta_ms >= 0")


@dataclass
class AliasConfig:
    """A public model name served by weighted variants (A/B tests, canaries), each a pool. A request's variant is
    sticky per `sticky` subject: "key" (the API key), "user" (the request's `user` field, else the key), or
    "header:NAME" (that request header's value, else the key). The header `x-tokenweir-variant: NAME` picks a
    variant outright, for a key the admin allows to (`may_pick_variant`; testing one, a dark one included); a
    rollout does not judge the requests it picks (gateway/request/variant_choice.py)."""

    model: str
    variants: list[VariantConfig] = field(default_factory=list)
    sticky: str = "key"
    rollout: RolloutConfig | None = None  # a canary stepped up or rolled back by its indicators

    __pydantic_config__ = _STRICT

    def __post_init__(self) -> None:
        if not self.variants or sum(v.weight for v in self.variants) <= 0:
            raise ValueError(f"alias {self.model}: needs variants with a positive total weight")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"alias {self.model}: variant names must differ, got {names}")
        if self.sticky not in ("key", "user") and not (self.sticky.startswith("header:") and len(self.sticky) > 7):
            raise ValueError(f"alias {self.model}: sticky is key, user or header:NAME, got {self.sticky!r}")
        r = self.rollout
        if r is not None and (r.canary not in names or r.baseline not in names or r.canary == r.baseline):
            raise ValueError(f"alias {self.model}: rollout.canary and rollout.baseline name two of its variants")

    def variant(self, name: str) -> VariantConfig:
        return next(v for v in self.variants if v.name == name)


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

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers: at least 1")
        for name in self.api_key_envs:
            if not _ENV_NAME.fullmatch(name) or name.startswith(ENV_PREFIX):
                raise ValueError(
                    f"api_key_envs: {name!r} is not an env variable a member's key may be read from (letters, digits "
                    f"and _, not a gateway's own {ENV_PREFIX}* name: name a key {MEMBER_KEY_PREFIX}<NAME> instead)"
                )
        for pool in self.pools:
            for upstream in pool.upstreams:
                if upstream.api_key_env and (error := member_key_env_error(upstream.api_key_env, self.api_key_envs)):
                    raise ValueError(f"pool {pool.model}, upstream {upstream.name}: {error}")
        if not 0 <= self.prefix_index_sync_s < _FOREVER_S:
            raise ValueError(f"prefix_index_sync_s: seconds >= 0 (0: off), got {self.prefix_index_sync_s!r}")
        if (error := routes_error(self.pools, self.aliases)) is not None:
            raise ValueError(error)

    def pool(self, model: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.model == model), None)


def _plain(text: str) -> bool:
    """No control characters (names end up in logs, metric labels and a database that refuses NUL)."""
    return not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def member_key_env_error(name: str, listed: list[str]) -> str | None:
    """Why a member's api_key_env may not name `name` (the gateway would send that variable's value to the member's
    address: its own admin key, its store's password), or None: names with MEMBER_KEY_PREFIX, the engines' key, and
    those `listed` (the config's api_key_envs) are members' keys."""
    if (name.startswith(MEMBER_KEY_PREFIX) and len(name) > len(MEMBER_KEY_PREFIX)) or name in (API_KEY_ENV, *listed):
        return None
    return (
        f"api_key_env {name} is not a member's key: it must be named {MEMBER_KEY_PREFIX}<NAME> or {API_KEY_ENV} (the "
        f"engines' key), or be listed in the gateway config's api_key_envs (to allow {name}, add it there)"
    )


def routes_error(pools: list[PoolConfig], aliases: list[AliasConfig]) -> str | None:
    """What makes these pools and aliases no routing table (a name that points nowhere, one name twice), or None."""
    names = [p.model for p in pools]
    if len(set(names)) != len(names):
        return f"pools: two pools share a name: {names}"
    known = set(names)
    for p in pools:
        refs = [*p.fallbacks, *p.context_window_fallbacks, *([p.shadow_pool] if p.shadow_pool else [])]
        if missing := [m for m in refs if m not in known]:
            return f"pool {p.model}: fallbacks or shadow_pool name pools that are not configured: {missing}"
    for alias in aliases:
        if alias.model in known:
            return f"alias {alias.model}: a pool has that name"
        if missing := [v.pool for v in alias.variants if v.pool not in known]:
            return f"alias {alias.model}: variants name pools that are not configured: {missing}"
    if len({a.model for a in aliases}) != len(aliases):
        return "aliases: two aliases share a name"
    return None


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """File (YAML by default, TOML by suffix) then env overrides; a missing path means defaults + env."""
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        data = tomllib.loads(text) if str(path).endswith(".toml") else (yaml.safe_load(text) or {})
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    env = os.environ if env is None else env
    _merge_env(data, env)
    config = _build(GatewayConfig, data, "")
    _resolve_api_keys(config, env)
    if env.get("TOKENWEIR_UPSTREAM_URL"):
        model = env.get("TOKENWEIR_UPSTREAM_MODEL", "default")
        config.pools = [p for p in config.pools if p.model != model]
        upstream = UpstreamConfig(env["TOKENWEIR_UPSTREAM_URL"])
        config.pools.append(
            PoolConfig(model=model, upstreams=[upstream], tokenizer=env.get("TOKENWEIR_UPSTREAM_TOKENIZER"))
        )
    return config


def _resolve_api_keys(config: GatewayConfig, env) -> None:
    """Upstreams' `api_key_env`: the key from that variable, now, so a missing one stops the start, not a request."""
    for pool in config.pools:
        for upstream in pool.upstreams:
            if upstream.api_key_env and not upstream.api_key:
                upstream.api_key = env.get(upstream.api_key_env) or None
                if upstream.api_key is None:
                    raise ValueError(
                        f"pool {pool.model}, upstream {upstream.name}: api_key_env names {upstream.api_key_env}, "
                        "which is not set (or empty) in the env"
                    )


def env_names(cls=GatewayConfig, prefix: str = ENV_PREFIX) -> dict[str, type]:
    """Every settable env name -> its field type: each field, and each field of a nested section."""
    names = {}
    for name, tp in typing.get_type_hints(cls).items():
        names[prefix + name.upper()] = tp
        if is_dataclass(tp):
            names.update(env_names(tp, f"{prefix}{name.upper()}__"))
    return names


def _merge_env(data: dict, env) -> None:
    """Env overrides into the file's data, coerced here so that errors name the variable."""
    names = env_names()
    for key, raw in sorted(env.items()):
        if not key.startswith(ENV_PREFIX) or key in OTHER_ENV or key.startswith(("TOKENWEIR_TEST_", MEMBER_KEY_PREFIX)):
            continue
        if key not in names:
            close = difflib.get_close_matches(key, [*names, *OTHER_ENV], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(f"unknown setting in env: {key}{hint}")
        tp = names[key]
        inner = _unwrap(tp)
        if raw == "" and inner is not tp:  # Optional: empty means None
            value = None
        elif is_dataclass(inner) or typing.get_origin(inner) is list:
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{key}: expected JSON ({e})") from e
        else:
            value = raw
        *sections, last = key[len(ENV_PREFIX) :].lower().split("__")
        target = data
        for part in sections:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[last] = _coerce(tp, value, key)


def _unwrap(tp):
    """T from T | None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def parse_section(cls: type[T], data: dict, where: str = "") -> T:
    """`data` (a mapping from YAML, TOML or JSON) as the config section `cls`, as strictly as the file is read:
    an unknown key or a value of the wrong type is a ValueError naming it (prefixed by `where`)."""
    return _build(cls, data, where)


def _build(cls, data: dict, where: str):
    known = {f.name: f for f in fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        hints = []
        for k in sorted(unknown, key=str):
            close = difflib.get_close_matches(str(k), list(known), n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"unknown config key(s) {', '.join(hints)} in {where or 'top level'}")
    field_types = typing.get_type_hints(cls)
    kwargs = {name: _coerce(field_types[name], value, f"{where}{name}") for name, value in data.items()}
    return cls(**kwargs)


def _coerce(tp, value, where: str):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None:
            return None
        tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and is_dataclass(tp):  # a section (a type hint here, never an instance)
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping")
        return _build(tp, value, where + ".")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list")
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool and isinstance(value, str):
        word = value.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{where}: expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")
        return word in _TRUE
    if tp in (int, float, str) and not isinstance(value, tp):
        try:
            return tp(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}") from e
    return value


def config_digest(config: GatewayConfig) -> str:
    """A short fingerprint of a configuration (every setting, secrets included: only their hash shows), for the
    config_info metric: two processes with one digest run the same settings."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:12]
