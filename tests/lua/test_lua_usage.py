"""lua/limits.lua's operator ops against a real redis-server and a three-node cluster:
`peek` (where a tenant stands, writing nothing) mirrors what a charge sees, for every
kind of limit; `reset` deletes a tenant's counters."""

import json
import time
import uuid

import pytest
import redis

from helpers import redis_now_ms
# The redis-server fixture too (the three-node cluster is conftest's).
from limits_script import (  # noqa: F401
    CASES, PINNED_SCRIPT, SCRIPT, age_keys, back_credits, case_keys, check_step, client, shift_window, step_args,
)
from lua_clock import clock_ahead, clock_arg


def peek_args(limits, op="peek"):
    return json.dumps({"op": op, "limits": [
        {"kind": l.get("kind", "tb"), "capacity": l["capacity"], "window_ms": l["window_ms"]} for l in limits
    ]})


def snapshot(client, keys):
    """Every key's whole state (DUMP) and time to live: what a write would change."""
    return [(client.dump(k), client.pttl(k)) for k in keys]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_a_peek_after_each_step_of_the_case_table_sees_what_the_charge_left(client, case):
    """Each step of the token-bucket case table runs, then a peek in the same MULTI: the
    peek reports the level and reset time the step reported after itself, and writes
    nothing."""
    keys = case_keys(case)
    written_at, clock = {}, 0
    for i, step in enumerate(case["steps"]):
        clock += step["advance_ms"]
        # The step and its peek at one instant (tests/lua/lua_clock.py): a loaded machine's
        # pause between the two scripts moves neither.
        now = clock_arg(redis_now_ms(client))
        pipe = client.pipeline(transaction=True)
        age_keys(pipe, keys, written_at, clock, now)
        back_credits(pipe, case, step, keys)
        pipe.eval(PINNED_SCRIPT, len(keys), *keys, step_args(case, step), now)
        pipe.eval(PINNED_SCRIPT, len(keys), *keys, peek_args(case["limits"]), now)
        replies = pipe.execute()
        step_reply, peek = replies[-2], replies[-1]
        check_step(case, i, step, step_reply, keys, written_at, clock)
        assert peek[0] == 1
        assert len(peek) == len(step_reply) == 1 + len(case["limits"]), f"{case['name']}: {peek} after {step_reply}"
        for got, after_step in zip(peek[1:], step_reply[1:]):
            status, cap, remaining, reset_after_ms, retry_after_ms, charged = got
            assert (cap, remaining, charged) == (after_step[1], after_step[2], 0), case["name"]
            # The same instant: the peek's reset is the step's own.
            assert reset_after_ms == after_step[3], f"{case['name']}: {reset_after_ms} vs {after_step[3]}"
            assert (status == 1) == (remaining >= 1) and (retry_after_ms > 0) == (remaining < 1)
        started = time.monotonic()
        before = snapshot(client, keys)
        client.eval(SCRIPT, len(keys), *keys, peek_args(case["limits"]))
        after = snapshot(client, keys)
        elapsed_ms = (time.monotonic() - started) * 1000
        for key, (dump, ttl_ms), (dump_after, _) in zip(keys, before, after):
            # A bucket settled back to full expires within ms on its own (its key lives until
            # the bucket would be full): gone within its time to live is time passing, not a write.
            # (-2: it expired between the snapshot's DUMP and its PTTL.)
            if dump_after is None and (ttl_ms == -2 or 0 <= ttl_ms <= elapsed_ms + 1):
                continue
            assert dump_after == dump, f"a peek wrote {key} (ttl {ttl_ms} ms before)"


def test_a_peek_of_a_tenant_never_seen_writes_no_key(client):
    tag = uuid.uuid4().hex
    limits = [{"capacity": 5, "window_ms": 1000}, {"kind": "sw", "capacity": 7, "window_ms": 1000},
              {"kind": "slots", "capacity": 3, "window_ms": 1000}]
    keys = [f"test:{{{tag}}}:{kind}:x" for kind in ("tb", "sw", "slots")]
    reply = client.eval(SCRIPT, 3, *keys, peek_args(limits))
    assert [o[:5] for o in reply[1:]] == [[1, 5, 5, 0, 0], [1, 7, 7, 0, 0], [1, 3, 3, 0, 0]]
    assert client.exists(*keys) == 0


def charge_args(limits, costs):
    return json.dumps({"op": "charge", "reservation_ttl_ms": 0, "limits": [
        {"kind": l.get("kind", "tb"), "capacity": l["capacity"], "window_ms": l["window_ms"], "cost": c, "min_cost": c}
        for l, c in zip(limits, costs)
    ]})


def test_a_sliding_window_peek_leaves_expired_entries_and_agrees_with_the_next_charge(client):
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:sw:tpm"
    # A 30 s window, time moved by shift_window: the real time a loaded machine spends
    # between the calls stays far inside it (a 300 ms window let the 6 leave for real).
    window = [{"kind": "sw", "capacity": 10, "window_ms": 30_000}]
    assert client.eval(SCRIPT, 1, key, charge_args(window, [6]))[0] == 1
    shift_window(client, key, 10_000)  # 10 s pass
    assert client.eval(SCRIPT, 1, key, charge_args(window, [4]))[0] == 1
    # Full: a peek and a refused charge of one, at one time (one MULTI), say the same,
    # to the millisecond: each script reads Redis's TIME anew, and a loaded machine can put
    # a millisecond boundary between the two (30000 against 29999 once, issue 24).
    pipe = client.pipeline(transaction=True)
    pipe.eval(SCRIPT, 1, key, peek_args(window))
    pipe.eval(SCRIPT, 1, key, charge_args(window, [1]))
    peek, refused = pipe.execute()
    assert refused[0] == 0 and peek[1][0] == 0
    assert peek[1][2] == refused[1][2] == 0
    assert abs(peek[1][4] - refused[1][4]) <= 1 and 15_000 <= peek[1][4] <= 20_000  # until the 6 leave
    assert abs(peek[1][3] - refused[1][3]) <= 1 and 25_000 <= peek[1][3] <= 30_000  # until all leave
    # The first charge leaves the window: the peek counts 6 free but removes nothing.
    shift_window(client, key, 25_000)
    entries = client.zcard(key)
    peek = client.eval(SCRIPT, 1, key, peek_args(window))
    assert peek[1][:3] == [1, 10, 6]
    assert client.zcard(key) == entries
    # The next charge of 6 fits exactly, as the peek said, and a seventh would not have.
    assert client.eval(SCRIPT, 1, key, charge_args(window, [7]))[0] == 0
    assert client.eval(SCRIPT, 1, key, charge_args(window, [6]))[0] == 1


def test_slots_peek_counts_live_slots_only_and_removes_none(client):
    # Pinned (tests/lua/lua_clock.py, clock_ahead): the slots live 1 s of the script's clock,
    # whatever the machine's pauses, and Redis's own expiry of the set is an hour away, so
    # the expired slots are certainly still stored when the second peek looks.
    tag = uuid.uuid4().hex
    key = f"test:{{{tag}}}:slots:cc"
    short = [{"kind": "slots", "capacity": 2, "window_ms": 1000}]
    start = clock_ahead(client)
    for request in ("a", "b"):
        reservation = f"test:{{{tag}}}:res:{request}"
        assert client.eval(PINNED_SCRIPT, 2, key, reservation, charge_args(short, [1]), clock_arg(start))[0] == 1
    peek = client.eval(PINNED_SCRIPT, 1, key, peek_args(short), clock_arg(start))
    assert peek[1][:3] == [0, 2, 0] and peek[1][4] == 1000  # the oldest slot's whole second
    # 1.05 s later: both slots expired, still stored until a charge drops them.
    assert client.zcard(key) == 2
    peek = client.eval(PINNED_SCRIPT, 1, key, peek_args(short), clock_arg(start + 1050))
    assert peek[1][:3] == [1, 2, 2] and peek[1][4] == 0
    assert client.zcard(key) == 2, "the peek removed nothing"


def test_a_reset_deletes_the_counters_and_the_tenant_is_fresh(client):
    tag = uuid.uuid4().hex
    limits = [{"capacity": 3, "window_ms": 60_000}, {"kind": "sw", "capacity": 100, "window_ms": 60_000},
              {"kind": "slots", "capacity": 2, "window_ms": 60_000}]
    keys = [f"test:{{{tag}}}:tb:rpm", f"test:{{{tag}}}:sw:tpm", f"test:{{{tag}}}:slots:cc"]
    reservation = f"test:{{{tag}}}:res:r1"
    assert client.eval(SCRIPT, 4, *keys, reservation, charge_args(limits, [3, 40, 1]))[0] == 1
    assert client.eval(SCRIPT, 3, *keys, peek_args(limits))[1][2] == 0
    reset = client.eval(SCRIPT, 3, *keys, peek_args(limits, op="reset"))
    assert reset[0] == 3
    assert [o[2] for o in reset[1:]] == [3, 100, 2]
    assert client.exists(*keys) == 0
    peek = client.eval(SCRIPT, 3, *keys, peek_args(limits))
    assert [o[2] for o in peek[1:]] == [3, 100, 2]
    # Nothing left to delete the second time.
    assert client.eval(SCRIPT, 3, *keys, peek_args(limits, op="reset"))[0] == 0


def test_peek_and_reset_take_no_amounts(client):
    bad = json.dumps({"op": "peek", "limits": [{"kind": "tb", "capacity": 1, "window_ms": 1, "cost": 1}]})
    with pytest.raises(redis.ResponseError, match="unknown field limits\\[0\\].cost for op peek"):
        client.eval(SCRIPT, 1, "test:{bad}:tb:x", bad)
    with pytest.raises(redis.ResponseError, match='"peek" or "reset"'):
        client.eval(SCRIPT, 1, "test:{bad}:tb:x", json.dumps({"op": "look", "limits": []}))


def test_peek_and_reset_run_on_a_cluster(cluster):
    limits = [{"capacity": 2, "window_ms": 60_000}, {"kind": "sw", "capacity": 10, "window_ms": 60_000}]
    nodes = set()
    for tenant in range(8):
        keys = [f"test:{{t{tenant}}}:tb:rpm", f"test:{{t{tenant}}}:sw:tpm"]
        nodes.add(cluster.nodes_manager.get_node_from_slot(cluster.keyslot(keys[0])).port)
        assert cluster.eval(SCRIPT, 2, *keys, charge_args(limits, [1, 4]))[0] == 1
        assert [o[2] for o in cluster.eval(SCRIPT, 2, *keys, peek_args(limits))[1:]] == [1, 6]
        assert cluster.eval(SCRIPT, 2, *keys, peek_args(limits, op="reset"))[0] == 2
        assert [o[2] for o in cluster.eval(SCRIPT, 2, *keys, peek_args(limits))[1:]] == [2, 10]
    assert len(nodes) > 1
