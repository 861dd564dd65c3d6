"""The Lua scripts behind `RedisState`: one atomic script per decision (reserve, settle, acquire, renew).

Each script names its KEYS and ARGV at the top (every one read once into a named local), and each has a matching
tuple of ARGV names here (`RESERVE_ARGV`, ...) that `script_args` fills in by name, so the Python side and the Lua
side agree on one documented order. Numbers travel as strings; -1 means "unlimited". Key layout: gateway.state_redis.
"""

from __future__ import annotations

# Shared Lua: drop stale slots of a window hash; return used units and the live slots sorted oldest first.
WINDOW_FUNCTIONS = """
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

# Take a hold: rate windows, then budgets; reaps expired holds first. Returns {code, detail, rpm_used, tpm_used}:
# code 0 taken, 1 rpm (detail: wait s), 2 tpm (wait s, -1 never), 3 day / 4 month budget (detail: tokens left).
RESERVE_ARGV = (
    "now",
    "tokens",
    "rpm_limit",
    "tpm_limit",
    "day_limit",
    "month_limit",
    "slot_s",
    "slots",
    "day_period",
    "month_period",
    "day_expire_s",
    "month_expire_s",
    "res_id",
    "hold_s",
    "res_prefix",
)
RESERVE = (
    WINDOW_FUNCTIONS
    + """
-- KEYS: rpm_window tpm_window day_hash month_hash holds_zset meta_hash
-- ARGV: now, tokens (prompt + max_tokens to hold), rpm_limit, tpm_limit, day_limit, month_limit (-1: unlimited),
--   slot_s, slots (window slot length and count), day_period, month_period (the current periods' keys),
--   day_expire_s, month_expire_s (the period hashes' TTLs), res_id, hold_s (the hold's lease), res_prefix
local rpm_window, tpm_window, day_hash, month_hash = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local holds_zset, meta_hash = KEYS[5], KEYS[6]
local now_text, n = ARGV[1], tonumber(ARGV[2])
local rpm_text, tpm_text, day_text, month_text = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local slot_s, slots = tonumber(ARGV[7]), tonumber(ARGV[8])
local day_period, month_period = ARGV[9], ARGV[10]
local day_expire_s, month_expire_s = ARGV[11], ARGV[12]
local res_id, hold_s, res_prefix = ARGV[13], tonumber(ARGV[14]), ARGV[15]
local now = tonumber(now_text)
local rpm_l, tpm_l, day_l, month_l = tonumber(rpm_text), tonumber(tpm_text), tonumber(day_text), tonumber(month_text)

local cur = math.floor(now / slot_s)
redis.call('HSET', meta_hash, 'rpm', rpm_text, 'tpm', tpm_text, 'day_limit', day_text, 'month_limit', month_text)
-- reap holds whose replica never settled them: their tokens go back to the periods still current
for _, id in ipairs(redis.call('ZRANGEBYSCORE', holds_zset, '-inf', now)) do
  local res = res_prefix .. id
  local r = redis.call('HMGET', res, 'tokens', 'day_key', 'month_key')
  local t = tonumber(r[1] or '0') or 0
  if r[2] == day_period then give_back(day_hash, 'reserved', t) end
  if r[3] == month_period then give_back(month_hash, 'reserved', t) end
  give_back(meta_hash, 'reserved', t)
  if r[1] then  -- tombstone: a settle arriving late still bills its tokens, without a second give-back
    redis.call('HSET', res, 'state', 'reaped')
    redis.call('EXPIRE', res, 86400)
  end
  redis.call('ZREM', holds_zset, id)
end
local rpm_used, rpm_live = window(rpm_window, cur - slots)
local tpm_used, tpm_live = window(tpm_window, cur - slots)
if rpm_l >= 0 and rpm_used + 1 > rpm_l then
  return {1, tostring(wait_for(rpm_used, rpm_live, 1, rpm_l, slots, slot_s, now)), rpm_used, tpm_used}
end
if tpm_l >= 0 and tpm_used + n > tpm_l then
  return {2, tostring(wait_for(tpm_used, tpm_live, n, tpm_l, slots, slot_s, now)), rpm_used, tpm_used}
end
local budgets = {{day_hash, day_l, 3}, {month_hash, month_l, 4}}
for _, b in ipairs(budgets) do
  local taken = hget_num(b[1], 'spent') + hget_num(b[1], 'reserved')
  if b[2] >= 0 and taken + n > b[2] then return {b[3], tostring(math.max(0, b[2] - taken)), rpm_used, tpm_used} end
end
local ttl_ms = math.ceil((slots + 2) * slot_s * 1000)
redis.call('HINCRBY', rpm_window, cur, 1)
redis.call('PEXPIRE', rpm_window, ttl_ms)
redis.call('HINCRBY', tpm_window, cur, n)
redis.call('PEXPIRE', tpm_window, ttl_ms)
redis.call('HINCRBY', day_hash, 'reserved', n)
redis.call('EXPIRE', day_hash, day_expire_s)
redis.call('HINCRBY', month_hash, 'reserved', n)
redis.call('EXPIRE', month_hash, month_expire_s)
redis.call('HINCRBY', meta_hash, 'reserved', n)
local res = res_prefix .. res_id
redis.call('HSET', res, 'tokens', n, 'taken_at', now_text, 'day_key', day_period, 'month_key', month_period)
redis.call('EXPIRE', res, math.ceil(hold_s) + 3600)
redis.call('ZADD', holds_zset, now + hold_s, res_id)
return {0, '0', rpm_used + 1, tpm_used + n}
"""
)

# Settle a hold: bill the actual tokens, give the held ones back, leave a tombstone. Returns the overshoot (tokens
# beyond the hold), or -1 when this hold was already settled.
SETTLE_ARGV = (
    "now",
    "actual",
    "slot_s",
    "slots",
    "day_period",
    "month_period",
    "day_expire_s",
    "month_expire_s",
    "res_id",
)
SETTLE = (
    WINDOW_FUNCTIONS
    + """
-- KEYS: tpm_window day_hash month_hash holds_zset meta_hash res_hash
-- ARGV: now, actual (tokens used), slot_s, slots, day_period, month_period, day_expire_s, month_expire_s, res_id
local tpm_window, day_hash, month_hash = KEYS[1], KEYS[2], KEYS[3]
local holds_zset, meta_hash, res_hash = KEYS[4], KEYS[5], KEYS[6]
local now, actual = tonumber(ARGV[1]), tonumber(ARGV[2])
local slot_s, slots = tonumber(ARGV[3]), tonumber(ARGV[4])
local day_period, month_period = ARGV[5], ARGV[6]
local day_expire_s, month_expire_s = ARGV[7], ARGV[8]
local res_id = ARGV[9]

local r = redis.call('HMGET', res_hash, 'tokens', 'taken_at', 'day_key', 'month_key', 'state')
if r[5] == 'settled' then return -1 end  -- idempotent: the first settle left this tombstone
-- a hold reaped (its lease ran out) or long gone: bill the tokens anyway, nothing is left to give back
local held = r[1] and r[5] ~= 'reaped'
local tokens, taken_at = tonumber(r[1] or actual), tonumber(r[2] or now)
local cur = math.floor(now / slot_s)
if actual < tokens then
  local slot = math.floor(taken_at / slot_s)
  if slot >= cur - slots then
    local have = hget_num(tpm_window, slot)
    if have > 0 then redis.call('HINCRBY', tpm_window, slot, -math.min(tokens - actual, have)) end
  end
elseif actual > tokens then
  redis.call('HINCRBY', tpm_window, cur, actual - tokens)
  redis.call('PEXPIRE', tpm_window, math.ceil((slots + 2) * slot_s * 1000))
end
local over = math.max(0, actual - tokens)
local periods = {{day_hash, r[3], day_period, day_expire_s}, {month_hash, r[4], month_period, month_expire_s}}
for _, p in ipairs(periods) do
  if held and p[2] == p[3] then give_back(p[1], 'reserved', tokens) end  -- else it left with its period
  redis.call('HINCRBY', p[1], 'spent', actual)
  redis.call('HINCRBY', p[1], 'overshoot', over)
  redis.call('EXPIRE', p[1], p[4])
end
if held then give_back(meta_hash, 'reserved', tokens) end
redis.call('ZREM', holds_zset, res_id)
redis.call('HSET', res_hash, 'state', 'settled')
redis.call('EXPIRE', res_hash, 86400)
return over
"""
)

# Take a concurrency lease unless the team is at its maximum (expired leases are dropped first). Returns 1 or 0.
ACQUIRE_ARGV = ("now", "lease_s", "max_concurrency", "lease_id")
ACQUIRE = """
-- KEYS: slots_zset
-- ARGV: now, lease_s, max_concurrency (-1: unlimited), lease_id
local slots_zset = KEYS[1]
local now, lease_s, max_concurrency, lease_id = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]

redis.call('ZREMRANGEBYSCORE', slots_zset, '-inf', now)
if max_concurrency >= 0 and redis.call('ZCARD', slots_zset) >= max_concurrency then return 0 end
redis.call('ZADD', slots_zset, now + lease_s, lease_id)
redis.call('PEXPIRE', slots_zset, math.ceil(lease_s * 1000) + 1000)
return 1
"""

# Push out the expiry of live leases (XX: a lease already reaped stays gone). ARGV is variadic: the two named
# values, then every lease id (see `RedisState.renew_leases`).
RENEW = """
-- KEYS: slots_zset
-- ARGV: expiry, ttl_ms, lease_id...
local slots_zset = KEYS[1]
local expiry, ttl_ms = ARGV[1], ARGV[2]

for i = 3, #ARGV do redis.call('ZADD', slots_zset, 'XX', expiry, ARGV[i]) end
if redis.call('EXISTS', slots_zset) == 1 then redis.call('PEXPIRE', slots_zset, ttl_ms) end
return 1
"""


def script_args(order: tuple[str, ...], **values) -> list:
    """A script's ARGV from named values, in the order `order` (e.g. RESERVE_ARGV) documents."""
    if values.keys() != set(order):
        raise TypeError(f"script arguments {sorted(values)} do not match {order}")
    return [values[name] for name in order]
