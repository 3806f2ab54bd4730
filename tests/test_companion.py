"""The companion over real HTTP against a real Redis: auth, input validation, script
loading and NOSCRIPT recovery, Redis outages, and Redis Cluster."""

import json
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from stack import http_get, wait_until

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
    """README (The companion): an adjustment without a reservation (a returned lease, what
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
