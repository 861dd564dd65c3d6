"""Which instance of a pool serves a request: a pure ranking (no I/O), fed by the gateway (gateway/upstream/pools.py)
with what it knows of each instance and what its prefix index says each one holds.

Strategies (per pool, `route:` in the pool config):
- `prefix` (engine pools' default): the instance expected to hold the longest cached prefix of the prompt, traded
  against its load: score = hit blocks * block_size (prefill tokens saved) - load * load_cost_tokens - KV usage *
  kv_cost_tokens. Bounded load: an instance whose load would exceed `(1 + load_epsilon)` times the mean (the pool's
  load plus this request, spread evenly; never below `min_bound`), or whose engine queue is longer than
  `max_waiting`, takes no affinity; the next best does ("spill"). A prompt no instance holds gets a stable home by
  rendezvous (highest-random-weight) hashing of its first block hash, under the same bound, so a new team's prefix
  lands on one instance and its next requests find it there.
  A chat with a system part (`home_depth` full blocks of it, `home_key` its hash) is homed by its system part, and
  only a hit deeper than the system part's blocks is affinity: prompts whose system parts share only a preamble (a
  chat template's header, a company's opening line) would otherwise all follow the instance that first cached the
  preamble; a team's system part instead picks its own home, and its requests go there while the load allows.
  A prompt with no full block (or no token ids) falls back to least loaded.
- `least_loaded`: lowest load first. Without engine load figures that is least in flight (external members).
- `round_robin`: the available instances in turn.

Unavailable instances (circuit open, cooldown not over) are never ranked. After the pick, every other available
instance follows, least loaded first, as the route plan's later hops.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

STRATEGIES = ("prefix", "least_loaded", "round_robin")


@dataclass(frozen=True)
class Candidate:
    """What the router knows of one instance at decision time."""

    name: str
    available: bool = True  # circuit closed (or a half-open probe may go)
    in_flight: int = 0  # this gateway's requests on it
    running: int = 0  # the engine's own queue, from its last /load (0 when unknown)
    waiting: int = 0
    kv_usage: float = 0.0  # 0-1
    hit_blocks: int = 0  # leading blocks of the prompt the prefix index says it holds
    prefix_capable: bool = True  # one of our engines (its cache is indexed); external members never are


@dataclass(frozen=True)
class RouteParams:
    strategy: str = "prefix"
    block_size: int = 16  # tokens a hit block saves
    load_cost_tokens: float = 32.0  # one request of load is worth this many prefill tokens
    kv_cost_tokens: float = 64.0  # a full KV pool (usage 1.0) is worth this many (it is about to evict)
    load_epsilon: float = 0.25  # bounded load: at most (1 + eps) * the mean load
    min_bound: int = 6  # an instance under this load is never over the bound (a batch of 6 is small for an engine)
    max_waiting: int = 8  # an engine queue longer than this takes no prefix affinity

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"route: expected one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        costs = (self.load_epsilon, self.min_bound, self.max_waiting, self.load_cost_tokens, self.kv_cost_tokens)
        if min(costs) < 0 or self.block_size < 1:
            raise ValueError(
                "route: load_epsilon, min_bound, max_waiting, load_cost_tokens and kv_cost_tokens >= 0, block_size >= 1"
            )


@dataclass(frozen=True)
class RouteReason:
    """Why the first instance was picked: what the request's event carries as `route_reason`."""

    strategy: str
    reason: str  # prefix_hit | prefix_spill | prefix_home | least_loaded | round_robin | none_available
    instance: str | None
    hit_blocks: int = 0
    score: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "reason": self.reason,
            "instance": self.instance,
            "hit_blocks": self.hit_blocks,
            "score": round(self.score, 3),
        }


def load(c: Candidate) -> float:
    """Requests on the instance, waiting ones counting double (not yet served): the engine's queue as its last /load
    saw it, or ours in flight where that is more (sent since the poll). Not their sum: the engine's queue holds ours,
    and adding them counted each of our requests twice (three times waiting), so two requests on an engine already
    reached `min_bound` and spilled a team off the engine holding its prefix."""
    return max(c.in_flight, c.running + c.waiting) + c.waiting


def _least_loaded_key(c: Candidate) -> float:
    return load(c) + c.kv_usage  # ties keep the caller's (configured) order: the sorts are stable


def score(c: Candidate, params: RouteParams) -> float:
    """Prefix strategy: prefill tokens expected saved, less the load's and the KV pool's cost in the same units.
    Higher is better."""
    return c.hit_blocks * params.block_size - load(c) * params.load_cost_tokens - c.kv_usage * params.kv_cost_tokens


def overloaded(c: Candidate, candidates: list[Candidate], params: RouteParams) -> bool:
    """Bounded load: taking one more request would put `c` above ceil((1 + eps) * the mean) (and above `min_bound`:
    at a handful of requests an engine's batch has room, and spreading them would only split the cache), or its
    queue is long."""
    total = sum(load(x) for x in candidates) + 1
    bound = max(math.ceil((1 + params.load_epsilon) * total / len(candidates) - 1e-9), params.min_bound)
    return load(c) + 1 > bound or c.waiting > params.max_waiting


def home_weight(key: int, name: str) -> int:
    """Rendezvous weight of an instance for a prompt's home key: a keyed digest, stable across processes (no salted
    str hash) and mixed well enough that which instance weighs more is a coin toss per key (a tuple's hash of the
    two is not: it sent 8 of 8 distinct system prompts to one of two instances)."""
    data = (key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little") + name.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"tw-route").digest(), "little")


def rank(
    candidates: list[Candidate],
    params: RouteParams,
    block_hashes: list[int] | None = None,
    turn: int = 0,
    home_depth: int = 0,
    home_key: int | None = None,
) -> tuple[list[str], RouteReason]:
    """Instance names in the order to try them, and why the first one. `block_hashes`: the prompt's (None: unknown,
    e.g. no tokenizer: least loaded); `turn`: the pool's round-robin counter; `home_depth`: leading blocks a hit must
    go beyond to be affinity (the system part's); `home_key`: what a home is chosen by (default its first block)."""
    up = [c for c in candidates if c.available]
    if not up:
        return [], RouteReason(params.strategy, "none_available", None)
    by_load = sorted(up, key=_least_loaded_key)
    if params.strategy == "round_robin":
        k = turn % len(up)
        ordered = up[k:] + up[:k]
        return [c.name for c in ordered], RouteReason("round_robin", "round_robin", ordered[0].name)
    if params.strategy == "least_loaded" or not block_hashes:
        first = by_load[0]
        return [c.name for c in by_load], RouteReason(params.strategy, "least_loaded", first.name)

    # a hit no deeper than home_depth is a preamble other prompts share: no affinity (the home decides)
    capable = [c if c.hit_blocks > home_depth else replace(c, hit_blocks=0) for c in up if c.prefix_capable]
    within = [c for c in capable if not overloaded(c, up, params)]
    held = [c for c in capable if c.hit_blocks > 0]
    if any(c.hit_blocks > 0 for c in within):
        # the best trade of cached prefix against load; an instance holding nothing competes on its load alone
        pick = max(within, key=lambda c: (score(c, params), c.hit_blocks, -_least_loaded_key(c)))
        reason = "prefix_hit" if pick.hit_blocks > 0 else "prefix_spill"
    elif within:
        key = block_hashes[0] if home_key is None else home_key
        pick = max(within, key=lambda c: (home_weight(key, c.name), c.name))
        reason = "prefix_spill" if held else "prefix_home"
    else:
        pick, reason = by_load[0], "prefix_spill" if held else "least_loaded"
    rest = [c.name for c in by_load if c.name != pick.name]
    why = RouteReason("prefix", reason, pick.name, pick.hit_blocks, score(pick, params))
    return [pick.name, *rest], why
