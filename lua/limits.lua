-- limits.lua: charge several limits of one tenant all or nothing, settle what a charge
-- reserved once the real cost is known, lease blocks of budget to proxy instances, and
-- keep concurrency slots alive. Four kinds of limit (token bucket, sliding window,
-- concurrency slots, calendar budget), each a driver with the same small set of operations (see
-- "Drivers"); seven ops over them, dispatched in one place (see "Ops"): the five the
-- filter's requests need, and two for operators (peek, reset).
--
-- KEYS[1..n]  limit i, in the order of `limits` below: a token bucket (a hash {tokens,
--             ts}), a sliding window (a sorted set of entries "seq:amount" scored by
--             time, see below) or a slot set (a sorted set of request ids scored by
--             their expiry, ms) or a calendar budget (a hash {spent, ends}).
-- KEYS[n+1]   optional: the reservation record of this request (a string); its key is
--             also the request's member in slot sets, so slot limits need it.
-- KEYS[n+2]   optional, with KEYS[n+1]: the request's cancel marker. charge: refuse if it
--             is set (the request was given up: its client left while the charge was
--             waiting, or the proxy stopped waiting for the answer); settle: set it
--             first, so a charge still to come can never happen after the refund; other
--             ops ignore it.
--             On Redis Cluster all keys must share one hash slot (the companion puts
--             the tenant in a hash tag). On one server the limits may be of several
--             owners (a tenant's own, a team's pool, the upstream's quota: the
--             companion's keys say whose), all charged or none, in this one call; on a
--             cluster the companion splits such a call by owner (companion/src/pools.rs).
-- KEYS[last m] with `plans` = m: the plans of the call's owners (a hash each, see
--             "Plans"), each in its owner's hash slot; limits name theirs by number.
--
-- ARGV[1]     one JSON object with named fields; a field the op does not take is an
--             error, so a misspelt name fails loudly instead of being ignored:
--   op                  "charge", "settle", "lease", "touch", "release", "peek" or
--                       "reset"
--   plans               optional, every op: how many of the last KEYS are plans (m >= 0)
--   reservation_ttl_ms  charge, optional: how long the reservation record lives (ms;
--                       absent or 0: no record)
--   share               lease, required: the share of what is left that one grant may
--                       take (0 < share <= 1)
--   once_ttl_ms         settle, optional: KEYS[n+1] is not a reservation record but the
--                       marker of a stand-alone adjustment, set (living this long, ms)
--                       when it is first applied
--   stand_in            settle, optional, 1: the credits (debits) stand in for the charge
--                       of KEYS[n+1]'s reservation, sent but never answered (it may have
--                       happened, or may yet) or never sent; needs KEYS[n+2] and
--                       reservation_ttl_ms (> 0: how long the record of what the debits
--                       took lives), see "settle" below
--   limits              one object per limit, in KEYS order, with
--     kind        "tb" (token bucket), "sw" (sliding window), "slots" (concurrency) or
--                 "cal" (calendar budget)
--     capacity    (> 0)  tb: tokens when full; sw: the most in any window; slots: how
--                        many at once; cal: the budget of one period
--     window_ms   (> 0)  tb: time in which an empty bucket refills to capacity; sw: the
--                        window; slots: how long a slot lives unless touched; cal: a
--                        period's nominal length (unused)
--     bounds      cal only, required: the period boundaries (ms since the epoch), 2 to 8
--                 ascending numbers, as the proxy's clock places them (see "Calendar")
--     plan        optional: {at, name}, the limit owner's plan (KEYS[#KEYS - m + at],
--                 1 <= at <= m) and the limit's name in it (see "Plans")
--     and, by op:
--     charge   cost      what the call costs (>= 0; slots: 1); a cost of 0 charges
--                        nothing but still refuses while the limit is overdrawn
--              min_cost  optional, default cost: the least this limit may be charged
--                        (<= cost); a limit with min_cost < cost is elastic
--              look_only optional, 1: the limit does not apply to this call (another
--                        model or tier): it is reported, and charged its cost, but never
--                        refuses, however overdrawn
--              shadow    optional, 1: the limit is tried, not enforced: charged its
--                        cost, its status says whether it had room, but it never refuses
--                        the call (nor clamps an elastic one)
--              fair      optional, a shared pool's fair shares (kind "tb" or "sw"):
--                        {id, weight, max, idle_ms}, the claimant charging it (the
--                        tenant, a key part of at most 64 characters), its weight (> 0),
--                        the most claimants the pool tracks (2 to 256) and how long one
--                        stays active after its last call (ms, > 0); see "Fair shares"
--     lease    wanted    the grant wanted (>= 0)
--              needed    optional, default wanted: the grant needed (<= wanted)
--              look_only optional, 1: as for charge, the grant never refused for it
--     settle   credit    tokens to give back (> 0) or to take as well (< 0); slots:
--                        ignored (the slot is released)
--     touch, release, peek, reset: nothing more.
--   Numbers are JSON numbers, read as doubles (as tonumber would read them): integers
--   are exact up to 2^53. Nothing is encoded back to JSON.
--
-- charge: every limit is brought to now (buckets refilled, expired slots dropped); if each
-- has room for its cost, all are charged (a slot taken by this request) and the
-- reservation record (if given) is written; otherwise none is. Elastic limits all give
-- up the same reduction r, the smallest that makes every one of them fit, if no limit
-- then falls below its min_cost: that is how a request's completion allowance is clamped
-- to what the tenant has left.
-- lease: if each limit has what is needed, each grants min(wanted, max(needed, share x
-- what is left)) and is charged that: grants shrink as a tenant nears its limit, so
-- instances sharing it do not starve each other; otherwise nothing is granted. Slot
-- limits cannot be leased.
-- settle: the request's slots are released; if the reservation record exists it is
-- deleted and each limit gets its credit back (never above capacity; a debit may take it
-- below zero, so the tenant waits it off); if the record is gone (settled before, or
-- expired) limits do not change. So a settlement applies at most once, and a reservation
-- never settled simply stands. A stand-alone adjustment (a returned lease, a
-- reconciliation) with once_ttl_ms applies only if its marker was not set yet, and sets
-- it: sent again after a lost answer, it applies at most once too. A stand-in (the
-- proxy admitted the request on its own, the companion away) sets the cancel marker, so
-- the charge cannot happen later; if the charge did happen (its record exists), the
-- charge and its record stand for the debits, which are not applied; else they are, and
-- write the record a charge would have (what they took, for the request's settlement to
-- be made against). Either way the request is counted once, whichever of the two reaches
-- Redis first; and a stand-in that finds the marker set already applied before.
-- touch: the request's slots live another window (a heartbeat for long streams); a slot
-- that already expired is not revived.
-- release: the request's slots are released at once, and nothing else changes (its
-- settlement, which releases them too, may follow).
-- peek: where each limit stands now, as a charge of 1 would see it, writing nothing (not
-- even the housekeeping a charge does: expired window entries and slots stay until the
-- next charge drops them). status 1 if one more unit fits now, else 0 with its retry.
-- reset: each limit's key is deleted (the limit is full again); reservations not yet
-- settled stay, and their settlement can only give back up to capacity.
--
-- A batch runs several such calls in one script call, each on its own and all at the
-- same time (one TIME), as if each were sent alone:
--   ARGV[1]  {"calls": [{"keys": k1, "call": {...}}, {"keys": k2, "call": {...}}, ...]}
--            each "call" an object as above; KEYS are the first call's k1 keys, then the
--            second's k2, and so on. On Redis Cluster every key of a batch must share one
--            hash slot, as within a call.
--   Reply    one element per call, in order: its reply (below), or, if the call failed,
--            its error message as a string (bad arguments, "CANCELLED ...", or a command
--            Redis refused); the other calls are not affected. What a failed call wrote
--            before failing stands, as it would alone.
-- Batches let the companion settle many reservations in one round trip; each settlement
-- in a batch is applied at most once exactly as alone (its reservation record decides).
--
-- Plans: an owner's limits changed at runtime (crates/protocol/src/plans.rs has the
-- format). A plan's hash holds `cap:<name>` (the limit's capacity for this owner, 0: it
-- refuses whatever costs anything), `suspended` (a reason), `expires_ms` and `at_expiry`
-- ("revert", the default, or "suspend"). It is read in the call that charges, so a change
-- holds from every proxy's next call. charge, lease, settle and peek apply the capacities
-- (a settlement's refund is capped by the capacity the owner has now); an expired plan is
-- no plan, or a suspension if at_expiry is "suspend" (by Redis's clock: TIME). A charge
-- or lease that names a suspended owner's plan writes nothing and replies
-- { -1, reason, i }: i the first such limit (0-based); the other ops go on.
--
-- Reply  { done, {status, limit, remaining, reset_after_ms, retry_after_ms, charged} per limit }
--          done            charge: 1 if charged; settle: 1 if applied; lease: 1 if granted;
--                          touch, release, peek: 1; reset: how many keys existed
--          status          1 room, 0 not now, -1 never (cost > capacity); settle, touch,
--                          release: 1
--          limit           the capacity (the plan's, if it sets one)
--          remaining       whole tokens (free slots) left, after the call if done
--          reset_after_ms  time until the limit is full again (slots: 0)
--          retry_after_ms  time until the limit has room for the cost (slots: until the
--                          oldest slot expires, at most 1 s); 0 if now or never
--          charged         what the limit was charged, or granted (0 if not done)
-- Bad arguments are an error reply "ERR limits: ..." naming the field and its value; a
-- charge whose cancel marker is set is the error "CANCELLED ...".
--
-- A sliding window admits at most `capacity` in any `window_ms`, exactly: it logs what
-- each call took, at its time, and forgets entries as they leave the window, keeping a
-- running sum so a call costs O(entries expired), not a scan. The sum and a sequence
-- number live in the same sorted set as members "~sum" and "~seq" scored -(value) - 1,
-- below every entry (entries are scored by time, > 0). A settlement adds a correcting
-- entry (minus the credit) at the time of the charge it corrects (kept in the reservation
-- record), so the correction leaves the window together with the charge.
--
-- Calendar: a budget for a day, a week or a month of some time zone, full again at the
-- period's end. The proxy knows the zone's rules and sends the boundaries around its own
-- clock (the start of the period before, of its own, of the next and of the one after);
-- Redis's clock picks the period [bounds[i], bounds[i+1]) it is in, so every proxy sees
-- the budget full again at the same instant, a boundary, whatever its own clock says
-- within a period either way (a call whose bounds do not hold Redis's time is an error:
-- "ERR limits: ... clock"). The hash holds what was spent and when its period ends
-- (`ends`); spending counts while `ends` is ahead of now, and the key expires at `ends`,
-- so a finished period leaves nothing behind. A settlement corrects only a charge made
-- in the current period (a charge's time is in its reservation record); the budget of an
-- ended period is gone. reset_after_ms is the time to the period's end, full or not (when
-- the budget resets); a refusal retries then. Calendar budgets are not leased.
--
-- Fair shares: a pool many tenants charge (a team's, the upstream's quota) can be held to
-- max-min fair shares among the tenants charging it, across every proxy, as its state is
-- here. Beside the pool's key, a hash (key .. "|fair", same hash slot) holds one field per
-- active claimant: "used at weight last", its admitted tokens decayed exponentially with a
-- time constant of the pool's window (a steady rate r holds it at r x window, so it is
-- measured in the pool's own unit, tokens per window), the time of its last call, its
-- weight and its last call's cost. A charge of claimant t, cost c, beside the pool's own
-- room, must fit two rules:
-- - its allowance: t's used + c <= A_t, the water level of t when the others keep what
--   they use: the share lambda x w_t that solves sum_j min(used_j, lambda x w_j) + lambda
--   x w_t = capacity over the other active claimants j. What a light claimant does not
--   use is what a heavy one may take (max-min), and a claimant is never held below its
--   weighted share of the capacity among the active ones;
-- - borrowing keeps a reserve: a claimant whose used + c passes its equal share g_t =
--   capacity x w_t / (sum of active weights) may not bring the pool's level below the
--   reserve, the sum over the other claimants under their share of min(g_j - used_j,
--   last_j): room for each light claimant's next call, so a heavy one that drains the
--   pool as fast as it refills does not refuse the light ones.
-- A refusal by either rule retries when t's use has decayed to its allowance or the pool
-- has refilled past the reserve. A settlement's credit (or debit) corrects its claimant's
-- used too (the reservation record keeps who it was). Claimants idle for idle_ms are
-- dropped; a new one finding the hash full takes the place of the one using least. Cost:
-- one HGETALL of at most `max` fields, a sort of them, one HSET per charge.
--
-- Time is Redis's own (TIME), so every proxy shares one clock. Buckets refill
-- continuously and hold fractional tokens. A written bucket expires when it would be full
-- again (a missing key and a full bucket are the same state); a slot set expires when its
-- last slot would.
-- The Rust model of the token buckets is crates/core/src/accounting/bucket.rs;
-- tests/cases/token_bucket.json is the case table both are tested with. The sliding windows
-- and slots are modelled by the fake companion (crates/core/src/testing.rs), tested with
-- this script against tests/cases/windows_and_slots.json.

-- The time of this call (ms, fractional); set once the arguments are known to be good.
local now_ms

local function nothing() end

--------------------------------------------------------------------------------------------
-- Drivers. One per kind, each with the same operations over a limit `l` (see `parse`:
-- l.key, l.member, l.capacity, l.window_ms, and l.level, what it has free now):
--   refresh(l)                 brings the limit to now; returns what it has free
--   peek(l)                    what refresh returns, writing nothing
--   retry_after(l, needed)     ms until `needed` fits (called when l.level < needed)
--   take(l, amount)            charges `amount` (> 0) now
--   give_back(l, credit, at)   a settlement's credit, for a charge made at time `at`;
--                              returns what it gave back if it cut the credit
--   touch(l)                   renews this request's slot (not a slot limit: nothing)
--   release(l)                 frees this request's slot (not a slot limit: nothing)
--   reset_after(l)             ms until the limit is full again
-- Each operation that changes what is free updates l.level.
--------------------------------------------------------------------------------------------
local drivers = {}

-- Token bucket: a hash {tokens, ts}, the level at time ts, refilling continuously.
local tb = {}
drivers.tb = tb

-- A bucket written under a plan's capacity keeps it (`pcap`): when the plan's capacity
-- changes (set, raised, lowered, removed), the level moves by the change, so what was
-- spent stays spent and no more: a key drained at 2 and raised to 5 has 3 at once. Only
-- a plan's change moves it; a capacity the call itself sends lower (the provider's word)
-- caps the level as before.
local function tb_store(l)
  redis.call('HSET', l.key, 'tokens', string.format('%.17g', l.level), 'ts', string.format('%.17g', now_ms))
  if l.plan_capacity then
    redis.call('HSET', l.key, 'pcap', string.format('%.17g', l.plan_capacity))
  elseif l.stored_plan_capacity then
    redis.call('HDEL', l.key, 'pcap')
  end
  redis.call('PEXPIRE', l.key, math.max(1, math.ceil((l.capacity - l.level) * l.window_ms / l.capacity)))
end

function tb.refresh(l)
  local state = redis.call('HMGET', l.key, 'tokens', 'ts', 'pcap')
  local tokens, ts = tonumber(state[1]), tonumber(state[2])
  if tokens == nil or ts == nil then
    return l.capacity
  end
  local stored = tonumber(state[3])
  l.stored_plan_capacity = stored
  if stored ~= l.plan_capacity then
    tokens = tokens + (l.plan_capacity or l.sent_capacity) - (stored or l.sent_capacity)
  end
  return math.min(l.capacity, tokens + math.max(0, now_ms - ts) * l.capacity / l.window_ms)
end

-- Reading the hash writes nothing.
tb.peek = tb.refresh

function tb.retry_after(l, needed)
  return math.ceil((needed - l.level) * l.window_ms / l.capacity)
end

function tb.take(l, amount)
  l.level = l.level - amount
  tb_store(l)
end

function tb.give_back(l, credit)
  l.level = math.min(l.capacity, l.level + credit)
  tb_store(l)
end

tb.touch = nothing
tb.release = nothing

function tb.reset_after(l)
  return math.ceil((l.capacity - l.level) * l.window_ms / l.capacity)
end

-- Sliding window (see the header).
local sw = {}
drivers.sw = sw

local function sw_meta(key, name)
  local score = redis.call('ZSCORE', key, name)
  return score and (-tonumber(score) - 1) or 0
end

local function sw_set_meta(key, name, value)
  redis.call('ZADD', key, -value - 1, name)
end

local function sw_add(l, at_ms, amount)
  local seq = sw_meta(l.key, '~seq') + 1
  sw_set_meta(l.key, '~seq', seq)
  redis.call('ZADD', l.key, at_ms, seq .. ':' .. string.format('%.17g', amount))
  sw_set_meta(l.key, '~sum', sw_meta(l.key, '~sum') + amount)
  redis.call('PEXPIRE', l.key, math.ceil(l.window_ms) + 1000)
end

-- The running sum without the entries that left the window, and how many left.
local function sw_in_window(l)
  local sum = sw_meta(l.key, '~sum')
  local expired = redis.call('ZRANGEBYSCORE', l.key, 0, now_ms - l.window_ms)
  for _, member in ipairs(expired) do
    sum = sum - (tonumber(string.match(member, ':(.+)$')) or 0)
  end
  return sum, #expired
end

-- Forgets the entries that left the window.
function sw.refresh(l)
  local sum, expired = sw_in_window(l)
  if expired > 0 then
    redis.call('ZREMRANGEBYSCORE', l.key, 0, now_ms - l.window_ms)
    sw_set_meta(l.key, '~sum', sum)
  end
  return l.capacity - sum
end

function sw.peek(l)
  return l.capacity - sw_in_window(l)
end

-- Walks the entries in the window oldest first until enough leaves (after a refresh the
-- window holds every entry; after a peek, older ones may still be stored).
function sw.retry_after(l, needed)
  local short = needed - l.level
  local after = string.format('(%.17g', math.max(0, now_ms - l.window_ms))
  local entries = redis.call('ZRANGEBYSCORE', l.key, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1000)
  local freed = 0
  for j = 1, #entries, 2 do
    freed = freed + (tonumber(string.match(entries[j], ':(.+)$')) or 0)
    if freed >= short then
      return math.max(1, math.ceil(tonumber(entries[j + 1]) + l.window_ms - now_ms))
    end
  end
  return math.ceil(l.window_ms)
end

function sw.take(l, amount)
  l.level = l.level - amount
  sw_add(l, now_ms, amount)
end

-- A charge that already left the window needs no correction.
-- The window's sum never goes below zero: a credit beyond what is in the window now is
-- cut to it (below zero the window would admit more than its capacity).
function sw.give_back(l, credit, charged_at)
  if charged_at > now_ms - l.window_ms then
    credit = math.min(credit, math.max(0, l.capacity - l.level))
    if credit ~= 0 then
      sw_add(l, charged_at, -credit)
      l.level = l.level + credit
    end
    return credit
  end
  return 0
end

sw.touch = nothing
sw.release = nothing

function sw.reset_after(l)
  local newest = redis.call('ZRANGE', l.key, -1, -1, 'WITHSCORES')
  local at = tonumber(newest[2])
  if not at or at <= 0 then
    return 0
  end
  return math.max(0, math.ceil(at + l.window_ms - now_ms))
end

-- Concurrency slots: a sorted set of request ids (reservation keys) scored by expiry.
local slots = {}
drivers.slots = slots

local function slots_hold(l, only_if_held)
  local expiry = now_ms + l.window_ms
  if only_if_held then
    redis.call('ZADD', l.key, 'XX', expiry, l.member)
  else
    redis.call('ZADD', l.key, expiry, l.member)
  end
  local last = redis.call('ZRANGE', l.key, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', l.key, math.ceil(tonumber(last[2])))
  end
end

-- What is free counting live slots only (expiring after now); remembers when the oldest
-- live one expires.
function slots.peek(l)
  local live = string.format('(%.17g', now_ms)
  local free = l.capacity - redis.call('ZCOUNT', l.key, live, '+inf')
  local first = redis.call('ZRANGEBYSCORE', l.key, live, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  l.oldest = tonumber(first[2])
  return free
end

-- Drops the expired slots first.
function slots.refresh(l)
  redis.call('ZREMRANGEBYSCORE', l.key, '-inf', now_ms)
  return slots.peek(l)
end

function slots.retry_after(l)
  return math.max(1, math.min(1000, math.ceil((l.oldest or now_ms) - now_ms)))
end

function slots.take(l, amount)
  l.level = l.level - amount
  slots_hold(l, false)
end

-- The slot is released by `release`, which a settlement calls for every limit.
slots.give_back = nothing

function slots.touch(l)
  slots_hold(l, true)
end

function slots.release(l)
  l.level = l.level + redis.call('ZREM', l.key, l.member)
end

function slots.reset_after()
  return 0
end

-- Calendar budget (see the header): a hash {spent, ends}. l.period_start and l.period_end
-- are the period Redis's clock is in, found before anything runs (see `place_periods`).
local cal = {}
drivers.cal = cal

function cal.refresh(l)
  local state = redis.call('HMGET', l.key, 'spent', 'ends')
  local spent, ends = tonumber(state[1]), tonumber(state[2])
  if spent == nil or ends == nil or ends <= now_ms then
    return l.capacity
  end
  return math.min(l.capacity, l.capacity - spent)
end

cal.peek = cal.refresh

local function cal_store(l)
  redis.call('HSET', l.key, 'spent', string.format('%.17g', l.capacity - l.level), 'ends', string.format('%.17g', l.period_end))
  redis.call('PEXPIREAT', l.key, math.ceil(l.period_end))
end

function cal.retry_after(l)
  return math.max(1, math.ceil(l.period_end - now_ms))
end

function cal.take(l, amount)
  l.level = l.level - amount
  cal_store(l)
end

-- A charge made before this period began is past correcting.
function cal.give_back(l, credit, charged_at)
  if charged_at < l.period_start then
    return 0
  end
  l.level = math.min(l.capacity, l.level + credit)
  cal_store(l)
  return credit
end

cal.touch = nothing
cal.release = nothing

function cal.reset_after(l)
  return math.max(0, math.ceil(l.period_end - now_ms))
end

-- Finds, for each calendar budget, the period of `bounds` Redis's clock is in; or
-- returns what is wrong.
local function place_periods(limits)
  for i, l in ipairs(limits) do
    if l.kind == 'cal' then
      for j = 1, #l.bounds - 1 do
        if l.bounds[j] <= now_ms and now_ms < l.bounds[j + 1] then
          l.period_start, l.period_end = l.bounds[j], l.bounds[j + 1]
        end
      end
      if not l.period_start then
        return 'limits[' .. (i - 1) .. '].bounds ' .. l.bounds[1] .. '..' .. l.bounds[#l.bounds]
          .. ' do not hold Redis\'s clock (' .. string.format('%.0f', now_ms)
          .. '): the proxy\'s clock is off by more than a period'
      end
    end
  end
end

--------------------------------------------------------------------------------------------
-- Fair shares (see the header). l.fair is {id, weight, max, idle_ms}; l.claimants the
-- active claimants, by id, as fair_load found them: {used, weight, last} at now.
--------------------------------------------------------------------------------------------

local function fair_key(key)
  return key .. '|fair'
end

local function fair_field(used, weight, last)
  return string.format('%.17g %.17g %.17g %.17g', used, now_ms, weight, last)
end

-- The active claimants of the pool at `key`, their use decayed to now (tau: window_ms);
-- the idle ones (and unreadable fields) are deleted. Returns them and how many there are.
local function fair_load(key, window_ms, idle_ms)
  local fields = redis.call('HGETALL', fair_key(key))
  local claimants, count, gone = {}, 0, {}
  for j = 1, #fields, 2 do
    local used, at, weight, last = string.match(fields[j + 1], '^(%S+) (%S+) (%S+) (%S+)$')
    used, at, weight, last = tonumber(used), tonumber(at), tonumber(weight), tonumber(last)
    if used and at and weight and weight > 0 and last and now_ms - at <= idle_ms then
      used = used * math.exp(-math.max(0, now_ms - at) / window_ms)
      claimants[fields[j]] = { used = used, weight = weight, last = last, ratio = used / weight }
      count = count + 1
    else
      gone[#gone + 1] = fields[j]
    end
  end
  if #gone > 0 then
    redis.call('HDEL', fair_key(key), unpack(gone))
  end
  return claimants, count
end

-- The water level of claimant `id` (weight w) when every other active claimant keeps
-- what it uses: lambda x w, with sum_j min(used_j, lambda x w_j) + lambda x w = capacity.
local function fair_allowance(claimants, id, w, capacity)
  local others, weights = {}, w
  for other, c in pairs(claimants) do
    if other ~= id then
      others[#others + 1] = c
      weights = weights + c.weight
    end
  end
  table.sort(others, function(a, b)
    return a.ratio < b.ratio
  end)
  local taken = 0
  for _, c in ipairs(others) do
    if c.ratio > (capacity - taken) / weights then
      break
    end
    taken = taken + c.used
    weights = weights - c.weight
  end
  return (capacity - taken) / weights * w
end

-- Sets l.room, what claimant l.fair.id may take from the pool now (at most l.level), and
-- l.fair_retry(needed), when `needed` would fit.
local function fair_judge(l)
  local f = l.fair
  local claimants, count = fair_load(l.key, l.window_ms, f.idle_ms)
  l.claimants, l.claimant_count = claimants, count
  local me = claimants[f.id] or { used = 0, weight = f.weight, last = l.cost }
  local total_weight = f.weight
  for id, c in pairs(claimants) do
    if id ~= f.id then
      total_weight = total_weight + c.weight
    end
  end
  local allowance = fair_allowance(claimants, f.id, f.weight, l.capacity)
  local share = l.capacity * f.weight / total_weight
  local reserve = 0
  for id, c in pairs(claimants) do
    local their_share = l.capacity * c.weight / total_weight
    if id ~= f.id and c.used < their_share then
      reserve = reserve + math.min(their_share - c.used, c.last)
    end
  end
  local room = math.min(l.level, allowance - me.used)
  if me.used + l.cost > share then
    room = math.min(room, l.level - reserve)
  end
  l.room = room
  l.fair_retry = function(needed)
    local wait = 0
    if me.used + needed > allowance then
      -- used decays as e^(-t / window): the time until it is allowance - needed.
      wait = allowance > needed and math.ceil(l.window_ms * math.log(me.used / (allowance - needed)))
        or math.ceil(l.window_ms)
    end
    if me.used + needed > share and l.level - reserve < needed then
      wait = math.max(wait, l.driver.retry_after(l, reserve + needed))
    end
    return math.max(1, wait)
  end
end

-- Records claimant l.fair.id's call: `charged` more used, now active. A newcomer finding
-- the hash full takes the place of the claimant using least.
local function fair_record(l, charged)
  local f = l.fair
  local me = l.claimants[f.id]
  if not me and l.claimant_count >= f.max then
    local least, least_used = nil, nil
    for id, c in pairs(l.claimants) do
      if least_used == nil or c.used < least_used then
        least, least_used = id, c.used
      end
    end
    redis.call('HDEL', fair_key(l.key), least)
  end
  local used = (me and me.used or 0) + charged
  redis.call('HSET', fair_key(l.key), f.id, fair_field(used, f.weight, math.max(l.cost, charged)))
  redis.call('PEXPIRE', fair_key(l.key), math.ceil(f.idle_ms))
end

-- A settlement's credit (a debit if < 0) corrects claimant `id`'s use of the pool at
-- `key`, if it is still active (never below zero).
local function fair_correct(key, id, credit, window_ms)
  local field = redis.call('HGET', fair_key(key), id)
  if not field then
    return
  end
  local used, at, weight, last = string.match(field, '^(%S+) (%S+) (%S+) (%S+)$')
  used, at = tonumber(used), tonumber(at)
  if used and at and tonumber(weight) and tonumber(last) then
    used = math.max(0, used * math.exp(-math.max(0, now_ms - at) / window_ms) - credit)
    redis.call('HSET', fair_key(key), id, fair_field(used, tonumber(weight), tonumber(last)))
  end
end

--------------------------------------------------------------------------------------------
-- Plans (see the header). A call reads each plan key once, whatever limits name it.
--------------------------------------------------------------------------------------------

local EXPIRED_REASON = 'the plan expired'

-- The plan in `key` as it stands now: {caps, suspended}, or nil (none, or expired back to
-- the config's limits).
local function read_plan(key)
  local fields = redis.call('HGETALL', key)
  if #fields == 0 then
    return nil
  end
  local plan, expires_ms, at_expiry = { caps = {} }, nil, nil
  for i = 1, #fields, 2 do
    local field, value = fields[i], fields[i + 1]
    if string.sub(field, 1, 4) == 'cap:' then
      plan.caps[string.sub(field, 5)] = tonumber(value)
    elseif field == 'suspended' then
      plan.suspended = value
    elseif field == 'expires_ms' then
      expires_ms = tonumber(value)
    elseif field == 'at_expiry' then
      at_expiry = value
    end
  end
  if expires_ms and expires_ms <= now_ms then
    if at_expiry == 'suspend' then
      return { caps = {}, suspended = plan.suspended or EXPIRED_REASON }
    end
    return nil
  end
  return plan
end

-- Applies the plans to the limits that name one: their capacities; returns the index
-- (0-based) of the first limit whose owner is suspended, and the reason, or nil. A
-- capacity of 0 closes the limit (`closed`): the drivers keep working on the config's
-- capacity (none of their arithmetic divides by 0), and admit refuses any cost.
local function apply_plans(limits, plan_keys)
  local read, suspended_at, reason = {}, nil, nil
  for i, l in ipairs(limits) do
    if l.plan then
      local at = l.plan.at
      if read[at] == nil then
        read[at] = read_plan(plan_keys[at]) or false
      end
      local plan = read[at]
      if plan then
        local capacity = plan.caps[l.plan.name]
        if capacity == 0 then
          l.closed = true
        elseif capacity and capacity > 0 then
          l.sent_capacity, l.plan_capacity, l.capacity = l.capacity, capacity, capacity
        end
        if plan.suspended and not suspended_at then
          suspended_at, reason = i - 1, plan.suspended
        end
      end
    end
  end
  return suspended_at, reason
end

--------------------------------------------------------------------------------------------
-- Ops. Each names the fields it takes (true: required, false: optional; all numbers),
-- whether it is about the tenant rather than one request (tenant_wide: no member key),
-- checks what the fields alone cannot say, and runs over the limits, already checked:
-- run(limits, args, keys) returns done (or an error reply), and sets each limit's status,
-- retry and charged where they differ from 1, 0 and 0.
--------------------------------------------------------------------------------------------

local function bring_to_now(limits)
  for _, l in ipairs(limits) do
    l.level = l.driver.refresh(l)
  end
end

-- Charges grants[i] from each limit if each holds required[i], and none can never fit
-- (least[i] above capacity); otherwise charges nothing. A look-only limit never refuses.
-- A shadow limit says whether it had room (its status) but never refuses either.
local function admit(limits, grants, required, least)
  local done = 1
  for i, l in ipairs(limits) do
    local enforced = l.shadow ~= 1
    if l.look_only == 1 then
      l.status = 1
    elseif least[i] > l.capacity or (l.closed and required[i] > 0) then
      l.status = -1
      done = enforced and 0 or done
    elseif l.level < required[i] then
      l.status = 0
      done = enforced and 0 or done
      l.retry = l.driver.retry_after(l, required[i])
    elseif l.room and l.room < required[i] then
      -- Room in the pool, but not for this claimant now (see "Fair shares").
      l.status = 0
      done = 0
      l.retry = l.fair_retry(required[i])
    end
  end
  if done == 1 then
    for i, l in ipairs(limits) do
      l.charged = grants[i]
      if grants[i] > 0 then
        l.driver.take(l, grants[i])
      end
    end
  end
  return done
end

--------------------------------------------------------------------------------------------
-- No credit without a debit. A settlement gives back at most what stands behind it:
-- - against a reservation record, at most what the charge took from that limit (the
--   record keeps it, see reservation_record); a record from before the amounts were kept
--   (a plain time) caps nothing, and lives at most its ttl after an upgrade;
-- - stand-alone (a returned lease, a grant beyond its request), at most what leases
--   granted the tenant on that limit and were not given back yet: each grant adds to the
--   limit's "granted" counter (a key beside the limit's, in its hash slot), each such
--   credit takes from it. With nothing behind it a credit is refused (0 given back).
-- Debits (credit < 0) are never cut.
--------------------------------------------------------------------------------------------

-- How long the granted counter outlives the window of its last grant: a lease lives far
-- less than a window, so a return never finds it gone.
local GRANTED_GRACE_MS = 60000
-- How long a cancel marker lives: longer than a charge can sit in a companion or a
-- proxy's queue of settlements before reaching Redis.
local CANCEL_MARKER_TTL_MS = 600000

local function granted_key(l)
  return l.key .. '|granted'
end

-- The record a charge leaves: its time (where a sliding window's correction goes) and
-- what it took from each limit, by the limit's key.
-- Numbers written with %.17g (cjson would round them to 14 digits).
-- A fair pool's claimant is kept too (`fair`, by the pool's key): its settlement corrects
-- the claimant's use.
-- `sign`: 1 for a charge (l.charged is what it took), -1 for a stand-in (its debits).
local function reservation_record(limits, sign)
  local took, fair = {}, {}
  for i, l in ipairs(limits) do
    took[i] = cjson.encode(l.key) .. ':' .. string.format('%.17g', sign * l.charged)
    if l.fair then
      fair[#fair + 1] = cjson.encode(l.key) .. ':' .. cjson.encode(l.fair.id)
    end
  end
  local claimants = #fair > 0 and (',"fair":{' .. table.concat(fair, ',') .. '}') or ''
  return '{"at":' .. string.format('%.17g', now_ms) .. ',"took":{' .. table.concat(took, ',') .. '}' .. claimants .. '}'
end

-- A record's time, amounts (nil: a record written before they were kept) and fair
-- pools' claimants (by the pool's key).
local function read_reservation_record(record)
  if not record then
    return now_ms, nil, {}
  end
  local plain = tonumber(record)
  if plain then
    return plain, nil, {}
  end
  local ok, decoded = pcall(cjson.decode, record)
  if ok and type(decoded) == 'table' and type(decoded.at) == 'number' and type(decoded.took) == 'table' then
    return decoded.at, decoded.took, type(decoded.fair) == 'table' and decoded.fair or {}
  end
  -- Unreadable: nothing stands behind a credit.
  return now_ms, {}, {}
end

-- The part of l.credit that stands on a debit (see above).
local function backed_credit(l, args, keys, took)
  local credit = l.credit
  if credit <= 0 or l.kind == 'slots' then
    return credit
  end
  if args.stand_in then
    return 0 -- it stands in for a charge: debits only
  end
  if keys.reservation and not args.once_ttl_ms then
    if took == nil then
      return credit
    end
    return math.min(credit, math.max(0, tonumber(took[l.key]) or 0))
  end
  local key = granted_key(l)
  local granted = tonumber(redis.call('GET', key)) or 0
  credit = math.min(credit, math.max(0, granted))
  if credit > 0 then
    if granted - credit <= 0 then
      redis.call('DEL', key)
    else
      redis.call('INCRBYFLOAT', key, -credit)
    end
  end
  return credit
end

local function between(value, low, high)
  return value >= low and value <= high
end

local ops = {}

ops.charge = {
  refused_when_suspended = true,
  args = { reservation_ttl_ms = false },
  limit = { cost = true, min_cost = false, look_only = false, shadow = false },
  fair = true,
  check = function(l)
    if l.cost < 0 then
      return 'cost', l.cost, 'must be >= 0'
    end
    l.min_cost = l.min_cost or l.cost
    if not between(l.min_cost, 0, l.cost) then
      return 'min_cost', l.min_cost, 'must be between 0 and cost (' .. l.cost .. ')'
    end
  end,
  run = function(limits, args, keys)
    if keys.cancel_marker and redis.call('EXISTS', keys.cancel_marker) == 1 then
      return redis.error_reply('CANCELLED the request was given up before its charge ran')
    end
    bring_to_now(limits)
    -- A fair pool judged for its claimant, when it applies and is enforced.
    for _, l in ipairs(limits) do
      if l.fair and l.look_only ~= 1 and l.shadow ~= 1 then
        fair_judge(l)
      end
    end
    -- The common reduction of the elastic limits: enough for each to fit, if it can.
    local reduction, most = 0, nil
    for _, l in ipairs(limits) do
      if l.min_cost < l.cost and l.shadow ~= 1 then
        reduction = math.max(reduction, l.cost - math.max(l.room or l.level, 0))
        most = math.min(most or (l.cost - l.min_cost), l.cost - l.min_cost)
      end
    end
    reduction = math.ceil(math.min(reduction, most or 0))
    local grants, least = {}, {}
    for i, l in ipairs(limits) do
      grants[i] = (l.min_cost < l.cost) and (l.cost - reduction) or l.cost
      least[i] = l.min_cost
    end
    local done = admit(limits, grants, grants, least)
    for _, l in ipairs(limits) do
      if l.claimants then
        fair_record(l, l.charged)
      end
    end
    -- A record only when there are tokens to settle (ttl > 0): slots and the queue need
    -- just the key's name. Its value is the time of the charge: where a sliding window's
    -- correction goes.
    if done == 1 and keys.reservation and (args.reservation_ttl_ms or 0) > 0 then
      redis.call('SET', keys.reservation, reservation_record(limits, 1), 'PX', math.floor(args.reservation_ttl_ms))
    end
    return done
  end,
}

ops.lease = {
  refused_when_suspended = true,
  args = { share = true },
  limit = { wanted = true, needed = false, look_only = false },
  check_args = function(args)
    if not (args.share > 0 and args.share <= 1) then
      return 'a lease needs a share in (0, 1], got ' .. tostring(args.share)
    end
  end,
  check = function(l)
    if l.wanted < 0 then
      return 'wanted', l.wanted, 'must be >= 0'
    end
    l.needed = l.needed or l.wanted
    if not between(l.needed, 0, l.wanted) then
      return 'needed', l.needed, 'must be between 0 and wanted (' .. l.wanted .. ')'
    end
  end,
  run = function(limits, args)
    bring_to_now(limits)
    local grants, needed = {}, {}
    for i, l in ipairs(limits) do
      grants[i] = math.min(l.wanted, math.max(l.needed, math.floor(math.max(l.level, 0) * args.share)))
      needed[i] = l.needed
    end
    local done = admit(limits, grants, needed, needed)
    if done == 1 then
      for _, l in ipairs(limits) do
        if l.charged > 0 then
          redis.call('INCRBYFLOAT', granted_key(l), l.charged)
          redis.call('PEXPIRE', granted_key(l), math.ceil(l.window_ms) + GRANTED_GRACE_MS)
        end
      end
    end
    return done
  end,
}

ops.settle = {
  args = { once_ttl_ms = false, stand_in = false, reservation_ttl_ms = false },
  limit = { credit = true },
  run = function(limits, args, keys)
    if args.stand_in and (args.stand_in ~= 1 or args.once_ttl_ms or not keys.cancel_marker) then
      return { err = 'stand_in must be 1, without once_ttl_ms, and needs the record and cancel marker keys' }
    end
    if (args.reservation_ttl_ms ~= nil) ~= (args.stand_in ~= nil) or (args.reservation_ttl_ms or 1) <= 0 then
      return { err = 'reservation_ttl_ms (> 0) goes with stand_in, and only with it' }
    end
    if args.once_ttl_ms and (not keys.reservation or args.once_ttl_ms <= 0) then
      return { err = 'once_ttl_ms must be > 0 and needs the marker key' }
    end
    bring_to_now(limits)
    local done, charged_at, took, claimants = 1, now_ms, nil, {}
    if args.stand_in then
      -- The first application sets the marker; the charge, if it happened, stands for
      -- the debits. They stand alone, placed now.
      if not redis.call('SET', keys.cancel_marker, '1', 'NX', 'PX', CANCEL_MARKER_TTL_MS) then
        done = 0
      elseif redis.call('EXISTS', keys.reservation) == 1 then
        done = 0
      end
    elseif args.once_ttl_ms then
      -- A stand-alone adjustment: the key is its marker, set by the first application.
      if not redis.call('SET', keys.reservation, '1', 'NX', 'PX', math.floor(args.once_ttl_ms)) then
        done = 0
      end
    elseif keys.reservation then
      if keys.cancel_marker then
        redis.call('SET', keys.cancel_marker, '1', 'PX', CANCEL_MARKER_TTL_MS)
      end
      local record = redis.call('GET', keys.reservation)
      charged_at, took, claimants = read_reservation_record(record)
      if redis.call('DEL', keys.reservation) == 0 then
        done = 0
      end
    end
    for _, l in ipairs(limits) do
      if done == 1 and l.credit ~= 0 then
        local credit = backed_credit(l, args, keys, took)
        if credit ~= 0 then
          credit = l.driver.give_back(l, credit, charged_at) or credit
        end
        -- What was given back (or taken): the companion counts credits cut or refused.
        l.charged = credit
        if credit ~= 0 and type(claimants[l.key]) == 'string' then
          fair_correct(l.key, claimants[l.key], credit, l.window_ms)
        end
      end
      l.driver.release(l)
    end
    if done == 1 and args.stand_in then
      redis.call('SET', keys.reservation, reservation_record(limits, -1), 'PX', math.floor(args.reservation_ttl_ms))
    end
    return done
  end,
}

-- An op that brings every limit to now and applies one driver operation to each.
local function each(operation)
  return {
    args = {},
    limit = {},
    run = function(limits)
      bring_to_now(limits)
      for _, l in ipairs(limits) do
        l.driver[operation](l)
      end
      return 1
    end,
  }
end

ops.touch = each('touch')
ops.release = each('release')

-- Looks only: each limit as a charge of one unit would find it.
ops.peek = {
  tenant_wide = true, -- no request of its own: a slot limit needs no member
  args = {},
  limit = {},
  run = function(limits)
    for _, l in ipairs(limits) do
      l.level = l.driver.peek(l)
      if l.level < 1 then
        l.status, l.retry = 0, l.driver.retry_after(l, 1)
      end
    end
    return 1
  end,
}

-- Every kind keeps a limit in its one key: deleting it is the state of a fresh tenant.
ops.reset = {
  tenant_wide = true,
  args = {},
  limit = {},
  run = function(limits)
    local deleted = 0
    for _, l in ipairs(limits) do
      deleted = deleted + redis.call('DEL', l.key)
      -- A pool's fair shares start afresh with it (not counted: the pool's own key is).
      redis.call('DEL', fair_key(l.key))
      l.level = l.capacity
    end
    return deleted
  end,
}

--------------------------------------------------------------------------------------------
-- Arguments
--------------------------------------------------------------------------------------------

local function shown(value)
  if type(value) == 'string' then
    return string.format('%q', value)
  elseif type(value) == 'number' then
    return tostring(value)
  elseif value == nil then
    return 'nothing'
  elseif value == cjson.null then
    return 'null'
  end
  return 'a ' .. type(value)
end

local function is_number(value)
  return type(value) == 'number' and value == value
end

-- `object`'s fields are those of `fixed` (checked by the caller) and `numbers` (name ->
-- required), each of the latter a number. Returns a problem, or nil.
local function check_fields(object, where, fixed, numbers, op)
  for name in pairs(object) do
    if not fixed[name] and numbers[name] == nil then
      return 'unknown field ' .. where .. tostring(name) .. ' for op ' .. op
    end
  end
  for name, required in pairs(numbers) do
    local value = object[name]
    if (required or value ~= nil) and not is_number(value) then
      return where .. name .. ' must be a number, got ' .. shown(value)
    end
  end
end

-- Whether `value` is a non-empty JSON array (a table with keys 1..n only).
local function is_array(value)
  if type(value) ~= 'table' or #value == 0 then
    return false
  end
  local fields = 0
  for _ in pairs(value) do
    fields = fields + 1
  end
  return fields == #value
end

local TOP = { op = true, limits = true, plans = true }
local PER_LIMIT = { kind = true, capacity = true, window_ms = true, bounds = true, fair = true, plan = true }

-- A calendar budget's bounds (2 to 8 ascending numbers); other kinds have none. Returns
-- a problem, or nil.
local function check_bounds(spec, where)
  if spec.kind ~= 'cal' then
    if spec.bounds ~= nil then
      return where .. 'bounds is for a calendar budget (kind "cal") only'
    end
    return nil
  end
  local bounds = spec.bounds
  if not is_array(bounds) or #bounds < 2 or #bounds > 8 then
    return where .. 'bounds must be 2 to 8 boundaries (ms), got ' .. shown(bounds)
  end
  for j, bound in ipairs(bounds) do
    if not is_number(bound) or (j > 1 and bound <= bounds[j - 1]) then
      return where .. 'bounds must be ascending numbers, got ' .. shown(bound) .. ' at ' .. (j - 1)
    end
  end
end

local FAIR = { id = true, weight = true, max = true, idle_ms = true }
local PLAN = { at = true, name = true }

-- Whether `value`, found at `where`, is an object of the `fields` only. Returns a
-- problem, or nil.
local function check_object(value, where, fields)
  if type(value) ~= 'table' then
    return where .. ' must be an object, got ' .. shown(value)
  end
  for name in pairs(value) do
    if not fields[name] then
      return 'unknown field ' .. where .. '.' .. tostring(name)
    end
  end
end

-- A limit's plan: {at, name}, at naming one of the call's `plans` plan keys. Returns a
-- problem, or nil.
local function check_plan(spec, where, plans)
  local plan = spec.plan
  if plan == nil then
    return nil
  end
  where = where .. 'plan'
  local problem = check_object(plan, where, PLAN)
  if problem then
    return problem
  end
  if not is_number(plan.at) or plan.at % 1 ~= 0 or plan.at < 1 or plan.at > plans then
    return where .. '.at must name one of the ' .. plans .. ' plan keys (1 to ' .. plans .. '), got ' .. shown(plan.at)
  end
  if type(plan.name) ~= 'string' or #plan.name < 1 or #plan.name > 64 then
    return where .. '.name must be a limit name (1 to 64 characters), got ' .. shown(plan.name)
  end
end

-- A fair pool's claimant (charge only, a token bucket or a sliding window). Returns a
-- problem, or nil.
local function check_fair(spec, where, op)
  local fair = spec.fair
  if fair == nil then
    return nil
  end
  where = where .. 'fair'
  if not op.fair then
    return where .. ' is for a charge only'
  end
  if spec.kind ~= 'tb' and spec.kind ~= 'sw' then
    return where .. ' needs a token bucket or a sliding window (kind "tb" or "sw")'
  end
  local problem = check_object(fair, where, FAIR)
  if problem then
    return problem
  end
  if type(fair.id) ~= 'string' or #fair.id < 1 or #fair.id > 64 or string.find(fair.id, '[^%w_.:-]') then
    return where .. '.id must be 1 to 64 letters, digits or "_.:-", got ' .. shown(fair.id)
  end
  if not is_number(fair.weight) or fair.weight <= 0 then
    return where .. '.weight must be a number > 0, got ' .. shown(fair.weight)
  end
  if not is_number(fair.max) or fair.max % 1 ~= 0 or fair.max < 2 or fair.max > 256 then
    return where .. '.max must be a whole number from 2 to 256, got ' .. shown(fair.max)
  end
  if not is_number(fair.idle_ms) or fair.idle_ms <= 0 then
    return where .. '.idle_ms must be a number > 0, got ' .. shown(fair.idle_ms)
  end
end

-- One call's op and limits (one table per limit, with its key and driver), from its
-- decoded arguments and its keys; or nil and what is wrong.
local function parse(args, keys)
  if type(args) ~= 'table' then
    return nil, nil, 'call must be a JSON object, got ' .. shown(args)
  end
  local op = ops[args.op]
  if type(args.op) ~= 'string' or not op then
    return nil, nil, 'op must be "charge", "settle", "lease", "touch", "release", "peek" or "reset", got '
      .. shown(args.op)
  end
  local problem = check_fields(args, '', TOP, op.args, args.op) or (op.check_args and op.check_args(args))
  if problem then
    return nil, nil, problem
  end
  local given = args.limits
  if not is_array(given) then
    return nil, nil, 'limits must be a non-empty array, got ' .. shown(given)
  end
  local plans = args.plans or 0
  if not is_number(plans) or plans % 1 ~= 0 or plans < 0 then
    return nil, nil, 'plans must be a whole number >= 0, got ' .. shown(args.plans)
  end
  local n = #given
  if #keys < n + plans or #keys > n + 2 + plans then
    return nil, nil, n .. ' limits and ' .. plans .. ' plans need ' .. (n + plans) .. ' to ' .. (n + 2 + plans)
      .. ' keys, got ' .. #keys
  end
  local own_keys = #keys - plans
  local limits = {}
  for i, spec in ipairs(given) do
    local where = 'limits[' .. (i - 1) .. '].'
    if type(spec) ~= 'table' then
      return nil, nil, 'limits[' .. (i - 1) .. '] must be an object, got ' .. shown(spec)
    end
    problem = check_fields(spec, where, PER_LIMIT, op.limit, args.op)
    if problem then
      return nil, nil, problem
    end
    if type(spec.kind) ~= 'string' or not drivers[spec.kind] then
      return nil, nil, where .. 'kind must be "tb", "sw", "slots" or "cal", got ' .. shown(spec.kind)
    end
    problem = check_bounds(spec, where) or check_fair(spec, where, op) or check_plan(spec, where, plans)
    if problem then
      return nil, nil, problem
    end
    for _, name in ipairs({ 'capacity', 'window_ms' }) do
      if not is_number(spec[name]) or spec[name] <= 0 then
        return nil, nil, where .. name .. ' must be a number > 0, got ' .. shown(spec[name])
      end
    end
    local l = { key = keys[i], member = own_keys > n and keys[n + 1] or nil, driver = drivers[spec.kind], status = 1, retry = 0, charged = 0 }
    for name, value in pairs(spec) do
      l[name] = value
    end
    l.sent_capacity = l.capacity -- before a plan's (see apply_plans)
    if op.check then
      local field, value, rule = op.check(l)
      if field then
        return nil, nil, where .. field .. ' ' .. rule .. ', got ' .. shown(value)
      end
    end
    if l.kind == 'slots' and ((not l.member and not op.tenant_wide) or args.op == 'lease') then
      return nil, nil, 'limits[' .. (i - 1) .. '] is a slot limit: it needs the reservation key, and cannot be leased'
    end
    if l.kind == 'cal' and args.op == 'lease' then
      return nil, nil, 'limits[' .. (i - 1) .. '] is a calendar budget: it cannot be leased'
    end
    limits[i] = l
  end
  return op, limits
end

-- Runs one parsed call over its keys: its reply, or an error reply (a table with `err`).
local function run(args, op, limits, keys)
  local n, plans = #limits, args.plans or 0
  local misplaced = place_periods(limits)
  if misplaced then
    return { err = 'ERR limits: ' .. misplaced }
  end
  local own_keys = #keys - plans
  local plan_keys = {}
  for j = 1, plans do
    plan_keys[j] = keys[own_keys + j]
  end
  local suspended_at, reason = apply_plans(limits, plan_keys)
  if suspended_at and op.refused_when_suspended then
    return { -1, reason, suspended_at }
  end
  local done = op.run(limits, args, {
    reservation = own_keys > n and keys[n + 1] or nil,
    cancel_marker = own_keys > n + 1 and keys[n + 2] or nil,
  })
  if type(done) == 'table' then
    return done
  end
  local reply = { done }
  for i, l in ipairs(limits) do
    local capacity, level = l.capacity, math.max(0, math.floor(l.level))
    if l.closed then
      capacity, level = 0, 0
    end
    reply[i + 1] = { l.status, capacity, level, l.driver.reset_after(l), l.retry, l.charged }
  end
  return reply
end

local function set_now()
  local time = redis.call('TIME')
  now_ms = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000
end

-- A batch's entries, each {keys = how many of KEYS, in order, are this call's; call =
-- its arguments}, with the keys split among them; or nil and what is wrong.
local function split_batch(calls)
  if not is_array(calls) then
    return nil, 'calls must be a non-empty array, got ' .. shown(calls)
  end
  local entries, next_key = {}, 1
  for j, entry in ipairs(calls) do
    local where = 'calls[' .. (j - 1) .. ']'
    if type(entry) ~= 'table' then
      return nil, where .. ' must be an object, got ' .. shown(entry)
    end
    for name in pairs(entry) do
      if name ~= 'keys' and name ~= 'call' then
        return nil, 'unknown field ' .. where .. '.' .. tostring(name)
      end
    end
    local k = entry.keys
    if not is_number(k) or k < 1 or k % 1 ~= 0 then
      return nil, where .. '.keys must be a whole number >= 1, got ' .. shown(k)
    end
    local keys = {}
    for i = 1, k do
      keys[i] = KEYS[next_key + i - 1]
    end
    next_key = next_key + k
    entries[j] = { args = entry.call, keys = keys }
  end
  if next_key - 1 ~= #KEYS then
    return nil, 'the calls name ' .. (next_key - 1) .. ' keys, got ' .. #KEYS
  end
  return entries
end

local function error_text(err)
  if type(err) == 'table' then
    return tostring(err.err)
  end
  return tostring(err)
end

--------------------------------------------------------------------------------------------
-- The call
--------------------------------------------------------------------------------------------

if #ARGV ~= 1 then
  return redis.error_reply('ERR limits: expected one argument, a JSON object (see the header), got ' .. #ARGV)
end
local decoded, args = pcall(cjson.decode, ARGV[1])
if not decoded or type(args) ~= 'table' then
  return redis.error_reply('ERR limits: ARGV[1] must be a JSON object')
end

if args.calls == nil then
  local op, limits, problem = parse(args, KEYS)
  if problem then
    return redis.error_reply('ERR limits: ' .. problem)
  end
  set_now()
  return run(args, op, limits, KEYS)
end

-- A batch: each call on its own, as if sent alone, at one time. A call that fails (bad
-- arguments, a cancelled charge, a command Redis refused) is reported as its error
-- message and the others go on; what it wrote before failing stands, as it would alone.
for name in pairs(args) do
  if name ~= 'calls' then
    return redis.error_reply('ERR limits: unknown field ' .. tostring(name) .. ' next to calls')
  end
end
local entries, problem = split_batch(args.calls)
if not entries then
  return redis.error_reply('ERR limits: ' .. problem)
end
set_now()
local replies = {}
for j, entry in ipairs(entries) do
  local op, limits, call_problem = parse(entry.args, entry.keys)
  if call_problem then
    replies[j] = 'ERR limits: calls[' .. (j - 1) .. ']: ' .. call_problem
  else
    local ok, reply = pcall(run, entry.args, op, limits, entry.keys)
    if not ok then
      replies[j] = error_text(reply)
    elseif reply.err then
      replies[j] = error_text(reply)
    else
      replies[j] = reply
    end
  end
end
return replies
