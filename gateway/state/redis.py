"""Shared live state in Redis for several gateway replicas: the same methods as `InMemoryState`.

Every decision is one Lua script (gateway.state.redis_lua; one round trip, atomic on the server), so N replicas
together admit exactly what one would: limits are never multiplied by the replica count. A request makes two: its
reservation with its concurrency lease (reserve_and_acquire), and its settle with the lease's release
(settle_and_release). Where each team's and API key's counters live: gateway.state.redis_keys; reading the scripts'
answers: gateway.state.redis_replies; the leases this replica holds and renews: gateway.state.redis_leases; the
client and its pools, on one server or a cluster: gateway.state.redis_connection.
A replica that dies without settling cannot hold budget or slots forever: expired holds are reaped (their
tokens given back) by the next reserve, expired slot leases by the next acquire. Live leases are renewed by a
background task. Budget and lease expiries are fixed points (period end, lease end), never pushed out by an
increment; a window hash's TTL does follow its newest write, which is harmless because the counts inside age
out by slot index, not by TTL (the TTL only garbage-collects an idle team's hash).
On a Redis Cluster (`cluster=True`) every call touches the keys of one team, which share its `{team}` hash tag and so
one slot: each script and each transaction runs on the one primary that serves it, and the two hot scripts go to it
lean as on one server (gateway.state.redis_cluster_wire). A cluster that cannot answer (a node down, CLUSTERDOWN
during a failover, no node reachable) is an unavailable state like a single Redis that cannot.
Times come from the calling replica's clock (NTP-synced replicas agree to well within a 1 s slot). Every method,
`snapshot` and `seed_spend` included, goes through the one asyncio client, bound to the event loop that first uses
it: a caller on another thread runs the coroutine on that loop (asyncio.run_coroutine_threadsafe).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tokenweir.common.ids import random_hex
from tokenweir.gateway.state.backend import Lease, StateUnavailable
from tokenweir.gateway.state.redis_calls import PackedCalls
from tokenweir.gateway.state.redis_connection import REDIS_ERRORS, RedisConnection
from tokenweir.gateway.state.redis_epoch import LiveHold, StateUnseeded
from tokenweir.gateway.state.redis_keys import RedisKeyLayout
from tokenweir.gateway.state.redis_leases import LeaseBook
from tokenweir.gateway.state.redis_replies import merged_headers, reserve_rejection, snapshot_view
from tokenweir.gateway.state.redis_wire import RedisClient
from tokenweir.policies.budget import as_key_rejection
from tokenweir.policies.limits import KeyLimits, TeamLimits
from tokenweir.policies.pricing import split_femtos
from tokenweir.policies.reservation import Reservation

NO_KEY_LIMITS = KeyLimits()  # what a key without limits of its own is counted under


class RedisState:
    """`InMemoryState`'s contract over Redis.

    `lease_s` bounds how long a dead replica's concurrency slots last (live ones are renewed every lease_s / 3);
    `hold_s` how long its budget holds last (default lease_s; the app sets it past the longest request, so a
    hold is never reaped while its request still runs). Every call has a socket timeout and the pool waits up
    to `pool_timeout_s` for a free connection instead of failing at once; a call that still fails raises
    `StateUnavailable`, with the change to retry in `pending` when it was a settle or a release.

    `cluster`: `url` names one node of a Redis Cluster (any; the others are found from it), whose pools do not
    wait (gateway.state.redis_connection).

    `require_seeded`: refuse (StateUnseeded) a team Redis holds no seeded spend for, after calling `on_unseeded`
    (which may seed it and answer True, and the reserve is tried again); the app sets both (gateway.state.repair)."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "tw",
        lease_s: float = 60.0,
        hold_s: float | None = None,
        max_connections: int = 256,
        pool_timeout_s: float = 2.0,
        timeout_s: float = 2.0,
        clock=time.time,
        require_seeded: bool = False,
        cluster: bool = False,
    ) -> None:
        assert lease_s > 0 and (hold_s is None or hold_s > 0)
        self._keys = RedisKeyLayout(prefix)
        self.lease_s, self._clock = lease_s, clock
        self.hold_s = hold_s or lease_s
        self._connection = connection = RedisConnection(
            url, max_connections=max_connections, pool_timeout_s=pool_timeout_s, timeout_s=timeout_s, cluster=cluster
        )
        self._redis = connection.client
        self._reserve_script, self._settle = connection.reserve, connection.settle
        self._calls = PackedCalls(self._keys)
        self._lease_book = LeaseBook(self._redis, self._keys, lease_s, clock, REDIS_ERRORS)
        self.live_holds: dict[str, LiveHold] = {}  # by hold id, until settled
        self.require_seeded = require_seeded
        self.on_unseeded: Callable[[str], Awaitable[bool]] | None = None

    @property
    def client(self) -> RedisClient:
        """The client, for other keys under this prefix too; on a cluster a RedisCluster: each command and each
        transaction over keys of one slot."""
        return self._redis

    @property
    def keys(self) -> RedisKeyLayout:
        return self._keys

    @property
    def leases(self) -> dict[tuple[str, str | None], list[str]]:
        """This replica's live slot leases per (team, key or None)."""
        return self._lease_book.leases

    async def reserve(
        self,
        team_id: str,
        limits: TeamLimits,
        prompt_tokens: int,
        max_tokens: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: KeyLimits | None = None,
        cost: int = 0,
    ) -> Reservation:
        key: dict[str, Any] = {"key_id": key_id, "key_limits": key_limits, "cost": cost}
        reservation, _ = await self._reserve(team_id, limits, prompt_tokens, max_tokens, now, None, **key)
        return reservation

    async def reserve_and_acquire(
        self,
        team_id: str,
        limits: TeamLimits,
        prompt_tokens: int,
        max_tokens: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        key_limits: KeyLimits | None = None,
        cost: int = 0,
        lease: Lease,
    ) -> tuple[Reservation, bool]:
        """`reserve` and `acquire_slot` in one script (one round trip): the lease is taken only with the hold, and a
        full slot leaves the hold taken (False: the caller refuses the request, and its settle gives it back)."""
        key: dict[str, Any] = {"key_id": key_id, "key_limits": key_limits, "cost": cost}
        return await self._reserve(team_id, limits, prompt_tokens, max_tokens, now, lease, **key)

    async def _reserve(
        self,
        team_id: str,
        limits: TeamLimits,
        prompt_tokens: int,
        max_tokens: int,
        now: float | None,
        lease: Lease | None,
        *,
        key_id: str | None,
        key_limits: KeyLimits | None,
        cost: int,
        seeding_tried: bool = False,
    ) -> tuple[Reservation, bool]:
        assert prompt_tokens >= 0 and max_tokens >= 0 and cost >= 0
        now = self._clock() if now is None else now
        n = prompt_tokens + max_tokens
        d, m, _, _ = self._keys.periods(now)
        res_id = random_hex()
        # A key without limits is still counted: a limit added later must see what it already spent.
        counted_key = key_id
        counted_limits = None if counted_key is None else key_limits or NO_KEY_LIMITS
        call = self._calls.reserve(
            team_id,
            limits,
            counted_key,
            counted_limits,
            now=now,
            tokens=n,
            cost=cost,
            res_id=res_id,
            hold_s=self.hold_s,
            require_seeded=self.require_seeded,
            lease=lease,
            lease_s=self.lease_s,
        )
        try:
            code, detail, which, took_lease, *used = await self._reserve_script.call(*call)
        except REDIS_ERRORS as e:
            # The hold (and the lease) may have been taken before the answer was lost: a settle of nothing gives
            # it back (and is a no-op if it never was).
            undo = {"op": "settle", "team_id": team_id, "res_id": res_id, "tokens": 0, "now": now}
            undo |= {"key_id": counted_key, "cost": 0}
            if lease is not None:
                undo["release"] = lease.release_op(team_id)
            raise StateUnavailable(f"reserve: {type(e).__name__}: {e}", pending=undo) from e
        if code == 7:  # nothing was taken
            if not seeding_tried and self.on_unseeded is not None and await self._seeded(team_id):
                key: dict[str, Any] = {"key_id": key_id, "key_limits": key_limits, "cost": cost, "seeding_tried": True}
                return await self._reserve(team_id, limits, prompt_tokens, max_tokens, now, lease, **key)
            raise StateUnseeded(f"team {team_id}: its spend is being rebuilt in the shared state after a loss")
        used = [int(u) for u in used]
        subject_limits: list[TeamLimits | KeyLimits] = [limits] if counted_limits is None else [limits, counted_limits]
        headers = merged_headers(subject_limits, used, now)
        if code != 0:
            i = int(which) - 1  # the subject that said no: 0 the team, 1 the key
            rpm_used, tpm_used = used[2 * i], used[2 * i + 1]
            rejection = reserve_rejection(
                int(code), detail, subject_limits[i], rpm_used, tpm_used, n, cost, now, headers
            )
            raise as_key_rejection(rejection) if i else rejection
        self.live_holds[res_id] = LiveHold(team_id, counted_key, n, cost, now, d, m)
        if lease is not None and int(took_lease):
            self._lease_book.taken(team_id, lease.key_id, lease.lease_id)
        hold = Reservation(team_id, n, now, d, m, headers=headers, backend_id=res_id, key_id=counted_key, cost=cost)
        return hold, bool(int(took_lease))

    async def _seeded(self, team_id: str) -> bool:
        assert self.on_unseeded is not None
        try:
            return await self.on_unseeded(team_id)
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"seeding team {team_id}: {type(e).__name__}: {e}") from e

    async def settle(
        self,
        reservation: Reservation,
        prompt_tokens: int,
        completion_tokens: int,
        now: float | None = None,
        *,
        cost: int = 0,
    ) -> Reservation:
        """Idempotent across replicas too: the first settle leaves a tombstone that later ones stop at."""
        return await self.settle_and_release(reservation, prompt_tokens, completion_tokens, now, cost=cost)

    async def settle_and_release(
        self,
        reservation: Reservation,
        prompt_tokens: int,
        completion_tokens: int,
        now: float | None = None,
        *,
        cost: int = 0,
        lease: Lease | None = None,
    ) -> Reservation:
        """`settle` and `release_slot` of `lease` in one script (one round trip). The lease is forgotten here
        before the await, and the round trip finishes even if the caller is cancelled (shielded); a failed call
        raises StateUnavailable with both pending (for the outbox)."""
        assert prompt_tokens >= 0 and completion_tokens >= 0 and cost >= 0
        release = None
        if lease is not None:
            lease_id = self._lease_book.dropped(reservation.team_id, lease.key_id, lease.lease_id)
            release = Lease(lease_id, lease.key_id).release_op(reservation.team_id)
        if reservation.settled:
            if release is not None:
                await asyncio.shield(self.replay(release))
            return reservation
        self.live_holds.pop(reservation.backend_id or "", None)
        now = self._clock() if now is None else now
        op: dict[str, Any] = {"op": "settle", "team_id": reservation.team_id, "res_id": reservation.backend_id}
        op |= {"tokens": prompt_tokens + completion_tokens, "now": now, "key_id": reservation.key_id, "cost": cost}
        if release is not None:
            op["release"] = release
        over = await asyncio.shield(self.replay(op))
        return reservation.mark_settled(prompt_tokens + completion_tokens, cost, max(0, int(over)))

    async def replay(self, op: dict) -> int:
        """Apply a settle (with the release of its lease, given "release") or a slot release alone, now or again
        later from the outbox (both are idempotent: a settle stops at its tombstone, a release of a lease already
        gone removes nothing)."""
        try:
            team_id, key_id = op["team_id"], op.get("key_id")
            if op["op"] == "release_slot":
                await self._lease_book.release(team_id, key_id, op["lease_id"])
                return 0
            assert op["op"] == "settle", op
            return int(await self._settle.call(*self._calls.settle(op)))
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"{op['op']}: {type(e).__name__}: {e}", pending=op) from e

    async def acquire_slot(
        self,
        team_id: str,
        max_concurrency: int | None,
        *,
        key_id: str | None = None,
        key_max: int | None = None,
        lease_id: str | None = None,
    ) -> bool:
        """Take a concurrency lease shared by all replicas (on the team's slots, and the key's given key_id);
        renewed in the background until released. `lease_id`: the caller's name for it (unique), chosen before
        the call so that a restart after this process dies can release it by name (gateway/request/inflight.py)."""
        return await self._lease_book.acquire(team_id, key_id, lease_id or random_hex(), max_concurrency, key_max)

    async def release_slot(self, team_id: str, *, key_id: str | None = None, lease_id: str | None = None) -> None:
        """Drop one of this replica's leases: `lease_id`, the one acquire_slot was given (the request's own, as its
        journal names it), else the newest. The local bookkeeping happens before the await, so a
        cancellation during the round trip still frees the slot here; a failed call raises StateUnavailable with
        the release pending (for the outbox), and Redis lets the lease lapse by expiry meanwhile."""
        lease_id = self._lease_book.dropped(team_id, key_id, lease_id)
        await asyncio.shield(self.replay(Lease(lease_id, key_id).release_op(team_id)))

    async def renew_leases(self) -> None:
        """Push out the expiry of every lease this replica holds (the background task calls this)."""
        await self._lease_book.renew()

    async def seed_spend(
        self,
        team_id: str,
        day_tokens: int,
        month_tokens: int,
        now: float | None = None,
        *,
        key_id: str | None = None,
        day_cost: int | None = None,
        month_cost: int | None = None,
    ) -> None:
        """Fill in spend from the store only where Redis has none: the live counters, shared by replicas that
        may hold unflushed usage, win over a store snapshot taken by whichever replica starts next. Costs are exact
        femto-USD, kept as whole micro-USD plus the femto-USD below one (as SETTLE keeps them)."""
        now = self._clock() if now is None else now
        day_k, month_k, _, _, d_exp, m_exp = self._keys.period_keys(team_id, now, key_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            # one command a statement: the stubs type each as its reply, not as the pipeline it returns
            pipe.hsetnx(day_k, "spent", day_tokens)
            pipe.expire(day_k, d_exp)
            pipe.hsetnx(month_k, "spent", month_tokens)
            pipe.expire(month_k, m_exp)
            for hash_key, cost in ((day_k, day_cost), (month_k, month_cost)):
                if cost is not None:
                    micros, below = split_femtos(cost)
                    pipe.hsetnx(hash_key, "cost_spent", micros)
                    pipe.hsetnx(hash_key, "cost_spent_rem", below)
            await pipe.execute()

    async def snapshot(self, team_id: str, now: float | None = None, *, key_id: str | None = None) -> dict:
        """Live counters across all replicas (one pipelined read); with key_id, that API key's own counters.
        StateUnavailable when Redis cannot answer."""
        now = self._clock() if now is None else now
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                results = await self._keys.snapshot_reads(pipe, team_id, now, key_id).execute()
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"snapshot: {type(e).__name__}: {e}") from e
        return snapshot_view(team_id, now, results)

    async def ping(self) -> None:
        """Readiness: StateUnavailable when Redis does not answer."""
        await self._connection.ping()

    async def close(self) -> None:
        await self._lease_book.close()
        await self._connection.close()
