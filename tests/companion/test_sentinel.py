"""The companion against Redis behind Sentinel (`redis+sentinel://`), with real processes: a
primary, its replica and three `redis-sentinel`s (stack.Stack.redis_sentinel), passwords on
the data nodes and on the Sentinels. It serves from the primary the Sentinels name, follows
a failover when the primary is killed, and says at start what is wrong with a password or
a master name."""

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from certificates import make_certificates
from stack import COMPANION_BIN, free_port, http_get, wait_until

TOKEN = "sentinel-test-token-0123"
DATA_PASSWORD = "data-node-password-0123"
SENTINEL_PASSWORD = "sentinel-password-0123"
PASSWORDS = {"LLMRL_REDIS_PASSWORD": DATA_PASSWORD, "LLMRL_REDIS_SENTINEL_PASSWORD": SENTINEL_PASSWORD}
# A bucket whose key outlives a test: it expires once refilled, 26 s per unit charged.
LIMIT = {"name": "rpm", "kind": "token_bucket", "capacity": 100_000, "window_ms": 30 * 86_400_000, "cost": 1}
TENANT = "5e" * 16
KEY = f"llmrl:{{llm:{TENANT}}}:tb:rpm"


def charge(port, timeout=2.0):
    """One charge; its HTTP status, or 0 when the companion did not answer."""
    body = json.dumps({"domain": "llm", "tenant": TENANT, "limits": [LIMIT]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/token_bucket", data=body,
                                     headers={"content-type": "application/json", "x-llmrl-token": TOKEN})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def metric(port, name):
    text = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture
def group(stack):
    return stack.redis_sentinel(password=DATA_PASSWORD, sentinel_password=SENTINEL_PASSWORD)


def test_charges_land_on_the_primary_and_the_url_is_logged_without_its_password(stack, group, tmp_path):
    # The data nodes' password in the URL, the Sentinels' from a file.
    password_file = tmp_path / "sentinel-password"
    password_file.write_text(SENTINEL_PASSWORD + "\n")
    url = group.url().replace("://", f"://:{DATA_PASSWORD}@")
    proc, port = stack.companion(url, TOKEN, extra=["--redis-sentinel-password-file", str(password_file)])
    assert [charge(port) for _ in range(3)] == [200] * 3
    assert float(group.cli(group.primary[1], "HGET", KEY, "tokens")) == pytest.approx(99_997, abs=1)
    log = proc.log_path.read_text()
    assert f"redis+sentinel://:***@127.0.0.1:{group.sentinels[0][1]}" in log, log
    assert f"primary of \"mymaster\" at 127.0.0.1:{group.primary[1]}" in log, log
    assert DATA_PASSWORD not in log and SENTINEL_PASSWORD not in log, log


def test_a_failover_under_load_is_followed_within_seconds_of_the_promotion(stack, group):
    primary_proc, primary_port = group.primary
    replica_port = group.replica[1]
    _, port = stack.companion(group.url(), TOKEN, redis_timeout="100ms", env=PASSWORDS)
    # The same primary without Sentinel: it never comes back (the check that the test
    # needs Sentinel to pass).
    _, plain = stack.companion(f"redis://:{DATA_PASSWORD}@127.0.0.1:{primary_port}", TOKEN, name="companion-plain")
    assert charge(port) == 200 and charge(plain) == 200

    answers, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            status = charge(port, timeout=1.0)
            answers.append((time.monotonic(), status))
            time.sleep(0.005)

    clients = [threading.Thread(target=client) for _ in range(3)]
    for thread in clients:
        thread.start()
    try:
        time.sleep(1.0)
        assert answers and all(status == 200 for _, status in answers), answers[-5:]
        killed = time.monotonic()
        primary_proc.kill()
        # The promotion as the replica reports it, then as the first Sentinel names it.
        promoted = wait_until(lambda: group.role(replica_port) == "master" and time.monotonic(), 30, "promotion")
        switched = wait_until(
            lambda: any(group.sentinel_cli(p, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster").endswith(
                str(replica_port)) for _, p in group.sentinels) and time.monotonic(),
            30, "the Sentinels naming the new primary")
        served = wait_until(lambda: next((t for t, s in answers if s == 200 and t > switched), None), 15,
                            "a charge served after the switch")
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    failed = [t for t, status in answers if status != 200 and t > killed]
    assert failed, "the kill interrupted nothing"
    first_served = min(t for t, status in answers if status == 200 and t > failed[0])
    print(f"\nfailover: promoted {promoted - killed:.2f} s after the kill, named by a Sentinel "
          f"{switched - killed:.2f} s after it; first charge served {first_served - killed:.2f} s after the kill, "
          f"{first_served - promoted:.2f} s after the promotion, {first_served - switched:.2f} s after the switch; "
          f"{len(failed)} charges failed meanwhile")
    assert first_served - switched < 10, "not served within 10 s of the Sentinels naming the new primary"
    assert served - switched < 10
    # Every charge after the first success on the new primary succeeds, and lands there.
    assert all(status == 200 for t, status in answers if t > first_served), "charges failed after the switch"
    assert group.cli(replica_port, "EXISTS", KEY) == "1"
    # The scripts reached the new primary (replicated, or loaded again on NOSCRIPT).
    assert charge(port) == 200
    print(f"NOSCRIPT reloads: {metric(port, 'llm_ratelimit_companion_noscript_reloads_total')}")
    # Without Sentinel, the companion keeps asking the dead primary.
    assert charge(plain) == 503


def run_companion(url, env, extra=()):
    return subprocess.run([str(COMPANION_BIN), "--listen", f"127.0.0.1:{free_port()}", "--redis-url", url,
                           "--startup-wait", "20s", *extra],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "LLMRL_COMPANION_TOKEN": TOKEN, **env})


def test_wrong_passwords_and_an_unknown_master_end_the_start_naming_the_problem(group):
    url = group.url()
    for env in ({**PASSWORDS, "LLMRL_REDIS_SENTINEL_PASSWORD": "not-the-sentinel-password"},
                {"LLMRL_REDIS_PASSWORD": DATA_PASSWORD}):
        result = run_companion(url, env)
        assert result.returncode != 0, result.stderr
        assert "the Sentinels refused the companion's credentials" in result.stderr, result.stderr
        assert "LLMRL_REDIS_SENTINEL_PASSWORD" in result.stderr, result.stderr
        assert "waiting for Redis" not in result.stderr and "not-the-sentinel-password" not in result.stderr
    result = run_companion(url, {**PASSWORDS, "LLMRL_REDIS_PASSWORD": "not-the-data-password"})
    assert result.returncode != 0, result.stderr
    assert "the primary the Sentinels named refused the companion's credentials" in result.stderr, result.stderr
    assert "waiting for Redis" not in result.stderr and "not-the-data-password" not in result.stderr
    result = run_companion(group.url(master="no-such-master"), PASSWORDS)
    assert result.returncode != 0, result.stderr
    assert "no Sentinel monitors this master name" in result.stderr and '"no-such-master"' in result.stderr, \
        result.stderr
    assert "waiting for Redis" not in result.stderr
    result = run_companion(f"redis://127.0.0.1:{group.primary[1]}", PASSWORDS)
    assert result.returncode != 0 and "need a redis+sentinel:// URL" in result.stderr, result.stderr


def test_a_manual_failover_moves_the_companion_off_the_old_primary_at_once(stack, group):
    """`SENTINEL FAILOVER`: the old primary stays up and goes on taking writes until
    Sentinel demotes it, some 10 s later, and nothing fails meanwhile: the companion moves
    on Sentinel's `+switch-master`, not on an error."""
    _, port = stack.companion(group.url(), TOKEN, redis_timeout="100ms", env=PASSWORDS)
    assert charge(port) == 200
    old, new = group.primary[1], group.replica[1]
    wait_until(lambda: group.cli(new, "HGET", KEY, "tokens"), 10, "the charge replicated")
    replicated = float(group.cli(new, "HGET", KEY, "tokens"))
    assert group.sentinel_cli(group.sentinels[0][1], "SENTINEL", "FAILOVER", "mymaster") == "OK"
    wait_until(lambda: group.role(new) == "master", 30, "the promotion")
    wait_until(lambda: charge(port) == 200 and float(group.cli(new, "HGET", KEY, "tokens")) < replicated, 5,
               "charges on the new primary")
    assert group.role(old) == "master", "the old primary was demoted already: this tests nothing"
    on_old, on_new = (float(group.cli(p, "HGET", KEY, "tokens")) for p in (old, new))
    assert [charge(port) for _ in range(3)] == [200] * 3
    assert float(group.cli(new, "HGET", KEY, "tokens")) == pytest.approx(on_new - 3, abs=1)
    assert float(group.cli(old, "HGET", KEY, "tokens")) == pytest.approx(on_old, abs=0.5)


def test_rediss_sentinel_speaks_tls_to_the_sentinels_and_the_data_nodes(stack, tmp_path):
    """Every process TLS only, client certificates required: the companion shows its own,
    checks theirs against the CA, and follows a failover."""
    certs = make_certificates(tmp_path)
    group = stack.redis_sentinel(password=DATA_PASSWORD, sentinel_password=SENTINEL_PASSWORD, tls=certs)
    assert group.url().startswith("rediss+sentinel://")
    tls = ["--redis-ca-file", str(certs / "ca.pem"), "--redis-client-cert", str(certs / "client.pem"),
           "--redis-client-key", str(certs / "client.key")]
    _, port = stack.companion(group.url(), TOKEN, redis_timeout="100ms", extra=tls, env=PASSWORDS)
    assert charge(port) == 200 and group.cli(group.primary[1], "EXISTS", KEY) == "1"
    group.primary[0].kill()
    wait_until(lambda: charge(port) == 200 and group.role(group.replica[1]) == "master", 20, "served after failover")
    # A CA that did not sign their certificates: refused at once.
    (tmp_path / "other").mkdir()
    other = make_certificates((tmp_path / "other").resolve())
    result = run_companion(group.url(), PASSWORDS, extra=["--redis-ca-file", str(other / "ca.pem"), *tls[2:]])
    assert result.returncode != 0 and "waiting for Redis" not in result.stderr, result.stderr
    assert "cannot connect to Redis" in result.stderr and "certificate" in result.stderr, result.stderr


def test_through_envoy_a_failover_costs_no_5xx_and_decisions_turn_central_again(stack, group):
    """The filter's degraded mode over a failover: while the companion fails, requests are
    decided locally (`failure_mode: local`), none answered 5xx; once the companion serves
    from the new primary, decisions are central again."""
    from stack import envoy_config, filter_config, send

    _, companion = stack.companion(group.url(), TOKEN, redis_timeout="40ms", env=PASSWORDS)
    _, mock = stack.mock()
    config = filter_config([{"name": "rph", "requests": 1_000_000, "window": "1h"}], token=TOKEN,
                           companion_timeout="250ms", failure_mode="local",
                           fallback={"instances": 1, "breaker_failures": 3, "breaker_cooldown": "300ms"})
    port = free_port()
    stack.envoy(envoy_config(listen_port=port, admin_port=free_port(), upstream_port=mock, companion_port=companion,
                             filter_config=config))
    assert send(port, "sk-sentinel").status == 200

    replies, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            replies.append(send(port, "sk-sentinel", timeout=10))
            time.sleep(0.01)

    clients = [threading.Thread(target=client) for _ in range(3)]
    for thread in clients:
        thread.start()
    try:
        time.sleep(1.0)
        killed = time.monotonic()
        group.primary[0].kill()
        switched = wait_until(
            lambda: any(group.sentinel_cli(p, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster").endswith(
                str(group.replica[1])) for _, p in group.sentinels) and time.monotonic(),
            30, "the Sentinels naming the new primary")
        central = wait_until(lambda: next((r.done for r in replies if r.started > switched
                                           and "x-llm-ratelimit-degraded" not in r.headers), None), 15,
                             "a central decision after the switch")
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    statuses = [r.status for r in replies]
    degraded = [r for r in replies if r.started > killed and r.headers.get("x-llm-ratelimit-degraded") == "local"]
    print(f"\nthrough Envoy: {len(replies)} requests, {len(degraded)} decided locally; central again "
          f"{central - switched:.2f} s after the switch ({central - killed:.2f} s after the kill)")
    assert not [s for s in statuses if s >= 500], f"5xx across the failover: {sorted(set(statuses))}"
    assert set(statuses) == {200}, sorted(set(statuses))
    assert degraded, "the failover went unnoticed: the test tests nothing"
    assert central - switched < 10
