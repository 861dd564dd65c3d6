"""Shared live state in Redis for several gateway replicas: the same methods as `InMemoryState`.

Every decision is one Lua script (one round trip, atomic on the server), so N replicas together admit exactly
what one would: limits are never multiplied by the replica count. Layout per team (a `{team}` hash tag keeps a
team's keys in one cluster slot):
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
from policies.budget import DAY, MONTH, day_key, month_key, period_bounds, seconds_until_reset
from policies.decisions import budget_rejection, rate_rejection
from policies.limits import TeamLimits
from policies.reservation import Reservation
from policies.retry import reset_header

# What a call to an unreachable, slow or overloaded Redis raises (a pool that waited in vain raises
# ConnectionError("No connection available"), a command past its socket timeout TimeoutError). Under uvloop a
# write on a connection Redis reset raises RuntimeError ("unable to perform operation on <TCPTransport
# closed=True>"), not an OSError.
REDIS_ERRORS = (redis.RedisError, OSError, TimeoutError, RuntimeError)

WINDOW_S = 60.0
SLOTS = 60
_NONE = -1  # "unlimited" on the wire

# Shared Lua: drop stale slots of a window hash; return used units and the live slots sorted oldest first.
_WINDOW = """
local function window(key, oldest)
  local h = redis.call('HGETALL', key)
  local used, live, stale = 0, {}, {}
  for i = 1, #h, 2 do
    local s, c = tonumber(h[i]), tonumber(h[i + 1])
    if s < oldest then stale[#stale + 1] = h[i] else used = used + c; live[#live + 1] = {s, c} end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(live, function(a, b) return a[1] < b[1] end)
  return used, live
end
local function wait_for(used, live, n, limit, slots, slot_s, now)
  if n > limit then return -1 end
  if used + n <= limit then return 0 end
  local freed = 0
  for _, e in ipairs(live) do
    freed = freed + e[2]
    if used - freed + n <= limit then return math.max(0, (e[1] + slots + 1) * slot_s - now) end
  end
  return slots * slot_s
end
local function hget_num(key, field)
  return tonumber(redis.call('HGET', key, field) or '0') or 0
end
local function give_back(key, field, n)  -- decrement, never below zero
  local have = hget_num(key, field)
  redis.call('HSET', key, field, math.max(0, have - n))
end
"""

# KEYS: rpm tpm day month holds meta   ARGV: now n rpm tpm day_limit month_limit slot_s slots day_key month_key
#   day_expire month_expire res_id lease_s res_prefix
_RESERVE = (
    _WINDOW
    + """
local now, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local rpm_l, tpm_l, day_l, month_l = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local slot_s, slots = tonumber(ARGV[7]), tonumber(ARGV[8])
local cur = math.floor(now / slot_s)
redis.call('HSET', KEYS[6], 'rpm', ARGV[3], 'tpm', ARGV[4], 'day_limit', ARGV[5], 'month_limit', ARGV[6])
-- reap holds whose replica never settled them: their tokens go back to the periods still current
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)) do
  local res = ARGV[15] .. id
  local r = redis.call('HMGET', res, 'tokens', 'day_key', 'month_key')
  local t = tonumber(r[1] or '0') or 0
  if r[2] == ARGV[9] then give_back(KEYS[3], 'reserved', t) end
  if r[3] == ARGV[10] then give_back(KEYS[4], 'reserved', t) end
  give_back(KEYS[6], 'reserved', t)
  if r[1] then  -- tombstone: a settle arriving late still bills its tokens, without a second give-back
    redis.call('HSET', res, 'state', 'reaped')
    redis.call('EXPIRE', res, 86400)
  end
  redis.call('ZREM', KEYS[5], id)
end
local rpm_used, rpm_live = window(KEYS[1], cur - slots)
local tpm_used, tpm_live = window(KEYS[2], cur - slots)
if rpm_l >= 0 and rpm_used + 1 > rpm_l then
  return {1, tostring(wait_for(rpm_used, rpm_live, 1, rpm_l, slots, slot_s, now)), rpm_used, tpm_used}
end
if tpm_l >= 0 and tpm_used + n > tpm_l then
  return {2, tostring(wait_for(tpm_used, tpm_live, n, tpm_l, slots, slot_s, now)), rpm_used, tpm_used}
end
local budgets = {{KEYS[3], day_l, 3}, {KEYS[4], month_l, 4}}
for _, b in ipairs(budgets) do
  local taken = hget_num(b[1], 'spent') + hget_num(b[1], 'reserved')
  if b[2] >= 0 and taken + n > b[2] then return {b[3], tostring(math.max(0, b[2] - taken)), rpm_used, tpm_used} end
end
local ttl_ms = math.ceil((slots + 2) * slot_s * 1000)
redis.call('HINCRBY', KEYS[1], cur, 1)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
redis.call('HINCRBY', KEYS[2], cur, n)
redis.call('PEXPIRE', KEYS[2], ttl_ms)
redis.call('HINCRBY', KEYS[3], 'reserved', n)
redis.call('EXPIRE', KEYS[3], ARGV[11])
redis.call('HINCRBY', KEYS[4], 'reserved', n)
redis.call('EXPIRE', KEYS[4], ARGV[12])
redis.call('HINCRBY', KEYS[6], 'reserved', n)
local res = ARGV[15] .. ARGV[13]
redis.call('HSET', res, 'tokens', n, 'taken_at', ARGV[1], 'day_key', ARGV[9], 'month_key', ARGV[10])
redis.call('EXPIRE', res, math.ceil(tonumber(ARGV[14])) + 3600)
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[14]), ARGV[13])
return {0, '0', rpm_used + 1, tpm_used + n}
"""
)

# KEYS: tpm day month holds meta res   ARGV: now actual slot_s slots day_key month_key day_expire month_expire id
_SETTLE = (
    _WINDOW
    + """
local r = redis.call('HMGET', KEYS[6], 'tokens', 'taken_at', 'day_key', 'month_key', 'state')
if r[5] == 'settled' then return -1 end  -- idempotent: the first settle left this tombstone
local now, actual = tonumber(ARGV[1]), tonumber(ARGV[2])
local slot_s, slots = tonumber(ARGV[3]), tonumber(ARGV[4])
-- a hold reaped (its lease ran out) or long gone: bill the tokens anyway, nothing is left to give back
local held = r[1] and r[5] ~= 'reaped'
local tokens, taken_at = tonumber(r[1] or actual), tonumber(r[2] or now)
local cur = math.floor(now / slot_s)
if actual < tokens then
  local slot = math.floor(taken_at / slot_s)
  if slot >= cur - slots then
    local have = hget_num(KEYS[1], slot)
    if have > 0 then redis.call('HINCRBY', KEYS[1], slot, -math.min(tokens - actual, have)) end
  end
elseif actual > tokens then
  redis.call('HINCRBY', KEYS[1], cur, actual - tokens)
  redis.call('PEXPIRE', KEYS[1], math.ceil((slots + 2) * slot_s * 1000))
end
local over = math.max(0, actual - tokens)
local periods = {{KEYS[2], r[3], ARGV[5], ARGV[7]}, {KEYS[3], r[4], ARGV[6], ARGV[8]}}
for _, p in ipairs(periods) do
  if held and p[2] == p[3] then give_back(p[1], 'reserved', tokens) end  -- else it left with its period
  redis.call('HINCRBY', p[1], 'spent', actual)
  redis.call('HINCRBY', p[1], 'overshoot', over)
  redis.call('EXPIRE', p[1], p[4])
end
if held then give_back(KEYS[5], 'reserved', tokens) end
redis.call('ZREM', KEYS[4], ARGV[9])
redis.call('HSET', KEYS[6], 'state', 'settled')
redis.call('EXPIRE', KEYS[6], 86400)
return over
"""
)

# KEYS: slots   ARGV: now lease_s max lease_id
_ACQUIRE = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local max = tonumber(ARGV[3])
if max >= 0 and redis.call('ZCARD', KEYS[1]) >= max then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[4])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000) + 1000)
return 1
"""

# KEYS: slots   ARGV: expiry ttl_ms lease_id...   (XX: a lease already reaped stays gone)
_RENEW = """
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i]) end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


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
        self._reserve = self._redis.register_script(_RESERVE)
        self._settle = self._redis.register_script(_SETTLE)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
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
        keys = [self._key(team_id, "rpm"), self._key(team_id, "tpm"), day_k, month_k]
        keys += [self._key(team_id, "holds"), self._key(team_id, "meta")]
        args = [repr(now), n, _lim(limits.rpm), _lim(limits.tpm), _lim(limits.tokens_per_day)]
        args += [_lim(limits.tokens_per_month), WINDOW_S / SLOTS, SLOTS, d, m, d_exp, m_exp, res_id, self.hold_s]
        args += [self._key(team_id, "res:")]
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
            keys = [self._key(team_id, "tpm"), day_k, month_k, self._key(team_id, "holds")]
            keys += [self._key(team_id, "meta"), self._key(team_id, f"res:{res_id}")]
            args = [repr(now), op["tokens"], WINDOW_S / SLOTS, SLOTS, d, m, d_exp, m_exp, res_id]
            return int(await self._settle(keys=keys, args=args))
        except REDIS_ERRORS as e:
            raise StateUnavailable(f"{op['op']}: {type(e).__name__}: {e}", pending=op) from e

    async def acquire_slot(self, team_id: str, max_concurrency: int | None) -> bool:
        """Take a concurrency lease shared by all replicas; renewed in the background until released."""
        lease_id = uuid.uuid4().hex
        key = self._key(team_id, "slots")
        args = [repr(self._clock()), self.lease_s, _lim(max_concurrency), lease_id]
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
        oldest = math.floor(now / (WINDOW_S / SLOTS)) - SLOTS
        rpm, tpm, day, month, meta, in_flight, holds = results

        def used(window: dict) -> int:
            return sum(int(c) for s, c in window.items() if int(s) >= oldest)

        def period(h: dict, key: str, period_name: str) -> dict:
            return {
                "period": key,
                "spent": int(h.get("spent", 0)),
                "reserved": int(h.get("reserved", 0)),
                "overshoot": int(h.get("overshoot", 0)),
                "resets_in_s": round(seconds_until_reset(period_name, now), 3),
            }

        def limit(name: str) -> int | None:
            value = int(meta.get(name, _NONE))
            return None if value == _NONE else value

        def left(lim: int | None, taken: int) -> int | None:
            return None if lim is None else max(0, lim - taken)

        day_view, month_view = period(day, d, DAY), period(month, m, MONTH)
        for view, name in ((day_view, "day_limit"), (month_view, "month_limit")):
            view["limit"] = limit(name)
            view["remaining"] = left(view["limit"], view["spent"] + view["reserved"])
        rpm_used, tpm_used = used(rpm), used(tpm)
        return {
            "team_id": team_id,
            "in_flight": in_flight,
            "reserved_tokens": int(meta.get("reserved", 0)),
            "open_reservations": holds,
            "requests_last_minute": rpm_used,
            "tokens_last_minute": tpm_used,
            "remaining_requests": left(limit("rpm"), rpm_used),
            "remaining_tokens": left(limit("tpm"), tpm_used),
            "day": day_view,
            "month": month_view,
            "spent_today": day_view["spent"],
            "spent_month": month_view["spent"],
            "remaining_day": day_view["remaining"],
            "remaining_month": month_view["remaining"],
        }

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        await self._redis.aclose()
        self._sync.close()


def _headers(limits: TeamLimits, rpm_used: int, tpm_used: int, now: float) -> dict[str, str]:
    """x-ratelimit-* as InMemoryState sends them; reset is when a slot taken now leaves the window."""
    slot_s = WINDOW_S / SLOTS
    reset = reset_header((math.floor(now / slot_s) + SLOTS + 1) * slot_s - now)
    headers = {}
    if limits.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - rpm_used))
        headers["x-ratelimit-reset-requests"] = reset
    if limits.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - tpm_used))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers
