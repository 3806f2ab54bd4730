"""What an operator has on day two, against real processes: the companion's Prometheus
metrics after traffic through Envoy (the series and their values), and the
`llm-ratelimit` CLI's usage and reset against a real companion and Redis."""

import json
import os
import re
import subprocess
import threading
import urllib.request

import pytest

from helpers import companion_metric as metric, companion_scrape as scrape
from stack import ROOT, Backend, free_port, http_get, send, tenant_of, wait_until

TOKEN = "ops-companion-token"
pytestmark = pytest.mark.backend(token=TOKEN)
CLI = ROOT / "target/release/llm-ratelimit"






def post(port: int, path: str, body: dict, token: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"x-llmrl-token": token, "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_companion_counts_what_envoy_decided(backend):
    limits = [{"name": "rpm", "requests": 5, "window": "1h"}, {"name": "tpm", "tokens": 100_000, "window": "1h"}]
    port = backend.envoy(backend.filter_config(limits))[0]
    statuses = [send(port, key="sk-ops-metrics")[0] for _ in range(8)]
    assert statuses == [200] * 5 + [429] * 3

    def settled():
        samples = scrape(backend.companion_port)
        return metric(samples, "settlements_total", outcome="applied") >= statuses.count(200) and samples

    samples = wait_until(settled, 15, "every admitted request settled")
    assert metric(samples, "decisions_total", op="charge", outcome="allowed") == statuses.count(200)
    assert metric(samples, "decisions_total", op="charge", outcome="limited") == statuses.count(429)
    assert metric(samples, "decisions_total", op="charge", outcome="error") == 0
    assert metric(samples, "settlements_total", outcome="applied") == statuses.count(200)
    assert metric(samples, "settlements_total", outcome="dropped") == 0
    assert metric(samples, "decisions_total", op="settle", outcome="allowed") == statuses.count(200)
    # Every charge's and settlement's script call was timed, under its own op.
    assert metric(samples, "redis_call_duration_seconds_count", op="charge") == len(statuses)
    assert metric(samples, "redis_call_duration_seconds_count", op="settle") == statuses.count(200)
    assert metric(samples, "redis_call_duration_seconds_bucket", op="charge", le="+Inf") == len(statuses)
    assert 0 < metric(samples, "redis_call_duration_seconds_sum", op="charge") < len(statuses) * 0.5
    for name in ("script_errors_total", "noscript_reloads_total", "auth_failures_total", "admin_resets_total",
                 "queue_depth", "queue_wait_seconds_count"):
        assert metric(samples, name) == 0, name

    # A call with a wrong token is refused and counted; one Redis lost its scripts is reloaded.
    charge = {"domain": "llm", "tenant": "t1", "limits": [{"name": "rpm", "capacity": 5, "window_ms": 60_000, "cost": 1}]}
    assert post(backend.companion_port, "/v1/token_bucket", charge, "wrong") == 401
    subprocess.run(["redis-cli", "-p", str(backend.redis_port), "SCRIPT", "FLUSH"], check=True, capture_output=True)
    assert post(backend.companion_port, "/v1/token_bucket", charge, TOKEN) == 200
    samples = scrape(backend.companion_port)
    assert metric(samples, "auth_failures_total") == 1
    assert metric(samples, "noscript_reloads_total") == 1
    assert metric(samples, "decisions_total", op="charge", outcome="allowed") == statuses.count(200) + 1
    # A script error: a key of another type where the tenant's bucket should be, which
    # Redis refuses (WRONGTYPE) inside the script.
    subprocess.run(["redis-cli", "-p", str(backend.redis_port), "SET", "llmrl:{llm:t2}:tb:rpm", "x"], check=True,
                   capture_output=True)
    assert post(backend.companion_port, "/v1/token_bucket", {**charge, "tenant": "t2"}, TOKEN) == 503
    samples = scrape(backend.companion_port)
    assert metric(samples, "script_errors_total") == 1
    assert metric(samples, "decisions_total", op="charge", outcome="error") == 1


ADMIN = Backend.ADMIN_TOKEN


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI with the backend's admin credential in its environment (as an operator runs it)."""
    env = env if env is not None else {**os.environ, "LLMRL_ADMIN_TOKEN": ADMIN}
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=60, env=env)


def test_usage_shows_the_level_after_requests_and_reset_starts_the_tenant_afresh(backend, tmp_path):
    key = "sk-ops-usage-0001"
    limits = [
        {"name": "rpm", "requests": 10, "window": "1h"},
        {"name": "tpm", "tokens": 50_000, "window": "1h", "algorithm": "sliding_window"},
        {"name": "inflight", "concurrency": 4},
    ]
    config = backend.filter_config(limits)
    config_file = tmp_path / "filter.json"
    config_file.write_text(json.dumps(config))
    port = backend.envoy(config)[0]
    replies = [send(port, key=key) for _ in range(3)]
    assert [r.status for r in replies] == [200] * 3
    # What the upstream reported: once settled, exactly that is used of the tokens.
    reported = sum(int(r.headers["x-mock-prompt-tokens"]) + int(r.headers["x-mock-completion-tokens"]) for r in replies)
    companion = f"http://127.0.0.1:{backend.companion_port}"
    common = ["--config", str(config_file), "--companion", companion]

    def usage(*who):
        done = cli("usage", *common, *who, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def settled():
        # The settlement (real usage in place of the reservation) follows on the worker's tick.
        reply = usage("--key", key)
        return reply if reply["limits"][2]["used"] == 0 and reply["reservations"] == 0 else None

    reply = wait_until(settled, 15, "the requests' slots released and reservations settled")
    assert reply["tenant"] == tenant_of(key) and reply["domain"] == "llm"
    rpm, tpm, inflight = reply["limits"]
    assert (rpm["name"], rpm["limit"], rpm["used"], rpm["remaining"]) == ("rpm", 10, 3, 7)
    assert rpm["retry_after_ms"] == 0 and 0 < rpm["reset_after_ms"] <= 3 * 360_000
    assert tpm["kind"] == "sliding_window" and tpm["limit"] == 50_000
    assert (tpm["used"], tpm["remaining"]) == (reported, 50_000 - reported)
    assert (inflight["kind"], inflight["limit"], inflight["remaining"]) == ("slots", 4, 4)
    # The same tenant by id, and as a table.
    levels = lambda limits: [(l["name"], l["used"], l["remaining"]) for l in limits]  # noqa: E731
    assert levels(usage("--tenant", tenant_of(key))["limits"]) == levels(reply["limits"])
    table = cli("usage", *common, "--tenant", tenant_of(key))
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[2:]}
    assert re.search(r"requests \(token bucket\)\s+3\s+7\s+10\s", rows["rpm"]), table.stdout
    assert "in flight" in rows["inflight"]
    # Nothing was charged by asking; every reservation was settled.
    assert usage("--key", key)["limits"][0]["used"] == 3
    assert reply["reservations_complete"]
    assert table.stdout.splitlines()[-1] == "reservations awaiting settlement: 0"
    # Two charges with reservations, not settled (as while their replies stream): counted.
    for reservation in ("r-open-1", "r-open-2"):
        charge = {"domain": "llm", "tenant": tenant_of(key), "reservation": {"id": reservation, "ttl_ms": 60_000},
                  "limits": [{"name": "tpm", "capacity": 50_000, "window_ms": 3_600_000, "cost": 10,
                              "kind": "sliding_window"}]}
        assert post(backend.companion_port, "/v1/token_bucket", charge, TOKEN) == 200
    assert usage("--key", key)["reservations"] == 2
    assert usage("--key", "sk-another-tenant")["reservations"] == 0

    # Reset: the tenant is fresh; the reset is logged by tenant id and counted.
    done = cli("reset", *common, "--key", key)
    assert done.returncode == 0, done.stderr
    assert f"reset tenant {tenant_of(key)}" in done.stdout and "2 counters deleted" in done.stdout
    assert [l["remaining"] for l in usage("--key", key)["limits"]] == [10, 50_000, 4]
    assert send(port, key=key)[0] == 200
    assert usage("--key", key)["limits"][0]["remaining"] == 9
    log = (backend.companion_proc.log_path).read_text()
    assert f"admin reset of tenant {tenant_of(key)} in domain llm: limits rpm, tpm, inflight" in log
    # --limit narrows a reset to some limits.
    done = cli("reset", *common, "--key", key, "--limit", "rpm")
    assert done.returncode == 0 and "rpm (1 counters deleted" in done.stdout, done.stdout
    assert usage("--key", key)["limits"][0]["remaining"] == 10

    # A wrong token is refused, named, and counted; the key appears nowhere.
    refused = cli("usage", *common, "--key", key, "--admin-token", "not-the-token-0123")
    assert refused.returncode == 1 and "the companion answered 401" in refused.stderr
    samples = scrape(backend.companion_port)
    assert metric(samples, "auth_failures_total") == 1
    assert metric(samples, "admin_resets_total") == 2
    assert metric(samples, "decisions_total", op="usage", outcome="allowed") >= 6
    assert metric(samples, "redis_call_duration_seconds_count", op="reset") == 2
    for text in (log, table.stdout, done.stdout, refused.stderr):
        assert key not in text and TOKEN not in text and ADMIN not in text


def test_the_cli_refuses_what_it_cannot_name(backend, tmp_path):
    config_file = tmp_path / "filter.json"
    config_file.write_text(json.dumps(backend.filter_config([{"name": "rpm", "requests": 10, "window": "1x"}])))
    done = cli("usage", "--config", str(config_file), "--tenant", tenant_of("k"))
    assert done.returncode == 1 and "limits[0].window" in done.stderr
    config_file.write_text(json.dumps(backend.filter_config([{"name": "rpm", "requests": 10, "window": "1m"}])))
    done = cli("usage", "--config", str(config_file), "--tenant", "sk-looks-like-a-key")
    assert done.returncode == 1 and "--tenant takes a tenant id" in done.stderr
    assert "sk-looks-like-a-key" not in done.stderr
    done = cli("usage", "--config", str(config_file), "--tenant", tenant_of("k"), "--limit", "tpm")
    assert done.returncode == 1 and 'no limit "tpm" (it has rpm)' in done.stderr
    done = cli("usage", "--config", str(config_file))
    assert done.returncode == 2  # neither --key nor --tenant: a usage error
    # The key from the environment, not the command line.
    env = {"LLMRL_API_KEY": "sk-from-env", "LLMRL_ADMIN_TOKEN": ADMIN, "PATH": "/usr/bin:/bin"}
    done = cli("usage", "--config", str(config_file), "--companion", f"http://127.0.0.1:{backend.companion_port}",
               "--json", env=env)
    assert done.returncode == 0 and json.loads(done.stdout)["tenant"] == tenant_of("sk-from-env"), done.stderr


def test_metrics_on_a_listener_of_their_own(stack):
    _, redis_port = stack.redis()
    metrics_port = free_port()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, extra=["--metrics-listen",
                                                                                f"127.0.0.1:{metrics_port}"])
    wait_until(lambda: http_get(f"http://127.0.0.1:{metrics_port}/metrics")[0] == 200, 10, "metrics listener")
    assert metric(scrape(metrics_port), "decisions_total", op="charge", outcome="allowed") == 0
    assert http_get(f"http://127.0.0.1:{port}/metrics")[0] == 404


def post_json(port: int, path: str, body: dict) -> dict:
    """`body` to the companion, with the credential the path takes (admin for usage and reset)."""
    token = ADMIN if path in ("/v1/usage", "/v1/admin/reset") else TOKEN
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"x-llmrl-token": token, "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def test_usage_and_reset_on_a_cluster_find_each_tenant_on_its_node(stack):
    """Reservation records are counted by SCAN on the node that holds the tenant's slot."""
    ports = stack.redis_cluster(3)
    _, port = stack.companion("redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports), TOKEN,
                              admin_token=ADMIN)
    # A 366-day window: what refills while the charges go in (under load, tenths of a
    # second) stays far below a token, so `used` is exactly what was charged.
    limits = [{"name": "tpm", "capacity": 1000, "window_ms": 366 * 86_400_000}]
    for n in range(6):
        tenant = tenant_of(f"sk-cluster-{n}")
        for r in range(n):
            charge = {"domain": "llm", "tenant": tenant, "reservation": {"id": f"r{r}", "ttl_ms": 60_000},
                      "limits": [{**limits[0], "cost": 10}]}
            assert post_json(port, "/v1/token_bucket", charge)["allowed"]
        usage = post_json(port, "/v1/usage", {"domain": "llm", "tenant": tenant, "limits": limits})
        assert (usage["reservations"], usage["reservations_complete"]) == (n, True)
        assert usage["limits"][0]["used"] == 10 * n
        assert post_json(port, "/v1/admin/reset", {"domain": "llm", "tenant": tenant, "limits": limits}) == {
            "deleted": 1 if n else 0}
        assert post_json(port, "/v1/usage", {"domain": "llm", "tenant": tenant, "limits": limits})["limits"][0][
            "remaining"] == 1000


def test_the_queue_shows_its_depth_and_waits(backend):
    """A charge that may wait, against a bucket that refills one request per second: it
    waits about a second, visible in queue_depth while it waits and queue_wait_seconds
    after."""
    port = backend.companion_port
    limits = [{"name": "rps", "capacity": 1, "window_ms": 1000, "cost": 1}]
    charge = {"domain": "llm", "tenant": "queued", "limits": limits}
    assert post_json(port, "/v1/token_bucket", charge)["allowed"]
    waiting = {**charge, "reservation": {"id": "w1", "ttl_ms": 60_000},
               "wait": {"max_ms": 5_000, "priority": 5, "aging_ms": 1_000}}
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(post_json(port, "/v1/token_bucket", waiting)))
    waiter.start()
    wait_until(lambda: metric(scrape(port), "queue_depth") == 1, 5, "a charge waiting")
    waiter.join(10)
    assert answers and answers[0]["allowed"] and answers[0]["waited_ms"] > 0
    samples = scrape(port)
    assert metric(samples, "queue_depth") == 0
    assert metric(samples, "queue_wait_seconds_count") == 1
    assert abs(metric(samples, "queue_wait_seconds_sum") - answers[0]["waited_ms"] / 1000) < 0.05
    assert metric(samples, "decisions_total", op="queue", outcome="allowed") == 1
    # The first waiter of a line polls Redis "about every 20 ms" (docs/queue.md): one
    # head check per poll, beside the ZADD and PEXPIRE that queue it and the ZREM that
    # takes it out. Never faster than every 20 ms (a few shorter sleeps as the wait's end
    # nears, when the bucket says less than 20 ms are left), and never a sleep of 200 ms.
    queue_calls = metric(samples, "redis_call_duration_seconds_count", op="queue")
    waited_ms = answers[0]["waited_ms"]
    assert waited_ms / 200 <= queue_calls - 3 <= waited_ms / 20 + 10, (queue_calls, waited_ms)


def test_a_count_past_a_million_keys_stops_and_says_at_least(stack):
    """The usage query counts reservation records by SCAN and stops after a million keys
    examined (docs/operating.md: "stopping after a million keys examined and then saying `at least`"):
    below that the count is complete and exact, above it incomplete and never more than
    there are."""
    redis_proc, redis_port = stack.redis()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, admin_token=ADMIN)
    import redis as redis_client  # the test's own filler, apart from the companion's client

    filler = redis_client.Redis(port=redis_port)
    limits = [{"name": "tpm", "capacity": 1000, "window_ms": 366 * 86_400_000}]
    tenant = tenant_of("sk-many-keys")
    for r in range(3):
        charge = {"domain": "llm", "tenant": tenant, "reservation": {"id": f"r{r}", "ttl_ms": 600_000},
                  "limits": [{**limits[0], "cost": 1}]}
        assert post_json(port, "/v1/token_bucket", charge)["allowed"]

    def fill(upto: int, start: int = 0) -> None:
        for first in range(start, upto, 10_000):
            filler.mset({f"filler:{n}": "x" for n in range(first, min(first + 10_000, upto))})

    def usage() -> dict:
        return post_json(port, "/v1/usage", {"domain": "llm", "tenant": tenant, "limits": limits})

    # 700,000 other keys: every key examined, the count exact.
    fill(700_000)
    assert (usage()["reservations"], usage()["reservations_complete"]) == (3, True)
    # 1,400,000: the count stops partway and says so; what it found is a lower bound.
    fill(1_400_000, start=700_000)
    assert filler.dbsize() > 1_400_000
    counted = usage()
    assert counted["reservations_complete"] is False, counted
    assert counted["reservations"] <= 3, counted
