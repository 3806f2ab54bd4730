"""lua/limits.lua's fair shares of a pool ("Fair shares" in its header) against a real
redis-server and a three-node Redis Cluster, with the case table the Rust model
(crates/core/src/accounting/fair_share.rs) is tested with: tests/cases/fair_share.json."""

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
TABLE = json.loads((ROOT / "tests/cases/fair_share.json").read_text())
CASES = TABLE["cases"]

# The script's clock is the table's (tests/lua/lua_clock.py): every step runs at the case's
# start by Redis's clock plus the steps' advance_ms, and the stored times are those the
# script wrote on that clock, so the time the machine takes between calls is no part of
# any result.
PINNED_SCRIPT = pinned(SCRIPT)

# The whole fair hash as the script left it: {id: used}, decayed to ARGV[2] (the table's
# clock, ms), with tau ARGV[1] (the window).
READ_USED = """
local now = tonumber(ARGV[2])
local fields = redis.call('HGETALL', KEYS[1])
local out = {}
for j = 1, #fields, 2 do
  local used, at = string.match(fields[j + 1], '^(%S+) (%S+)')
  out[#out + 1] = fields[j]
  out[#out + 1] = string.format('%.17g', tonumber(used) * math.exp(-math.max(0, now - tonumber(at)) / tonumber(ARGV[1])))
end
return out
"""


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


def pool_of(case):
    return {"kind": "tb", "capacity": 1000, "window_ms": 60_000, **case.get("pool", {})}


def fair_of(case):
    return {"max": 64, "idle_ms": 60_000, **case.get("fair", {})}


def step_call(case, step):
    """ARGV[1] of one step."""
    pool = pool_of(case)
    if step.get("op") == "settle":
        return json.dumps({"op": "settle", "limits": [{**pool, "credit": step["credit"]}]})
    fair = {"id": step["id"], "weight": step.get("weight", 1), **fair_of(case)}
    limit = {**pool, "cost": step["cost"], "min_cost": step.get("min_cost", step["cost"]), "fair": fair}
    return json.dumps({"op": "charge", "reservation_ttl_ms": 60_000 if "record" in step else 0, "limits": [limit]})


def run_case(client, case, tolerance_ms=1):
    tag = uuid.uuid4().hex
    pool_key = f"test:{{{tag}}}:pool"
    fair_key = f"{pool_key}|fair"
    window_ms = pool_of(case)["window_ms"]
    start, clock = redis_now_ms(client), 0
    for i, step in enumerate(case["steps"]):
        what = f"{case['name']} / step {i}"
        clock += step["advance_ms"]
        now = clock_arg(start + clock)
        keys = [pool_key]
        if "record" in step:
            keys.append(f"test:{{{tag}}}:res:{step['record']}")
        # EVAL by name: a cluster's pipeline has no eval() (its keys share one slot here).
        pipe = client.pipeline(transaction=True)
        pipe.execute_command("EVAL", PINNED_SCRIPT, len(keys), *keys, step_call(case, step), now)
        pipe.execute_command("EVAL", READ_USED, 1, fair_key, window_ms, now)
        reply, used = pipe.execute()
        assert reply[0] == int(step["done"]), f"{what}: {reply}"
        status, _cap, remaining, _reset, retry_after_ms, charged = reply[1]
        assert remaining == step["remaining"], f"{what}: {reply}"
        assert abs(retry_after_ms - step.get("retry_after_ms", 0)) <= tolerance_ms, f"{what}: {reply}"
        if "charged" in step:
            assert charged == step["charged"], f"{what}: {reply}"
        got = {used[j].decode(): float(used[j + 1]) for j in range(0, len(used), 2)}
        assert got.keys() == step["used"].keys(), f"{what}: {got}"
        for claimant, want in step["used"].items():
            # To the table's 0.01, as the model: no real time enters the decay.
            assert math.isclose(got[claimant], want, abs_tol=0.01), f"{what}: {claimant} {got[claimant]} vs {want}"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case_table(client, case):
    run_case(client, case)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case_table_on_a_cluster(cluster, case):
    run_case(cluster, case)


def charge(client, keys, limit, fair):
    return client.eval(SCRIPT, len(keys), *keys, json.dumps({"op": "charge", "limits": [{**limit, "fair": fair}]}))


LIMIT = {"kind": "tb", "capacity": 1000, "window_ms": 60_000, "cost": 10, "min_cost": 10}
FAIR = {"id": "tenant-a", "weight": 1, "max": 8, "idle_ms": 60_000}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fair": {**FAIR, "id": "a b"}}, "limits[0].fair.id must be 1 to 64"),
        ({"fair": {**FAIR, "id": "x" * 65}}, "limits[0].fair.id must be 1 to 64"),
        ({"fair": {**FAIR, "weight": 0}}, "limits[0].fair.weight must be a number > 0"),
        ({"fair": {**FAIR, "max": 1}}, "limits[0].fair.max must be a whole number from 2 to 256"),
        ({"fair": {**FAIR, "max": 2.5}}, "limits[0].fair.max must be a whole number from 2 to 256"),
        ({"fair": {**FAIR, "max": 257}}, "limits[0].fair.max must be a whole number from 2 to 256"),
        ({"fair": {**FAIR, "idle_ms": -1}}, "limits[0].fair.idle_ms must be a number > 0"),
        ({"fair": {**FAIR, "share": 1}}, "unknown field limits[0].fair.share"),
        ({"fair": "tenant-a"}, "limits[0].fair must be an object"),
        ({"kind": "slots"}, "limits[0].fair needs a token bucket or a sliding window"),
    ],
)
def test_bad_fair_arguments_are_refused_naming_the_field(client, change, message):
    key = f"test:{{{uuid.uuid4().hex}}}:pool"
    limit = {**LIMIT, **{k: v for k, v in change.items() if k != "fair"}}
    with pytest.raises(redis.ResponseError, match=message.replace("[", r"\[").replace("]", r"\]")):
        charge(client, [key, f"{key}:res"], limit, change.get("fair", FAIR))
    assert client.exists(key, f"{key}|fair") == 0


def test_fair_is_for_a_charge_only(client):
    key = f"test:{{{uuid.uuid4().hex}}}:pool"
    settle = {"op": "settle", "limits": [{"kind": "tb", "capacity": 10, "window_ms": 1000, "credit": 1, "fair": FAIR}]}
    with pytest.raises(redis.ResponseError, match=r"limits\[0\]\.fair is for a charge only"):
        client.eval(SCRIPT, 1, key, json.dumps(settle))


def test_a_sliding_window_pool_is_shared_fairly_too(client):
    """The rules read only the pool's level: a sliding window holds the heavy claimant to
    what the light one leaves, as a bucket does (the table's second case)."""
    key = f"test:{{{uuid.uuid4().hex}}}:pool"
    window = {"kind": "sw", "capacity": 1000, "window_ms": 60_000}

    def ask(claimant, cost):
        fair = {**FAIR, "id": claimant}
        return charge(client, [key], {**window, "cost": cost, "min_cost": cost}, fair)

    assert ask("light", 100)[0] == 1
    assert ask("heavy", 800)[0] == 1
    refused = ask("heavy", 100)
    assert refused[0] == 0 and refused[1][2] == 100, "the last 100 are the light claimant's reserve"
    assert ask("light", 100)[0] == 1


def test_the_fair_hash_is_bounded_and_expires(client):
    """Whatever ids callers invent, the hash holds at most `max` claimants, and it expires
    idle_ms after its last write."""
    key = f"test:{{{uuid.uuid4().hex}}}:pool"
    for n in range(50):
        charge(client, [key], {**LIMIT, "cost": 1, "min_cost": 1}, {**FAIR, "id": f"invented-{n}", "max": 8, "idle_ms": 5000})
    assert client.hlen(f"{key}|fair") == 8
    assert 4000 < client.pttl(f"{key}|fair") <= 5000


def test_a_shadow_or_look_only_pool_is_not_judged(client):
    """Fair shares refuse only where the pool is enforced: a shadow pool and one that does
    not apply to the call record nothing and never refuse."""
    key = f"test:{{{uuid.uuid4().hex}}}:pool"
    assert charge(client, [key], {**LIMIT, "cost": 900, "min_cost": 900}, {**FAIR, "id": "light"})[0] == 1
    for flag in ("shadow", "look_only"):
        limit = {**LIMIT, "cost": 50, "min_cost": 50, flag: 1}
        assert charge(client, [key], limit, {**FAIR, "id": "other"})[0] == 1
    assert client.hkeys(f"{key}|fair") == [b"light"]


def test_reset_forgets_the_fair_shares(client):
    key = f"test:{{{uuid.uuid4().hex}}}:pool"
    charge(client, [key], LIMIT, FAIR)
    reset = {"op": "reset", "limits": [{"kind": "tb", "capacity": 1000, "window_ms": 60_000}]}
    assert client.eval(SCRIPT, 1, key, json.dumps(reset))[0] == 1, "the pool's own key is what reset counts"
    assert client.exists(key, f"{key}|fair") == 0


@pytest.mark.parametrize("tenants", [64, 256])
def test_memory_per_tenant(client, tenants):
    """What docs/benchmark.md#fair-shares says a fair pool costs in Redis: its hash full of `tenants`
    claimants (MEMORY USAGE), printed."""
    key = f"test:{{{uuid.uuid4().hex}}}:pool"
    for _ in range(tenants):
        fair = {**FAIR, "id": uuid.uuid4().hex, "max": tenants}
        charge(client, [key], {**LIMIT, "capacity": 10_000_000}, fair)
    assert client.hlen(f"{key}|fair") == tenants
    used = client.memory_usage(f"{key}|fair")
    print(f"\nfair hash of {tenants} tenants: {used} bytes, {used / tenants:.0f} per tenant")
    assert used / tenants < 150
