"""The Lua scripts behind `RedisState`: one atomic script per decision (reserve, settle, acquire, renew). A request's
hot path is two of them: RESERVE, which also takes its concurrency lease, and SETTLE, which also gives the lease back
(one round trip each; ACQUIRE and the release alone serve callers that hold no reservation).

Each script names its KEYS and ARGV at the top (every one read once into a named local), and each has a matching
tuple of ARGV names here (`RESERVE_ARGV`, ...) that `script_args` fills in by name, so the Python side and the Lua
side agree on one documented order. Numbers travel as strings; -1 means "unlimited".
Key layout: gateway.state.redis_keys.
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

# Take a lease on every slots zset given unless one is at its maximum (-1: none; expired leases are dropped first).
LEASE_FUNCTIONS = """
local function take_lease(slot_keys, maxes, now, lease_s, lease_id)
  for i, key in ipairs(slot_keys) do
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    if maxes[i] >= 0 and redis.call('ZCARD', key) >= maxes[i] then return 0 end
  end
  for _, key in ipairs(slot_keys) do
    redis.call('ZADD', key, now + lease_s, lease_id)
    redis.call('PEXPIRE', key, math.ceil(lease_s * 1000) + 1000)
  end
  return 1
end
local function slot_keys_after(n_subject_keys, n_slots)  -- the slots zsets that follow the subjects' KEYS
  local keys = {}
  for j = 1, n_slots do keys[j] = KEYS[n_subject_keys + j] end
  return keys
end
"""

# ARGV[4..10] of both the reserve and the settle script: the rate window's slots, the budget periods, the hold's id.
WINDOW_ARGV = ("slot_s", "slots", "day_period", "month_period", "day_expire_s", "month_expire_s", "res_id")

# Take a hold on every subject (the team; then the API key, whose spend is counted limits or not): rate windows, then
# token and spend budgets, all checked before anything is taken; reaps expired holds first. Returns
# {code, detail, subject, rpm_used, tpm_used, ...one pair per subject}: code 0 taken, 1 rpm (detail: wait s),
# 2 tpm (wait s, -1 never), 3 day / 4 month token budget, 5 day / 6 month spend budget (detail: what is left);
# subject: which one said no (1 team, 2 key); 7: the team's spend is not seeded in this Redis (its data was lost or
# never seeded; gateway.state.repair), nothing taken. With slots zsets after the subjects' KEYS (slot_keys of them),
# a hold taken also takes the request's concurrency lease on them when none is full (ACQUIRE's rule); `lease` in the
# reply: 1 taken, 0 not (full, or none asked for). A lease that does not fit leaves the hold taken.
LEASE_ARGV = ("lease_id", "lease_s", "max_concurrency", "key_max_concurrency", "slot_keys")
RESERVE_ARGV = ("now", "tokens", "cost", *WINDOW_ARGV, "hold_s", "require_seeded", *LEASE_ARGV)
# Then, per subject, in this order (`subject_args`); KEYS per subject: RESERVE_KEYS.
RESERVE_SUBJECT_ARGV = ("rpm_limit", "tpm_limit", "day_limit", "month_limit", "cost_day_limit", "cost_month_limit",
                        "res_prefix")  # fmt: skip
RESERVE_KEYS = ("rpm_window", "tpm_window", "day_hash", "month_hash", "holds_zset", "meta_hash")
RESERVE = (
    WINDOW_FUNCTIONS
    + LEASE_FUNCTIONS
    + """
-- KEYS: per subject rpm_window tpm_window day_hash month_hash holds_zset meta_hash; then slot_keys slots_zsets (the
--   team's, then its key's when the key has a concurrency cap of its own)
-- ARGV: now, tokens (prompt + max_tokens to hold), cost (micro-USD to hold), slot_s, slots (window slot length and
--   count), day_period, month_period (the current periods' keys), day_expire_s, month_expire_s (the period hashes'
--   TTLs), res_id, hold_s (the hold's lease), require_seeded (1: refuse a team whose meta has no seed marker),
--   lease_id, lease_s, max_concurrency, key_max_concurrency (-1: unlimited), slot_keys (0: take no lease);
--   then per subject: rpm_limit, tpm_limit, day_limit, month_limit, cost_day_limit, cost_month_limit
--   (-1: unlimited), res_prefix
local now_text, n, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local slot_s, slots = tonumber(ARGV[4]), tonumber(ARGV[5])
local day_period, month_period = ARGV[6], ARGV[7]
local day_expire_s, month_expire_s = ARGV[8], ARGV[9]
local res_id, hold_s = ARGV[10], tonumber(ARGV[11])
local lease_id, lease_s = ARGV[13], tonumber(ARGV[14])
local lease_maxes, n_slots = {tonumber(ARGV[15]), tonumber(ARGV[16])}, tonumber(ARGV[17])
local n_subjects = (#KEYS - n_slots) / 6
local now = tonumber(now_text)
local cur = math.floor(now / slot_s)

-- a budget that forgot its spend (a FLUSH, a failover to an empty replica) must not be admitted against
if ARGV[12] == '1' and redis.call('HEXISTS', KEYS[6], 'seeded') == 0 then
  local zeros = {}
  for i = 1, n_subjects * 2 do zeros[i] = 0 end
  return {7, '0', 1, 0, unpack(zeros)}
end

local subjects = {}
for i = 1, n_subjects do
  local k, a = (i - 1) * 6, 17 + (i - 1) * 7
  subjects[i] = {
    rpm_window = KEYS[k + 1], tpm_window = KEYS[k + 2], day_hash = KEYS[k + 3], month_hash = KEYS[k + 4],
    holds_zset = KEYS[k + 5], meta_hash = KEYS[k + 6],
    rpm_text = ARGV[a + 1], tpm_text = ARGV[a + 2], day_text = ARGV[a + 3], month_text = ARGV[a + 4],
    cost_day_text = ARGV[a + 5], cost_month_text = ARGV[a + 6], res_prefix = ARGV[a + 7],
  }
end

local used = {}
for i, s in ipairs(subjects) do
  redis.call('HSET', s.meta_hash, 'rpm', s.rpm_text, 'tpm', s.tpm_text, 'day_limit', s.day_text,
    'month_limit', s.month_text, 'cost_day_limit', s.cost_day_text, 'cost_month_limit', s.cost_month_text)
  -- reap holds whose replica never settled them: their tokens go back to the periods still current
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', s.holds_zset, '-inf', now)) do
    local res = s.res_prefix .. id
    local r = redis.call('HMGET', res, 'tokens', 'day_key', 'month_key', 'cost')
    local t, c = tonumber(r[1] or '0') or 0, tonumber(r[4] or '0') or 0
    if r[2] == day_period then give_back(s.day_hash, 'reserved', t); give_back(s.day_hash, 'cost_reserved', c) end
    if r[3] == month_period then
      give_back(s.month_hash, 'reserved', t); give_back(s.month_hash, 'cost_reserved', c)
    end
    give_back(s.meta_hash, 'reserved', t)
    if r[1] then  -- tombstone: a settle arriving late still bills its tokens, without a second give-back
      redis.call('HSET', res, 'state', 'reaped')
      redis.call('EXPIRE', res, 86400)
    end
    redis.call('ZREM', s.holds_zset, id)
  end
  -- a key's window is kept only under a limit of its own (as InMemoryState keeps it): its spend is what must last
  s.rpm_on, s.tpm_on = i == 1 or tonumber(s.rpm_text) >= 0, i == 1 or tonumber(s.tpm_text) >= 0
  s.rpm_used, s.rpm_live, s.tpm_used, s.tpm_live = 0, {}, 0, {}
  if s.rpm_on then s.rpm_used, s.rpm_live = window(s.rpm_window, cur - slots) end
  if s.tpm_on then s.tpm_used, s.tpm_live = window(s.tpm_window, cur - slots) end
  used[#used + 1] = s.rpm_used
  used[#used + 1] = s.tpm_used
end

local function no(code, detail, i) return {code, tostring(detail), i, 0, unpack(used)} end
for i, s in ipairs(subjects) do
  local rpm_l, tpm_l = tonumber(s.rpm_text), tonumber(s.tpm_text)
  if rpm_l >= 0 and s.rpm_used + 1 > rpm_l then
    return no(1, wait_for(s.rpm_used, s.rpm_live, 1, rpm_l, slots, slot_s, now), i)
  end
  if tpm_l >= 0 and s.tpm_used + n > tpm_l then
    return no(2, wait_for(s.tpm_used, s.tpm_live, n, tpm_l, slots, slot_s, now), i)
  end
  local budgets = {
    {s.day_hash, tonumber(s.day_text), 3, 'spent', 'reserved', n},
    {s.month_hash, tonumber(s.month_text), 4, 'spent', 'reserved', n},
    {s.day_hash, tonumber(s.cost_day_text), 5, 'cost_spent', 'cost_reserved', cost},
    {s.month_hash, tonumber(s.cost_month_text), 6, 'cost_spent', 'cost_reserved', cost},
  }
  for _, b in ipairs(budgets) do
    if b[2] >= 0 then
      local taken = hget_num(b[1], b[4]) + hget_num(b[1], b[5])
      if taken + b[6] > b[2] then return no(b[3], math.max(0, b[2] - taken), i) end
    end
  end
end

local ttl_ms = math.ceil((slots + 2) * slot_s * 1000)
for i, s in ipairs(subjects) do
  if s.rpm_on then
    redis.call('HINCRBY', s.rpm_window, cur, 1)
    redis.call('PEXPIRE', s.rpm_window, ttl_ms)
  end
  if s.tpm_on then
    redis.call('HINCRBY', s.tpm_window, cur, n)
    redis.call('PEXPIRE', s.tpm_window, ttl_ms)
  end
  redis.call('HINCRBY', s.day_hash, 'reserved', n)
  redis.call('HINCRBY', s.day_hash, 'cost_reserved', cost)
  redis.call('EXPIRE', s.day_hash, day_expire_s)
  redis.call('HINCRBY', s.month_hash, 'reserved', n)
  redis.call('HINCRBY', s.month_hash, 'cost_reserved', cost)
  redis.call('EXPIRE', s.month_hash, month_expire_s)
  redis.call('HINCRBY', s.meta_hash, 'reserved', n)
  local res = s.res_prefix .. res_id
  redis.call('HSET', res, 'tokens', n, 'cost', cost, 'taken_at', now_text, 'day_key', day_period,
    'month_key', month_period)
  redis.call('EXPIRE', res, math.ceil(hold_s) + 3600)
  redis.call('ZADD', s.holds_zset, now + hold_s, res_id)
  used[2 * i - 1] = s.rpm_used + 1
  used[2 * i] = s.tpm_used + n
end
local lease = 0
if n_slots > 0 then
  lease = take_lease(slot_keys_after(n_subjects * 6, n_slots), lease_maxes, now, lease_s, lease_id)
end
return {0, '0', 0, lease, unpack(used)}
"""
)

# Settle a hold on every subject it took from: bill the actual tokens and cost, give the held ones back, leave a
# tombstone (per subject). Returns the team's overshoot (tokens beyond the hold), or -1 when already settled.
# The cost is exact: whole micro-USD (actual_cost) and the femto-USD below a micro-dollar (actual_cost_rem), carried
# in cost_spent_rem until it makes a whole micro-dollar, so billed spend sums exactly (policies.pricing).
# With slots zsets after the subjects' KEYS (slot_keys of them), the request's lease_id is released from them too,
# whether or not the hold was settled already (a release of a lease already gone removes nothing).
SETTLE_ARGV = ("now", "actual", "actual_cost", *WINDOW_ARGV, "actual_cost_rem", "lease_id", "slot_keys")
SETTLE_KEYS = ("tpm_window", "day_hash", "month_hash", "holds_zset", "meta_hash", "res_hash")
SETTLE = (
    WINDOW_FUNCTIONS
    + LEASE_FUNCTIONS
    + """
-- KEYS: per subject tpm_window day_hash month_hash holds_zset meta_hash res_hash; then slot_keys slots_zsets
-- ARGV: now, actual (tokens used), actual_cost (whole micro-USD), slot_s, slots, day_period, month_period,
--   day_expire_s, month_expire_s, res_id, actual_cost_rem (femto-USD below a micro-dollar, 0 to 10^9 - 1),
--   lease_id (the lease to release), slot_keys (0: release none)
local now, actual, actual_cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local slot_s, slots = tonumber(ARGV[4]), tonumber(ARGV[5])
local day_period, month_period = ARGV[6], ARGV[7]
local day_expire_s, month_expire_s = ARGV[8], ARGV[9]
local res_id, actual_cost_rem = ARGV[10], tonumber(ARGV[11])
local lease_id, n_slots = ARGV[12], tonumber(ARGV[13])
local n_subjects = (#KEYS - n_slots) / 6
local FEMTOS_PER_MICRO = 1000000000
local cur = math.floor(now / slot_s)

for _, key in ipairs(slot_keys_after(n_subjects * 6, n_slots)) do redis.call('ZREM', key, lease_id) end
local result = -1
for i = 1, n_subjects do
  local k = (i - 1) * 6
  local tpm_window, day_hash, month_hash = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local holds_zset, meta_hash, res_hash = KEYS[k + 4], KEYS[k + 5], KEYS[k + 6]
  local r = redis.call('HMGET', res_hash, 'tokens', 'taken_at', 'day_key', 'month_key', 'state', 'cost')
  if r[5] ~= 'settled' then  -- idempotent: the first settle left this tombstone
    -- a hold reaped (its lease ran out) or long gone: bill the tokens anyway, nothing is left to give back
    local held = r[1] and r[5] ~= 'reaped'
    local tokens, taken_at = tonumber(r[1] or actual), tonumber(r[2] or now)
    local held_cost = tonumber(r[6] or actual_cost)
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
    local cost_over = math.max(0, actual_cost - held_cost)
    local periods = {{day_hash, r[3], day_period, day_expire_s}, {month_hash, r[4], month_period, month_expire_s}}
    for _, p in ipairs(periods) do
      if held and p[2] == p[3] then  -- else it left with its period
        give_back(p[1], 'reserved', tokens)
        give_back(p[1], 'cost_reserved', held_cost)
      end
      redis.call('HINCRBY', p[1], 'spent', actual)
      redis.call('HINCRBY', p[1], 'overshoot', over)
      redis.call('HINCRBY', p[1], 'cost_spent', actual_cost)
      if redis.call('HINCRBY', p[1], 'cost_spent_rem', actual_cost_rem) >= FEMTOS_PER_MICRO then
        redis.call('HINCRBY', p[1], 'cost_spent_rem', -FEMTOS_PER_MICRO)
        redis.call('HINCRBY', p[1], 'cost_spent', 1)
      end
      redis.call('HINCRBY', p[1], 'cost_overshoot', cost_over)
      redis.call('EXPIRE', p[1], p[4])
    end
    if held then give_back(meta_hash, 'reserved', tokens) end
    redis.call('ZREM', holds_zset, res_id)
    redis.call('HSET', res_hash, 'state', 'settled')
    redis.call('EXPIRE', res_hash, 86400)
    if i == 1 then result = over end
  end
end
return result
"""
)

# Take a concurrency lease on every subject's slots (the team's; the key's too when KEYS has two) unless one is at
# its maximum (expired leases are dropped first). Returns 1 or 0.
ACQUIRE_ARGV = ("now", "lease_s", "max_concurrency", "lease_id", "key_max_concurrency")
ACQUIRE = (
    LEASE_FUNCTIONS
    + """
-- KEYS: slots_zset (the team's), then the key's slots_zset when the key has a concurrency cap of its own
-- ARGV: now, lease_s, max_concurrency (-1: unlimited), lease_id, key_max_concurrency (-1: unlimited)
local now, lease_s, lease_id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[4]
return take_lease(slot_keys_after(0, #KEYS), {tonumber(ARGV[3]), tonumber(ARGV[5])}, now, lease_s, lease_id)
"""
)

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
