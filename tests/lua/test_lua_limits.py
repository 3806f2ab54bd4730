"""lua/limits.lua against a real redis-server, with the case tables that the Rust
models are tested with (token buckets: crates/core/src/accounting/bucket.rs; sliding windows and
slots: the fake companion of crates/core/src/testing.rs); and on a three-node Redis Cluster."""

import json
import math
import re
import time
import uuid

import pytest
import redis
from helpers import redis_now_ms
from limits_script import (  # noqa: F401 (client: the module's redis-server)
    CASES, PINNED_SCRIPT, ROOT, SCRIPT, STATUS, age_keys, back_credits, case_keys, check_step, client, script_args,
    shift_window, step_args,
)
from lua_clock import clock_ahead, clock_arg


def call(client, op, keys, limits, amounts, reservation=None, ttl_ms=60_000):
    all_keys = keys + ([reservation] if reservation else [])
    return client.eval(SCRIPT, len(all_keys), *all_keys, script_args(op, limits, amounts, ttl_ms))


def run_case(client, case):
    keys = case_keys(case)
    written_at = {}
    clock = 0
    for i, step in enumerate(case["steps"]):
        clock += step["advance_ms"]
        now = clock_arg(redis_now_ms(client))
        pipe = client.pipeline(transaction=True)
        age_keys(pipe, keys, written_at, clock, now)
        back_credits(pipe, case, step, keys)
        pipe.eval(PINNED_SCRIPT, len(keys), *keys, step_args(case, step), now)
        check_step(case, i, step, pipe.execute()[-1], keys, written_at, clock)
    return keys


def batch_args(calls):
    """ARGV[1] of a batch: `calls` is a list of (number of keys, ARGV[1] of the call)."""
    return json.dumps({"calls": [{"keys": n, "call": json.loads(argument)} for n, argument in calls]})


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case_table(client, case):
    run_case(client, case)


RPM10 = [{"capacity": 10, "window_ms": 60_000}]


def test_numbers_keep_their_precision_through_json(client):
    """Arguments are JSON numbers, read as doubles as tonumber read the old positional
    strings: integers up to 2^53 are exact, and nothing is encoded back through cjson."""
    key = f"test:{{{uuid.uuid4().hex}}}:tpm"
    big = [{"capacity": 2**53, "window_ms": 86_400_000}]
    reply = call(client, "charge", [key], big, [2**53 - 3])
    assert reply[0] == 1 and reply[1][1] == 2**53 and reply[1][2] == 3 and reply[1][5] == 2**53 - 3
    assert float(client.hget(key, "tokens")) < 4  # stored with %.17g, not rounded by cjson


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


def test_a_stand_alone_adjustment_with_a_once_marker_applies_once(client):
    # A returned lease has no reservation record: its marker, set when it is first
    # applied, keeps a batch sent again after a lost answer from giving it back twice.
    tag = uuid.uuid4().hex
    key, marker = f"test:{{{tag}}}:tpm", f"test:{{{tag}}}:once:l1"
    lease = json.dumps({"op": "lease", "share": 1,
                        "limits": [{"kind": "tb", "capacity": 10, "window_ms": 60_000, "wanted": 8}]})
    assert client.eval(SCRIPT, 1, key, lease)[1][5] == 8  # a lease granted 8
    once = json.dumps({"op": "settle", "once_ttl_ms": 600_000,
                       "limits": [{"kind": "tb", "capacity": 10, "window_ms": 60_000, "credit": 5}]})
    first = client.eval(SCRIPT, 2, key, marker, once)
    again = client.eval(SCRIPT, 2, key, marker, once)
    assert (first[0], first[1][2]) == (1, 7)
    assert (again[0], again[1][2]) == (0, 7)
    assert 599_000 < client.pttl(marker) <= 600_000
    # Without the marker key there is nothing to keep it at once: refused, not applied.
    with pytest.raises(redis.ResponseError, match="once_ttl_ms must be > 0 and needs the marker key"):
        client.eval(SCRIPT, 1, key, once)


def stand_in_args(debit, **extra):
    return json.dumps({"op": "settle", "stand_in": 1, "reservation_ttl_ms": 60_000, **extra,
                       "limits": [{"kind": "tb", "capacity": 10, "window_ms": 60_000, "credit": debit}]})


@pytest.mark.parametrize("store", ["client", "cluster"])
def test_a_stand_in_and_the_charge_it_stands_in_for_count_once_in_either_order(store, request):
    """A proxy that got no answer to a charge admits the request itself and sends a debit
    standing in for it; the charge may still run (a paused companion runs it later), before
    or after the stand-in. Whichever comes first counts; the other does nothing; and the
    request's settlement is made against whichever record stands. On one server and on a
    3-node cluster (the record and the marker share the tenant's slot)."""
    client = request.getfixturevalue(store)
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:tpm"

    def keys(request):
        return [key, f"test:{{{tag}}}:res:{request}", f"test:{{{tag}}}:cancel:{request}"]

    def charge(request, cost):
        return client.eval(SCRIPT, 3, *keys(request), script_args("charge", RPM10, [cost], ttl_ms=60_000))

    def settle(request, credit):
        return call(client, "settle", [key], RPM10, [credit], keys(request)[1])

    # The late charge first: it and its record stand for the debit.
    assert charge("r1", 3)[0] == 1
    reply = client.eval(SCRIPT, 3, *keys("r1"), stand_in_args(-3))
    assert (reply[0], reply[1][2]) == (0, 7), reply
    assert client.exists(keys("r1")[2]) == 1
    # The stand-in first: applied, and the charge that comes after is refused.
    reply = client.eval(SCRIPT, 3, *keys("r2"), stand_in_args(-2))
    assert (reply[0], reply[1][2], reply[1][5]) == (1, 5, -2), reply
    assert 59_000 < client.pttl(keys("r2")[1]) <= 60_000, "its record, as a charge's"
    with pytest.raises(redis.ResponseError, match="CANCELLED"):
        charge("r2", 2)
    assert call(client, "charge", [key], RPM10, [0])[1][2] == 5
    # Each request settles against the record that stands: r2 used 1 of its 2 (a credit
    # of 9 gives back what the stand-in took, no more); r1 used all 3.
    reply = settle("r2", 9)
    assert (reply[0], reply[1][2], reply[1][5]) == (1, 7, 2), reply
    assert settle("r1", 0)[0] == 1 and client.exists(keys("r1")[1]) == 0
    reply = settle("r2", 1)
    assert reply[0] == 0, "settled once"
    # Sent again after a lost answer: applied once.
    assert client.eval(SCRIPT, 3, *keys("r2"), stand_in_args(-2))[0] == 0
    assert call(client, "charge", [key], RPM10, [0])[1][2] == 7
    # It stands in for a charge: a credit in it gives nothing back.
    reply = client.eval(SCRIPT, 3, *keys("r3"), stand_in_args(4))
    assert (reply[0], reply[1][2], reply[1][5]) == (1, 7, 0), reply


@pytest.mark.parametrize(
    "keys, extra, message",
    [
        (2, {}, "needs the record and cancel marker keys"),  # no cancel marker key
        (3, {"stand_in": 2}, "stand_in must be 1"),
        (3, {"once_ttl_ms": 60_000}, "without once_ttl_ms"),
        (3, {"reservation_ttl_ms": 0}, "reservation_ttl_ms \\(> 0\\) goes with stand_in"),
    ],
)
def test_a_malformed_stand_in_is_an_error_and_writes_nothing(client, keys, extra, message):
    tag = uuid.uuid4().hex
    all_keys = [f"test:{{{tag}}}:tpm", f"test:{{{tag}}}:res:r", f"test:{{{tag}}}:cancel:r"][:keys]
    with pytest.raises(redis.ResponseError, match=message):
        client.eval(SCRIPT, keys, *all_keys, stand_in_args(-1, **extra))
    assert client.exists(*all_keys) == 0


def test_a_credit_gives_back_at_most_what_its_reservation_took(client):
    tag = uuid.uuid4().hex
    key, reservation = f"test:{{{tag}}}:tpm", f"test:{{{tag}}}:res:r1"
    assert call(client, "charge", [key], RPM10, [3], reservation)[0] == 1
    assert call(client, "charge", [key], RPM10, [6])[0] == 1  # another request's: 1 left
    # A settlement claiming 9 back for a charge of 3 gets 3: the other request's 6 stand.
    reply = call(client, "settle", [key], RPM10, [9], reservation)
    assert reply[0] == 1
    assert (reply[1][2], reply[1][5]) == (4, 3), reply  # remaining 1 + 3; credit applied 3
    # A debit is never cut.
    assert call(client, "charge", [key], RPM10, [2], f"test:{{{tag}}}:res:r2")[0] == 1
    reply = call(client, "settle", [key], RPM10, [-5], f"test:{{{tag}}}:res:r2")
    assert (reply[1][2], reply[1][5]) == (0, -5), reply


def test_a_credit_with_nothing_behind_it_is_refused(client):
    # Exhausted, then a stand-alone credit no lease granted: nothing comes back, with a
    # once marker (as the companion sends them) or without one.
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:tpm"
    assert call(client, "charge", [key], RPM10, [10])[0] == 1
    once = json.dumps({"op": "settle", "once_ttl_ms": 60_000,
                       "limits": [{"kind": "tb", "capacity": 10, "window_ms": 60_000, "credit": 10}]})
    reply = client.eval(SCRIPT, 2, key, f"test:{{{tag}}}:once:forged", once)
    assert (reply[1][2], reply[1][5]) == (0, 0), reply
    reply = call(client, "settle", [key], RPM10, [10])
    assert (reply[1][2], reply[1][5]) == (0, 0), reply
    assert call(client, "charge", [key], RPM10, [1])[0] == 0, "still exhausted"
    # A grant backs returns up to what it granted, in total, whatever the once ids.
    lease = json.dumps({"op": "lease", "share": 1,
                        "limits": [{"kind": "tb", "capacity": 10, "window_ms": 60_000, "wanted": 0}]})
    client.eval(SCRIPT, 1, key, lease)
    client.incrbyfloat(f"{key}|granted", 0)  # (nothing granted: the counter stays 0)
    reply = client.eval(SCRIPT, 2, key, f"test:{{{tag}}}:once:again", once)
    assert reply[1][5] == 0, reply
    # A reservation settled once is gone: its second settlement gives nothing back.
    reservation = f"test:{{{tag}}}:res:r"
    client.delete(key)
    assert call(client, "charge", [key], RPM10, [4], reservation)[0] == 1
    assert call(client, "settle", [key], RPM10, [4], reservation)[1][5] == 4
    assert call(client, "settle", [key], RPM10, [4], reservation)[0] == 0


def test_a_sliding_window_sum_never_goes_below_zero(client):
    tag = uuid.uuid4().hex
    key, reservation = f"test:{{{tag}}}:tpm", f"test:{{{tag}}}:res:r1"
    window = [{"kind": "sw", "capacity": 10, "window_ms": 60_000}]
    assert call(client, "charge", [key], window, [2], reservation)[0] == 1
    # Backed by a grant larger than the window holds: the window gives back what it
    # holds (2), never more, so the next window admits 10, not 10 + the excess.
    client.incrbyfloat(f"{key}|granted", 50)
    reply = call(client, "settle", [key], window, [50])
    assert (reply[1][2], reply[1][5]) == (10, 2), reply
    assert call(client, "charge", [key], window, [10])[0] == 1
    assert call(client, "charge", [key], window, [1])[0] == 0


def argv_of(*limits, op="charge", **extra):
    """ARGV[1] for the bad-argument cases: `limits` as given, nothing filled in."""
    return json.dumps({"op": op, "limits": list(limits), **extra})


TB5 = {"kind": "tb", "capacity": 5, "window_ms": 1000}


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "expected one argument, a JSON object"),
        ([argv_of({**TB5})], "limits[0].cost must be a number, got nothing"),
        ([argv_of({**TB5, "cost": 1}, op="refund")], 'op must be "charge", "settle", "lease", "touch", "release", "peek" or "reset", got "refund"'),
        ([argv_of({**TB5, "cost": 1}, {**TB5, "cost": 1})], "2 limits and 0 plans need 2 to 4 keys, got 1"),
        ([argv_of({**TB5, "capacity": 0, "cost": 1})], "limits[0].capacity must be a number > 0, got 0"),
        ([argv_of({**TB5, "window_ms": 0, "cost": 1})], "limits[0].window_ms must be a number > 0, got 0"),
        ([argv_of({**TB5, "cost": -1, "min_cost": 0})], "limits[0].cost must be >= 0, got -1"),
        ([argv_of({**TB5, "cost": 1, "min_cost": 2})], "limits[0].min_cost must be between 0 and cost (1), got 2"),
        ([argv_of({**TB5, "kind": "leaky", "cost": 1})], 'limits[0].kind must be "tb", "sw", "slots" or "cal", got "leaky"'),
        ([argv_of({**TB5, "capacity": "x", "credit": 1}, op="settle")], 'limits[0].capacity must be a number > 0, got "x"'),
        ([argv_of({**TB5, "wanted": 1, "needed": 1}, op="lease", share=0)], "a lease needs a share in (0, 1], got 0"),
        ([argv_of({**TB5, "wanted": 1, "needed": 2}, op="lease", share=0.5)], "limits[0].needed must be between 0 and wanted (1), got 2"),
        ([argv_of({**TB5, "kind": "slots", "cost": 1})], "limits[0] is a slot limit: it needs the reservation key"),
        # Named arguments: a misspelt or misplaced field is an error, not silently ignored.
        (["charge 1 0 tb 5 1000 1 1"], "ARGV[1] must be a JSON object"),
        ([argv_of({**TB5, "cost": 1, "min": 1})], "unknown field limits[0].min for op charge"),
        ([argv_of({**TB5, "cost": 1}, share=0.5)], "unknown field share for op charge"),
        ([argv_of({**TB5, "credit": 1}, op="settle", reservation_ttl_ms=1000)], "reservation_ttl_ms (> 0) goes with stand_in, and only with it"),
        ([argv_of({**TB5, "wanted": 1})], "unknown field limits[0].wanted for op charge"),
        ([argv_of({**TB5, "credit": 1, "look_only": 1}, op="settle")], "unknown field limits[0].look_only for op settle"),
        ([argv_of(op="lease", share=0.5)], "limits must be a non-empty array"),
    ],
)
def test_bad_arguments_are_errors(client, args, message):
    with pytest.raises(redis.ResponseError, match=re.escape(message)):
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
    # Pinned (tests/lua/lua_clock.py, clock_ahead): the slot lives 200 ms of the script's
    # clock, whatever the machine's pauses between the calls; Redis's real expiry of the
    # set, an hour away, cannot empty it under the test.
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:slots:cc"
    short = [{"kind": "slots", "capacity": 1, "window_ms": 200}]
    start = clock_ahead(client)

    def charge(request, at_ms):
        reservation = f"test:{{{tag}}}:res:{request}"
        return client.eval(PINNED_SCRIPT, 2, key, reservation, script_args("charge", short, [1], 60_000),
                           clock_arg(start + at_ms))

    assert charge("crashed", 0)[0] == 1
    assert charge("next", 199)[0] == 0, "the crashed proxy's slot is live for its whole window"
    assert charge("next", 250)[0] == 1, "and no longer once the window has passed unrenewed"
    assert client.zscore(key, f"test:{{{tag}}}:res:crashed") is None, "the expired slot is dropped"
    # The set itself expires with its last slot: the key's deadline is that slot's.
    assert client.zscore(key, f"test:{{{tag}}}:res:next") == start + 250 + 200
    assert client.execute_command("PEXPIRETIME", key) == math.ceil(start + 250 + 200)  # rounded up to whole ms


def test_slots_and_buckets_are_charged_together(client):
    tag = uuid.uuid4().hex
    keys = [f"test:{{{tag}}}:tb:rpm", f"test:{{{tag}}}:slots:cc"]
    limits = [{"capacity": 1, "window_ms": 60_000}, {"kind": "slots", "capacity": 5, "window_ms": 60_000}]
    assert call(client, "charge", keys, limits, [1, 1], f"test:{{{tag}}}:res:r1")[0] == 1
    # The bucket is out: the slot must not be taken either.
    assert call(client, "charge", keys, limits, [1, 1], f"test:{{{tag}}}:res:r2")[0] == 0
    assert client.zcard(keys[1]) == 1



def test_runs_on_a_cluster_with_one_hash_tag_per_tenant(cluster):
    nodes_used = set()
    for tenant in range(12):
        keys = [f"test:{{tenant{tenant}}}:rpm", f"test:{{tenant{tenant}}}:rpd"]
        slot = cluster.keyslot(keys[0])
        assert cluster.keyslot(keys[1]) == slot
        nodes_used.add(cluster.nodes_manager.get_node_from_slot(slot).port)
        limits = [{"capacity": 2, "window_ms": 60_000}, {"capacity": 100, "window_ms": 86_400_000}]
        results = [cluster.eval(SCRIPT, 2, *keys, script_args("charge", limits, [1, 1]))[0] for _ in range(3)]
        assert results == [1, 1, 0], tenant
    assert len(nodes_used) > 1, "tenants should spread over the cluster's nodes"
    # Without a shared tag the keys land in different slots, which the cluster refuses.
    with pytest.raises(redis.RedisClusterException):
        cluster.eval(SCRIPT, 2, "test:a:rpm", "test:b:rpm", script_args("charge", RPM10 * 2, [1, 1]))


@pytest.mark.parametrize("kind", ["tb", "sw"])
def test_a_look_only_limit_never_refuses_on_a_cluster(cluster, kind):
    """An overdrawn per-model limit refuses a cost of 0 (a cached_input limit that applies
    and reserves nothing), but not a call for which it only looks (another model)."""
    limit = [{"kind": kind, "capacity": 10, "window_ms": 60_000}]
    key, record = f"test:{{look-{kind}}}:{kind}:tpm", f"test:{{look-{kind}}}:r:1"
    assert cluster.eval(SCRIPT, 2, key, record, script_args("charge", limit, [10], ttl_ms=60_000))[0] == 1
    assert cluster.eval(SCRIPT, 2, key, record, script_args("settle", limit, [-5]))[0] == 1  # overdrawn by 5
    assert cluster.eval(SCRIPT, 1, key, script_args("charge", limit, [0]))[0] == 0
    looked = cluster.eval(SCRIPT, 1, key, script_args("charge", limit, [0], looks=[True]))
    assert (looked[0], looked[1][0], looked[1][5]) == (1, 1, 0)
    assert cluster.eval(SCRIPT, 1, key, script_args("lease", limit, [0], share=0.5, looks=[True]))[0] == 1
    assert cluster.eval(SCRIPT, 1, key, script_args("lease", limit, [0], share=0.5))[0] == 0


# Ten in any 100 s: time is moved by shift_window, and the real time a loaded machine
# spends between the calls (it was a 1 s window: 100 ms of it failed the bound below)
# stays far inside the window.
SW10 = [{"kind": "sw", "capacity": 10, "window_ms": 100_000}]


def test_a_sliding_window_admits_no_double_burst_at_the_edge(client):
    """A fixed window admits 10 just before its boundary and 10 just after: 20 in a few ms.
    The sliding window admits 10 in any window, wherever the boundary falls."""
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:sw:rps"
    assert [call(client, "charge", [key], SW10, [1])[0] for _ in range(11)] == [1] * 10 + [0]
    refused = call(client, "charge", [key], SW10, [1])
    assert refused[1][0] == 0 and 90_000 < refused[1][4] <= 100_000  # until the first entry leaves
    shift_window(client, key, 60_000)  # 60 s later: the same 10 are still in the window
    assert call(client, "charge", [key], SW10, [1])[0] == 0
    shift_window(client, key, 40_001)  # 100.001 s after them: they all left
    assert [call(client, "charge", [key], SW10, [1])[0] for _ in range(11)] == [1] * 10 + [0]
    assert call(client, "charge", [key], SW10, [11])[1][0] == -1  # never fits


def test_a_sliding_windows_key_expires_a_window_and_a_second_after_its_last_entry(client):
    """docs/capacity.md: a window's key expires a window (and a second) after its
    last entry, so a tenant that stops leaves nothing behind, and one that goes on keeps
    its window. Bounds measured around each call, whatever the machine's load."""
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:sw:rps"
    full_life_ms = 100_000 + 1000

    def charged_and_ttl():
        started = time.monotonic()
        assert call(client, "charge", [key], SW10, [1])[0] == 1
        ttl = client.pttl(key)
        return ttl, (time.monotonic() - started) * 1000

    ttl, elapsed_ms = charged_and_ttl()
    assert full_life_ms - elapsed_ms - 1 <= ttl <= full_life_ms, (ttl, elapsed_ms)
    time.sleep(0.3)  # time, not state: the second entry comes 300 ms after the first
    ttl, elapsed_ms = charged_and_ttl()
    # Counted from the second entry: a key kept from the first would have at most
    # full_life_ms - 300 left.
    assert full_life_ms - elapsed_ms - 1 <= ttl <= full_life_ms, (ttl, elapsed_ms)


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
    shift_window(client, key, 100_001)
    assert call(client, "charge", [key], SW10, [10])[0] == 1
    assert call(client, "charge", [key], SW10, [1])[0] == 0


# Batches: several calls in one script call (the companion's way to settle many
# reservations, and to run calls that arrive together, in one round trip).


def test_the_case_table_holds_for_calls_batched_together(client):
    """Every case of the table at once: step i of all cases in one batch, each call with its
    own keys and virtual clock, and each reply exactly what the call gets alone."""
    runs = [{"case": case, "keys": case_keys(case), "written_at": {}, "clock": 0} for case in CASES]
    for i in range(max(len(case["steps"]) for case in CASES)):
        due = [run for run in runs if i < len(run["case"]["steps"])]
        now = clock_arg(redis_now_ms(client))
        pipe = client.pipeline(transaction=True)
        keys, calls = [], []
        for run in due:
            step = run["case"]["steps"][i]
            run["clock"] += step["advance_ms"]
            age_keys(pipe, run["keys"], run["written_at"], run["clock"], now)
            back_credits(pipe, run["case"], step, run["keys"])
            keys += run["keys"]
            calls.append((len(run["keys"]), step_args(run["case"], step)))
        pipe.eval(PINNED_SCRIPT, len(keys), *keys, batch_args(calls), now)
        replies = pipe.execute()[-1]
        assert len(replies) == len(due)
        for run, reply in zip(due, replies):
            step = run["case"]["steps"][i]
            check_step(run["case"], i, step, reply, run["keys"], run["written_at"], run["clock"])


def settle_call(key, reservation, credit):
    return (2, script_args("settle", RPM10, [credit])), [key, reservation]


def test_a_batch_applies_each_settlement_once(client):
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:tpm"
    r1, r2 = f"test:{{{tag}}}:res:r1", f"test:{{{tag}}}:res:r2"
    call(client, "charge", [key], RPM10, [4], r1)
    call(client, "charge", [key], RPM10, [3], r2)  # 3 left
    calls, keys = [], []
    for reservation, credit in [(r1, 2), (r1, 2), (r2, -1), (f"test:{{{tag}}}:res:never", 5)]:
        one, its_keys = settle_call(key, reservation, credit)
        calls.append(one)
        keys += its_keys
    replies = client.eval(SCRIPT, len(keys), *keys, batch_args(calls))
    # Applied, already settled (within the same batch), applied (a debit), never charged.
    assert [reply[0] for reply in replies] == [1, 0, 1, 0]
    assert [reply[1][2] for reply in replies] == [5, 5, 4, 4]
    assert client.exists(r1, r2) == 0
    # The same batch again changes nothing.
    again = client.eval(SCRIPT, len(keys), *keys, batch_args(calls))
    assert [reply[0] for reply in again] == [0, 0, 0, 0] and again[-1][1][2] == 4


def test_a_failing_call_in_a_batch_leaves_the_others_alone(client):
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:rpm"
    cancelled, marker = f"test:{{{tag}}}:res:gone", f"test:{{{tag}}}:cancel:gone"
    client.set(marker, "1")
    wrong_type = f"test:{{{tag}}}:res:hash"
    client.hset(wrong_type, "x", "1")  # a reservation key of the wrong type: GET fails
    calls = [
        (1, script_args("charge", RPM10, [1])),
        (1, script_args("charge", RPM10, [-1], mins=[0])),  # refused by the argument check
        (2, script_args("settle", RPM10, [1])),  # with the wrong-type reservation key
        (3, script_args("charge", RPM10, [1])),  # its cancel marker is set
        (1, script_args("charge", RPM10, [2])),
    ]
    keys = [key, key, key, wrong_type, key, cancelled, marker, key]
    calls.append((1, "7"))  # not an object
    keys.append(key)
    replies = client.eval(SCRIPT, len(keys), *keys, batch_args(calls))
    assert replies[0][0] == 1 and replies[0][1][2] == 9
    assert replies[1] == b"ERR limits: calls[1]: limits[0].cost must be >= 0, got -1"
    assert b"WRONGTYPE" in replies[2]
    assert replies[3].startswith(b"CANCELLED")
    # The calls after the failures ran; the refused and the cancelled charged nothing.
    assert replies[4][0] == 1 and replies[4][1][2] == 7
    assert replies[5] == b"ERR limits: calls[5]: call must be a JSON object, got 7"


@pytest.mark.parametrize(
    "calls, keys, message",
    [
        ([], 1, "calls must be a non-empty array"),
        ({"keys": 1}, 1, "calls must be a non-empty array"),
        ([{"keys": 0, "call": {}}], 1, "calls[0].keys must be a whole number >= 1, got 0"),
        ([{"keys": 1.5, "call": {}}], 1, "calls[0].keys must be a whole number >= 1, got 1.5"),
        ([{"keys": 1, "call": {}, "op": "charge"}], 1, "unknown field calls[0].op"),
        ([7], 1, "calls[0] must be an object, got 7"),
        ([{"keys": 1, "call": {}}, {"keys": 1, "call": {}}], 1, "the calls name 2 keys, got 1"),
        ([{"keys": 1, "call": {}}], 2, "the calls name 1 keys, got 2"),
    ],
)
def test_a_malformed_batch_is_an_error(client, calls, keys, message):
    argument = json.dumps({"calls": calls})
    with pytest.raises(redis.ResponseError, match=re.escape(message)):
        client.eval(SCRIPT, keys, *[f"test:{{bad}}:k{i}" for i in range(keys)], argument)


def test_a_batch_takes_nothing_but_its_calls(client):
    with pytest.raises(redis.ResponseError, match=re.escape("unknown field op next to calls")):
        client.eval(SCRIPT, 1, "test:{bad}:k", json.dumps({"calls": [], "op": "charge"}))


def test_a_batch_runs_on_a_cluster_within_one_hash_slot(cluster):
    """The companion batches only calls whose keys share a slot: two tenants in one slot
    share a script call; across slots the cluster refuses it."""
    first = "tenant-a"
    slot = cluster.keyslot(f"{{{first}}}")
    second = next(f"tenant-{i}" for i in range(100_000) if f"tenant-{i}" != first and cluster.keyslot(f"{{tenant-{i}}}") == slot)
    other = next(f"tenant-{i}" for i in range(100_000) if cluster.keyslot(f"{{tenant-{i}}}") != slot)
    run = uuid.uuid4().hex[:8]
    same = [f"test:{{{first}}}:{run}:rpm", f"test:{{{second}}}:{run}:rpm"]
    calls = [(1, script_args("charge", RPM10, [3])), (1, script_args("charge", RPM10, [4]))]
    replies = cluster.eval(SCRIPT, 2, *same, batch_args(calls))
    assert [(reply[0], reply[1][2]) for reply in replies] == [(1, 7), (1, 6)]
    with pytest.raises(redis.RedisClusterException):
        cluster.eval(SCRIPT, 2, same[0], f"test:{{{other}}}:{run}:rpm", batch_args(calls))


# The sliding windows and slots of tests/cases/windows_and_slots.json, which the Rust
# model (the fake companion of crates/core/src/testing.rs) is tested with too. Time moves
# by moving every stored time back: window entries and slot expiries (scores > 0; the
# window's bookkeeping members score below 0) and the reservation records (the time of
# their charge), all by the step's advance less the time since the last step by the
# pinned clock (ARGV[2], the call's), in the same MULTI as the call.
WS_CASES = json.loads((ROOT / "tests/cases/windows_and_slots.json").read_text())["cases"]
SHIFT_TIMES = """
local now = tonumber(ARGV[2])
local last = tonumber(redis.call('GET', KEYS[1])) or now
local shift = (now - last) - tonumber(ARGV[1])
for i = 2, #KEYS do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind == 'zset' then
    local entries = redis.call('ZRANGEBYSCORE', KEYS[i], '(0', '+inf', 'WITHSCORES')
    for j = 1, #entries, 2 do
      redis.call('ZADD', KEYS[i], string.format('%.17g', tonumber(entries[j + 1]) + shift), entries[j])
    end
  elseif kind == 'string' then
    -- A reservation record: a plain time (the old form) or {"at":<time>,"took":{...}}.
    local value = redis.call('GET', KEYS[i])
    local at = tonumber(value)
    if at then
      redis.call('SET', KEYS[i], string.format('%.17g', at + shift), 'KEEPTTL')
    else
      local head, time, rest = string.match(value, '^({"at":)([^,}]+)(.*)$')
      if time and tonumber(time) then
        redis.call('SET', KEYS[i], head .. string.format('%.17g', tonumber(time) + shift) .. rest, 'KEEPTTL')
      end
    end
  end
end
redis.call('SET', KEYS[1], string.format('%.17g', now))
"""


@pytest.mark.parametrize("case", WS_CASES, ids=[c["name"] for c in WS_CASES])
def test_windows_and_slots_case_table(client, case):
    tag = uuid.uuid4().hex
    keys = [f"test:{{{tag}}}:{limit['name']}" for limit in case["limits"]]
    requests = sorted({step["request"] for step in case["steps"]})
    records = {r: f"test:{{{tag}}}:res:{r}" for r in requests}
    clock = f"test:{{{tag}}}:clock"
    for i, step in enumerate(case["steps"]):
        what = f"{case['name']} / step {i}"
        op = step.get("op", "charge")
        assert len(step["amounts"]) == len(case["limits"]), what
        argument = json.loads(script_args(op, case["limits"], step["amounts"], ttl_ms=60_000))
        pipe = client.pipeline(transaction=True)
        stored = [clock, *keys, *records.values()]
        now = clock_arg(redis_now_ms(client))
        pipe.eval(SHIFT_TIMES, len(stored), *stored, step["advance_ms"], now)
        call_keys = keys + [records[step["request"]]]
        pipe.eval(PINNED_SCRIPT, len(call_keys), *call_keys, json.dumps(argument), now)
        reply = pipe.execute()[-1]
        assert reply[0] == int(step["done"]), f"{what}: {reply}"
        if op != "charge":
            continue
        assert len(reply) == 1 + len(case["limits"]) == 1 + len(step["outcomes"]), f"{what}: {reply}"
        for got, want in zip(reply[1:], step["outcomes"]):
            status, _cap, remaining, reset_after_ms, retry_after_ms, _charged = got
            assert [STATUS[status], remaining] == want[:2], f"{what}: {got}"
            assert abs(reset_after_ms - want[2]) <= 1, f"{what}: reset {reset_after_ms} vs {want[2]}"
            assert abs(retry_after_ms - want[3]) <= 1, f"{what}: retry {retry_after_ms} vs {want[3]}"


def test_a_sliding_window_charge_reads_only_the_entries_that_expired(client):
    """docs/configuration.md#a-complete-policy: a sliding window keeps a running sum, "so a call costs
    only the entries that expired, never a scan". With 5,000 entries in the window and 3
    just expired, the commands an admitted charge runs (as Redis's MONITOR shows them)
    read no range but the expired one: nothing that visits the live entries."""
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:sw:tpm"
    window = [{"kind": "sw", "capacity": 1_000_000, "window_ms": 100_000}]
    pipe = client.pipeline(transaction=False)
    for _ in range(5_000):
        pipe.eval(SCRIPT, 1, key, script_args("charge", window, [1]))
    assert all(reply[0] == 1 for reply in pipe.execute())
    # The three oldest entries left the window 100 s ago.
    oldest = client.zrangebyscore(key, "(0", "+inf", start=0, num=3, withscores=True)
    for member, score in oldest:
        client.zadd(key, {member: score - 200_000}, xx=True)
    marker = f"end-of-{tag}"
    with client.monitor() as monitor:
        other = redis.Redis(port=client.connection_pool.connection_kwargs["port"])
        started_ms = time.time() * 1000
        reply = other.eval(SCRIPT, 1, key, script_args("charge", window, [1]))
        other.echo(marker)
        commands = []
        while True:
            seen = monitor.next_command()
            if marker in seen["command"]:
                break
            if seen.get("client_type") == "lua":
                commands.append(seen["command"].split())
    assert reply[0] == 1 and reply[1][2] == 1_000_000 - (5_000 - 3 + 1), reply  # the 3 expired no longer count
    names = [c[0].upper() for c in commands]
    assert "ZRANGEBYSCORE" in names and "ZREMRANGEBYSCORE" in names, commands
    for command in commands:
        name = command[0].upper()
        assert name not in ("ZREVRANGE", "ZSCAN", "ZCOUNT", "ZCARD", "SCAN", "KEYS", "ZRANGESTORE"), command
        if name == "ZRANGE":  # the newest entry alone (when the window is full again)
            assert command[2:4] == ["-1", "-1"], command
        if name in ("ZRANGEBYSCORE", "ZREMRANGEBYSCORE"):
            # From the oldest possible entry to the window's start: only what expired.
            low, high = command[2], float(command[3])
            assert low == "0" and high <= started_ms - 100_000 + 5_000, command
    assert client.zcount(key, "(0", "+inf") == 5_000 - 3 + 1
