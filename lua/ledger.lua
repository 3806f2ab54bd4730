-- ledger.lua: adds one owner's rows of a proxy worker's ledger batch to the spend ledger,
-- at most once per batch, atomically. The companion runs it once per owner of a batch
-- (every key here shares the owner's hash tag, so it runs on a Redis Cluster too).
--
-- KEYS[1]    the owner's marker for the worker (a string): the last batch number (`seq`)
--            added for this owner from that worker. Batches of a worker are sent one at a
--            time and resent, same number, until acknowledged, so a number at or below
--            the marker's was added already.
-- KEYS[2..]  the owner's ledger hash of each day the batch has rows for, in `days` order:
--            fields `<model>|<part>` (part: r requests, i input, o output, c cached,
--            t reasoning tokens, u micro-dollars; a part that stayed 0 has no field),
--            `~label` (`tenant`, or the pool's `<header>=<value>`) and `~models` (how
--            many models the day counts apart, `other` aside).
-- ARGV[1]    one JSON object:
--   seq          the batch's number (1 <= seq < 2^53)
--   marker_ttl_s how long the marker lives (how late a resent batch is still known)
--   retention_s  how long a day's hash lives after its last addition
--   max_models   the models a day counts apart; rows of further models go to `other`
--   label        the owner's label
--   days         one list of rows per KEYS[2..]: {model, r, i, o, c, t, u}, counts as
--                non-negative integers below 2^53
-- Returns {1} when the rows were added, {0} when the batch had been added before.

local call = cjson.decode(ARGV[1])

local function whole(value, name, least)
  local n = tonumber(value)
  if not n or n ~= math.floor(n) or n < least or n >= 9007199254740992 then
    return nil, redis.error_reply(name .. ' must be a whole number in [' .. least .. ', 2^53)')
  end
  return n
end

local seq, err = whole(call.seq, 'seq', 1)
if not seq then return err end
local marker_ttl_s, err2 = whole(call.marker_ttl_s, 'marker_ttl_s', 1)
if not marker_ttl_s then return err2 end
local retention_s, err3 = whole(call.retention_s, 'retention_s', 1)
if not retention_s then return err3 end
local max_models, err4 = whole(call.max_models, 'max_models', 1)
if not max_models then return err4 end
if type(call.label) ~= 'string' or call.label == '' then
  return redis.error_reply('label must be a non-empty string')
end
if type(call.days) ~= 'table' or #call.days ~= #KEYS - 1 then
  return redis.error_reply('days must hold one list of rows per day key')
end
local PARTS = { 'r', 'i', 'o', 'c', 't', 'u' }
-- Everything is checked before anything is written: a batch is added whole or not at all.
for d, rows in ipairs(call.days) do
  if type(rows) ~= 'table' then
    return redis.error_reply('days[' .. d .. '] must be a list of rows')
  end
  for _, row in ipairs(rows) do
    if type(row.model) ~= 'string' or row.model == '' or string.sub(row.model, 1, 1) == '~' then
      return redis.error_reply('a row model must be a non-empty string not starting with ~')
    end
    for _, part in ipairs(PARTS) do
      local n, bad = whole(row[part] or 0, 'row ' .. part, 0)
      if not n then return bad end
    end
  end
end

local marker = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if seq <= marker then
  return { 0 }
end

for d, rows in ipairs(call.days) do
  local key = KEYS[d + 1]
  for _, row in ipairs(rows) do
    local model = row.model
    if model ~= 'other' and redis.call('HEXISTS', key, model .. '|r') == 0 then
      -- A model new to this day: counted apart while the day has room, else `other`.
      local models = tonumber(redis.call('HGET', key, '~models') or '0') or 0
      if models >= max_models then
        model = 'other'
      else
        redis.call('HINCRBY', key, '~models', 1)
      end
    end
    -- The requests field always exists for a model counted apart (it marks the model).
    redis.call('HINCRBY', key, model .. '|r', string.format('%.0f', tonumber(row.r or 0)))
    for p = 2, #PARTS do
      local n = tonumber(row[PARTS[p]] or 0)
      if n > 0 then
        redis.call('HINCRBY', key, model .. '|' .. PARTS[p], string.format('%.0f', n))
      end
    end
  end
  redis.call('HSET', key, '~label', call.label)
  redis.call('EXPIRE', key, retention_s)
end
redis.call('SET', KEYS[1], string.format('%.0f', seq), 'EX', marker_ttl_s)
return { 1 }
