"""Upstream pools: load-aware instance pick, a circuit breaker per instance, and the route plan of hops.

A hop is (public model, instance). The plan is: the model's pool instances (ranked by the pool's route strategy,
policies/routing.py: where the prompt's prefix is cached, least loaded, or in turn), then each configured fallback
model's instances (least loaded first). The relay tries hops in order while a failure happens BEFORE the first
byte; the hops it tried end up in the request's event as `route`.

An instance's own state (its circuit, its load) is gateway/upstream/instance.py; the poll that refreshes its load is
gateway/upstream/load_poll.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tokenweir.common.text import prefix_hash
from tokenweir.gateway.config import (
    AliasConfig,
    GatewayConfig,
    PoolConfig,
    UpstreamConfig,
    routes_error,
)
from tokenweir.gateway.upstream.client import UpstreamClient
from tokenweir.gateway.upstream.instance import Instance
from tokenweir.gateway.upstream.load_poll import awaiting_first_answer, poll_instance
from tokenweir.gateway.upstream.prefix_index import PrefixIndex
from tokenweir.policies import routing
from tokenweir.policies.canary import RolloutState

if TYPE_CHECKING:
    from tokenweir.gateway.accounting.metrics import Metrics


@dataclass
class Pool:
    cfg: PoolConfig
    instances: list[Instance] = field(default_factory=list)
    index: PrefixIndex = field(init=False)
    turn: int = 0  # round robin
    # Split once (the members are fixed): the ones an answer may come from, and a disaggregated pool's prefill members
    serving: list[Instance] = field(init=False)
    prefill_members: list[Instance] = field(init=False)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(self.cfg.prefix_index_entries)
        self.adopt_members()

    def adopt_members(self) -> None:
        for inst in self.instances:
            inst.index = self.index
        self.serving = [i for i in self.instances if i.cfg.role != "prefill"]
        self.prefill_members = [i for i in self.instances if i.cfg.role == "prefill"]

    @property
    def model(self) -> str:
        return self.cfg.model

    def member(self, name: str) -> Instance | None:
        return next((i for i in self.instances if i.name == name), None)

    @property
    def serves_embeddings(self) -> bool:
        if self.cfg.embeddings is not None:
            return self.cfg.embeddings
        return bool(self.instances) and not any(i.cfg.engine for i in self.instances)

    @property
    def max_model_len(self) -> int | None:
        """The context length /v1/models reports: the pool's max_context, else the shortest its engines report."""
        if self.cfg.max_context is not None:
            return self.cfg.max_context
        known = [i.max_model_len for i in self.instances if i.max_model_len is not None]
        return min(known) if known else None

    def ranked(self, now: float, members: list[Instance] | None = None) -> list[Instance]:
        """Least loaded first, of `members` (default: the serving ones; a fallback pool's hops)."""
        members = self.serving if members is None else members
        return sorted((i for i in members if i.available(now)), key=Instance.score)

    def block_size(self) -> int | None:
        """The engines' prefix-cache block size, from /load, when they agree and hash as we do; else None."""
        sizes = set()
        for inst in self.instances:
            load = inst.load
            if not inst.cfg.engine or not load or "block_size" not in load:
                continue
            bs = int(load["block_size"])
            if not load.get("prefix_caching", True) or load.get("prefix_hash_probe") != prefix_hash.probe(bs):
                return None
            sizes.add(bs)
        return sizes.pop() if len(sizes) == 1 else None

    def route(
        self, now: float, token_ids: list[int] | None, prefill: bool = False, head: int = 0, salt: str | None = None
    ) -> tuple[list[Instance], routing.RouteReason, list[int]]:
        """The pool's instances in the order to try them (its prefill members with `prefill`, else the others), why
        the first, and the prompt's block hashes (empty when the decision did not use them). `head`: the prompt's
        leading tokens before its first user turn (a chat's system part; 0: none), which choose its home. `salt`: the
        request's cache_salt, which the engine's hashes start from (gateway/request/cache_scope.py)."""
        members = self.prefill_members if prefill else self.serving
        strategy, hashes, hits = self.cfg.strategy, [], {}
        block_size = self.block_size() if strategy == "prefix" and token_ids else None
        if block_size is not None:
            assert token_ids  # a block size is looked up only for them
            # the engine looks up at most (n - 1) // block_size blocks (the last token is always computed)
            most = (len(token_ids) - 1) // block_size
            hashes = prefix_hash.block_hashes(token_ids, block_size, max_blocks=most, salt=salt)
            hits = self.index.match(hashes)
        cands = [i.candidate(i.available(now), hits.get(i.name, 0)) for i in members]
        home_depth, home_key = 0, None
        if hashes:
            assert token_ids and block_size is not None
            # A home is chosen by the prompt alone, whatever its salt (its unsalted first block, or system part; ints:
            # the same in every process): it tells nothing of what others sent. Only hits are the salt's.
            home_key = prefix_hash.chain(None, tuple(token_ids[:block_size]))
            if head > 0:
                home_depth, home_key = head // block_size, hash(tuple(token_ids[:head]))
        params = self.cfg.route_params(block_size or 16)
        names, why = routing.rank(cands, params, hashes or None, self.turn, home_depth, home_key)
        if strategy == "round_robin":
            self.turn += 1
        by_name = {i.name: i for i in members}
        return [by_name[n] for n in names], why, hashes


@dataclass
class Hop:
    model: str  # public model name of the pool this hop belongs to
    instance: Instance
    requested: str | None = None  # the model whose route plan this hop is in (another one: a fallback hop)
    error: str | None = (
        None  # why it failed, address included (gateway/upstream/calls.py `failed`): the event's, not tenants'
    )

    @property
    def label(self) -> str:
        """Pool and instance name: what events and metrics show (an address only in a discovered member's name)."""
        return f"{self.model}@{self.instance.name}"

    @property
    def public_label(self) -> str:
        """What tenants' errors show: the label, a discovered member's as declared (its name, without the address
        its instance is named by: gateway/upstream/discovery.py `expand`)."""
        name = self.instance.name
        return f"{self.model}@{name.rsplit('-', 1)[0] if self.instance.cfg.discover else name}"

    @property
    def where(self) -> str:
        """The label with the instance's address: for the log and the request's event, never a tenant."""
        return f"{self.label} ({self.instance.cfg.base_url})"

    @property
    def fallback(self) -> bool:
        return self.requested is not None and self.requested != self.model

    def done(self, ok: bool, now: float) -> None:
        """`instance.done`, and a request served (ok) by a fallback pool's hop is counted as a fallback."""
        self.instance.done(ok, now)
        if ok and self.fallback and self.instance.metrics is not None:
            self.instance.metrics.fallbacks.labels(self.requested, self.model).inc()


@dataclass(frozen=True, slots=True)
class Routes:
    """One routing table: the pools and aliases by public name. A change makes a new table; a request keeps the one
    it was admitted under to its end (a pool removed meanwhile still serves it), but its hops are the members its
    pools have now (`Upstreams.route`): a member removed meanwhile gets nothing new from it."""

    pools: dict[str, Pool]
    aliases: dict[str, AliasConfig]  # as requests see them: a rollout's weights applied
    version: int = 0  # the store's routing version it reflects (0: the config file alone)
    # What the admin API and the rollout controller read: the aliases as declared, their rollouts' states, and
    # each stored entry's version ((kind, name) -> version; absent: only the config file declares it)
    declared: dict[str, AliasConfig] = field(default_factory=dict)
    rollouts: dict[str, RolloutState] = field(default_factory=dict)
    entry_versions: dict[tuple[str, str], int] = field(default_factory=dict)


class Upstreams:
    def __init__(self, config: GatewayConfig, metrics: Metrics | None = None) -> None:
        self.breaker = config.breaker
        self.metrics = metrics
        pools = {pc.model: Pool(pc, [self._instance(u, pc.model) for u in pc.upstreams]) for pc in config.pools}
        assert routes_error(config.pools, config.aliases) is None  # GatewayConfig checked it
        self.routes = Routes(pools, {a.model: a for a in config.aliases}, declared={a.model: a for a in config.aliases})
        self.attach_metrics(metrics)
        self.poll_interval_s = config.load_poll_interval_s
        self._poller: asyncio.Task | None = None
        self._client: UpstreamClient | None = None
        # (pool, instance, block hashes) of each prompt sent, for the other replicas (gateway/upstream/shared_index.py)
        self.on_record: Callable[[str, str, list[int]], None] | None = None

    @property
    def pools(self) -> dict[str, Pool]:
        return self.routes.pools

    @property
    def aliases(self) -> dict[str, AliasConfig]:  # public names over weighted variants (pools)
        return self.routes.aliases

    def _instance(self, cfg: UpstreamConfig, model: str) -> Instance:
        inst = Instance(cfg, self.breaker, model=model, metrics=self.metrics)
        if cfg.discover:  # found by DNS: no requests until its /load (or /health) answers (a pod not ready yet)
            inst.mark_down(time.monotonic())
        return inst

    def apply(
        self,
        pools: list[PoolConfig],
        aliases: list[AliasConfig],
        version: int,
        *,
        declared: list[AliasConfig] | None = None,
        rollouts: dict[str, RolloutState] | None = None,
        entry_versions: dict[tuple[str, str], int] | None = None,
    ) -> None:
        """Swap in a new routing table (validated: `routes_error` is None). What did not change keeps its state: a
        pool whose settings are equal stays as it is; a member whose settings are equal but for `draining` keeps its
        load, circuit, in-flight count and cached prefixes. Requests in flight keep the table they started with; a
        member that left a pool that stays is `removed`: no request routes to it again."""
        assert routes_error(pools, aliases) is None
        old = self.routes.pools
        new: dict[str, Pool] = {}
        for pc in pools:
            prev = old.get(pc.model)
            if prev is not None and prev.cfg == pc:
                new[pc.model] = prev
                continue
            members = []
            for u in pc.upstreams:
                inst = prev.member(u.name) if prev is not None else None
                if inst is not None and replace(inst.cfg, draining=u.draining) == u:
                    inst.cfg = u
                else:
                    inst = self._instance(u, pc.model)
                    inst._report()
                members.append(inst)
            pool = Pool(pc, members)
            if prev is not None:
                pool.turn = prev.turn
                if prev.cfg.prefix_index_entries == pc.prefix_index_entries:
                    pool.index = prev.index
                    pool.adopt_members()
            new[pc.model] = pool
        kept = {id(i) for p in new.values() for i in p.instances}
        for model, pool in old.items():
            for inst in pool.instances:
                if id(inst) not in kept:
                    inst.removed = model in new  # (a pool removed whole serves the requests admitted under it)
                    inst.forget_metrics()
                    if inst.index is not None:  # what it cached is not what a later member of that name will
                        inst.index.forget_instance(inst.name)
        self.routes = Routes(
            new,
            {a.model: a for a in aliases},
            version,
            {a.model: a for a in (aliases if declared is None else declared)},
            rollouts or {},
            entry_versions or {},
        )
        if self._client is not None and self._poller is None:
            self.start(self._client)

    def attach_metrics(self, metrics: Metrics | None) -> None:
        """Per-instance circuit state, failures, hops, fallbacks and revision go to `metrics` from now on."""
        self.metrics = metrics
        for pool in self.pools.values():
            for inst in pool.instances:
                inst.metrics = metrics
                inst._report()
                inst._report_revision()

    def get(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def plan(self, model: str) -> list[Hop]:
        return self.route(model)[0]

    def route(
        self,
        model: str,
        token_ids: list[int] | None = None,
        requested: str | None = None,
        routes: Routes | None = None,
        head: int = 0,
        salt: str | None = None,
    ) -> tuple[list[Hop], routing.RouteReason, list[int]]:
        """The route plan of pool `model` (for a request of `requested`, default `model`: another one makes every
        hop a fallback hop) in `routes` (default: the current table: its pools and fallbacks; their members as they
        are now, `current`), why its first hop, and the prompt's block hashes (to `record` once a hop is taken)."""
        now = time.monotonic()
        requested = requested or model
        pools = (routes or self.routes).pools
        pool = self.current(pools[model])
        ranked, why, hashes = pool.route(now, token_ids, head=head, salt=salt)
        hops = [Hop(model, i, requested) for i in ranked]
        # A disaggregated pool whose decode members all fail: its prefill members answer whole requests (the prompt
        # likely in their cache from the prefill hop) before another pool is asked.
        hops += [Hop(model, i, requested) for i in pool.ranked(now, pool.prefill_members)]
        for fb in pools[model].cfg.fallbacks:  # as the request's table has them (admission reserved for those)
            hops += [Hop(fb, i, requested) for i in self.current(pools[fb]).ranked(now)]
        return hops, why, hashes

    def current(self, pool: Pool) -> Pool:
        """`pool` as the current table has it (its members now), else as it was (removed whole: it serves its own)."""
        return self.routes.pools.get(pool.model, pool)

    def prefill_route(
        self,
        model: str,
        token_ids: list[int] | None,
        routes: Routes | None = None,
        head: int = 0,
        salt: str | None = None,
    ) -> tuple[list[Hop], list[int]]:
        """A disaggregated pool's prefill members, in the order to try them (where the prompt's prefix is cached
        first: that cache is the one that saves work), and the prompt's block hashes."""
        pool = self.current((routes or self.routes).pools[model])
        ranked, _, hashes = pool.route(time.monotonic(), token_ids, prefill=True, head=head, salt=salt)
        return [Hop(model, i, model) for i in ranked], hashes

    def record(self, hop: Hop, hashes: list[int]) -> None:
        """The hop's instance was sent a prompt with these block hashes: its pool's index learns it holds them
        (only for the requested pool's own engines: a fallback pool's tokenizer may differ)."""
        if hashes and not hop.fallback and hop.instance.cfg.engine and hop.instance.index is not None:
            hop.instance.index.record(hop.instance.name, hashes)
            if self.on_record is not None:
                self.on_record(hop.model, hop.instance.name, hashes)

    # --- load poller --------------------------------------------------------------------------------------
    def start(self, client: UpstreamClient) -> None:
        """Poll our engines' /load (and discovered members' /health until they answer); a table applied later that
        brings the first of them starts the poller then."""
        self._client = client
        if any(i.cfg.engine or i.cfg.discover for p in self.pools.values() for i in p.instances):
            self._poller = asyncio.create_task(self._poll_forever(client))

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)

    async def _poll_forever(self, client: UpstreamClient) -> None:
        while True:
            polled = [i for p in self.pools.values() for i in p.instances if i.cfg.engine or awaiting_first_answer(i)]
            await asyncio.gather(*(poll_instance(client, i) for i in polled))
            await asyncio.sleep(self.poll_interval_s)

    async def poll_pending(self) -> None:
        """Poll the discovered members that have not answered yet, now: a new address takes requests within a
        round trip of joining, not a poll interval."""
        if self._client is not None:
            pending = [i for p in self.pools.values() for i in p.instances if awaiting_first_answer(i)]
            await asyncio.gather(*(poll_instance(self._client, i) for i in pending))
