"""Which generation of Redis's data a replica is looking at, and the steps that rebuild a team's state after Redis lost
it (a FLUSH, a failover to an empty replica, a restart without persistence).

`<prefix>:epoch` names the generation: it is set once every team's spend was seeded from the store, and every team's
meta hash carries the epoch it was seeded in (the RESERVE script refuses a team without one). On a Redis Cluster a
primary can lose its data alone (a failover to a replica that had none), so the marker is kept once per primary
(`<prefix>:epoch:{<tag>}`, the tag chosen to land on the lowest slot it serves): any one missing is a loss. A
replica puts back the holds and leases it still has in flight (`restore`); one replica at a time (`lock`) seeds every
team (`seed_team`). When to do which is gateway.state.repair's job.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from redis.asyncio.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from tokenweir.gateway.state.backend import StateUnavailable
from tokenweir.gateway.state.redis_lua import script_args
from tokenweir.gateway.state.redis_seed import RESTORE, RESTORE_ARGV, SEED, SEED_ARGV
from tokenweir.policies.pricing import split_femtos

if TYPE_CHECKING:
    from tokenweir.gateway.state.redis import RedisState


class StateUnseeded(StateUnavailable):
    """The team's spend is not in Redis (its data was lost, or the team is new since the last seeding): nothing was
    taken; admission answers as for an unreachable state until gateway.state.repair has seeded it."""


@dataclass(frozen=True, slots=True)
class LiveHold:
    """A hold a replica took and has not settled: what `RedisEpoch.restore` puts back if Redis loses it."""

    team_id: str
    key_id: str | None
    tokens: int
    cost: int
    taken_at: float
    day_key: str
    month_key: str


@dataclass(frozen=True, slots=True)
class SubjectSpend:
    """What the store says a team (key_id None) or one of its API keys spent this UTC day and month."""

    key_id: str | None
    day_tokens: int = 0
    month_tokens: int = 0
    day_cost: int = 0  # femto-USD (policies.pricing)
    month_cost: int = 0


@functools.cache
def slot_tag(slot: int) -> str:
    """A short hash tag whose keys live in cluster slot `slot`: the first of "0", "1", "2", ... that does."""
    return next(tag for tag in map(str, itertools.count()) if key_slot(tag.encode()) == slot)


class RedisEpoch:
    """The epoch marker, the repair lock, and the SEED / RESTORE scripts of one `RedisState`."""

    def __init__(self, state: RedisState) -> None:
        self.state = state
        self.redis = state.client
        self._epoch_key = f"{state.keys.prefix}:epoch"
        self._lock_key = f"{state.keys.prefix}:epoch:repair"
        self._seed = self.redis.register_script(SEED)
        self._restore = self.redis.register_script(RESTORE)

    async def current(self) -> str | None:
        """The epoch Redis holds (None: never seeded, or its data is gone; on a cluster, gone from any primary, or
        the primaries disagree while a replica is setting a new one)."""
        markers = await self._markers()
        if len(markers) == 1:
            return cast("str | None", await self.redis.get(markers[0]))  # decode_responses: str, never bytes
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in markers:
                pipe.get(key)
            values = await pipe.execute()
        return cast("str | None", values[0]) if len(set(values)) == 1 else None

    async def set(self, epoch: str) -> None:
        for key in await self._markers():
            await self.redis.set(key, epoch)

    async def _markers(self) -> list[str]:
        """The epoch's keys: one on one server; on a cluster one per primary, on the lowest slot it serves (the slot
        stays with its shard across a failover; after a resharding a marker may be missing once, which rebuilds)."""
        client = self.redis
        if not isinstance(client, RedisCluster):
            return [self._epoch_key]
        if not client.nodes_manager.slots_cache:
            await client.initialize()
        lowest: dict[str, int] = {}
        for slot, nodes in client.nodes_manager.slots_cache.items():
            if slot < lowest.get(nodes[0].name, REDIS_CLUSTER_HASH_SLOTS):
                lowest[nodes[0].name] = slot
        return [f"{self._epoch_key}:{{{slot_tag(slot)}}}" for slot in sorted(lowest.values())]

    async def lock(self, owner: str, ttl_s: float) -> bool:
        """The right to seed, for `ttl_s` (a replica that dies seeding lets the next one try)."""
        return bool(await self.redis.set(self._lock_key, owner, nx=True, px=int(ttl_s * 1000)))

    async def unlock(self, owner: str) -> None:
        if await self.redis.get(self._lock_key) == owner:
            await self.redis.delete(self._lock_key)

    async def seed_team(self, team_id: str, epoch: str, spend: list[SubjectSpend], now: float) -> bool:
        """Add the team's and its keys' stored spend and mark the team seeded in `epoch` (once: False if it was)."""
        keys_ = self.state.keys
        subjects = [SubjectSpend(None)] + [s for s in spend if s.key_id is not None]
        team = next((s for s in spend if s.key_id is None), None)
        if team is not None:
            subjects[0] = team
        keys, args = [keys_.key(team_id, "meta")], []
        _, _, _, _, d_exp, m_exp = keys_.period_keys(team_id, now)
        for s in subjects:
            day_k, month_k, *_ = keys_.period_keys(team_id, now, s.key_id)
            keys += [day_k, month_k]
            args += [s.day_tokens, s.month_tokens, *split_femtos(s.day_cost), *split_femtos(s.month_cost)]
        head = script_args(SEED_ARGV, epoch=epoch, day_expire_s=d_exp, month_expire_s=m_exp)
        return bool(await self._seed(keys=keys, args=head + args))

    async def restore(self, now: float) -> int:
        """Put back this replica's live holds Redis has no record of, and re-add its live leases; idempotent.
        Returns how many holds were put back."""
        state, keys_ = self.state, self.state.keys
        restored = 0
        for res_id, hold in list(state.live_holds.items()):
            keys = []
            for sub_key in (None, hold.key_id) if hold.key_id is not None else (None,):
                sub = keys_.subject(sub_key)
                day_k, month_k, d, m, d_exp, m_exp = keys_.period_keys(hold.team_id, now, sub_key)
                keys += [day_k, month_k, keys_.key(hold.team_id, sub + "holds"), keys_.key(hold.team_id, sub + "meta")]
                keys.append(keys_.key(hold.team_id, f"{sub}res:{res_id}"))
            args = script_args(
                RESTORE_ARGV,
                tokens=hold.tokens,
                cost=hold.cost,
                taken_at=repr(hold.taken_at),
                day_key=hold.day_key,
                month_key=hold.month_key,
                hold_until=repr(hold.taken_at + state.hold_s),
                day_period=d,
                month_period=m,
                day_expire_s=d_exp,
                month_expire_s=m_exp,
                res_id=res_id,
            )
            restored += int(await self._restore(keys=keys, args=args))
        expiry, ttl_ms = now + state.lease_s, int(state.lease_s * 1000) + 1000
        async with self.redis.pipeline(transaction=False) as pipe:
            for (team_id, key_id), leases in list(state.leases.items()):
                for slots in {keys_.key(team_id, "slots"), keys_.key(team_id, keys_.subject(key_id) + "slots")}:
                    if leases:  # one command a statement: the stubs type each as its reply, not as the pipeline
                        pipe.zadd(slots, dict.fromkeys(leases, expiry))
                        pipe.pexpire(slots, ttl_ms)
            await pipe.execute()
        return restored
