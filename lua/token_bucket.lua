-- token_bucket.lua: check several token buckets and charge them all, or none.
--
-- KEYS[i]  bucket of limit i: a hash {tokens, ts}. All keys must share one hash slot
--          (the companion puts the tenant in a hash tag), so this runs on Redis Cluster.
-- ARGV     three numbers per key, in KEYS order:
--            capacity   (> 0)  tokens the bucket holds when full
--            window_ms  (> 0)  time in which an empty bucket refills to capacity
--            cost       (>= 0) tokens this call takes; 0 only looks
-- Reply    { allowed, {status, limit, remaining, reset_after_ms, retry_after_ms} per key }
--            allowed         1: every bucket had room and all were charged; 0: none was
--            status          1 room, 0 not now, -1 never (cost > capacity)
--            limit           the capacity
--            remaining       whole tokens left (after the charge, when charged)
--            reset_after_ms  time until the bucket is full again
--            retry_after_ms  time until the bucket has room for cost (0 if now or never)
--
-- Time is Redis's own (TIME), so every proxy shares one clock. Buckets refill
-- continuously and hold fractional tokens. A charged bucket expires when it would be full
-- again: a missing key and a full bucket are the same state.
-- The Rust model of this script is src/bucket.rs; tests/cases/token_bucket.json is the case
-- table both are tested with.

local n = #KEYS
if n == 0 or #ARGV ~= 3 * n then
  return redis.error_reply('ERR token_bucket: need 3 ARGV per key, got ' .. #ARGV .. ' for ' .. n)
end

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

local specs, levels = {}, {}
local allowed = 1
for i = 1, n do
  local capacity = tonumber(ARGV[3 * i - 2])
  local window_ms = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  if not capacity or capacity <= 0 or not window_ms or window_ms <= 0 or not cost or cost < 0 then
    return redis.error_reply('ERR token_bucket: bad capacity, window_ms or cost for key ' .. i)
  end
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens, ts = tonumber(state[1]), tonumber(state[2])
  if tokens == nil or ts == nil then
    tokens = capacity
  else
    local elapsed = math.max(0, now_ms - ts)
    tokens = math.min(capacity, tokens + elapsed * capacity / window_ms)
  end
  specs[i] = { capacity, window_ms, cost }
  levels[i] = tokens
  if cost > capacity or tokens < cost then
    allowed = 0
  end
end

local reply = { allowed }
for i = 1, n do
  local capacity, window_ms, cost = specs[i][1], specs[i][2], specs[i][3]
  local tokens = levels[i]
  local status, retry_after_ms = 1, 0
  if cost > capacity then
    status = -1
  elseif tokens < cost then
    status = 0
    retry_after_ms = math.ceil((cost - tokens) * window_ms / capacity)
  end
  if allowed == 1 and cost > 0 then
    tokens = tokens - cost
    redis.call('HSET', KEYS[i], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', now_ms))
    redis.call('PEXPIRE', KEYS[i], math.max(1, math.ceil((capacity - tokens) * window_ms / capacity)))
  end
  local reset_after_ms = math.ceil((capacity - tokens) * window_ms / capacity)
  reply[i + 1] = { status, capacity, math.floor(tokens), reset_after_ms, retry_after_ms }
end
return reply
