"""The pools: each a public model name served by its members (our engines or any OpenAI-compatible server), and
the timeouts and circuit breaker of the calls to them."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenweir.common.text.tool_prompt import TOOL_CALL_FORMATS
from tokenweir.gateway.config.base import CACHE_SCOPES, FAIRNESS, FOREVER_S, STRICT, plain
from tokenweir.policies.pricing import Prices, price_error
from tokenweir.policies.routing import RouteParams


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
    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        who = f"upstream {self.name or self.base_url}"
        if not self.base_url.startswith(("http://", "https://")) or not plain(self.base_url + self.name):
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
    # With `tokenizer`: the format the engines show tools in where the chat template does not (their
    # --tool-call-parser), so the exact count renders a chat with tools as they will
    tool_call_parser: str = "hermes"
    max_context: int | None = None  # prompt + max_tokens must fit
    capacity: int = 64  # requests dispatched to the pool at once; the rest wait in its priority queue
    max_queued: int = 1024
    # How the queue shares the pool between the teams of a priority band (gateway/request/queue.py): "tokens", by
    # the weighted tokens each has been served (prompt + output_token_weight x output: VTC), or "requests", by the
    # requests each has dispatched
    fairness: str = "tokens"
    output_token_weight: float = 2.0
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
    # External members that serve OpenAI's /v1/responses themselves: a /v1/responses request is passed to them as
    # the client sent it (its earlier turns, kept here, written into its input; stored here, not there), billed from
    # the usage of its response. False: it is translated into a chat (our engines serve no /v1/responses).
    serves_responses: bool = False

    __pydantic_config__ = STRICT

    @property
    def disaggregated(self) -> bool:
        return any(u.role == "prefill" for u in self.upstreams)

    def __post_init__(self) -> None:
        self._check_sizes()
        for i, upstream in enumerate(self.upstreams):
            upstream.name = upstream.name or f"{self.model}-{i}"
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"pool {self.model}: upstream names must differ within a pool, got {names}")
        if self.disaggregated and all(u.role == "prefill" for u in self.upstreams):
            raise ValueError(f"pool {self.model}: prefill members need a decode (or both) member to stream from")
        self._check_policies()

    def _check_sizes(self) -> None:
        if not 0 < len(self.model) <= 256 or not plain(self.model):
            raise ValueError(f"pool {self.model!r}: model is 1-256 characters of plain text")
        if self.capacity < 1 or self.max_queued < 0 or self.non_text_part_tokens < 0:
            raise ValueError(f"pool {self.model}: capacity >= 1, max_queued >= 0, non_text_part_tokens >= 0")
        if any(t is not None and not 0 < t < FOREVER_S for t in (self.ttft_timeout_s, self.total_timeout_s)):
            raise ValueError(f"pool {self.model}: timeouts are seconds > 0")
        if (self.max_context is not None and self.max_context < 1) or not 0 < self.retry_backoff_s < FOREVER_S:
            raise ValueError(f"pool {self.model}: max_context >= 1 and 0 < retry_backoff_s")

    def _check_policies(self) -> None:
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
        if self.serves_responses and any(u.engine for u in self.upstreams):
            raise ValueError(f"pool {self.model}: serves_responses is for external members (engine: false) only")
        if self.tool_call_parser not in (*TOOL_CALL_FORMATS, "none"):
            choices = ", ".join((*TOOL_CALL_FORMATS, "none"))
            raise ValueError(f"pool {self.model}: tool_call_parser must be one of {choices}")
        if self.cache_scope not in CACHE_SCOPES:
            raise ValueError(f"pool {self.model}: cache_scope must be one of {', '.join(CACHE_SCOPES)}")
        if self.fairness not in FAIRNESS or not 0 <= self.output_token_weight <= 100:
            choices = ", ".join(FAIRNESS)
            raise ValueError(f"pool {self.model}: fairness is one of {choices}, and 0 <= output_token_weight <= 100")

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
class TimeoutConfig:
    queue_s: float = 30.0
    ttft_s: float = 60.0
    total_s: float = 600.0
    connect_s: float = 5.0

    __pydantic_config__ = STRICT


@dataclass
class BreakerConfig:
    failures: int = 3  # consecutive failures that open an instance's circuit
    cooldown_s: float = 10.0  # then one half-open probe is let through

    __pydantic_config__ = STRICT
