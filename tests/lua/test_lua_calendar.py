"""lua/limits.lua's calendar budgets (kind "cal") against a real redis-server, with the
case table the Rust model is tested with (tests/cases/calendar.json,
crates/core/src/bucket.rs); and on a three-node Redis Cluster.

The table's times are a virtual clock from the case's start. Each step places the period
boundaries around Redis's own time (read just before the call, to the whole ms: what a
proxy whose clock agrees with Redis's would send), pins the script's clock to that time
(tests/lua/lua_clock.py) and moves what the earlier steps stored to the virtual clock: a
budget's period end (`ends`) and a reservation's charge time, in the same MULTI as the
call. So the table's resets and retries hold to the millisecond, however long the machine
takes between the calls. The other tests run on Redis's real clock (TOLERANCE_MS)."""

import json
import math
import uuid
from pathlib import Path

import pytest
import redis
from helpers import redis_now_ms
from lua_clock import clock_arg, pinned

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "lua/limits.lua").read_text()
CASES = json.loads((ROOT / "tests/cases/calendar.json").read_text())["cases"]
STATUS = {1: "allowed", 0: "limited", -1: "never"}
TOLERANCE_MS = 250

PINNED_SCRIPT = pinned(SCRIPT)

# The budget's stored period ends ARGV[1] ms after ARGV[2], the call's pinned clock (<= 0:
# it has ended).
SET_ENDS = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'ends', string.format('%.17g', tonumber(ARGV[2]) + tonumber(ARGV[1])))
end
"""

# The reservation record's charge was made ARGV[1] ms before ARGV[2], the call's pinned
# clock.
SET_CHARGED_AGO = """
local record = redis.call('GET', KEYS[1])
if record then
  local now = tonumber(ARGV[2])
  local rest = string.match(record, '^{"at":[^,]*(,.*)$')
  redis.call('SET', KEYS[1], '{"at":' .. string.format('%.17g', now - tonumber(ARGV[1])) .. rest, 'KEEPTTL')
end
"""


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


def budget(capacity, bounds, **amounts):
    """One calendar budget as the script takes it."""
    return {"kind": "cal", "capacity": capacity, "window_ms": bounds[-1] - bounds[0], "bounds": bounds, **amounts}


def charge_args(limit, cost, ttl_ms=0):
    return json.dumps({"op": "charge", "reservation_ttl_ms": ttl_ms, "limits": [{**limit, "cost": cost, "min_cost": cost}]})


def period_end(bounds, clock):
    return next(end for start, end in zip(bounds, bounds[1:]) if start <= clock < end)


def run_case(client, case):
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:cal:budget"
    record = lambda name: f"test:{{{tag}}}:res:{name}"  # noqa: E731
    charged_at, ends_at, clock = {}, None, 0
    for i, step in enumerate(case["steps"]):
        what = f"{case['name']} / step {i}"
        clock += step["advance_ms"]
        op, amount, reservation = step.get("op", "charge"), step["amount"], step.get("reservation")
        # The whole ms of Redis's clock, the script's for this step: the boundaries fall on
        # it exactly, and a step on a boundary is in the period it starts.
        now_ms = math.floor(redis_now_ms(client))
        now, base = clock_arg(now_ms), now_ms - clock
        bounds = [base + b for b in case["bounds_ms"]]
        pipe = client.pipeline(transaction=True)
        if ends_at is not None:
            pipe.eval(SET_ENDS, 1, key, ends_at - clock, now)
        keys = [key]
        if op == "charge":
            keys += [record(reservation)] if reservation else []
            args = charge_args(budget(case["capacity"], bounds), amount, ttl_ms=600_000 if reservation else 0)
        else:
            keys.append(record(reservation))
            pipe.eval(SET_CHARGED_AGO, 1, record(reservation), clock - charged_at.get(reservation, clock), now)
            args = json.dumps({"op": "settle", "limits": [budget(case["capacity"], bounds, credit=amount)]})
        pipe.eval(PINNED_SCRIPT, len(keys), *keys, args, now)
        reply = pipe.execute()[-1]
        assert reply[0] == int(step["done"]), f"{what}: {reply}"
        if op == "charge" and step["done"] and reservation:
            charged_at[reservation] = clock
        if client.exists(key):
            # Whatever the call stored ends where the period of the virtual clock does
            # (a write), or where it ended before (none).
            stored = float(client.hget(key, "ends"))
            ends_at = min(case["bounds_ms"], key=lambda b: abs(b - (stored - base)))
        status, capacity, remaining, reset_after_ms, retry_after_ms, charged = reply[1]
        want = step["outcome"]
        assert (STATUS[status], capacity, remaining) == (want[0], case["capacity"], want[1]), what
        assert abs(reset_after_ms - want[2]) <= 1, f"{what}: reset {reset_after_ms} vs {want[2]}"
        assert abs(retry_after_ms - want[3]) <= 1, f"{what}: retry {retry_after_ms} vs {want[3]}"
        if "charged" in step:
            assert charged == step["charged"], what
    return key


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_script_matches_the_shared_calendar_table(client, case):
    run_case(client, case)


def test_the_key_expires_at_the_period_end(client):
    """Nothing outlives its period: the key's expiry is the period's end by Redis's clock."""
    key = f"test:{{{uuid.uuid4().hex}}}:cal:budget"
    now = redis_now_ms(client)
    bounds = [round(now - 86_400_000), round(now - 1000), round(now + 60_000), round(now + 120_000)]
    assert client.eval(SCRIPT, 1, key, charge_args(budget(10, bounds), 3))[0] == 1
    expires_at = client.execute_command("PEXPIRETIME", key)
    assert expires_at == bounds[2], "the key expires exactly when its period ends"
    assert client.hget(key, "spent") == b"3"


def test_the_period_is_the_one_of_redis_clock_not_the_proxy(client):
    """A proxy whose clock is a period behind sends boundaries around its own time: Redis
    still charges the period its clock is in. One whose clock is further off is told so."""
    key = f"test:{{{uuid.uuid4().hex}}}:cal:budget"
    now = redis_now_ms(client)
    day = 86_400_000
    # Redis is in the day starting 1 s ago; the proxy thinks it is in the day before.
    behind = [round(now - 1000 - 2 * day), round(now - 1000 - day), round(now - 1000), round(now - 1000 + day)]
    reply = client.eval(SCRIPT, 1, key, charge_args(budget(10, behind), 4))
    assert reply[0] == 1 and reply[1][2] == 6
    assert abs(reply[1][3] - (day - 1000)) <= TOLERANCE_MS, "resets at the end of Redis's day"
    assert client.execute_command("PEXPIRETIME", key) == behind[3]
    far = [round(now + day), round(now + 2 * day), round(now + 3 * day), round(now + 4 * day)]
    with pytest.raises(redis.ResponseError, match=r"limits\[0\]\.bounds .* do not hold Redis's clock"):
        client.eval(SCRIPT, 1, key, charge_args(budget(10, far), 1))
    assert client.hget(key, "spent") == b"4", "a refused call writes nothing"


@pytest.mark.parametrize(
    "limit, fragment",
    [
        ({"kind": "cal", "capacity": 1, "window_ms": 1}, r"limits\[0\]\.bounds must be 2 to 8 boundaries"),
        ({"kind": "cal", "capacity": 1, "window_ms": 1, "bounds": [3, 2]}, r"bounds must be ascending"),
        ({"kind": "cal", "capacity": 1, "window_ms": 1, "bounds": list(range(9))}, r"2 to 8 boundaries"),
        ({"kind": "tb", "capacity": 1, "window_ms": 1, "bounds": [1, 2]}, r"bounds is for a calendar budget"),
    ],
)
def test_bad_bounds_are_refused_naming_the_field(client, limit, fragment):
    key = f"test:{{{uuid.uuid4().hex}}}:x"
    with pytest.raises(redis.ResponseError, match=fragment):
        client.eval(SCRIPT, 1, key, json.dumps({"op": "charge", "limits": [{**limit, "cost": 1}]}))
    assert not client.exists(key)


def test_a_calendar_budget_is_not_leased(client):
    now = redis_now_ms(client)
    limit = budget(10, [round(now - 1000), round(now + 60_000)], wanted=2)
    with pytest.raises(redis.ResponseError, match="calendar budget: it cannot be leased"):
        client.eval(SCRIPT, 1, f"test:{{{uuid.uuid4().hex}}}:cal:b", json.dumps({"op": "lease", "share": 0.5, "limits": [limit]}))


def test_peek_and_reset_say_when_the_period_ends(client):
    key = f"test:{{{uuid.uuid4().hex}}}:cal:budget"
    now = redis_now_ms(client)
    bounds = [round(now - 1000), round(now + 30_000)]
    client.eval(SCRIPT, 1, key, charge_args(budget(10, bounds), 10))
    peek = client.eval(SCRIPT, 1, key, json.dumps({"op": "peek", "limits": [budget(10, bounds)]}))
    status, _, remaining, reset_after_ms, retry_after_ms, _ = peek[1]
    assert (status, remaining) == (0, 0)
    assert abs(reset_after_ms - 30_000) <= TOLERANCE_MS and abs(retry_after_ms - 30_000) <= TOLERANCE_MS
    assert client.eval(SCRIPT, 1, key, json.dumps({"op": "reset", "limits": [budget(10, bounds)]}))[0] == 1
    assert not client.exists(key)


def test_runs_on_a_cluster_beside_a_token_bucket(cluster):
    """Tenants on different nodes, each with a calendar budget and a token bucket in one
    hash slot, charged all or nothing."""
    now = redis_now_ms(cluster)
    bounds = [round(now - 1000), round(now + 60_000), round(now + 120_000)]
    for tenant in range(6):
        tag = f"t{tenant}-{uuid.uuid4().hex[:8]}"
        keys = [f"test:{{{tag}}}:cal:month", f"test:{{{tag}}}:tb:rpm"]
        limits = [
            {**budget(2, bounds), "cost": 1, "min_cost": 1},
            {"kind": "tb", "capacity": 100, "window_ms": 60_000, "cost": 1, "min_cost": 1},
        ]
        args = json.dumps({"op": "charge", "limits": limits})
        done = [cluster.eval(SCRIPT, 2, *keys, args)[0] for _ in range(3)]
        assert done == [1, 1, 0], tag
        # Two charges taken (plus what refilled meanwhile), not three.
        assert 98 <= float(cluster.hget(keys[1], "tokens")) < 99, "the refused third charge took nothing from the bucket"
