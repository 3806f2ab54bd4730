-- provider.lua: what the providers said about their own limits, per upstream credential
-- and model (a keyed hash: neither appears here), as every proxy of the fleet heard it,
-- and who sends the one probe once a provider's retry time has passed.
--
-- KEYS[1]  the domain's hash: one field per provider key (16 hex digits), each
--          "said out refused owner probe_until r0 u0 r1 u1 r2 u2 r3 u3": when the request
--          whose reply said it was sent, until when the provider refuses (0: it does
--          not), whether it refused with a 429 (1) rather than said a quota was spent
--          (0), the proxy that may probe ('-': none) and until when, and per quota
--          (requests, tokens, input tokens, output tokens) what is left and until when
--          (0: not said). All times ms since the epoch. Bounded by `max_entries`.
-- ARGV[1]  one JSON object:
--   proxy          the asking proxy's id (16 hex digits)
--   offer_ms       how long a proxy given the probe has to send it
--   hold_ms        how long a probe that went out holds it (its reply normally comes sooner)
--   ttl_ms         how long the hash lives after its last exchange
--   max_entries    most fields
--   reports        [{key, said_ms, out_until_ms, refused, probing, left: [[r, u] x 4]}]
-- Returns one string per field still in effect:
--   "key said out refused probe probe_until r0 u0 r1 u1 r2 u2 r3 u3", probe being
--   'you', 'another' or 'nobody'.
--
-- Later news wins (by `said`). Past a 429's retry time the first proxy to ask is given
-- the probe for `offer_ms`; a proxy that sent it reports `probing` and holds it for
-- `hold_ms`; its next later news (the probe's reply) ends it. So the fleet sends at most
-- one probe per retry period, whichever proxies see traffic.

local call = cjson.decode(ARGV[1])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local offer_ms = tonumber(call.offer_ms) or 2000
local hold_ms = tonumber(call.hold_ms) or 10000
local max_entries = tonumber(call.max_entries) or 256
-- An entry stays this long after the last time in it, so a 429 whose retry time passed
-- while no proxy asked still gives its probe to one proxy only.
local LINGER_MS = 60000

if type(call.proxy) ~= 'string' or not string.match(call.proxy, '^%x+$') then
  return redis.error_reply('proxy must be hex digits')
end

local function decode(text)
  if not text then
    return nil
  end
  local f = {}
  for part in string.gmatch(text, '%S+') do
    f[#f + 1] = part
  end
  if #f ~= 13 then
    return nil
  end
  local e = { said = tonumber(f[1]), out = tonumber(f[2]), refused = f[3] == '1', owner = f[4],
              probe_until = tonumber(f[5]), left = {} }
  for q = 0, 3 do
    e.left[q + 1] = { tonumber(f[6 + 2 * q]), tonumber(f[7 + 2 * q]) }
  end
  return e
end

local function n(x)
  return string.format('%.0f', math.max(0, tonumber(x) or 0))
end

local function figures(e)
  local parts = {}
  for q = 1, 4 do
    parts[#parts + 1] = n(e.left[q][1]) .. ' ' .. n(e.left[q][2])
  end
  return table.concat(parts, ' ')
end

local function encode(e)
  return n(e.said) .. ' ' .. n(e.out) .. ' ' .. (e.refused and '1' or '0') .. ' ' .. e.owner .. ' '
    .. n(e.probe_until) .. ' ' .. figures(e)
end

local function last_time(e)
  local last = math.max(e.out, e.probe_until)
  for q = 1, 4 do
    last = math.max(last, e.left[q][2])
  end
  return last
end

local function prune()
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local e = decode(all[i + 1])
    if not e or last_time(e) + LINGER_MS < now then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end

for _, r in ipairs(call.reports or {}) do
  local key = r.key
  local left = r.left
  if type(key) == 'string' and string.match(key, '^%x+$') and type(left) == 'table' and #left == 4 then
    local stored = decode(redis.call('HGET', KEYS[1], key))
    local room = stored ~= nil
    if not room then
      if redis.call('HLEN', KEYS[1]) >= max_entries then
        prune()
      end
      room = redis.call('HLEN', KEYS[1]) < max_entries
    end
    local said = tonumber(r.said_ms) or 0
    if room then
      local e = stored or { said = -1, out = 0, refused = false, owner = '-', probe_until = 0, left = {} }
      if said > e.said or (said == e.said and not stored) then
        -- Later news. From the proxy that held the probe, it is the probe's answer.
        if e.owner == call.proxy then
          e.owner, e.probe_until = '-', 0
        end
        e.said, e.out, e.refused = said, tonumber(r.out_until_ms) or 0, r.refused == true
        for q = 1, 4 do
          local pair = left[q]
          e.left[q] = { tonumber(pair[1]) or 0, tonumber(pair[2]) or 0 }
        end
        if e.out == 0 then
          e.owner, e.probe_until = '-', 0
        end
      end
      if r.probing == true and e.owner == call.proxy then
        e.probe_until = now + hold_ms
      end
      redis.call('HSET', KEYS[1], key, encode(e))
    end
  end
end

local replies = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local key, e = all[i], decode(all[i + 1])
  if not e or last_time(e) + LINGER_MS < now then
    redis.call('HDEL', KEYS[1], key)
  else
    local probe = 'nobody'
    if e.refused and e.out ~= 0 and e.out <= now then
      if e.owner == '-' or e.probe_until <= now then
        e.owner, e.probe_until = call.proxy, now + offer_ms
        redis.call('HSET', KEYS[1], key, encode(e))
      end
      probe = (e.owner == call.proxy) and 'you' or 'another'
    end
    replies[#replies + 1] = key .. ' ' .. n(e.said) .. ' ' .. n(e.out) .. ' ' .. (e.refused and '1' or '0') .. ' '
      .. probe .. ' ' .. n(e.probe_until) .. ' ' .. figures(e)
  end
end
if call.ttl_ms and tonumber(call.ttl_ms) > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], math.floor(tonumber(call.ttl_ms)))
end
return replies
