"""lua/provider.lua against a real redis-server and a three-node Redis Cluster: later news
wins, past a 429's retry time the probe goes to the first proxy that asks and to no other
until the probe's reply (or its offer lapses), and the hash stays bounded."""

import json
import math
import time
from pathlib import Path

import pytest
import redis

from helpers import redis_now_ms
from lua_clock import clock_arg, pinned
from stack import redis_key

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "lua/provider.lua").read_text()
# The script with its clock pinned (tests/lua/lua_clock.py): a test that times an exchange
# against a retry time or an offer passes the script's time, so a loaded machine's pause
# between two exchanges moves nothing. (The key's expiry, PEXPIRE ttl_ms, is relative.)
PINNED_SCRIPT = pinned(SCRIPT)
KEY = redis_key("llmrl:", "llm", "provider", "prov", "words")
A, B = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"
K = "00112233aabbccdd"
NOTHING = [[0, 0]] * 4


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


def now_ms():
    return int(time.time() * 1000)


def exchange(client, proxy, reports=(), key=KEY, offer_ms=2000, hold_ms=10000, max_entries=256, at=None):
    """One proxy's exchange; `at` (ms since the epoch): the script's clock, pinned
    (None: Redis's own TIME)."""
    call = {"proxy": proxy, "offer_ms": offer_ms, "hold_ms": hold_ms, "ttl_ms": 60_000, "max_entries": max_entries,
            "reports": list(reports)}
    if at is None:
        lines = client.eval(SCRIPT, 1, key, json.dumps(call))
    else:
        lines = client.eval(PINNED_SCRIPT, 1, key, json.dumps(call), clock_arg(at))
    entries = {}
    for line in lines:
        f = line.decode().split(" ")
        entries[f[0]] = {"said": int(f[1]), "out": int(f[2]), "refused": f[3] == "1", "probe": f[4],
                         "probe_until": int(f[5]), "left": [[int(f[6 + 2 * q]), int(f[7 + 2 * q])] for q in range(4)]}
    return entries


def report(said, out, refused=True, probing=False, left=NOTHING, key=K):
    return {"key": key, "said_ms": said, "out_until_ms": out, "refused": refused, "probing": probing, "left": left}


@pytest.fixture
def fresh(client):
    client.delete(KEY)
    return client


def test_later_news_wins_and_the_other_proxy_hears_it(fresh):
    now = now_ms()
    exchange(fresh, A, [report(now, now + 5000, left=[[0, now + 5000], [100, now + 60000], [0, 0], [0, 0]])])
    heard = exchange(fresh, B)[K]
    assert (heard["out"], heard["refused"], heard["probe"]) == (now + 5000, True, "nobody"), "still out: no probe"
    assert heard["left"][1] == [100, now + 60000]
    # An older reply changes nothing; a later one replaces it.
    assert exchange(fresh, B, [report(now - 10, 0, refused=False)])[K]["out"] == now + 5000
    back = exchange(fresh, B, [report(now + 10, 0, refused=False, left=[[5, now + 60000]] + NOTHING[1:])])[K]
    assert (back["out"], back["left"][0]) == (0, [5, now + 60000])
    # Nothing in an entry holds any more: it is forgotten.
    assert K not in exchange(fresh, A, [report(now + 20, 0, refused=False)])


def past_its_retry_time(client, key=KEY):
    """A reports, at `now`, a 429 whose retry time is 300 ms later; returns `now`. The
    exchanges after it pass the retry time by the pinned clock (`now + PAST`), not by
    sleeping: a pause of the machine's can neither make A's exchange land past the retry
    time nor stretch the later ones past an offer."""
    now = math.floor(redis_now_ms(client))
    assert exchange(client, A, [report(now - 1000, now + 300)], key=key, at=now)[K]["probe"] == "nobody"
    return now


PAST = 350  # ms after the report: its retry time (300 ms) has passed


def test_past_the_retry_time_one_proxy_is_given_the_probe(fresh):
    now = past_its_retry_time(fresh)
    at = now + PAST
    first = exchange(fresh, B, at=at)[K]
    assert first["probe"] == "you" and first["probe_until"] >= now + 1500
    assert exchange(fresh, A, at=at + 1)[K]["probe"] == "another", "the probe is B's"
    assert exchange(fresh, B, at=at + 2)[K]["probe"] == "you", "and stays B's while offered"
    # B sent it: held longer; its reply (later news) ends it and clears the refusal.
    held = exchange(fresh, B, [report(now - 1000, now + 300, probing=True)], at=at + 3)[K]
    assert held["probe"] == "you" and held["probe_until"] >= now + 9000
    assert exchange(fresh, A, at=at + 4)[K]["probe"] == "another"
    back = exchange(fresh, B, [report(now + 50, 0, refused=False, left=[[2, now + 60000]] + NOTHING[1:])], at=at + 5)[K]
    assert (back["out"], back["probe"]) == (0, "nobody")


def test_an_offer_that_lapses_goes_to_another_proxy(fresh):
    now = past_its_retry_time(fresh)
    assert exchange(fresh, A, offer_ms=1, at=now + PAST)[K]["probe"] == "you"
    # The 1 ms offer lapses: 10 ms later by the script's clock.
    assert exchange(fresh, B, at=now + PAST + 10)[K]["probe"] == "you"


def test_a_spent_quota_needs_no_probe(fresh):
    now = now_ms()
    exchange(fresh, A, [report(now - 1000, now - 1, refused=False, left=[[0, now - 1], [0, 0], [0, 0], [0, 0]])])
    assert exchange(fresh, B)[K]["probe"] == "nobody"


def test_the_hash_is_bounded_and_forgets_what_no_longer_holds(fresh):
    now = now_ms()
    keys = [f"{i:016x}" for i in range(5)]
    exchange(fresh, A, [report(now, now + 60_000, key=k) for k in keys], max_entries=3)
    assert fresh.hlen(KEY) == 3, "new keys beyond the bound are dropped"
    fresh.delete(KEY)
    exchange(fresh, A, [report(now - 120_000, now - 100_000, key=keys[0])])
    assert exchange(fresh, B) == {}, "an entry whose every time passed long ago is deleted"
    assert fresh.hlen(KEY) == 0
    assert fresh.pttl(KEY) in (-2, -1) or fresh.pttl(KEY) <= 60_000


def test_on_a_cluster(cluster):
    key = redis_key("llmrl:", "cluster", "provider", "prov", "words")
    cluster.delete(key)
    client = cluster.get_node_from_key(key)
    node = redis.Redis(host=client.host, port=client.port)
    now = past_its_retry_time(node, key=key)
    assert exchange(node, B, key=key, at=now + PAST)[K]["probe"] == "you"
    assert exchange(node, A, key=key, at=now + PAST + 1)[K]["probe"] == "another"


def test_bad_calls_are_refused(client):
    with pytest.raises(redis.ResponseError, match="proxy must be hex"):
        client.eval(SCRIPT, 1, KEY, json.dumps({"proxy": "x y", "reports": []}))
