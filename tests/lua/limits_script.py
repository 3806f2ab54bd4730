"""lua/limits.lua as the tests under tests/lua/ call it: the script and its pinned form
(tests/lua/lua_clock.py), the token-bucket case table (tests/cases/token_bucket.json) and
what runs one of its steps (the arguments, the keys, their ageing, the check of the reply),
and a module's redis-server (the `client` fixture). test_lua_limits.py runs the table;
test_lua_usage.py peeks after each of its steps."""

import json
import uuid
from pathlib import Path

import pytest
import redis
from lua_clock import pinned

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "lua/limits.lua").read_text()
# The script with its clock pinned (tests/lua/lua_clock.py): the case tables run each step's
# MULTI at one instant, ARGV[2], so the keys' ages are exact whatever the machine's load.
PINNED_SCRIPT = pinned(SCRIPT)
CASES = json.loads((ROOT / "tests/cases/token_bucket.json").read_text())["cases"]
STATUS = {1: "allowed", 0: "limited", -1: "never"}

# Moves a bucket's stored `ts` to ARGV[1] ms before ARGV[2], the pinned clock of the call
# under test (in the same MULTI): "this bucket was last written that long ago".
SET_AGE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'ts', string.format('%.17g', tonumber(ARGV[2]) - tonumber(ARGV[1])))
end
"""


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


# What a limit's amount and minimum are called in each op's arguments (see the script's
# header); touch and release take neither.
AMOUNT_FIELDS = {
    "charge": ("cost", "min_cost"),
    "lease": ("wanted", "needed"),
    "settle": ("credit", None),
    "touch": (None, None),
    "release": (None, None),
}


def script_args(op, limits, amounts, ttl_ms=0, share=None, mins=None, looks=None, shadows=None):
    """ARGV[1]: one JSON object, for the case table's `amounts` (and `mins`, `looks`,
    `shadows`)."""
    amount_field, min_field = AMOUNT_FIELDS[op]
    specs = []
    for i, (limit, amount) in enumerate(zip(limits, amounts)):
        spec = {"kind": limit.get("kind", "tb"), "capacity": limit["capacity"], "window_ms": limit["window_ms"]}
        if amount_field:
            spec[amount_field] = amount
        if min_field:
            spec[min_field] = mins[i] if mins else max(amount, 0)
        if looks and looks[i]:
            spec["look_only"] = 1
        if shadows and shadows[i]:
            spec["shadow"] = 1
        specs.append(spec)
    args = {"op": op, "limits": specs}
    if op == "charge":
        args["reservation_ttl_ms"] = ttl_ms
    if op == "lease":
        args["share"] = share
    return json.dumps(args)



def step_args(case, step):
    """ARGV[1] of one step of a case."""
    op = step.get("op", "charge")
    share = step.get("share", 0.5) if op == "lease" else None
    return script_args(
        op,
        case["limits"],
        step["amounts"],
        share=share,
        mins=step.get("mins"),
        looks=step.get("looks"),
        shadows=step.get("shadows"),
    )


def age_keys(pipe, keys, written_at, clock, now):
    """Queues, in `pipe`, the ageing of every written key to the case's virtual clock, for
    a call pinned at `now` (clock_arg)."""
    for key in keys:
        if key in written_at:
            pipe.eval(SET_AGE, 1, key, clock - written_at[key], now)


def back_credits(pipe, case, step, keys):
    """The table is the buckets' arithmetic: a settle step's credits stand on grants made
    before (what a stand-alone credit needs, see the script's "No credit without a
    debit", tested on its own below), queued in `pipe` as a lease would leave them."""
    if step.get("op") == "settle":
        for key, credit in zip(keys, step["amounts"]):
            if credit > 0:
                pipe.incrbyfloat(f"{key}|granted", credit)


def check_step(case, i, step, reply, keys, written_at, clock, tolerance_ms=1):
    what = f"{case['name']} / step {i}"
    # One outcome per limit, in the table and in the reply: zip alone would pass a reply
    # missing outcomes.
    assert len(step["outcomes"]) == len(step["amounts"]) == len(case["limits"]) == len(keys), what
    assert len(reply) == 1 + len(case["limits"]), f"{what}: {reply}"
    assert reply[0] == int(step["done"]), what
    if step["done"]:
        for key, amount in zip(keys, step["amounts"]):
            if amount != 0:
                written_at[key] = clock
    if "charged" in step:
        assert [outcome[5] for outcome in reply[1:]] == step["charged"], what
    for got, want, limit in zip(reply[1:], step["outcomes"], case["limits"]):
        status, cap, remaining, reset_after_ms, retry_after_ms, _charged = got
        assert STATUS[status] == want[0], what
        assert cap == limit["capacity"], what
        assert remaining == want[1], what
        for name, got_ms, want_ms in (("reset", reset_after_ms, want[2]), ("retry", retry_after_ms, want[3])):
            assert abs(got_ms - want_ms) <= tolerance_ms, f"{what}: {name} {got_ms} vs {want_ms}"


def case_keys(case):
    """Each limit's key: the case's tenant's hash tag, or its `owner`'s (a shared pool's,
    as the companion keys them), so one call may charge counters of several owners."""
    tag = uuid.uuid4().hex
    return [f"test:{{{tag}{limit.get('owner', '')}}}:{limit['name']}" for limit in case["limits"]]


def shift_window(client, key, ms):
    """Moves every entry of a sliding window `ms` into the past (time passing)."""
    entries = client.zrangebyscore(key, "(0", "+inf", withscores=True)
    for member, score in entries:
        client.zadd(key, {member: score - ms}, xx=True)
