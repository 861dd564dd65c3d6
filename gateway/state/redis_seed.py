"""The Lua scripts that rebuild a team's state in Redis after Redis lost it (gateway.state.repair): seed its spend from
the store once per epoch, and put back the holds a replica still has in flight. Key layout:
gateway.state.redis_keys; the RESERVE script refuses a team until SEED has marked it (state_redis_lua.RESERVE).
"""

from __future__ import annotations

# Add the store's spend of this day / month to every subject of one team (the team, then its API keys) and mark the
# team seeded in `epoch`; a second call in the same epoch adds nothing (returns 0). It adds rather than sets: what
# the team's requests settled since the loss is in Redis already, and the store may hold it too, so a rebuilt
# budget can count a request twice (it refuses early) but never forgets one. A team whose meta still carries an
# earlier epoch's marker lost nothing (a loss takes a team's keys together: one slot, one server) and is only marked:
# only part of a cluster may have lost its data, or only the epoch marker.
SEED_ARGV = ("epoch", "day_expire_s", "month_expire_s")
# Then, per subject: day_tokens, month_tokens, day_cost, day_cost_rem, month_cost, month_cost_rem (whole micro-USD and
# the femto-USD below one, as the SETTLE script keeps them); KEYS: the team's meta hash, then per subject its day and
# month hashes.
SEED = """
local meta, epoch = KEYS[1], ARGV[1]
local day_expire_s, month_expire_s = ARGV[2], ARGV[3]
local seeded = redis.call('HGET', meta, 'seeded')
if seeded == epoch then return 0 end
if seeded then
  redis.call('HSET', meta, 'seeded', epoch)
  return 0
end
local function add(hash, tokens, micros, rem, expire_s)
  redis.call('HINCRBY', hash, 'spent', tokens)
  redis.call('HINCRBY', hash, 'cost_spent', micros)
  if redis.call('HINCRBY', hash, 'cost_spent_rem', rem) >= 1000000000 then
    redis.call('HINCRBY', hash, 'cost_spent_rem', -1000000000)
    redis.call('HINCRBY', hash, 'cost_spent', 1)
  end
  redis.call('EXPIRE', hash, expire_s)
end
for i = 0, (#KEYS - 1) / 2 - 1 do
  local a = 3 + 6 * i
  add(KEYS[2 + 2 * i], ARGV[a + 1], ARGV[a + 3], ARGV[a + 4], day_expire_s)
  add(KEYS[3 + 2 * i], ARGV[a + 2], ARGV[a + 5], ARGV[a + 6], month_expire_s)
end
redis.call('HSET', meta, 'seeded', epoch)
return 1
"""

# Put one live hold back on every subject it took from, where Redis has no record of it (a hold settled meanwhile
# left a tombstone, and stays settled): its tokens and cost reserved again on the periods still current.
RESTORE_ARGV = ("tokens", "cost", "taken_at", "day_key", "month_key", "hold_until", "day_period", "month_period",
                "day_expire_s", "month_expire_s", "res_id")  # fmt: skip
RESTORE_KEYS = ("day_hash", "month_hash", "holds_zset", "meta_hash", "res_hash")
RESTORE = """
local tokens, cost, taken_at = ARGV[1], ARGV[2], ARGV[3]
local day_key, month_key, hold_until = ARGV[4], ARGV[5], ARGV[6]
local day_period, month_period, day_expire_s, month_expire_s, res_id = ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local restored = 0
for i = 0, #KEYS / 5 - 1 do
  local day_hash, month_hash, holds_zset = KEYS[5 * i + 1], KEYS[5 * i + 2], KEYS[5 * i + 3]
  local meta_hash, res_hash = KEYS[5 * i + 4], KEYS[5 * i + 5]
  if redis.call('EXISTS', res_hash) == 0 then
    if day_key == day_period then
      redis.call('HINCRBY', day_hash, 'reserved', tokens)
      redis.call('HINCRBY', day_hash, 'cost_reserved', cost)
      redis.call('EXPIRE', day_hash, day_expire_s)
    end
    if month_key == month_period then
      redis.call('HINCRBY', month_hash, 'reserved', tokens)
      redis.call('HINCRBY', month_hash, 'cost_reserved', cost)
      redis.call('EXPIRE', month_hash, month_expire_s)
    end
    redis.call('HINCRBY', meta_hash, 'reserved', tokens)
    redis.call('HSET', res_hash, 'tokens', tokens, 'cost', cost, 'taken_at', taken_at, 'day_key', day_key,
      'month_key', month_key)
    redis.call('EXPIRE', res_hash, math.ceil(tonumber(hold_until) - tonumber(taken_at)) + 3600)
    redis.call('ZADD', holds_zset, hold_until, res_id)
    restored = 1
  end
end
return restored
"""
