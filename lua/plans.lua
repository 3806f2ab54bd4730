-- plans.lua: an admin's change to one owner's plan (the hash `lua/limits.lua` reads; its
-- fields are described in crates/protocol/src/plans.rs), read before and written
-- atomically, so the before and after it returns (and logs) are exactly what changed.
--
-- ARGV[1] the operation:
--   set     KEYS[1] the owner's plan; on one server also KEYS[2] the domain's index of
--           owners with a plan (a sorted set, score 0) and KEYS[3] the audit log (a
--           stream), updated here, atomically with the plan. On a cluster they are in
--           another hash slot, so the companion updates them around this call.
--           ARGV[2] one JSON object: owner, by (the admin's fingerprint), op (the audit
--           entry's `op`), audit_max (the log's MAXLEN ~), and the change: replace,
--           caps {name: "capacity"}, clear [names], suspend (a reason), unsuspend,
--           expires_ms ("ms"), at_expiry, no_expiry, note ("" removes it). Numbers come
--           as strings: they are written as given, never through a Lua number.
--           A plan left with no capacity, suspension, expiry or note is deleted. With
--           at_expiry `revert` the key expires at expires_ms (PEXPIREAT), else it has no TTL.
--           Returns {1, before, after} (each the plan's fields as a JSON object, {} for no
--           plan), or {0, message} for a change that cannot apply (nothing written).
--   delete  KEYS as for set; ARGV[2] as for set without the change. Returns
--           {1, before, '{}'}, or {2} when the owner has no plan (nothing written, nothing
--           logged).
--   prune   one server only: KEYS[1] the index, KEYS[2..] plan keys, ARGV[2] a JSON list
--           of their owners: each owner whose plan is gone (a `revert` plan that expired)
--           leaves the index. Returns how many left.

local op = ARGV[1]
local call = cjson.decode(ARGV[2])

if op == 'prune' then
  local removed = 0
  for i, owner in ipairs(call) do
    if redis.call('EXISTS', KEYS[i + 1]) == 0 then
      removed = removed + redis.call('ZREM', KEYS[1], owner)
    end
  end
  return removed
end

local function fields(key)
  local flat = redis.call('HGETALL', key)
  local t = {}
  for i = 1, #flat, 2 do
    t[flat[i]] = flat[i + 1]
  end
  return t, #flat > 0
end

local function is_empty(t)
  return next(t) == nil
end

-- cjson encodes an empty table as {} (an object), as wanted here.
local function encoded(t)
  return cjson.encode(t)
end

local function logged(before, after)
  if #KEYS < 3 then
    return
  end
  if is_empty(after) then
    redis.call('ZREM', KEYS[2], call.owner)
  else
    redis.call('ZADD', KEYS[2], 0, call.owner)
  end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', call.audit_max, '*', 'owner', call.owner, 'op', call.op, 'by',
    call.by, 'before', encoded(before), 'after', encoded(after))
end

local plan = KEYS[1]
local before, had = fields(plan)

if op == 'delete' then
  if not had then
    return {2}
  end
  redis.call('DEL', plan)
  logged(before, {})
  return {1, encoded(before), '{}'}
end

if op ~= 'set' then
  return redis.error_reply('unknown operation ' .. tostring(op))
end

local after = {}
if not call.replace then
  for k, v in pairs(before) do
    after[k] = v
  end
end
for name, capacity in pairs(call.caps or {}) do
  after['cap:' .. name] = capacity
end
for _, name in ipairs(call.clear or {}) do
  after['cap:' .. name] = nil
end
if call.suspend then
  after.suspended = call.suspend
end
if call.unsuspend then
  after.suspended = nil
end
if call.note then
  if call.note == '' then
    after.note = nil
  else
    after.note = call.note
  end
end
if call.no_expiry then
  after.expires_ms = nil
  after.at_expiry = nil
end
if call.expires_ms then
  after.expires_ms = call.expires_ms
  after.at_expiry = after.at_expiry or 'revert'
end
if call.at_expiry then
  if not after.expires_ms then
    return {0, 'at_expiry: the plan has no expires_ms (give one too)'}
  end
  after.at_expiry = call.at_expiry
end

local time = redis.call('TIME')
local now_ms = string.format('%s%03d', time[1], math.floor(tonumber(time[2]) / 1000))

local meaningful = false
for k, _ in pairs(after) do
  if k ~= 'updated_ms' and k ~= 'updated_by' and k ~= 'at_expiry' then
    meaningful = true
  end
end
-- A revert plan whose end has passed is no plan (PEXPIREAT would delete it at once).
-- Both are decimal strings of 13 digits until the year 2286: compared as numbers.
local reverted = after.expires_ms and after.at_expiry == 'revert' and tonumber(after.expires_ms) <= tonumber(now_ms)

redis.call('DEL', plan)
if not meaningful or reverted then
  after = {}
else
  after.updated_ms = now_ms
  after.updated_by = call.by
  local args = {}
  for k, v in pairs(after) do
    args[#args + 1] = k
    args[#args + 1] = v
  end
  redis.call('HSET', plan, unpack(args))
  if after.expires_ms and after.at_expiry == 'revert' then
    redis.call('PEXPIREAT', plan, after.expires_ms)
  end
end
logged(before, after)
return {1, encoded(before), encoded(after)}
