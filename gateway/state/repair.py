"""Budgets that survive Redis losing its data: a FLUSH, a failover to an empty replica, a restart without persistence.

Spend lives in Redis while the gateway runs and in the store for good. Without a guard, a Redis that lost its data
hands every budget out again (the store was read only at start-up) and forgets the concurrency leases of requests
still running. The guard (gateway.state.redis_epoch):
- every team's Redis meta hash carries the epoch it was seeded in, and the RESERVE script refuses a team without
  one, so nothing is admitted against a budget that forgot its spend (503 `state_unavailable`, or local limits under
  `state.on_unavailable: fail_open`);
- every replica reads the epoch once per `watch_s`; when it is gone or changed, the replica writes its unflushed usage
  to the store and puts back the holds and leases it still has in flight (so concurrency stays bounded);
- one replica (a lock) then waits `watch_s` + a margin, so that every replica has done so, seeds every team's
  spend from the store and sets a new epoch; teams answer again as they are seeded.
A team created after the last seeding is seeded on its first request. What a team's requests settled during the
repair may be counted twice (in Redis and in the store): a rebuilt budget can refuse early, never overspend.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from tokenweir.common.logging import get_logger
from tokenweir.gateway.accounting.usage import UsageRecorder
from tokenweir.gateway.state.backend import StateUnavailable
from tokenweir.gateway.state.redis import RedisState
from tokenweir.gateway.state.redis_connection import REDIS_ERRORS
from tokenweir.gateway.state.redis_epoch import RedisEpoch, SubjectSpend
from tokenweir.gateway.store.store import Store
from tokenweir.policies.budget import DAY, MONTH, period_start_day

log = get_logger()
_SEEDING_POLL_S = 0.05  # a replica waiting at start for another's seeding looks this often


def stored_spend(store: Store, now: float, team_id: str | None = None) -> dict[str, list[SubjectSpend]]:
    """Every team's (or one team's) spend of this UTC day and month from the store: the team's own, then each key's."""
    day, month = period_start_day(DAY, now), period_start_day(MONTH, now)
    teams = [team_id] if team_id is not None else [t.id for t in store.list_teams()]
    keys: dict[tuple[str, str], list[int]] = {}
    team_cost: dict[str, list[int]] = {}
    for i, since in enumerate((day, month)):
        for t, key_id, tokens, cost in store.spent_by_key(since, femtos=True):
            if team_id is None or t == team_id:
                row = keys.setdefault((t, key_id), [0, 0, 0, 0])
                row[i], row[2 + i] = tokens, cost
                team_cost.setdefault(t, [0, 0])[i] += cost
    spend: dict[str, list[SubjectSpend]] = {}
    for t in teams:
        d_cost, m_cost = team_cost.get(t, (0, 0))
        spent = (store.spent_tokens(t, day), store.spent_tokens(t, month))
        spend[t] = [SubjectSpend(None, *spent, d_cost, m_cost)]
    for (t, key_id), row in keys.items():
        if t in spend:
            spend[t].append(SubjectSpend(key_id, *row))
    return spend


class StateWatch:
    """Seeds a `RedisState` at start, watches its epoch, and rebuilds it after a loss (this module's docstring)."""

    def __init__(self, state: RedisState, store: Store, usage: UsageRecorder, *, watch_s: float = 1.0) -> None:
        assert watch_s > 0
        self.state, self.store, self.usage, self.watch_s = state, store, usage, watch_s
        self.epoch = RedisEpoch(state)
        self.known: str | None = None  # the epoch this replica last saw whole
        self.seen: str | None = None  # what it read last (logged once per change)
        self._seeding: dict[str, asyncio.Future[bool]] = {}  # a new team's seeding, shared by its first requests
        state.require_seeded = True
        state.on_unseeded = self.seed_new_team

    async def start(self) -> None:
        """At start-up (raises while Redis is unreachable): adopt the live epoch, or seed a Redis that has none. No
        wait before seeding: a replica starting alone has nothing in flight, and replicas already running see the
        new epoch on their next look and put back what they hold. Replicas starting together on an empty Redis: one
        seeds, the others wait for its epoch (adopting none, they would refuse every new team until their next look)."""
        waited = False
        while True:
            current = await self.epoch.current()
            if current is not None:
                self.known = self.seen = current
                return
            if await self.rebuild(wait_s=0.0):
                return
            if not waited:
                log.info("state_seeding_elsewhere")
                waited = True
            await asyncio.sleep(_SEEDING_POLL_S)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.watch_s)
            try:
                await self.check()
            except (StateUnavailable, *REDIS_ERRORS) as e:  # Redis away: the next look tries again
                log.warning("state_watch_failed", error=f"{type(e).__name__}: {e}")

    async def check(self) -> None:
        current = await self.epoch.current()
        if current is not None and current == self.known:
            return
        # Redis lost its data, or another replica rebuilt it while this one looked away: what this replica billed
        # goes to the store (the seed reads it there), what it has in flight goes back into Redis.
        await self.usage.flush()
        restored = await self.epoch.restore(time.time())
        if current != self.seen:
            log.warning("state_epoch_changed", known=self.known, current=current, holds_restored=restored)
            self.seen = current
        if current is not None:
            self.known = current
        else:
            await self.rebuild(wait_s=self.watch_s + 1.0)

    async def rebuild(self, wait_s: float) -> bool:
        """Seed every team under a new epoch, if this replica wins the lock; False if another one is doing it."""
        owner = uuid.uuid4().hex
        if not await self.epoch.lock(owner, ttl_s=wait_s + 60.0):
            return False
        try:
            await asyncio.sleep(wait_s)  # every replica has seen the loss, flushed its usage and put back its holds
            epoch, now = uuid.uuid4().hex, time.time()
            spend = await asyncio.to_thread(stored_spend, self.store, now)
            for team_id, subjects in spend.items():
                await self.epoch.seed_team(team_id, epoch, subjects, now)
            await self.epoch.set(epoch)
            self.known = self.seen = epoch
            log.warning("state_seeded", epoch=epoch, teams=len(spend))
        finally:
            await self.epoch.unlock(owner)
        return True

    async def seed_new_team(self, team_id: str) -> bool:
        """A team Redis has no seeded spend for, on its first request: seed it at once when the epoch is the one
        this replica knows (a team created since); False while the whole state is being rebuilt. The requests that
        arrive together for it wait on one seeding (a burst does not read the store once per request)."""
        seeding = self._seeding.get(team_id)
        if seeding is None:
            seeding = self._seeding[team_id] = asyncio.ensure_future(self._seed_new_team(team_id))

            def done(seeded: asyncio.Future[bool]) -> None:
                self._seeding.pop(team_id, None)
                if not seeded.cancelled():
                    seeded.exception()  # retrieved even if every waiter left

            seeding.add_done_callback(done)
        return await asyncio.shield(seeding)

    async def _seed_new_team(self, team_id: str) -> bool:
        current = await self.epoch.current()
        if current is None or current != self.known:
            return False
        now = time.time()
        spend = await asyncio.to_thread(stored_spend, self.store, now, team_id)
        await self.epoch.seed_team(team_id, current, spend.get(team_id, []), now)
        return True
