"""A pinned clock for the Lua scripts under test: `pinned(script)` is the script with
Redis's TIME replaced by a number the test passes as one more, last, argument.

A script reads TIME once per call (lua/limits.lua's set_now); a test ageing stored
timestamps by Redis's TIME, then calling the script, then reading the result, reads the
real clock several times, and a loaded machine can pause Redis between the readings (8 ms
seen, issue 43). Pinned, the script's clock is the case table's, whatever the machine.

Test-only: the prefix below is Lua put in front of the script's text here, so it exists
only in the scripts the tests send. The companion loads lua/limits.lua as it is
(include_str!) with one JSON argument, and the script refuses any other number of
arguments: no production caller can choose the script's time.

The prefix shadows the globals `ARGV` (without its last element, the pinned time) and
`redis` (whose `call('TIME')` answers the pinned time; every other command and field is
the real one) with locals, which the script's own code then sees.

    pipe.execute_command("EVAL", pinned(SCRIPT), len(keys), *keys, argument, clock_arg(now_ms))
"""

import math
from helpers import redis_now_ms

PIN_TIME = """
local pinned_us = math.floor(tonumber(ARGV[#ARGV]) * 1000 + 0.5)
local ARGV = { unpack(ARGV, 1, #ARGV - 1) }
local real_redis = redis
local redis = setmetatable({
  call = function(command, ...)
    if type(command) == 'string' and string.upper(command) == 'TIME' then
      return { string.format('%d', math.floor(pinned_us / 1000000)), string.format('%d', pinned_us % 1000000) }
    end
    return real_redis.call(command, ...)
  end,
}, { __index = real_redis })
"""


def pinned(script: str) -> str:
    """`script` reading the pinned time (the last argument, ms since the epoch) as TIME."""
    return PIN_TIME + script


def clock_arg(now_ms: float) -> str:
    """The last argument of a pinned script: `now_ms` to the microsecond, as TIME has it."""
    return f"{now_ms:.3f}"




# How far ahead of Redis's clock `clock_ahead` starts a pinned clock.
AHEAD_MS = 3_600_000


def clock_ahead(client) -> int:
    """A pinned clock's start an hour ahead of Redis's own, in whole ms (so the times a
    test computes from it are exact): for a test of expiry.

    The script sets its keys' expiry from its clock (PEXPIREAT now + window), but Redis
    expires keys by its real one. Pinned at Redis's time, a short-lived key (a 200 ms slot)
    is deleted by Redis if the machine pauses the test that long between two calls, and
    the later call then sees an empty key instead of the script's own judgement of what
    is live. An hour ahead, nothing the test writes expires for real while it runs: what
    is live is decided by the pinned clock alone, and PEXPIRETIME reads the deadline the
    script set, exactly."""
    return math.floor(redis_now_ms(client)) + AHEAD_MS
