"""Shared live state in Redis for several gateway replicas: the same methods as `InMemoryState`.

Every decision is one Lua script (gateway.state_redis_lua; one round trip, atomic on the server), so N replicas
together admit exactly what one would: limits are never multiplied by the replica count. Layout per team (a
`{team}` hash tag keeps a team's keys in one cluster slot):
  rpm / tpm           hash slot_index -> units: the same sliding window as `policies.rate.SlidingWindow`
  day:<key> month:<key>  hash spent / reserved / overshoot, expiring a day after the period ends
  holds               zset reservation id -> lease expiry; res:<id> hash with what the hold took
  slots               zset lease id -> lease expiry (concurrency)
A replica that dies without settling cannot hold budget or slots forever: expired holds are reaped (their
tokens given back) by the next reserve, expired slot leases by the next acquire. Live leases are renewed by a
background task. Budget and lease expiries are fixed points (period end, lease end), never pushed out by an
increment; a window hash's TTL does follow its newest write, which is harmless because the counts inside age
out by slot index, not by TTL (the TTL only garbage-collects an idle team's hash).
Times come from the calling replica's clock (NTP-synced replicas agree to well within a 1 s slot); `snapshot`
and `seed_spend` are sync by contract and use a small blocking client (an admin call, a metrics scrape).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid

import redis
import redis.asyncio as aioredis

from gateway.state import StateUnavailable
from gateway.state_redis_lua import (
    ACQUIRE,
    ACQUIRE_ARGV,
    RENEW,
    RESERVE,
    RESERVE_ARGV,
    SETTLE,
    SETTLE_ARGV,
    script_args,
)
from policies.budget import DAY, MONTH, day_key, month_key, period_bounds, seconds_until_reset
from policies.decisions import budget_rejection, rate_rejection
from policies.limits import TeamLimits
from policies.rate import SLOTS, WINDOW_S, oldest_counted_slot, slot_index, slot_leaves_window_s
from policies.reservation import Reservation
from policies.snapshot import WindowHeaders, budget_view, ratelimit_headers, remaining, team_snapshot

# What a call to an unreachable, slow or overloaded Redis raises (a pool that waited in vain raises
# ConnectionError("No connection available"), a command past its socket timeout TimeoutError). Under uvloop a
# write on a connection Redis reset raises RuntimeError ("unable to perform operation on <TCPTransport
# closed=True>"), not an OSError.
REDIS_ERRORS = (redis.RedisError, OSError, TimeoutError, RuntimeError)

_NONE = -1  # "unlimited" on the wire


def _lim(value: int | None) -> int:
    return _NONE if value is None else value


class RedisState:
    """`InMemoryState`'s contract over Redis.

    `lease_s` bounds how long a dead replica's concurrency slots last (live ones are renewed every lease_s / 3);
    `hold_s` how long its budget holds last (default lease_s; the app sets it past the longest request, so a
    hold is never reaped while its request still runs). Every call has a socket timeout and the pool waits up
    to `pool_timeout_s` for a free connection instead of failing at once; a call that still fails raises
    `StateUnavailable`, with the change to retry in `pending` when it was a settle or a release."""

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
    ) -> None:
        assert lease_s > 0 and (hold_s is None or hold_s > 0)
        self.prefix, self.lease_s, self._clock = prefix, lease_s, clock
        self.hold_s = hold_s or lease_s
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=pool_timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        # seed_spend() and snapshot() are sync by contract (start-up, tests)
        self._sync = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._reserve = self._redis.register_script(RESERVE)
        self._settle = self._redis.register_script(SETTLE)
        self._acquire = self._redis.register_script(ACQUIRE)
        self._renew = self._redis.register_script(RENEW)
        self._leases: dict[str, list[str]] = {}  # this replica's live slot leases per team
        self._renewer: asyncio.Task | None = None

    def _key(self, team_id: str, name: str) -> str:
        return f"{self.prefix}:{{{team_id}}}:{name}"

    def _period_keys(self, team_id: str, now: float) -> tuple[str, str, str, str, int, int]:
        d, m = day_key(now), month_key(now)
        # kept a day past the period's end so a snapshot at 00:00:01 can still read yesterday's numbers
        # (relative TTLs from the caller's clock, so Redis's own clock never has to agree with ours)
        d_exp = math.ceil(period_bounds(DAY, now)[1] - now) + 86400
        m_exp = math.ceil(period_bounds(MONTH, now)[1] - now) + 86400
        return self._key(team_id, f"day:{d}"), self._key(team_id, f"month:{m}"), d, m, d_exp, m_exp

    async def reserve(
        self, team_id: str, limits: TeamLimits, prompt_tokens: int, max_tokens: int, now: float | None = None
    ) -> Reservation:
        assert prompt_tokens >= 0 and max_tokens >= 0
        now = self._clock() if now is None else now
        n = prompt_tokens + max_tokens
        day_k, month_k, d, m, d_exp, m_exp = self._period_keys(team_id, now)
        res_id = uuid.uuid4().hex
        # KEYS: rpm_window tpm_window day_hash month_hash holds_zset meta_hash (see state_redis_lua.RESERVE)
        keys = [self._key(team_id, "rpm"), self._key(team_id, "tpm"), day_k, month_k]
        keys += [self._key(team_id, "holds"), self._key(team_id, "meta")]
        args = script_args(
            RESERVE_ARGV,
            now=repr(now),
            tokens=n,
            rpm_limit=_lim(limits.rpm),
            tpm_limit=_lim(limits.tpm),
            day_limit=_lim(limits.tokens_per_day),
            month_limit=_lim(limits.tokens_per_month),
            slot_s=WINDOW_S / SLOTS,
            slots=SLOTS,
            day_period=d,
            month_period=m,
            day_expire_s=d_exp,
            month_expire_s=m_exp,
            res_id=res_id,
            hold_s=self.hold_s,
            res_prefix=self._key(team_id, "res:"),
        )
        try:
            code, detail, rpm_used, tpm_used = await self._reserve(keys=keys, args=args)
        except REDIS_ERRORS as e:
            # The hold may have been taken before the answer was lost: a settle of nothing gives it back (and
            # is a no-op if it never was).
            undo = {"op": "settle", "team_id": team_id, "res_id": res_id, "tokens": 0, "now": now}
            raise StateUnavailable(f"reserve: {type(e).__name__}: {e}", pending=undo) from e
        headers = _headers(limits, int(rpm_used), int(tpm_used), now)
        if code == 1:
            wait = float(detail)
            raise rate_rejection("requests", limits.rpm, max(0, limits.rpm - rpm_used), 1, wait, headers)
        if code == 2:
            wait = None if float(detail) < 0 else float(detail)
            raise rate_rejection("tokens", limits.tpm, max(0, limits.tpm - tpm_used), n, wait, headers)
        if code in (3, 4):
            period, limit = (DAY, limits.tokens_per_day) if code == 3 else (MONTH, limits.tokens_per_month)
            reset = seconds_until_reset(period, now)
            raise budget_rejection(period, limit, int(detail), n, reset, headers)
        return Reservation(team_id, n, now, d, m, headers=headers, backend_id=res_id)

    async def settle(
        self, reservation: Reservation, prompt_tokens: int, completion_tokens: int, now: float | None = None
    ) -> Reservation:
        """Idempotent across replicas too: the first settle leaves a tombstone that later ones stop at."""
        assert prompt_tokens >= 0 and completion_tokens >= 0
        if reservation.settled:
            return reservation
        now = self._clock() if now is None else now
        op = {"op": "settle", "team_id": reservation.team_id, "res_id": reservation.backend_id}
        op |= {"tokens": prompt_tokens + completion_tokens, "now": now}
        over = await self.replay(op)
        reservation.settled = True
        reservation.actual_tokens = prompt_tokens + completion_tokens
        reservation.overshoot = max(0, int(over))
        return reservation

    async def replay(self, op: dict) -> int:
        """Apply a settle or a slot release, now or again later from the outbox (both are idempotent: a settle
        stops at its tombstone, a release of a lease already gone removes nothing)."""
        try:
            if op["op"] == "release_slot":
                await self._redis.zrem(self._key(op["team_id"], "slots"), op["lease_id"])
                return 0
            assert op["op"] == "settle", op
            team_id, res_id, now = op["team_id"], op["res_id"], op["now"]
            day_k, month_k, d, m, d_exp, m_exp = self._period_keys(team_id, now)
            # KEYS: tpm_window day_hash month_hash holds_zset meta_hash res_hash (see state_redis_lua.SETTLE)
            keys = [self._key(team_id, "tpm"), day_k, month_k, self._key(team_id, "holds")]
            keys += [self._key(team_id, "meta"), self._key(team_id, f"res:{res_id}")]
            args = script_args(
                SETTLE_ARGV,
                now=repr(now),
                actual=op["tokens"],
                slot_s=WINDOW_S / SLOTS,
                slots=SLOTS,
                day_period=d,
                month_period=m,
                day_expire_s=d_exp,
                month_expire_s=m_exp,
                res_id=res_id,
            )
            return int(await self._settle(keys=keys, args=args))
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"{op['op']}: {type(e).__name__}: {e}", pending=op) from e

    async def acquire_slot(self, team_id: str, max_concurrency: int | None) -> bool:
        """Take a concurrency lease shared by all replicas; renewed in the background until released."""
        lease_id = uuid.uuid4().hex
        key = self._key(team_id, "slots")
        args = script_args(
            ACQUIRE_ARGV,
            now=repr(self._clock()),
            lease_s=self.lease_s,
            max_concurrency=_lim(max_concurrency),
            lease_id=lease_id,
        )
        try:
            if not await self._acquire(keys=[key], args=args):
                return False
        except REDIS_ERRORS as e:
            # The lease may have been taken before the answer was lost: release it, or it would hold one of the
            # team's slots until it expires.
            undo = {"op": "release_slot", "team_id": team_id, "lease_id": lease_id}
            raise StateUnavailable(f"acquire_slot: {type(e).__name__}: {e}", pending=undo) from e
        self._leases.setdefault(team_id, []).append(lease_id)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop())
        return True

    async def release_slot(self, team_id: str) -> None:
        """Drop one of this replica's leases. The local bookkeeping happens before the await, so a
        cancellation during the round trip still frees the slot here; a failed call raises StateUnavailable with
        the release pending (for the outbox), and Redis lets the lease lapse by expiry meanwhile."""
        leases = self._leases.get(team_id)
        assert leases, f"release_slot without acquire_slot for team {team_id}"
        lease_id = leases.pop()
        if not leases:
            del self._leases[team_id]
        await asyncio.shield(self.replay({"op": "release_slot", "team_id": team_id, "lease_id": lease_id}))

    async def renew_leases(self) -> None:
        """Push out the expiry of every lease this replica holds (the background task calls this)."""
        expiry = repr(self._clock() + self.lease_s)
        ttl_ms = math.ceil(self.lease_s * 1000) + 1000
        for team_id, leases in list(self._leases.items()):
            if leases:
                # ARGV: expiry, ttl_ms, then every lease id (see state_redis_lua.RENEW)
                await self._renew(keys=[self._key(team_id, "slots")], args=[expiry, ttl_ms, *leases])

    async def _renew_loop(self) -> None:
        while self._leases:
            await asyncio.sleep(self.lease_s / 3)
            with contextlib.suppress(*REDIS_ERRORS):  # Redis is away: next round (a lease lasts three)
                await self.renew_leases()

    def seed_spend(self, team_id: str, day_tokens: int, month_tokens: int, now: float | None = None) -> None:
        """Fill in spend from the store only where Redis has none: the live counters, shared by replicas that
        may hold unflushed usage, win over a store snapshot taken by whichever replica starts next."""
        now = self._clock() if now is None else now
        day_k, month_k, _, _, d_exp, m_exp = self._period_keys(team_id, now)
        with self._sync.pipeline() as pipe:
            pipe.hsetnx(day_k, "spent", day_tokens).expire(day_k, d_exp)
            pipe.hsetnx(month_k, "spent", month_tokens).expire(month_k, m_exp)
            pipe.execute()

    def snapshot(self, team_id: str, now: float | None = None) -> dict:
        """Live counters across all replicas (one pipelined read; sync because the contract is)."""
        now = self._clock() if now is None else now
        with self._sync.pipeline(transaction=False) as pipe:
            return self._snapshot_view(team_id, now, self._snapshot_reads(pipe, team_id, now).execute())

    async def read_snapshot(self, team_id: str) -> dict:
        """`snapshot` without blocking the event loop; StateUnavailable when Redis cannot answer."""
        now = self._clock()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                results = await self._snapshot_reads(pipe, team_id, now).execute()
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"snapshot: {type(e).__name__}: {e}") from e
        return self._snapshot_view(team_id, now, results)

    async def ping(self) -> None:
        """Readiness: StateUnavailable when Redis does not answer."""
        try:
            await self._redis.ping()
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"ping: {type(e).__name__}: {e}") from e

    def _snapshot_reads(self, pipe, team_id: str, now: float):
        day_k, month_k, *_ = self._period_keys(team_id, now)
        pipe.hgetall(self._key(team_id, "rpm")).hgetall(self._key(team_id, "tpm"))
        pipe.hgetall(day_k).hgetall(month_k).hgetall(self._key(team_id, "meta"))
        return pipe.zcount(self._key(team_id, "slots"), f"({now!r}", "+inf").zcard(self._key(team_id, "holds"))

    def _snapshot_view(self, team_id: str, now: float, results: list) -> dict:
        _, _, d, m, _, _ = self._period_keys(team_id, now)
        oldest = oldest_counted_slot(now, WINDOW_S / SLOTS, SLOTS)
        rpm, tpm, day, month, meta, in_flight, holds = results

        def used(window: dict) -> int:
            return sum(int(c) for s, c in window.items() if int(s) >= oldest)

        def limit(name: str) -> int | None:
            value = int(meta.get(name, _NONE))
            return None if value == _NONE else value

        def period(h: dict, period_name: str, key: str, limit_name: str) -> dict:
            spent, reserved, over = (int(h.get(k, 0)) for k in ("spent", "reserved", "overshoot"))
            return budget_view(period_name, key, limit(limit_name), spent, reserved, over, now)

        rpm_used, tpm_used = used(rpm), used(tpm)
        return team_snapshot(
            team_id,
            in_flight=in_flight,
            reserved_tokens=int(meta.get("reserved", 0)),
            open_reservations=holds,
            requests_last_minute=rpm_used,
            tokens_last_minute=tpm_used,
            remaining_requests=remaining(limit("rpm"), rpm_used),
            remaining_tokens=remaining(limit("tpm"), tpm_used),
            day=period(day, DAY, d, "day_limit"),
            month=period(month, MONTH, m, "month_limit"),
        )

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        await self._redis.aclose()
        self._sync.close()


def _headers(limits: TeamLimits, rpm_used: int, tpm_used: int, now: float) -> dict[str, str]:
    """x-ratelimit-* as InMemoryState sends them; reset is when a slot taken now leaves the window."""
    slot_s = WINDOW_S / SLOTS
    reset = slot_leaves_window_s(slot_index(now, slot_s), now, slot_s, SLOTS)
    rpm = None if limits.rpm is None else WindowHeaders(limits.rpm, remaining(limits.rpm, rpm_used), reset)
    tpm = None if limits.tpm is None else WindowHeaders(limits.tpm, remaining(limits.tpm, tpm_used), reset)
    return ratelimit_headers(rpm, tpm)
