"""The companion over real HTTP against a real Redis: auth, input validation, script
loading and NOSCRIPT recovery, Redis outages, and Redis Cluster."""

import json
import math
import os
import selectors
import signal
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from stack import http_get, wait_until
from helpers import redis_now_ms

TOKEN = "companion-test-token"


def call(port, body, token=TOKEN, path="/v1/token_bucket", timeout=5):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["x-llmrl-token"] = token
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def send_only(port, body, path="/v1/token_bucket"):
    """Writes one call on a connection of its own and returns the socket, unanswered (read
    it with `answer`): the caller knows the request is written before it goes on."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: companion\r\ncontent-type: application/json\r\n"
                 f"x-llmrl-token: {TOKEN}\r\nconnection: close\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def answer(sock):
    """The status and JSON body of a call written by `send_only`, once it comes."""
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(payload)


def companion_has_read(port):
    """The companion serves on one thread: once it has answered requests sent after the
    calls written so far, it has read those calls and queued their script calls."""
    for _ in range(3):
        assert http_get(f"http://127.0.0.1:{port}/metrics", timeout=30)[0] == 200


@pytest.fixture
def pausable(stack):
    """A companion whose Redis a test pauses (`pause`) until its calls are all in the
    companion, not for a fixed time a loaded machine may spend before they arrive: its
    Redis calls may wait that long without timing out. Unpaused at the end whatever happens."""
    _, redis_port = stack.redis()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, extra=["--key-prefix", "t1:"],
                              redis_timeout="30s")
    store = redis.Redis(port=redis_port)
    yield store, port
    store.execute_command("CLIENT", "UNPAUSE")


def pause(store):
    store.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")


def blocked_in_redis(store):
    return any(c["cmd"] in ("evalsha", "eval") and "b" in c["flags"] for c in store.client_list())


def bucket_request(tenant, capacity=3, names=("rpm",)):
    return {
        "domain": "llm",
        "tenant": tenant,
        "limits": [{"name": n, "capacity": capacity, "window_ms": 60_000, "cost": 1} for n in names],
    }


@pytest.fixture
def single(stack):
    redis_proc, redis_port = stack.redis()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, extra=["--key-prefix", "t1:"])
    return stack, redis_port, port


def test_requires_the_shared_token(single):
    _, _, port = single
    for token in (None, "wrong", TOKEN + "x"):
        status, body = call(port, bucket_request("a"), token=token)
        assert status == 401 and "x-llmrl-token" in body["error"]
    assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200  # health needs no token


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "invalid request body"),
        ({"domain": "llm", "tenant": "a"}, "missing field `limits`"),
        ({**bucket_request("a"), "extra": 1}, "unknown field `extra`"),
        (bucket_request("{a}"), "tenant must be"),
        ({**bucket_request("a"), "limits": []}, "limits must have 1 to"),
        ({"domain": "llm", "tenant": "a", "limits": [{"name": "rpm", "capacity": 0, "window_ms": 1, "cost": 1}]}, "capacity must be positive"),
        ({"domain": "llm", "tenant": "a", "limits": [{"name": "rpm", "capacity": -1, "window_ms": 1, "cost": 1}]}, "invalid value"),
    ],
)
def test_rejects_bad_input_with_a_message(single, body, fragment):
    _, _, port = single
    status, reply = call(port, body)
    assert status == 400
    assert fragment in reply["error"]


def test_enforces_limits_in_prefixed_hash_tagged_keys(single):
    _, redis_port, port = single
    replies = [call(port, bucket_request("tenant1", names=("rpm", "rpd"))) for _ in range(4)]
    assert [r[1]["allowed"] for r in replies] == [True, True, True, False]
    assert [o["remaining"] for o in replies[2][1]["limits"]] == [0, 0]
    assert [o["status"] for o in replies[3][1]["limits"]] == ["limited", "limited"]
    keys = sorted(k.decode() for k in redis.Redis(port=redis_port).keys("*"))
    assert keys == ["t1:{llm:tenant1}:tb:rpd", "t1:{llm:tenant1}:tb:rpm"]


def settlement(tenant, reservation, credit, window_ms=3_600_000):
    return {"domain": "llm", "tenant": tenant, "reservation": reservation,
            "limits": [{"name": "tpm", "capacity": 1000, "window_ms": window_ms, "credit": credit}]}


def test_settles_each_reservation_once(single):
    _, redis_port, port = single
    charge = {"domain": "llm", "tenant": "t9", "reservation": {"id": "res1", "ttl_ms": 60_000},
              "limits": [{"name": "tpm", "capacity": 1000, "window_ms": 3_600_000, "cost": 700}]}
    status, reply = call(port, charge)
    assert status == 200 and reply["limits"][0]["remaining"] == 300
    store = redis.Redis(port=redis_port)
    assert store.exists("t1:{llm:t9}:res:res1") == 1
    batch = {"settlements": [settlement("t9", "res1", 650), settlement("t9", "never-charged", 100)]}
    status, reply = call(port, batch, path="/v1/settle")
    assert status == 200 and reply["results"] == ["applied", "already_settled"]
    assert float(store.hget("t1:{llm:t9}:tb:tpm", "tokens")) == pytest.approx(950, abs=1)
    status, reply = call(port, batch, path="/v1/settle")
    assert reply["results"] == ["already_settled", "already_settled"]
    assert float(store.hget("t1:{llm:t9}:tb:tpm", "tokens")) == pytest.approx(950, abs=1)
    assert call(port, batch, token=None, path="/v1/settle")[0] == 401
    status, reply = call(port, {"settlements": [settlement("{bad}", "r", 1)]}, path="/v1/settle")
    assert status == 400 and "settlements[0]: tenant" in reply["error"]


def test_a_stand_alone_adjustment_applies_once_under_a_marker_that_lives_a_minute(single):
    """docs/companion.md: an adjustment without a reservation (a returned lease, what
    was admitted locally) carries a once id; its marker `once:<id>` lives a minute, so the
    same batch sent again within it (after a lost answer) is not applied twice."""
    _, redis_port, port = single
    store = redis.Redis(port=redis_port)
    adjustment = {"domain": "llm", "tenant": "t-once", "once": "returned-1",
                  "limits": [{"name": "tpm", "capacity": 1000, "window_ms": 366 * 86_400_000, "credit": -100}]}
    sent = time.monotonic()
    status, reply = call(port, {"settlements": [adjustment]}, path="/v1/settle")
    ttl, elapsed_ms = store.pttl("t1:{llm:t-once}:once:returned-1"), (time.monotonic() - sent) * 1000
    assert status == 200 and reply["results"] == ["applied"], reply
    assert 60_000 - elapsed_ms - 1 <= ttl <= 60_000, (ttl, elapsed_ms)
    assert float(store.hget("t1:{llm:t-once}:tb:tpm", "tokens")) == pytest.approx(900, abs=0.01)
    status, reply = call(port, {"settlements": [adjustment]}, path="/v1/settle")
    assert status == 200 and reply["results"] == ["already_settled"], reply
    assert float(store.hget("t1:{llm:t-once}:tb:tpm", "tokens")) == pytest.approx(900, abs=0.01)


def test_reloads_scripts_after_script_flush(single):
    _, redis_port, port = single
    redis.Redis(port=redis_port).script_flush()
    status, reply = call(port, bucket_request("after-flush"))
    assert status == 200 and reply["allowed"]


def test_survives_a_redis_restart(single):
    stack, redis_port, port = single
    redis_proc = next(p for p in stack.processes if p.name.startswith("redis"))
    redis_proc.kill()
    status, reply = call(port, bucket_request("during-outage"))
    assert status == 503 and "redis" in reply["error"]
    assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 503
    # Settlements fail per entry (to be sent again), logged once per error with a count.
    batch = {"settlements": [settlement("t9", "res1", 1), settlement("t9", "res2", 1)]}
    assert call(port, batch, path="/v1/settle") == (200, {"results": ["failed", "failed"]})
    companion = next(p for p in stack.processes if p.name == "companion")
    assert "companion: settle failed for 2 of 2 entries: " in companion.log_path.read_text()
    # A new, empty Redis on the same port: reconnect, reload the script (NOSCRIPT), carry on.
    stack.redis(redis_port, name="redis-restarted")
    wait_until(lambda: call(port, bucket_request("after-restart"))[0] == 200, 10, "companion recovery")


def test_token_from_file_and_refusal_without_token(stack, tmp_path):
    _, redis_port = stack.redis()
    token_file = tmp_path / "token"
    token_file.write_text("from-file-0123456789\n")
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", None, extra=["--token-file", str(token_file)])
    assert call(port, bucket_request("a"), token="from-file-0123456789")[0] == 200
    from stack import COMPANION_BIN
    result = subprocess.run([str(COMPANION_BIN), "--redis-url", f"redis://127.0.0.1:{redis_port}"],
                            capture_output=True, text=True, timeout=10, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "data-plane credential is required" in result.stderr


def test_runs_against_a_redis_cluster(stack):
    ports = stack.redis_cluster(3)
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    _, port = stack.companion(url, TOKEN, extra=["--threads", "2"])  # and on more than one thread
    for tenant in [f"tenant{i}" for i in range(10)]:
        results = [call(port, bucket_request(tenant, capacity=2, names=("rpm", "rpd"))) for _ in range(3)]
        assert [r[0] for r in results] == [200, 200, 200], (tenant, results)
        assert [r[1]["allowed"] for r in results] == [True, True, False], tenant
    cluster = redis.RedisCluster(host="127.0.0.1", port=ports[0])
    try:
        keys = [k.decode() for k in cluster.keys(target_nodes=redis.RedisCluster.ALL_NODES)]
        assert len(keys) == 20
        holders = {cluster.nodes_manager.get_node_from_slot(cluster.keyslot(k)).port for k in keys}
        assert len(holders) > 1
        # A settlement batch across tenants, so across slots and nodes: the companion splits
        # it by hash slot, and each entry is applied once.
        tenants = [f"settling{i}" for i in range(12)]
        for tenant in tenants:
            charge = {"domain": "llm", "tenant": tenant, "reservation": {"id": "r1", "ttl_ms": 60_000},
                      "limits": [{"name": "tpm", "capacity": 1000, "window_ms": 3_600_000, "cost": 700}]}
            assert call(port, charge)[1]["allowed"]
        batch = {"settlements": [settlement(t, "r1", 650) for t in tenants] + [settlement(tenants[0], "r1", 650)]}
        status, reply = call(port, batch, path="/v1/settle")
        assert status == 200 and reply["results"] == ["applied"] * 12 + ["already_settled"]
        for tenant in tenants:
            assert float(cluster.hget(f"llmrl:{{llm:{tenant}}}:tb:tpm", "tokens")) == pytest.approx(950, abs=1)
    finally:
        cluster.close()


def script_calls(store):
    """Script calls Redis has served (one per round trip)."""
    stats = store.info("commandstats")
    return sum(stats.get(name, {}).get("calls", 0) for name in ("cmdstat_evalsha", "cmdstat_eval"))


def test_settles_a_large_batch_in_few_script_calls(single):
    """A proxy's settlement batch costs one script call per 100 entries, not one each; each
    entry is still applied once, with its own outcome."""
    _, redis_port, port = single
    store = redis.Redis(port=redis_port)
    tenants = [f"bulk{i}" for i in range(50)]
    # A window of 366 days: the buckets refill 0.003 tokens in 100 s, so the levels below
    # are the charges and credits alone however slowly a loaded machine sends them (with an
    # hour's window, 3.6 s of sending moved them by a token).
    year = 366 * 86_400_000
    for i in range(250):
        charge = {"domain": "llm", "tenant": tenants[i % 50], "reservation": {"id": f"r{i}", "ttl_ms": 60_000},
                  "limits": [{"name": "tpm", "capacity": 1000, "window_ms": year, "cost": 100}]}
        assert call(port, charge)[1]["allowed"]
    settlements = [settlement(tenants[i % 50], f"r{i}", 60, window_ms=year) for i in range(250)]
    settlements += [settlement(tenants[i], f"unknown{i}", 60, window_ms=year) for i in range(10)]
    before = script_calls(store)
    status, reply = call(port, {"settlements": settlements}, path="/v1/settle")
    assert status == 200 and reply["results"] == ["applied"] * 250 + ["already_settled"] * 10
    assert script_calls(store) - before == 3
    # Five charges of 100 a tenant, 60 of each given back: 1000 - 5 x 40 left.
    for tenant in tenants:
        assert float(store.hget(f"t1:{{llm:{tenant}}}:tb:tpm", "tokens")) == pytest.approx(800, abs=1)
    status, reply = call(port, {"settlements": settlements}, path="/v1/settle")
    assert reply["results"] == ["already_settled"] * 260
    assert float(store.hget(f"t1:{{llm:{tenants[0]}}}:tb:tpm", "tokens")) == pytest.approx(800, abs=1)


def test_charges_arriving_together_share_a_script_call(pausable):
    """While a script call is out, the calls that arrive wait and go together in the next:
    with Redis paused, 32 concurrent charges cost two or three script calls, and each is
    still charged on its own."""
    store, port = pausable
    before = script_calls(store)
    pause(store)
    sockets = [send_only(port, bucket_request(f"together{i % 4}", capacity=10)) for i in range(32)]
    wait_until(lambda: blocked_in_redis(store), 30, "the first charge's script call blocked in Redis")
    companion_has_read(port)
    store.execute_command("CLIENT", "UNPAUSE")
    replies = [answer(sock) for sock in sockets]
    assert [status for status, _ in replies] == [200] * 32
    # Four tenants of capacity 10, eight charges each: all admitted, 2 left each.
    assert sorted(reply["limits"][0]["remaining"] for _, reply in replies) == sorted(list(range(2, 10)) * 4)
    assert script_calls(store) - before <= 3


def test_a_charge_goes_before_a_backlog_of_settlements(pausable):
    """A proxy's settlements flushed in bulk (here 1,000 while Redis is paused) wait behind
    a charge that arrives after them: the charge is answered first, and every settlement
    is still applied."""
    store, port = pausable
    for i in range(1000):
        store.set(f"t1:{{llm:backlog}}:res:r{i}", "0", px=600_000)
    backlog = {"settlements": [settlement("backlog", f"r{i}", 1) for i in range(1000)]}
    answered = {}

    def settle():
        reply = call(port, backlog, path="/v1/settle", timeout=60)
        answered["settlements"] = time.monotonic()
        return reply

    pause(store)
    with ThreadPoolExecutor(1) as pool:
        settled = pool.submit(settle)
        # The settlements are out first: their script call waits in the paused Redis.
        wait_until(lambda: blocked_in_redis(store), 30, "the settlements' script call blocked in Redis")
        charge = send_only(port, bucket_request("eager"))
        companion_has_read(port)
        assert not settled.done(), "Redis is still paused: nothing was settled yet"
        store.execute_command("CLIENT", "UNPAUSE")
        status, reply = answer(charge)
        answered["charge"] = time.monotonic()
        assert status == 200 and reply["allowed"], reply
        assert settled.result() == (200, {"results": ["applied"] * 1000})
    assert answered["charge"] < answered["settlements"]


# A window of 366 days: a bucket refills 0.003 tokens of 1,000 in 100 s, so the levels
# below are the writes and credits alone, however slowly a loaded machine runs.
YEAR_MS = 366 * 86_400_000




def as_an_old_companion_charged(store, key, capacity, level):
    """A token bucket as a companion of the release before capped credits left it after a
    charge or a lease grant (`git show 2196772^:lua/limits.lua`): the same hash {tokens, ts}
    and expiry as today, and nothing beside it: no `|granted` counter for a grant."""
    store.hset(key, mapping={"tokens": f"{level:.17g}", "ts": f"{redis_now_ms(store):.17g}"})
    store.pexpire(key, math.ceil((capacity - level) * YEAR_MS / capacity))


def test_a_reservation_record_written_by_an_old_companion_caps_nothing(single):
    """docs/credentials.md#upgrading-to-two-credentials-and-capped-credits: "a record written by an
    old companion caps nothing when a new one settles it". The old record is the charge's
    time alone; settled here with a credit beyond what that charge took (100), the whole
    credit comes back, where a record of this companion's would cap it at 100."""
    _, redis_port, port = single
    store = redis.Redis(port=redis_port)
    key = "t1:{llm:old-record}:tb:tpm"
    # The old companion charged 100 under r-old, another request 500: 400 left.
    as_an_old_companion_charged(store, key, 1000, 400)
    store.set("t1:{llm:old-record}:res:r-old", f"{redis_now_ms(store):.17g}", px=60_000)
    batch = {"settlements": [settlement("old-record", "r-old", 300, window_ms=YEAR_MS)]}
    assert call(port, batch, path="/v1/settle") == (200, {"results": ["applied"]})
    assert float(store.hget(key, "tokens")) == pytest.approx(400 + 300, abs=0.01)


def test_a_lease_granted_by_an_old_companion_gives_nothing_back_when_returned_here(single):
    """docs/credentials.md#upgrading-to-two-credentials-and-capped-credits: "a lease granted by an
    old companion and returned to a new one gives nothing back (no grant was recorded):
    its remainder stays charged until its window refills". The return is applied (its
    once marker set) but credits nothing, and is counted as a credit refused `unbacked`."""
    _, redis_port, port = single
    store = redis.Redis(port=redis_port)
    key = "t1:{llm:old-lease}:tb:tpm"
    as_an_old_companion_charged(store, key, 1000, 800)  # an old grant of 200
    before = store.hgetall(key)
    returned = {"domain": "llm", "tenant": "old-lease", "once": "returned-old",
                "limits": [{"name": "tpm", "capacity": 1000, "window_ms": YEAR_MS, "credit": 150}]}
    assert call(port, {"settlements": [returned]}, path="/v1/settle") == (200, {"results": ["applied"]})
    assert store.hgetall(key) == before, "the bucket was written: something was given back"
    # Where this companion sees the tenant: the 200 still charged, full again only when
    # the window has refilled them (200 of 1,000: a fifth of the window).
    status, reply = call(port, {"domain": "llm", "tenant": "old-lease",
                                "limits": [{"name": "tpm", "capacity": 1000, "window_ms": YEAR_MS, "cost": 801}]})
    assert status == 200 and not reply["allowed"], reply
    assert reply["limits"][0]["remaining"] == 800
    assert YEAR_MS / 5 - 60_000 <= reply["limits"][0]["reset_after_ms"] <= YEAR_MS / 5
    metrics = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    assert 'llm_ratelimit_companion_credits_refused_total{outcome="unbacked"} 1' in metrics


def fair_pool_charge(tenant, cost, reservation, wait_ms=None):
    """A charge of an every-caller pool of 1,000 tokens held to fair shares, claimed by
    `tenant`, under a reservation; with `wait_ms`, one that may wait in the queue (its
    token limit `provisional`, as the filter sends it)."""
    charge = {"domain": "llm", "tenant": tenant, "reservation": {"id": reservation, "ttl_ms": 60_000},
              "limits": [{"name": "pool", "owner": "all", "capacity": 1000, "window_ms": YEAR_MS, "cost": cost,
                          "provisional": wait_ms is not None,
                          "fair": {"claimant": tenant, "weight": 1, "max_claimants": 8, "idle_ms": 3_600_000}}]}
    if wait_ms:
        charge["wait"] = {"max_ms": wait_ms, "priority": 0, "aging_ms": 100}
    return charge


def fair_use(store, claimant):
    """The claimant's field of the pool's `|fair` hash: (used, time it was written), or None."""
    field = store.hget("t1:{llm:all}:tb:pool|fair", claimant)
    if field is None:
        return None
    used, at, _weight, _last = field.decode().split()
    return float(used), float(at)


def test_a_charge_retried_from_the_queue_adds_nothing_to_the_tenants_fair_use_until_admitted(single):
    """docs/pools.md#fair-shares-of-a-scarce-pool: "a charge retried from the queue adds
    nothing to the tenant's use until it is admitted". Tenant b's charge of 300 finds 100
    left and waits; each retry rewrites its field of the pool's `|fair` hash (its time
    moves), its use staying 0; once a settlement of a's gives 500 back it is admitted,
    and its use is its cost, once."""
    _, redis_port, port = single
    store = redis.Redis(port=redis_port)
    status, reply = call(port, fair_pool_charge("a", 900, "ra"))
    assert status == 200 and reply["allowed"], reply
    waiting = send_only(port, fair_pool_charge("b", 300, "rb", wait_ms=30_000))
    uses, times = [], set()

    def retried():
        use = fair_use(store, "b")
        if use is not None and store.zcard("t1:{llm:b}:queue:waiters") == 1:
            uses.append(use[0])
            times.add(use[1])
        return len(times) >= 3

    wait_until(retried, 20, "three retries of b's charge from the queue")
    assert set(uses) == {0.0}, f"b's use moved while its charge waited: {uses}"
    settle_a = {"domain": "llm", "tenant": "a", "reservation": "ra",
                "limits": [{"name": "pool", "owner": "all", "capacity": 1000, "window_ms": YEAR_MS, "credit": 500}]}
    assert call(port, {"settlements": [settle_a]}, path="/v1/settle") == (200, {"results": ["applied"]})
    status, reply = answer(waiting)
    assert status == 200 and reply["allowed"] and reply["waited_ms"] > 0, reply
    assert fair_use(store, "b")[0] == pytest.approx(300, abs=0.01)
    assert fair_use(store, "a")[0] == pytest.approx(900 - 500, abs=0.01)


ADMIN_TOKEN = "companion-test-admin-token"


def usage(port, tenant, limit):
    """Where `tenant` (a key, or a pool's owner) stands on `limit`, as a companion's
    peek sees it: its remaining."""
    spec = {name: limit[name] for name in ("name", "capacity", "window_ms")}
    status, reply = call(port, {"domain": "llm", "tenant": tenant, "limits": [spec]}, token=ADMIN_TOKEN,
                         path="/v1/usage")
    assert status == 200, reply
    return reply["limits"][0]["remaining"]


def test_a_companion_killed_between_a_parts_charge_and_its_rollback_leaves_that_part_charged_for_a_window(stack):
    """docs/pools.md (on Redis Cluster): "If the companion dies in that window,
    what the part took stays charged until the counter refills (at most one request's
    cost per counter, for one window)". A request of 100 against its key's limit, its
    team's pool and the upstream's (exhausted) quota: the key's and the team's parts are
    charged, the upstream's part blocks in its paused node, and the companion is killed
    (SIGKILL) there, before the refusal and the rollback. Each charged counter is then
    short by exactly the request's 100, and full again a window later (the key's limit is
    100 per 4 s, the team's 400 per 16 s: both refill 100 in 4 s); the upstream's is as
    it was."""
    ports = stack.redis_cluster(3)
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    # A Redis timeout far above the test's: the blocked part must not time out (and be
    # rolled back) before the kill.
    dying, port = stack.companion(url, TOKEN, redis_timeout="30s")
    _, after = stack.companion(url, TOKEN, name="companion-after", admin_token=ADMIN_TOKEN)
    cluster = redis.RedisCluster(host="127.0.0.1", port=ports[0])

    def node_of(key):
        return cluster.nodes_manager.get_node_from_slot(cluster.keyslot(key)).port

    upstream = {"name": "upstream-tpm", "owner": "all", "capacity": 1000, "window_ms": YEAR_MS}
    paused = node_of("llmrl:{llm:all}:tb:upstream-tpm")
    tenant = next(t for t in (f"crash{i}" for i in range(64)) if node_of(f"llmrl:{{llm:{t}}}:tb:key-tpm") != paused)
    team = next(o for o in (f"pteam{i}" for i in range(64)) if node_of(f"llmrl:{{llm:{o}}}:tb:team-tpm") != paused)
    key_limit = {"name": "key-tpm", "capacity": 100, "window_ms": 4_000}
    team_limit = {"name": "team-tpm", "owner": team, "capacity": 400, "window_ms": 16_000}
    key_bucket, team_bucket = f"llmrl:{{llm:{tenant}}}:tb:key-tpm", f"llmrl:{{llm:{team}}}:tb:team-tpm"
    try:
        status, reply = call(port, {"domain": "llm", "tenant": "filler", "limits": [{**upstream, "cost": 1000}]})
        assert status == 200 and reply["allowed"], reply
        upstream_before = cluster.hgetall("llmrl:{llm:all}:tb:upstream-tpm")
        paused_node = redis.Redis(port=paused)
        pause(paused_node)
        try:
            request = {"domain": "llm", "tenant": tenant,
                       "limits": [{**l, "cost": 100} for l in (key_limit, team_limit, upstream)]}
            sock = send_only(port, request)
            wait_until(lambda: cluster.exists(team_bucket) and blocked_in_redis(paused_node), 30,
                       "the key's and the team's parts charged, the upstream's blocked")
            dying.kill()
            sock.close()
        finally:
            paused_node.execute_command("CLIENT", "UNPAUSE")
        # Short by exactly the request's cost, and no rollback ran: each part's record stands.
        assert float(cluster.hget(key_bucket, "tokens")) == 100 - 100
        assert float(cluster.hget(team_bucket, "tokens")) == 400 - 100
        assert cluster.hgetall("llmrl:{llm:all}:tb:upstream-tpm") == upstream_before
        for owner in (tenant, team):
            assert len(list(cluster.scan_iter(match=f"llmrl:{{llm:{owner}}}:res:*"))) == 1, owner
        assert usage(after, tenant, key_limit) < 100 and usage(after, team, team_limit) < 400
        # Full again one window after the charge (which came before the kill), with 1.5 s
        # for a loaded machine's polling.
        wait_until(lambda: usage(after, tenant, key_limit) == 100 and usage(after, team, team_limit) == 400,
                   4 + 1.5, "the key's and the team's counters full again")
    finally:
        cluster.close()


def answered_at(sockets):
    """Each call written by `send_only`: its status and body, and when its answer began to
    come (monotonic), watching all of them at once."""
    selector = selectors.DefaultSelector()
    for i, sock in enumerate(sockets):
        selector.register(sock, selectors.EVENT_READ, i)
    came, deadline = {}, time.monotonic() + 60
    while len(came) < len(sockets) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1):
            came[key.data] = time.monotonic()
            selector.unregister(key.fileobj)
    selector.close()
    return [(*answer(sock), came.get(i)) for i, sock in enumerate(sockets)]


def test_with_redis_stalled_a_charge_is_answered_within_twice_the_redis_timeout(stack):
    """docs/companion.md (`--redis-timeout`) and docs/troubleshooting.md: `companion.timeout`
    must be above twice `--redis-timeout`, as a call may wait one timeout for its turn and
    then run for another. With the companion's Redis stopped (SIGSTOP), 250 charges sent
    at once: the first goes out and times out, the next 100 go together after it and time
    out, the rest, a timeout late when their turn comes, fail unsent. Each is answered (503,
    Redis failed) within 2 x 1 s, plus 0.5 s for a loaded machine (a VM stalled for 0.8 s
    once here), and some waited their turn and then ran (over one timeout)."""
    timeout_s, slack_s = 1.0, 0.5
    redis_proc, redis_port = stack.redis()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, redis_timeout="1s")
    assert call(port, bucket_request("before"))[0] == 200
    os.kill(redis_proc.pid, signal.SIGSTOP)
    try:
        sockets, sent = [], []
        for i in range(250):
            sockets.append(send_only(port, bucket_request(f"stalled{i}")))
            sent.append(time.monotonic())
        answers = answered_at(sockets)
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
    assert all(status == 503 and body["error"].startswith("redis:") for status, body, _ in answers), answers[:3]
    took = [came - at for (_, _, came), at in zip(answers, sent)]
    assert max(took) <= 2 * timeout_s + slack_s, sorted(took)[-5:]
    assert max(took) > timeout_s, sorted(took)[-5:]


def test_the_fleets_provider_words_stay_within_256_keys_whatever_is_reported(single):
    """docs/provider-limits.md: the fleet's provider words are "one Redis hash of
    at most 256 fields". Through the companion's own endpoint, 6 exchanges of 64 reports
    for 384 different keys leave 256 fields, and the reply names no more."""
    from stack import redis_key

    _, redis_port, port = single
    store = redis.Redis(port=redis_port)
    now = int(time.time() * 1000)
    keys = [f"{i:016x}" for i in range(6 * 64)]
    for batch in range(6):
        reports = [{"key": key, "said_ms": now, "out_until_ms": now + 600_000, "refused": True, "probing": False,
                    "left": [[0, 0]] * 4} for key in keys[batch * 64:(batch + 1) * 64]]
        status, reply = call(port, {"domain": "llm", "proxy": "aaaaaaaaaaaaaaaa", "reports": reports},
                             path="/v1/provider")
        assert status == 200, reply
        assert len(reply["entries"]) == min(256, (batch + 1) * 64)
    assert store.hlen(redis_key("t1:", "llm", "provider", "prov", "words")) == 256
    # What came first is kept; the keys beyond the bound were dropped.
    assert {e["key"] for e in reply["entries"]} == set(keys[:256])
