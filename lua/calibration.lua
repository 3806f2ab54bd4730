-- calibration.lua: what every proxy has learned about the models' token counts, per
-- model rule, so a proxy that starts (or meets a model) later reserves at the figures the
-- fleet already learned instead of learning them again from its own replies.
--
-- KEYS[1]  the domain's calibration hash: one field per model rule (its fingerprint),
--          each "mean deviation samples mean deviation samples" (the provider's prompt
--          tokens per token a proxy counted; completion lengths), "-" for a figure not
--          learned yet. Bounded by the rules of the configs, never by client input.
-- ARGV[1]  one JSON object:
--   window  samples count as a plain mean over the first `window`, then as an exponential
--           average over about that many (the filter's calibration::WINDOW)
--   ttl_ms  how long the hash lives after its last exchange
--   rules   [{rule, prompt_ratios?, outputs?}]: each rule's new samples, in the order
--           the proxy learned them (a rule without samples only asks)
-- Returns one entry per rule, in order: {rule, figures} with figures in the stored form
-- (nothing is encoded back to JSON, so the figures reach the proxy exact).
--
-- Each sample is taken in as the filter's calibration::Running::observe takes it; the
-- case table tests/cases/calibration.json pins both.

local call = cjson.decode(ARGV[1])
local window = tonumber(call.window)
if not window or window < 1 then
  return redis.error_reply('window must be a number >= 1')
end

local function decode(text)
  local mean, deviation, samples = string.match(text or '', '^(%S+) (%S+) (%S+)$')
  if not mean then
    return nil
  end
  return { mean = tonumber(mean), deviation = tonumber(deviation), samples = tonumber(samples) }
end

local function encode(running)
  if not running then
    return '-'
  end
  return string.format('%.17g %.17g %d', running.mean, running.deviation, running.samples)
end

local function observe(running, sample)
  if not running then
    return { mean = sample, deviation = 0, samples = 1 }
  end
  local samples = running.samples + 1
  local weight = 1 / math.min(math.max(samples, 1), window)
  local miss = sample - running.mean
  return {
    mean = running.mean + miss * weight,
    deviation = running.deviation + (math.abs(miss) - running.deviation) * weight,
    samples = samples,
  }
end

local function observe_all(running, samples)
  if type(samples) == 'table' then
    for _, sample in ipairs(samples) do
      running = observe(running, tonumber(sample))
    end
  end
  return running
end

local replies = {}
for i, rule in ipairs(call.rules or {}) do
  local stored = redis.call('HGET', KEYS[1], rule.rule)
  local ratio, output = nil, nil
  if stored then
    local first, second = string.match(stored, '^(.-)|(.*)$')
    ratio, output = decode(first), decode(second)
  end
  local learned = (type(rule.prompt_ratios) == 'table' and #rule.prompt_ratios > 0)
    or (type(rule.outputs) == 'table' and #rule.outputs > 0)
  ratio = observe_all(ratio, rule.prompt_ratios)
  output = observe_all(output, rule.outputs)
  local figures = encode(ratio) .. '|' .. encode(output)
  if learned then
    redis.call('HSET', KEYS[1], rule.rule, figures)
  end
  replies[i] = { rule.rule, figures }
end
if call.ttl_ms and tonumber(call.ttl_ms) > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], math.floor(tonumber(call.ttl_ms)))
end
return replies
