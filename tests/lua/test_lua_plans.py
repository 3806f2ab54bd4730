"""Plans read by lua/limits.lua inside the call that charges (the format:
crates/protocol/src/plans.rs): the shared case table tests/cases/plans.json (also run
against the fake companion's model, crates/core/src/testing.rs), then what the table does
not hold: a settlement's refund, leases, peeks, bad arguments, a cluster."""

import json
import uuid
from pathlib import Path

import pytest
import redis
from helpers import redis_now_ms
from lua_clock import clock_arg, pinned

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "lua/limits.lua").read_text()
PINNED_SCRIPT = pinned(SCRIPT)
CASES = json.loads((ROOT / "tests/cases/plans.json").read_text())["cases"]
STATUS = {1: "allowed", 0: "limited", -1: "never"}


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


def plan_key(tag):
    return f"test:{{{tag}}}:plan:limits"


def limit_key(tag, limit):
    return f"test:{{{tag}}}:{limit['kind']}:{limit['name']}"


def call_for(limits, tags, op, amounts, amount_field, extra=None, own_keys=()):
    """KEYS and ARGV[1] of one call: each limit's key, `own_keys` (a record, a marker),
    then each owner's plan once, in order of first use, as the companion sends them."""
    owners = []
    specs = []
    for limit, amount in zip(limits, amounts):
        owner = limit["owner"]
        if owner not in owners:
            owners.append(owner)
        spec = {k: limit[k] for k in ("kind", "capacity", "window_ms")}
        if amount_field:
            spec[amount_field] = amount
        spec["plan"] = {"at": owners.index(owner) + 1, "name": limit["name"]}
        specs.append(spec)
    keys = [limit_key(tags[l["owner"]], l) for l in limits] + list(own_keys) + [plan_key(tags[o]) for o in owners]
    args = {"op": op, "plans": len(owners), "limits": specs, **(extra or {})}
    return keys, json.dumps(args)


def write_plans(client, plans, tags, now_ms):
    for owner, fields in plans.items():
        fields = dict(fields)
        if "expires_in_ms" in fields:
            fields["expires_ms"] = str(now_ms + fields.pop("expires_in_ms"))
        client.hset(plan_key(tags[owner]), mapping=fields)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_plans_follow_the_shared_case_table(client, case):
    tags = {"tenant": uuid.uuid4().hex, "team": uuid.uuid4().hex}
    now_ms = redis_now_ms(client)
    write_plans(client, case["plans"], tags, now_ms)
    for step, charge in enumerate(case["charges"]):
        for owner, fields in charge.get("set_plans", {}).items():
            client.delete(plan_key(tags[owner]))
            write_plans(client, {owner: fields} if fields else {}, tags, now_ms)
        keys, argument = call_for(case["limits"], tags, "charge", charge["cost"], "cost", {"reservation_ttl_ms": 0})
        reply = client.eval(PINNED_SCRIPT, len(keys), *keys, argument, clock_arg(now_ms))
        where = f"{case['name']}, charge {step}: {reply}"
        if charge["done"] == "suspended":
            assert reply[0] == -1, where
            assert (reply[1].decode(), reply[2]) == (charge["reason"], charge["suspended_limit"]), where
            # A suspension writes nothing: every counter is as it was.
            assert not any(client.exists(k) for k in keys[: len(case["limits"])]), where
            continue
        assert reply[0] == charge["done"], where
        assert [STATUS[o[0]] for o in reply[1:]] == charge["status"], where
        assert [o[1] for o in reply[1:]] == charge["limit"], where


TPM = {"name": "tpm", "owner": "tenant", "kind": "tb", "capacity": 100, "window_ms": 60_000}


def test_a_refund_is_capped_by_the_plans_capacity_not_the_configs(client):
    """A charge under a raised capacity is refunded up to that capacity: capped at the
    config's, the refund of a large reservation would be lost."""
    tags = {"tenant": uuid.uuid4().hex}
    client.hset(plan_key(tags["tenant"]), mapping={"cap:tpm": "1000"})
    record = f"test:{{{tags['tenant']}}}:res:r1"
    keys, argument = call_for([TPM], tags, "charge", [900], "cost", {"reservation_ttl_ms": 60_000}, [record])
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == 1 and reply[1][1:3] == [1000, 100], reply
    keys, argument = call_for([TPM], tags, "settle", [800], "credit", own_keys=[record])
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == 1 and reply[1][2] >= 900, reply


def test_a_lease_is_sized_by_the_plan_and_refused_while_suspended(client):
    tags = {"tenant": uuid.uuid4().hex}
    client.hset(plan_key(tags["tenant"]), mapping={"cap:tpm": "1000"})
    keys, argument = call_for([TPM], tags, "lease", [600], "wanted", {"share": 1})
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == 1 and reply[1][1] == 1000 and reply[1][5] == 600, reply
    client.hset(plan_key(tags["tenant"]), "suspended", "paused by billing")
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == -1 and reply[1] == b"paused by billing", reply


def test_a_peek_shows_the_plans_capacity_and_a_settlement_goes_on_while_suspended(client):
    tags = {"tenant": uuid.uuid4().hex}
    client.hset(plan_key(tags["tenant"]), mapping={"cap:tpm": "250", "suspended": "audit"})
    keys, argument = call_for([TPM], tags, "peek", [None], None)
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == 1 and reply[1][1:3] == [250, 250], reply
    # A request admitted before the suspension still settles (its refund is not lost).
    keys, argument = call_for([TPM], tags, "settle", [-50], "credit")
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == 1 and reply[1][1:3] == [250, 200], reply


def test_a_closed_limit_reports_nothing_left_and_a_reopened_one_its_old_level(client):
    tags = {"tenant": uuid.uuid4().hex}
    keys, argument = call_for([TPM], tags, "charge", [30], "cost", {"reservation_ttl_ms": 0})
    assert client.eval(SCRIPT, len(keys), *keys, argument)[1][2] == 70
    client.hset(plan_key(tags["tenant"]), "cap:tpm", "0")
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == 0 and reply[1][:3] == [-1, 0, 0], reply
    client.delete(plan_key(tags["tenant"]))
    reply = client.eval(SCRIPT, len(keys), *keys, argument)
    assert reply[0] == 1 and reply[1][1] == 100 and 39 <= reply[1][2] <= 41, reply


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda a: a.update(plans=-1), "plans must be a whole number >= 0"),
        (lambda a: a.update(plans=2), "1 limits and 2 plans need 3 to 5 keys, got 2"),
        (lambda a: a["limits"][0].update(plan={"at": 2, "name": "tpm"}), "plan.at must name one of the 1 plan keys"),
        (lambda a: a["limits"][0].update(plan={"at": 1}), "plan.name must be a limit name"),
        (lambda a: a["limits"][0].update(plan={"at": 1, "name": "tpm", "x": 1}), "unknown field limits[0].plan.x"),
    ],
)
def test_bad_plan_arguments_are_refused_naming_the_field(client, change, problem):
    tags = {"tenant": uuid.uuid4().hex}
    keys, argument = call_for([TPM], tags, "charge", [1], "cost", {"reservation_ttl_ms": 0})
    args = json.loads(argument)
    change(args)
    with pytest.raises(redis.ResponseError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        client.eval(SCRIPT, len(keys), *keys, json.dumps(args))
    assert not client.exists(keys[0])


def test_a_plan_shares_its_owners_slot_on_a_cluster(cluster):
    """The plan key is in the owner's hash slot: the cluster runs the call, plan and all."""
    for _ in range(4):
        tags = {"tenant": uuid.uuid4().hex}
        cluster.hset(plan_key(tags["tenant"]), mapping={"cap:tpm": "7"})
        keys, argument = call_for([TPM], tags, "charge", [5], "cost", {"reservation_ttl_ms": 0})
        assert cluster.eval(SCRIPT, len(keys), *keys, argument)[1][1:3] == [7, 2]
        cluster.hset(plan_key(tags["tenant"]), "suspended", "off")
        assert cluster.eval(SCRIPT, len(keys), *keys, argument)[0] == -1
