"""Runtime pools and aliases: the config file's are the seed, the store's entries (written through the admin API,
or by a rollout) override them by name, and every replica polls the store's routing version and swaps in the new
table within `interval_s` of a change (at once on the replica that made it). Members found by DNS are expanded
into one per address (gateway/upstream/discovery.py) right before a table is applied, and the last composed table
is applied again when their addresses change.

An entry's body is JSON: a pool is PoolConfig's fields (read as strictly as the config file); an alias is
`{"alias": AliasConfig's fields, "rollout_state": RolloutState or null}`. A body of None removes the name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass, replace
from typing import Any

from tokenweir.common.logging import get_logger
from tokenweir.gateway.config import AliasConfig, PoolConfig, member_key_env_error, parse_section, routes_error
from tokenweir.gateway.store.db import DB_ERRORS
from tokenweir.gateway.store.routing import RoutingEntry
from tokenweir.gateway.store.store import Store
from tokenweir.gateway.upstream.discovery import Discovery
from tokenweir.gateway.upstream.periodic import Periodic
from tokenweir.gateway.upstream.pools import Upstreams
from tokenweir.policies.canary import RolloutState

log = get_logger()


def pool_body(pool: PoolConfig) -> dict:
    """A pool as a stored entry's body: every setting (secrets never: a member's key is named by api_key_env)."""
    body = dataclasses.asdict(pool)
    for upstream in body["upstreams"]:
        upstream.pop("api_key", None)
    return body


def alias_body(alias: AliasConfig, state: RolloutState | None) -> dict:
    return {"alias": dataclasses.asdict(alias), "rollout_state": None if state is None else state.to_dict()}


def pool_from_body(body: Any, where: str = "") -> PoolConfig:
    if not isinstance(body, dict):
        raise ValueError(f"{where or 'pool'}: expected a mapping")
    return parse_section(PoolConfig, body, where)


def with_keys(pool: PoolConfig, seed: PoolConfig | None, listed: list[str]) -> PoolConfig:
    """A stored pool's members' API keys: from their api_key_env now, else the seed member's at the same address (a
    bundled engine's key lives in this process only). An api_key_env that names no member's key (`listed`: the
    config's api_key_envs; an entry written before the rule, or into the store directly) is a ValueError: the entry
    is skipped, and the variable's value never sent."""
    known = {(u.name, u.base_url): u.api_key for u in seed.upstreams} if seed is not None else {}
    for upstream in pool.upstreams:
        if upstream.api_key_env and (error := member_key_env_error(upstream.api_key_env, listed)) is not None:
            raise ValueError(f"pool {pool.model}, upstream {upstream.name}: {error}")
        if upstream.api_key_env:
            upstream.api_key = os.environ.get(upstream.api_key_env) or None
        elif upstream.api_key is None:
            upstream.api_key = known.get((upstream.name, upstream.base_url))
    return pool


def alias_from_body(body: dict) -> tuple[AliasConfig, RolloutState | None]:
    alias = parse_section(AliasConfig, body["alias"], "alias.")
    state = body.get("rollout_state")
    return alias, RolloutState.from_dict(state) if isinstance(state, dict) else None


def effective_alias(alias: AliasConfig, state: RolloutState | None) -> AliasConfig:
    """The alias as requests see it: a rollout's canary at its current share, the baseline at the rest."""
    r = alias.rollout
    if r is None:
        return alias
    share = (state or RolloutState()).canary_share(r.steps)
    weights = {r.canary: share, r.baseline: 100.0 - share}
    return replace(alias, variants=[replace(v, weight=weights.get(v.name, v.weight)) for v in alias.variants])


@dataclass
class Composed:
    pools: list[PoolConfig]
    declared: list[AliasConfig]
    rollouts: dict[str, RolloutState]
    entry_versions: dict[tuple[str, str], int]

    @property
    def aliases(self) -> list[AliasConfig]:
        return [effective_alias(a, self.rollouts.get(a.model)) for a in self.declared]


def compose(
    seed_pools: list[PoolConfig],
    seed_aliases: list[AliasConfig],
    entries: list[RoutingEntry],
    api_key_envs: list[str] | None = None,
) -> Composed:
    """The seed overlaid by the entries. An entry that no longer parses (written by another version), or whose
    members' api_key_env names no member's key (`api_key_envs`: the config's), is skipped with a log line; the result
    may still break references (check it with `routes_error`)."""
    pools = {p.model: p for p in seed_pools}
    aliases = {a.model: a for a in seed_aliases}
    rollouts: dict[str, RolloutState] = {}
    versions = {}
    for e in entries:
        versions[(e.kind, e.name)] = e.version
        target: dict[str, Any] = pools if e.kind == "pool" else aliases
        if e.body is None:
            target.pop(e.name, None)
            continue
        try:
            if e.kind == "pool":
                pools[e.name] = with_keys(pool_from_body(e.body), pools.get(e.name), api_key_envs or [])
            else:
                aliases[e.name], state = alias_from_body(e.body)
                if state is not None:
                    rollouts[e.name] = state
        except (ValueError, KeyError, TypeError) as exc:
            log.error("routing_entry_invalid", kind=e.kind, name=e.name, error=str(exc))
    return Composed(list(pools.values()), list(aliases.values()), rollouts, versions)


class RoutingSync:
    """Keeps this replica's routing table in step with the store."""

    def __init__(
        self,
        upstreams: Upstreams,
        store: Store,
        seed_pools: list[PoolConfig],
        seed_aliases: list[AliasConfig],
        discovery: Discovery | None = None,
        api_key_envs: list[str] | None = None,
    ) -> None:
        self.upstreams, self.store, self.discovery = upstreams, store, discovery
        self.api_key_envs = api_key_envs or []  # the config's: what a stored member's api_key_env may name
        self.seed_pools, self.seed_aliases = list(seed_pools), list(seed_aliases)
        self.version = 0  # the store's routing version applied here
        # the last table applied, as composed (before discovery's expansion), and its version
        self.applied = (0, Composed(self.seed_pools, self.seed_aliases, {}, {}))
        # one refresh at a time: a slower one (the poll's) never applies its older table over a newer one
        self._refreshing = asyncio.Lock()
        self.poll = Periodic(self.refresh, "routing_refresh_failed", DB_ERRORS)  # the table we have stands
        self.discover = Periodic(self.rediscover, "discovery_failed", DB_ERRORS)

    def composed(self, entries: list[RoutingEntry]) -> Composed:
        return compose(self.seed_pools, self.seed_aliases, entries, self.api_key_envs)

    async def refresh(self, force: bool = False) -> bool:
        """Reload and apply the table if the store's version moved (or `force`); True if it applied one."""
        async with self._refreshing:
            return await self._refresh(force)

    async def _refresh(self, force: bool) -> bool:
        if not force and await asyncio.to_thread(self.store.routing_version) == self.version:
            return False
        version, entries = await asyncio.to_thread(self.store.routing_entries)
        composed = self.composed(entries)
        if (error := routes_error(composed.pools, composed.aliases)) is not None:
            # two writers raced past each other's checks: keep the table we have, say why until it is fixed
            log.error("routing_table_invalid", version=version, error=error)
            self.version = version
            return False
        self._apply(version, composed)
        if version != self.version:
            log.info(
                "routing_table_applied", version=version, pools=len(composed.pools), aliases=len(composed.declared)
            )
        self.version = version
        return True

    def declared_pool(self, model: str) -> PoolConfig | None:
        """Pool `model` of the table applied, as composed: its discovered members as written, not one per address."""
        return next((p for p in self.applied[1].pools if p.model == model), None)

    async def rediscover(self) -> None:
        """Resolve the discovered members' names again: when their addresses changed, the last table applied goes in
        again with the new expansion, and the new addresses are asked at once whether they are up."""
        if self.discovery is None or not await self.discovery.refresh(self.applied[1].pools):
            return
        self._apply(*self.applied)  # as it is now: a refresh may have applied a newer table meanwhile
        await self.upstreams.poll_pending()

    def _apply(self, version: int, composed: Composed) -> None:
        pools = composed.pools if self.discovery is None else self.discovery.expand(composed.pools)
        self.upstreams.apply(
            pools,
            composed.aliases,
            version,
            declared=composed.declared,
            rollouts=composed.rollouts,
            entry_versions=composed.entry_versions,
        )
        self.applied = (version, composed)
