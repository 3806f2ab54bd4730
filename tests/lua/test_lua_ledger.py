"""lua/ledger.lua against a real redis-server: a batch is added once per (worker, owner)
however often it is sent, the models of an owner's day are capped with `other`, the
retention is set on every day's hash, bad arguments write nothing; and on a three-node
Redis Cluster, where every key of a call shares its owner's hash tag."""

import json
from pathlib import Path

import pytest
import redis

from stack import redis_key

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "lua/ledger.lua").read_text()
OWNER = "0123456789abcdef0123456789abcdef"
DAY, NEXT_DAY = "20261101", "20261102"


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


def keys(owner=OWNER, vm="vm1", days=(DAY,), domain="llm"):
    return [redis_key("llmrl:", domain, owner, "ledger-seq", vm)] + [
        redis_key("llmrl:", domain, owner, "ledger", day) for day in days]


def row(model, r=1, i=0, o=0, c=0, t=0, u=0):
    return {"model": model, "r": r, "i": i, "o": o, "c": c, "t": t, "u": u}


def add(client, seq, days_rows, vm="vm1", owner=OWNER, days=(DAY,), max_models=64, retention_s=31_622_400,
        label="tenant"):
    args = {"seq": seq, "marker_ttl_s": 604_800, "retention_s": retention_s, "max_models": max_models,
            "label": label, "days": days_rows}
    return client.eval(SCRIPT, len(days) + 1, *keys(owner, vm, days), json.dumps(args))


def stored(client, day=DAY, owner=OWNER):
    return {k.decode(): v.decode() for k, v in client.hgetall(keys(owner, days=(day,))[1]).items()}


@pytest.fixture(autouse=True)
def clean(client):
    client.flushall()


def test_a_batch_is_added_once_however_often_it_is_sent(client):
    batch = [[row("gpt-4o", r=2, i=100, o=40, c=10, t=5, u=700)]]
    assert add(client, 1, batch) == [1]
    assert add(client, 1, batch) == [0], "resent after a lost answer: added before"
    assert stored(client) == {"gpt-4o|r": "2", "gpt-4o|i": "100", "gpt-4o|o": "40", "gpt-4o|c": "10",
                              "gpt-4o|t": "5", "gpt-4o|u": "700", "~label": "tenant", "~models": "1"}
    # The next batch of the worker adds; an older number (never sent after a newer) does not.
    assert add(client, 2, [[row("gpt-4o", r=1, u=1)]]) == [1]
    assert add(client, 1, batch) == [0]
    # Another worker's batches are numbered apart.
    assert add(client, 1, [[row("gpt-4o", r=1, u=1)]], vm="vm2") == [1]
    assert stored(client)["gpt-4o|r"] == "4" and stored(client)["gpt-4o|u"] == "702"
    # Parts that stayed 0 take no field.
    add(client, 3, [[row("o3-mini", r=1)]])
    assert "o3-mini|i" not in stored(client) and stored(client)["o3-mini|r"] == "1"


def test_models_beyond_the_cap_are_counted_as_other(client):
    rows = [row(f"model-{n}", r=1, i=n, u=10) for n in range(5)]
    add(client, 1, [rows], max_models=3)
    day = stored(client)
    assert day["~models"] == "3"
    assert {k.split("|")[0] for k in day if not k.startswith("~")} == {"model-0", "model-1", "model-2", "other"}
    assert (day["other|r"], day["other|i"], day["other|u"]) == ("2", str(3 + 4), "20")
    # A model already counted apart stays apart; a new one still goes to other.
    add(client, 2, [[row("model-1", r=1), row("model-9", r=1)]], max_models=3)
    assert (stored(client)["model-1|r"], stored(client)["other|r"]) == ("2", "3")
    # Totals are exact whatever the cap.
    total = sum(int(v) for k, v in stored(client).items() if k.endswith("|r"))
    assert total == 7


def test_every_days_hash_lives_for_the_retention_and_the_marker_for_its_ttl(client):
    add(client, 1, [[row("gpt-4o")], [row("gpt-4o", r=3)]], days=(DAY, NEXT_DAY), retention_s=366 * 86_400)
    for day in (DAY, NEXT_DAY):
        ttl = client.ttl(keys(days=(day,))[1])
        assert 366 * 86_400 - 5 <= ttl <= 366 * 86_400, day
    assert stored(client, NEXT_DAY)["gpt-4o|r"] == "3"
    assert 604_800 - 5 <= client.ttl(keys()[0]) <= 604_800
    assert client.get(keys()[0]) == b"1"


def test_bad_arguments_write_nothing(client):
    for bad in ([[{"model": "gpt-4o", "r": -1}]], [[{"model": "gpt-4o", "r": 1.5}]], [[{"model": "", "r": 1}]],
                [[{"model": "~label", "r": 1}]], [[{"model": "m", "u": 2 ** 53}]], [[row("m")], [row("m")]]):
        with pytest.raises(redis.ResponseError):
            add(client, 1, [[row("ok")]] if bad is None else bad)
    with pytest.raises(redis.ResponseError):
        add(client, 0, [[row("m")]])
    assert client.keys("*") == [], "nothing written, not even the marker"


def test_large_counts_are_exact(client):
    big = 2 ** 53 - 1
    add(client, 1, [[row("m", r=1, u=big)]])
    add(client, 2, [[row("m", r=1, u=big)]])
    assert int(stored(client)["m|u"]) == 2 * big, "HINCRBY keeps 64-bit integers exact"


def test_runs_on_a_cluster_one_call_per_owner(cluster):
    owners = [OWNER, "p" + "a" * 32, "p" + "b" * 32, "fedcba9876543210fedcba9876543210"]
    for owner in owners:
        ks = keys(owner=owner, days=(DAY, NEXT_DAY), domain="cluster")
        args = {"seq": 1, "marker_ttl_s": 60, "retention_s": 3600, "max_models": 64, "label": "tenant",
                "days": [[row("gpt-4o", u=5)], [row("gpt-4o", u=7)]]}
        assert cluster.eval(SCRIPT, len(ks), *ks, json.dumps(args)) == [1]
        assert cluster.eval(SCRIPT, len(ks), *ks, json.dumps(args)) == [0]
        assert cluster.hget(ks[2], "gpt-4o|u") == b"7"
