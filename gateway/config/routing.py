"""Public names over weighted variants (aliases), their canary rollouts, and the rule that a routing table's names
point somewhere."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenweir.gateway.config.base import STRICT, plain
from tokenweir.gateway.config.upstreams import PoolConfig


@dataclass
class VariantConfig:
    """One version behind a public model name: the pool that serves it, and its share of the subjects."""

    pool: str
    weight: float = 1.0
    name: str = ""  # what events and metrics call it; default: the pool's name

    __pydantic_config__ = STRICT

    def __post_init__(self) -> None:
        self.name = self.name or self.pool
        if not 0 <= self.weight < 1e12 or not plain(self.name) or len(self.name) > 256:
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

    __pydantic_config__ = STRICT

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

    __pydantic_config__ = STRICT

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
