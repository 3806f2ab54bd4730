"""lua/token_bucket.lua against a real redis-server, with the case table that the Rust
model (src/bucket.rs) is tested with; and on a three-node Redis Cluster."""

import json
import time
import uuid
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "lua/token_bucket.lua").read_text()
CASES = json.loads((ROOT / "tests/cases/token_bucket.json").read_text())["cases"]
STATUS = {1: "allowed", 0: "limited", -1: "never"}

# Moves a bucket's stored `ts` to Redis's TIME minus ARGV[1] ms: "this bucket was last
# written that long ago". Run in the same MULTI as the call under test, so no real time
# passes between the two and the table's virtual clock is exact.
SET_AGE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  redis.call('HSET', KEYS[1], 'ts', string.format('%.17g', now - tonumber(ARGV[1])))
end
"""


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


def bucket_args(op, limits, amounts, ttl_ms=0, mins=None):
    args = [op, len(limits), ttl_ms]
    for i, (limit, amount) in enumerate(zip(limits, amounts)):
        args += [limit.get("kind", "tb"), limit["capacity"], limit["window_ms"], amount, mins[i] if mins else max(amount, 0)]
    return args


def call(client, op, keys, limits, amounts, reservation=None, ttl_ms=60_000):
    all_keys = keys + ([reservation] if reservation else [])
    return client.eval(SCRIPT, len(all_keys), *all_keys, *bucket_args(op, limits, amounts, ttl_ms))


def run_case(client, case, tolerance_ms=1):
    tag = uuid.uuid4().hex
    keys = [f"test:{{{tag}}}:{limit['name']}" for limit in case["limits"]]
    written_at = {}
    clock = 0
    for i, step in enumerate(case["steps"]):
        clock += step["advance_ms"]
        pipe = client.pipeline(transaction=True)
        for key in keys:
            if key in written_at:
                pipe.eval(SET_AGE, 1, key, clock - written_at[key])
        op = step.get("op", "charge")
        third = step.get("share", 0.5) if op == "lease" else 0
        pipe.eval(SCRIPT, len(keys), *keys, *bucket_args(op, case["limits"], step["amounts"], third, mins=step.get("mins")))
        reply = pipe.execute()[-1]
        what = f"{case['name']} / step {i}"
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
            assert abs(reset_after_ms - want[2]) <= tolerance_ms, f"{what}: reset {reset_after_ms} vs {want[2]}"
            assert abs(retry_after_ms - want[3]) <= tolerance_ms, f"{what}: retry {retry_after_ms} vs {want[3]}"
    return keys


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case_table(client, case):
    run_case(client, case)


RPM10 = [{"capacity": 10, "window_ms": 60_000}]


def test_charged_buckets_expire_when_they_would_be_full(client):
    key = f"test:{{{uuid.uuid4().hex}}}:rpm"
    call(client, "charge", [key], RPM10, [4])
    ttl = client.pttl(key)
    # 4 of 10 spent, refilling 10 per minute: full again in 24 s.
    assert 23_000 < ttl <= 24_000


def test_a_look_writes_nothing(client):
    key = f"test:{{{uuid.uuid4().hex}}}:rpm"
    call(client, "charge", [key], RPM10, [0])
    assert client.exists(key) == 0


def test_a_reservation_settles_at_most_once_and_expires(client):
    tag = uuid.uuid4().hex
    key, reservation = f"test:{{{tag}}}:tpm", f"test:{{{tag}}}:res:r1"
    assert call(client, "charge", [key], RPM10, [8], reservation, ttl_ms=60_000)[0] == 1
    assert 59_000 < client.pttl(reservation) <= 60_000
    first = call(client, "settle", [key], RPM10, [5], reservation)
    again = call(client, "settle", [key], RPM10, [5], reservation)
    assert (first[0], first[1][2]) == (1, 7)
    assert (again[0], again[1][2]) == (0, 7)  # not applied twice
    assert client.exists(reservation) == 0
    # A denied charge writes no reservation; an expired one settles nothing.
    call(client, "charge", [key], RPM10, [9], f"test:{{{tag}}}:res:r2")
    assert client.exists(f"test:{{{tag}}}:res:r2") == 0
    call(client, "charge", [key], RPM10, [1], f"test:{{{tag}}}:res:r3", ttl_ms=1)
    time.sleep(0.01)
    assert call(client, "settle", [key], RPM10, [1], f"test:{{{tag}}}:res:r3")[0] == 0


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "expected op, n"),
        (["charge", 1, 0, "tb", 5, 1000, 1], "expected op, n"),
        (["refund", 1, 0, "tb", 5, 1000, 1, 1], "expected op, n"),
        (["charge", 2, 0, "tb", 5, 1000, 1, 1], "expected op, n"),
        (["charge", 1, 0, "tb", 0, 1000, 1, 1], "bad kind, capacity"),
        (["charge", 1, 0, "tb", 5, 0, 1, 1], "bad kind, capacity"),
        (["charge", 1, 0, "tb", 5, 1000, -1, 0], "bad kind, capacity"),
        (["charge", 1, 0, "tb", 5, 1000, 1, 2], "bad kind, capacity"),
        (["charge", 1, 0, "leaky", 5, 1000, 1, 1], "bad kind, capacity"),
        (["settle", 1, 0, "tb", "x", 1000, 1, 0], "bad kind, capacity"),
        (["lease", 1, 0, "tb", 5, 1000, 1, 1], "needs a share"),
        (["lease", 1, 0.5, "tb", 5, 1000, 1, 2], "bad kind, capacity"),
        (["charge", 1, 0, "slots", 5, 1000, 1, 1], "needs the reservation key"),
    ],
)
def test_bad_arguments_are_errors(client, args, message):
    with pytest.raises(redis.ResponseError, match=message):
        client.eval(SCRIPT, 1, "test:{bad}:rpm", *args)


SLOTS = [{"kind": "slots", "capacity": 2, "window_ms": 60_000}]


def slot_call(client, op, tag, request, limits=SLOTS):
    return call(client, op, [f"test:{{{tag}}}:slots:cc"], limits, [1], f"test:{{{tag}}}:res:{request}")


def test_slots_are_taken_released_and_renewed(client):
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:slots:cc"
    first, second, third = (slot_call(client, "charge", tag, r) for r in ("a", "b", "c"))
    assert (first[0], first[1][2]) == (1, 1)
    assert (second[0], second[1][2]) == (1, 0)
    assert third[0] == 0 and third[1][0] == 0 and 1 <= third[1][4] <= 1000
    assert client.zcard(key) == 2
    # Releasing is idempotent, and frees the slot for another request.
    assert slot_call(client, "settle", tag, "a")[1][2] == 1
    assert slot_call(client, "settle", tag, "a")[1][2] == 1
    assert slot_call(client, "charge", tag, "c")[0] == 1
    # A touch extends a live slot and does not revive a released one.
    before = client.zscore(key, f"test:{{{tag}}}:res:b")
    time.sleep(0.01)
    slot_call(client, "touch", tag, "b")
    assert client.zscore(key, f"test:{{{tag}}}:res:b") > before
    slot_call(client, "touch", tag, "a")
    assert client.zscore(key, f"test:{{{tag}}}:res:a") is None


def test_a_slot_expires_when_its_proxy_stops_renewing_it(client):
    tag = uuid.uuid4().hex
    short = [{"kind": "slots", "capacity": 1, "window_ms": 200}]
    assert slot_call(client, "charge", tag, "crashed", short)[0] == 1
    assert slot_call(client, "charge", tag, "next", short)[0] == 0
    time.sleep(0.25)
    assert slot_call(client, "charge", tag, "next", short)[0] == 1
    # The set itself expires with its last slot.
    assert 0 < client.pttl(f"test:{{{tag}}}:slots:cc") <= 201  # expiry rounded up to whole ms


def test_slots_and_buckets_are_charged_together(client):
    tag = uuid.uuid4().hex
    keys = [f"test:{{{tag}}}:tb:rpm", f"test:{{{tag}}}:slots:cc"]
    limits = [{"capacity": 1, "window_ms": 60_000}, {"kind": "slots", "capacity": 5, "window_ms": 60_000}]
    assert call(client, "charge", keys, limits, [1, 1], f"test:{{{tag}}}:res:r1")[0] == 1
    # The bucket is out: the slot must not be taken either.
    assert call(client, "charge", keys, limits, [1, 1], f"test:{{{tag}}}:res:r2")[0] == 0
    assert client.zcard(keys[1]) == 1


def test_runs_on_a_cluster_with_one_hash_tag_per_tenant(module_stack):
    ports = module_stack.redis_cluster(3)
    cluster = redis.RedisCluster(host="127.0.0.1", port=ports[0])
    try:
        nodes_used = set()
        for tenant in range(12):
            keys = [f"test:{{tenant{tenant}}}:rpm", f"test:{{tenant{tenant}}}:rpd"]
            slot = cluster.keyslot(keys[0])
            assert cluster.keyslot(keys[1]) == slot
            nodes_used.add(cluster.nodes_manager.get_node_from_slot(slot).port)
            limits = [{"capacity": 2, "window_ms": 60_000}, {"capacity": 100, "window_ms": 86_400_000}]
            results = [cluster.eval(SCRIPT, 2, *keys, *bucket_args("charge", limits, [1, 1]))[0] for _ in range(3)]
            assert results == [1, 1, 0], tenant
        assert len(nodes_used) > 1, "tenants should spread over the cluster's nodes"
        # Without a shared tag the keys land in different slots, which the cluster refuses.
        with pytest.raises(redis.RedisClusterException):
            cluster.eval(SCRIPT, 2, "test:a:rpm", "test:b:rpm", *bucket_args("charge", RPM10 * 2, [1, 1]))
    finally:
        cluster.close()


def shift_window(client, key, ms):
    """Moves every entry of a sliding window `ms` into the past (time passing)."""
    entries = client.zrangebyscore(key, "(0", "+inf", withscores=True)
    for member, score in entries:
        client.zadd(key, {member: score - ms}, xx=True)


SW10 = [{"kind": "sw", "capacity": 10, "window_ms": 1000}]


def test_a_sliding_window_admits_no_double_burst_at_the_edge(client):
    """A fixed window admits 10 just before its boundary and 10 just after: 20 in a few ms.
    The sliding window admits 10 in any 1000 ms, wherever the boundary falls."""
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:sw:rps"
    assert [call(client, "charge", [key], SW10, [1])[0] for _ in range(11)] == [1] * 10 + [0]
    refused = call(client, "charge", [key], SW10, [1])
    assert refused[1][0] == 0 and 900 < refused[1][4] <= 1000  # until the first entry leaves
    shift_window(client, key, 600)  # 600 ms later: the same 10 are still in the window
    assert call(client, "charge", [key], SW10, [1])[0] == 0
    shift_window(client, key, 401)  # 1001 ms after them: they all left
    assert [call(client, "charge", [key], SW10, [1])[0] for _ in range(11)] == [1] * 10 + [0]
    assert call(client, "charge", [key], SW10, [11])[1][0] == -1  # never fits


def test_a_sliding_window_charges_several_costs_and_settles_at_the_charge_time(client):
    tag = uuid.uuid4().hex
    key, reservation = f"test:{{{tag}}}:sw:tpm", f"test:{{{tag}}}:res:r1"
    assert call(client, "charge", [key], SW10, [8], reservation, ttl_ms=60_000)[1][2] == 2
    settled = call(client, "settle", [key], SW10, [5], reservation)
    assert (settled[0], settled[1][2]) == (1, 7)
    assert call(client, "settle", [key], SW10, [5], reservation)[0] == 0  # once only
    assert call(client, "charge", [key], SW10, [7])[0] == 1  # 3 + 7 = 10
    assert call(client, "charge", [key], SW10, [1])[0] == 0
    # Everything leaves the window, the charge and its correction together: exactly the
    # capacity is free again (a lingering -5 would let 15 through).
    shift_window(client, key, 1001)
    assert call(client, "charge", [key], SW10, [10])[0] == 1
    assert call(client, "charge", [key], SW10, [1])[0] == 0
