-- token_bucket.lua: charge several limits all or nothing, settle what a charge reserved
-- once the real cost is known, lease blocks of budget to proxy instances, and keep
-- concurrency slots alive.
--
-- KEYS[1..n]  limit i: a token bucket (a hash {tokens, ts}), a sliding window (a sorted set
--             of entries "seq:amount" scored by time, see below) or a slot set (a sorted
--             set of request ids scored by their expiry, ms).
-- KEYS[n+1]   optional: the reservation record of this request (a string); its key is
--             also the request's member in slot sets, so slot limits need it.
-- KEYS[n+2]   optional, with KEYS[n+1]: the request's cancel marker. charge: refuse if it
--             is set (the client gave up while the charge was waiting); settle: set it
--             first, so a charge still waiting can never happen after the refund.
--             All keys must share one hash slot (the companion puts the tenant in a hash
--             tag), so this runs on Redis Cluster.
-- ARGV[1]     "charge", "settle", "lease", "touch" or "release"
-- ARGV[2]     n, the number of limits
-- ARGV[3]     charge: how long the reservation record lives (ms; 0: no record); lease: the share of
--             what is left that one grant may take (0 < share <= 1); otherwise ignored
-- ARGV[4..]   five values per limit, in KEYS order:
--               kind       "tb" (token bucket), "sw" (sliding window) or "slots"
--                          (concurrency)
--               capacity   (> 0)  tb: tokens when full; slots: how many at once
--               window_ms  (> 0)  tb: time in which an empty bucket refills to capacity;
--                                 sw: the window; slots: how long a slot lives unless touched
--               amount     charge: the cost (>= 0; 0 only looks; slots: 1)
--                          settle: tokens to give back (> 0) or to take as well (< 0)
--                          lease: the grant wanted
--               min        charge: the least this bucket may be charged (<= amount); a
--                          bucket with min < amount is elastic
--                          lease: the grant needed (<= amount); otherwise ignored
--
-- charge: every limit is brought to now (buckets refilled, expired slots dropped); if each
-- has room for its cost, all are charged (a slot taken by this request) and the
-- reservation record (if given) is written; otherwise none is. Elastic buckets all give
-- up the same reduction r, the smallest that makes every one of them fit, if no bucket
-- then falls below its min: that is how a request's completion allowance is clamped to
-- what the tenant has left.
-- lease: if each bucket has what is needed, each grants min(wanted, max(needed, share x
-- what is left)) and is charged that: grants shrink as a tenant nears its limit, so
-- instances sharing it do not starve each other; otherwise nothing is granted. Slot
-- limits cannot be leased.
-- settle: the request's slots are released; if the reservation record exists it is
-- deleted and each bucket gets its amount back (never above capacity; a debit may take it
-- below zero, so the tenant waits it off); if the record is gone (settled before, or
-- expired) buckets do not change. So a settlement applies at most once, and a reservation
-- never settled simply stands.
-- touch: the request's slots live another window (a heartbeat for long streams); a slot
-- that already expired is not revived.
-- release: the request's slots are released at once, and nothing else changes (its
-- settlement, which releases them too, may follow).
--
-- Reply  { done, {status, limit, remaining, reset_after_ms, retry_after_ms, charged} per limit }
--          done            charge: 1 if charged; settle: 1 if applied; lease: 1 if granted
--          status          1 room, 0 not now, -1 never (cost > capacity); settle, touch: 1
--          limit           the capacity
--          remaining       whole tokens (free slots) left, after the call if done
--          reset_after_ms  time until the bucket is full again (slots: 0)
--          retry_after_ms  time until the bucket has room for the cost (slots: until the
--                          oldest slot expires, at most 1 s); 0 if now or never
--          charged         what the bucket was charged, or granted (0 if not done)
--
-- A sliding window admits at most `capacity` in any `window_ms`, exactly: it logs what
-- each call took, at its time, and forgets entries as they leave the window, keeping a
-- running sum so a call costs O(entries expired), not a scan. The sum and a sequence
-- number live in the same sorted set as members "~sum" and "~seq" scored -(value) - 1,
-- below every entry (entries are scored by time, > 0). A settlement adds a correcting
-- entry (minus the credit) at the time of the charge it corrects (kept in the reservation
-- record), so the correction leaves the window together with the charge.
--
-- Time is Redis's own (TIME), so every proxy shares one clock. Buckets refill
-- continuously and hold fractional tokens. A written bucket expires when it would be full
-- again (a missing key and a full bucket are the same state); a slot set expires when its
-- last slot would.
-- The Rust model of the token buckets is src/bucket.rs; tests/cases/token_bucket.json is
-- the case table both are tested with.

local op = ARGV[1]
local n = tonumber(ARGV[2])
local ops = { charge = true, settle = true, lease = true, touch = true, release = true }
if not ops[op] or not n or n < 1 or #ARGV ~= 3 + 5 * n or #KEYS < n or #KEYS > n + 2 then
  return redis.error_reply('ERR token_bucket: expected op, n, a third value and 5 ARGV per limit, with n to n+2 keys')
end
local reservation = KEYS[n + 1]
local cancel_marker = KEYS[n + 2]
if cancel_marker and op == 'charge' and redis.call('EXISTS', cancel_marker) == 1 then
  return redis.error_reply('CANCELLED the request was abandoned while it waited')
end
if cancel_marker and op == 'settle' then
  redis.call('SET', cancel_marker, '1', 'PX', 600000)
end
local reservation_ttl_ms = tonumber(ARGV[3])
local share = tonumber(ARGV[3])
if op == 'lease' and (not share or share <= 0 or share > 1) then
  return redis.error_reply('ERR token_bucket: a lease needs a share in (0, 1]')
end

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

-- Sliding-window bookkeeping (see the header).
local function sw_meta(key, name)
  local score = redis.call('ZSCORE', key, name)
  return score and (-tonumber(score) - 1) or 0
end

local function sw_set_meta(key, name, value)
  redis.call('ZADD', key, -value - 1, name)
end

-- Forgets the entries that left the window; returns what the window holds.
local function sw_refresh(key, window_ms)
  local sum = sw_meta(key, '~sum')
  local cutoff = now_ms - window_ms
  local expired = redis.call('ZRANGEBYSCORE', key, 0, cutoff)
  if #expired > 0 then
    for _, member in ipairs(expired) do
      sum = sum - (tonumber(string.match(member, ':(.+)$')) or 0)
    end
    redis.call('ZREMRANGEBYSCORE', key, 0, cutoff)
    sw_set_meta(key, '~sum', sum)
  end
  return sum
end

local function sw_add(key, window_ms, at_ms, amount)
  local seq = sw_meta(key, '~seq') + 1
  sw_set_meta(key, '~seq', seq)
  redis.call('ZADD', key, at_ms, seq .. ':' .. string.format('%.17g', amount))
  sw_set_meta(key, '~sum', sw_meta(key, '~sum') + amount)
  redis.call('PEXPIRE', key, math.ceil(window_ms) + 1000)
end

-- How long until `needed` more fits: walk the entries oldest first until enough leaves.
local function sw_retry(key, window_ms, needed)
  local entries = redis.call('ZRANGEBYSCORE', key, '(0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1000)
  local freed = 0
  for j = 1, #entries, 2 do
    freed = freed + (tonumber(string.match(entries[j], ':(.+)$')) or 0)
    if freed >= needed then
      return math.max(1, math.ceil(tonumber(entries[j + 1]) + window_ms - now_ms))
    end
  end
  return math.ceil(window_ms)
end

local function sw_reset(key, window_ms)
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  local at = tonumber(newest[2])
  if not at or at <= 0 then
    return 0
  end
  return math.max(0, math.ceil(at + window_ms - now_ms))
end

local specs, levels, oldest = {}, {}, {}
for i = 1, n do
  local at = 5 * i - 1
  local kind = ARGV[at]
  local capacity = tonumber(ARGV[at + 1])
  local window_ms = tonumber(ARGV[at + 2])
  local amount = tonumber(ARGV[at + 3])
  local min = tonumber(ARGV[at + 4])
  if (kind ~= 'tb' and kind ~= 'sw' and kind ~= 'slots') or not capacity or capacity <= 0 or not window_ms or window_ms <= 0
      or not amount or not min or ((op == 'charge' or op == 'lease') and (amount < 0 or min < 0 or min > amount)) then
    return redis.error_reply('ERR token_bucket: bad kind, capacity, window_ms, amount or min for limit ' .. i)
  end
  if kind == 'slots' and (not reservation or op == 'lease') then
    return redis.error_reply('ERR token_bucket: a slot limit needs the reservation key, and cannot be leased')
  end
  if kind == 'sw' then
    levels[i] = capacity - sw_refresh(KEYS[i], window_ms)
  elseif kind == 'slots' then
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now_ms)
    levels[i] = capacity - redis.call('ZCARD', KEYS[i])
    local first = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
    oldest[i] = tonumber(first[2])
  else
    local state = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
    local tokens, ts = tonumber(state[1]), tonumber(state[2])
    if tokens == nil or ts == nil then
      levels[i] = capacity
    else
      levels[i] = math.min(capacity, tokens + math.max(0, now_ms - ts) * capacity / window_ms)
    end
  end
  specs[i] = { capacity, window_ms, amount, min, kind }
end

local function store(i, tokens)
  local capacity, window_ms = specs[i][1], specs[i][2]
  redis.call('HSET', KEYS[i], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', now_ms))
  redis.call('PEXPIRE', KEYS[i], math.max(1, math.ceil((capacity - tokens) * window_ms / capacity)))
end

local function hold_slot(i, only_if_held)
  local expiry = now_ms + specs[i][2]
  if only_if_held then
    redis.call('ZADD', KEYS[i], 'XX', expiry, reservation)
  else
    redis.call('ZADD', KEYS[i], expiry, reservation)
  end
  local last = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', KEYS[i], math.ceil(tonumber(last[2])))
  end
end

local done = 1
local statuses, retries, charged = {}, {}, {}
if op == 'charge' or op == 'lease' then
  -- What each limit must hold for the call to go ahead, and what it gives if it does.
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
    local capacity, window_ms, min, kind = specs[i][1], specs[i][2], specs[i][4], specs[i][5]
    statuses[i], retries[i] = 1, 0
    if min > capacity then
      statuses[i], done = -1, 0
    elseif levels[i] < required[i] then
      statuses[i], done = 0, 0
      if kind == 'slots' then
        retries[i] = math.max(1, math.min(1000, math.ceil((oldest[i] or now_ms) - now_ms)))
      elseif kind == 'sw' then
        retries[i] = sw_retry(KEYS[i], window_ms, required[i] - levels[i])
      else
        retries[i] = math.ceil((required[i] - levels[i]) * window_ms / capacity)
      end
    end
  end
  if done == 1 then
    for i = 1, n do
      if charged[i] > 0 then
        levels[i] = levels[i] - charged[i]
        if specs[i][5] == 'slots' then
          hold_slot(i, false)
        elseif specs[i][5] == 'sw' then
          sw_add(KEYS[i], specs[i][2], now_ms, charged[i])
        else
          store(i, levels[i])
        end
      end
    end
    -- A record only when there are tokens to settle (ttl > 0): slots and the queue need
    -- just the key's name.
    if reservation and op == 'charge' and (reservation_ttl_ms or 0) > 0 then
      -- Its value is the time of the charge: where a sliding window's correction goes.
      redis.call('SET', reservation, string.format('%.17g', now_ms), 'PX', math.floor(reservation_ttl_ms))
    end
  end
else
  local charged_at = now_ms
  if op == 'settle' and reservation then
    charged_at = tonumber(redis.call('GET', reservation)) or now_ms
    if redis.call('DEL', reservation) == 0 then
      done = 0
    end
  end
  for i = 1, n do
    statuses[i], retries[i], charged[i] = 1, 0, 0
    if specs[i][5] == 'slots' then
      if op == 'settle' or op == 'release' then
        levels[i] = levels[i] + redis.call('ZREM', KEYS[i], reservation)
      else
        hold_slot(i, true)
      end
    elseif op == 'settle' and done == 1 and specs[i][3] ~= 0 and specs[i][5] == 'sw' then
      -- A charge that already left the window needs no correction.
      if charged_at > now_ms - specs[i][2] then
        sw_add(KEYS[i], specs[i][2], charged_at, -specs[i][3])
        levels[i] = math.min(specs[i][1], levels[i] + specs[i][3])
      end
    elseif op == 'settle' and done == 1 and specs[i][3] ~= 0 then
      levels[i] = math.min(specs[i][1], levels[i] + specs[i][3])
      store(i, levels[i])
    end
  end
end

local reply = { done }
for i = 1, n do
  local capacity, window_ms = specs[i][1], specs[i][2]
  local tokens = levels[i]
  local reset_after_ms = 0
  if specs[i][5] == 'tb' then
    reset_after_ms = math.ceil((capacity - tokens) * window_ms / capacity)
  elseif specs[i][5] == 'sw' then
    reset_after_ms = sw_reset(KEYS[i], window_ms)
  end
  reply[i + 1] = { statuses[i], capacity, math.max(0, math.floor(tokens)), reset_after_ms, retries[i],
    done == 1 and charged[i] or 0 }
end
return reply
