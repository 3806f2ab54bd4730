-- token_bucket.lua: charge several token buckets all or nothing, settle what a charge
-- reserved once the real cost is known, and lease blocks of budget to proxy instances.
--
-- KEYS[1..n]  bucket of limit i: a hash {tokens, ts}.
-- KEYS[n+1]   optional: the reservation record of this request (a string).
--             All keys must share one hash slot (the companion puts the tenant in a hash
--             tag), so this runs on Redis Cluster.
-- ARGV[1]     "charge", "settle" or "lease"
-- ARGV[2]     n, the number of buckets
-- ARGV[3]     charge: how long the reservation record lives (ms); lease: the share of
--             what is left that one grant may take (0 < share <= 1); settle: ignored
-- ARGV[4..]   four numbers per bucket, in KEYS order:
--               capacity   (> 0)  tokens the bucket holds when full
--               window_ms  (> 0)  time in which an empty bucket refills to capacity
--               amount     charge: the cost (>= 0; 0 only looks)
--                          settle: tokens to give back (> 0) or to take as well (< 0)
--                          lease: the grant wanted
--               min        charge: the least this bucket may be charged (<= amount); a
--                          bucket with min < amount is elastic
--                          lease: the grant needed (<= amount); settle: ignored
--
-- charge: every bucket is refilled to now; if each has room for its cost, all are
-- charged and the reservation record (if given) is written; otherwise none is. Elastic
-- buckets all give up the same reduction r, the smallest that makes every one of them fit,
-- if no bucket then falls below its min: that is how a request's completion allowance is
-- clamped to what the tenant has left.
-- lease: if each bucket has what is needed, each grants min(wanted, max(needed, share x
-- what is left)) and is charged that: grants shrink as a tenant nears its limit, so
-- instances sharing it do not starve each other; otherwise nothing is granted.
-- settle: if the reservation record exists it is deleted and each bucket gets its amount
-- back (never above capacity; a debit may take it below zero, so the tenant waits it
-- off); if the record is gone (settled before, or expired) nothing changes. So a
-- settlement applies at most once, and a reservation never settled simply stands.
--
-- Reply  { done, {status, limit, remaining, reset_after_ms, retry_after_ms, charged} per bucket }
--          done            charge: 1 if charged; settle: 1 if applied
--          status          1 room, 0 not now, -1 never (cost > capacity); settle: 1
--          limit           the capacity
--          remaining       whole tokens left (after the charge or settlement, if done)
--          reset_after_ms  time until the bucket is full again
--          retry_after_ms  time until the bucket has room for the cost (0 if now or never)
--          charged         what the bucket was charged, or granted (0 if not done; settle: 0)
--
-- Time is Redis's own (TIME), so every proxy shares one clock. Buckets refill
-- continuously and hold fractional tokens. A written bucket expires when it would be full
-- again: a missing key and a full bucket are the same state.
-- The Rust model of this script is src/bucket.rs; tests/cases/token_bucket.json is the
-- case table both are tested with.

local op = ARGV[1]
local n = tonumber(ARGV[2])
if (op ~= 'charge' and op ~= 'settle' and op ~= 'lease') or not n or n < 1 or #ARGV ~= 3 + 4 * n or (#KEYS ~= n and #KEYS ~= n + 1) then
  return redis.error_reply('ERR token_bucket: expected op, n, ttl and 4 ARGV per bucket, with n or n+1 keys')
end
local reservation = KEYS[n + 1]
local reservation_ttl_ms = tonumber(ARGV[3])
local share = tonumber(ARGV[3])
if op == 'lease' and (not share or share <= 0 or share > 1) then
  return redis.error_reply('ERR token_bucket: a lease needs a share in (0, 1]')
end

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

local specs, levels = {}, {}
for i = 1, n do
  local capacity = tonumber(ARGV[4 * i])
  local window_ms = tonumber(ARGV[4 * i + 1])
  local amount = tonumber(ARGV[4 * i + 2])
  local min = tonumber(ARGV[4 * i + 3])
  if not capacity or capacity <= 0 or not window_ms or window_ms <= 0 or not amount or not min
      or (op ~= 'settle' and (amount < 0 or min < 0 or min > amount)) then
    return redis.error_reply('ERR token_bucket: bad capacity, window_ms, amount or min for bucket ' .. i)
  end
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens, ts = tonumber(state[1]), tonumber(state[2])
  if tokens == nil or ts == nil then
    tokens = capacity
  else
    tokens = math.min(capacity, tokens + math.max(0, now_ms - ts) * capacity / window_ms)
  end
  specs[i] = { capacity, window_ms, amount, min }
  levels[i] = tokens
end

local function store(i, tokens)
  local capacity, window_ms = specs[i][1], specs[i][2]
  redis.call('HSET', KEYS[i], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', now_ms))
  redis.call('PEXPIRE', KEYS[i], math.max(1, math.ceil((capacity - tokens) * window_ms / capacity)))
end

local done = 1
local statuses, retries, charged = {}, {}, {}
if op == 'charge' or op == 'lease' then
  -- What each bucket must hold for the call to go ahead, and what it gives if it does.
  local required = {}
  if op == 'charge' then
    -- The common reduction of the elastic buckets: enough for each to fit, if it can.
    local reduction, most = 0, nil
    for i = 1, n do
      local cost, min = specs[i][3], specs[i][4]
      if min < cost then
        reduction = math.max(reduction, cost - math.max(levels[i], 0))
        most = math.min(most or (cost - min), cost - min)
      end
    end
    reduction = math.ceil(math.min(reduction, most or 0))
    for i = 1, n do
      local cost, min = specs[i][3], specs[i][4]
      charged[i] = (min < cost) and (cost - reduction) or cost
      required[i] = charged[i]
    end
  else
    for i = 1, n do
      local wanted, needed = specs[i][3], specs[i][4]
      charged[i] = math.min(wanted, math.max(needed, math.floor(math.max(levels[i], 0) * share)))
      required[i] = needed
    end
  end
  for i = 1, n do
    local capacity, window_ms, min = specs[i][1], specs[i][2], specs[i][4]
    statuses[i], retries[i] = 1, 0
    if min > capacity then
      statuses[i], done = -1, 0
    elseif levels[i] < required[i] then
      statuses[i], done = 0, 0
      retries[i] = math.ceil((required[i] - levels[i]) * window_ms / capacity)
    end
  end
  if done == 1 then
    for i = 1, n do
      if charged[i] > 0 then
        levels[i] = levels[i] - charged[i]
        store(i, levels[i])
      end
    end
    if reservation and op == 'charge' then
      redis.call('SET', reservation, '1', 'PX', math.max(1, math.floor(reservation_ttl_ms or 0)))
    end
  end
else
  if reservation and redis.call('DEL', reservation) == 0 then
    done = 0
  end
  for i = 1, n do
    statuses[i], retries[i], charged[i] = 1, 0, 0
    if done == 1 and specs[i][3] ~= 0 then
      levels[i] = math.min(specs[i][1], levels[i] + specs[i][3])
      store(i, levels[i])
    end
  end
end

local reply = { done }
for i = 1, n do
  local capacity, window_ms = specs[i][1], specs[i][2]
  local tokens = levels[i]
  reply[i + 1] = { statuses[i], capacity, math.max(0, math.floor(tokens)), math.ceil((capacity - tokens) * window_ms / capacity),
    retries[i], done == 1 and charged[i] or 0 }
end
return reply
