"""The companion and Redis as a trust boundary (issue 21), over real HTTP against real
redis-servers: two rights with two credentials, no credit without a debit, Redis with
AUTH, ACL users and TLS, and weak credentials refused at start."""

import json
import socket
import subprocess
import urllib.request

import pytest

from certificates import make_certificates
from stack import COMPANION_BIN, free_cluster_port, free_port, http_get, wait_until

DATA = "trust-data-plane-0123456789"
ADMIN = "trust-admin-credential-0123"


def post(port, path, body, token):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "x-llmrl-token": token})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def limit(cost=None, credit=None, capacity=10):
    spec = {"name": "tpm", "kind": "token_bucket", "capacity": capacity, "window_ms": 60_000}
    if cost is not None:
        spec["cost"] = cost
    if credit is not None:
        spec["credit"] = credit
    return spec


def charge(port, tenant, cost, reservation=None):
    body = {"domain": "llm", "tenant": tenant, "limits": [limit(cost=cost)]}
    if reservation:
        body["reservation"] = {"id": reservation, "ttl_ms": 60_000}
    return post(port, "/v1/token_bucket", body, DATA)


def settle(port, tenant, credit, reservation=None, once=None):
    entry = {"domain": "llm", "tenant": tenant, "limits": [limit(credit=credit)]}
    if reservation:
        entry["reservation"] = reservation
    if once:
        entry["once"] = once
    return post(port, "/v1/settle", {"settlements": [entry]}, DATA)


def metric(port, name):
    text = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture
def companion(stack):
    _, redis_port = stack.redis()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", DATA, admin_token=ADMIN)
    return port


def test_the_filter_credential_is_refused_on_admin_endpoints(companion):
    tenant_limits = {"domain": "llm", "tenant": "a" * 32,
                     "limits": [{"name": "tpm", "capacity": 10, "window_ms": 60_000}]}
    for path in ("/v1/usage", "/v1/admin/reset"):
        status, body = post(companion, path, tenant_limits, DATA)
        assert status == 401 and "admin credential" in body["error"], (path, body)
        assert post(companion, path, tenant_limits, ADMIN)[0] == 200, path
    # And the admin credential carries no data-plane right.
    assert post(companion, "/v1/token_bucket", {"domain": "llm", "tenant": "a" * 32,
                                                "limits": [limit(cost=1)]}, ADMIN)[0] == 401


def test_without_an_admin_credential_the_admin_endpoints_are_closed(stack):
    _, redis_port = stack.redis()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", DATA)
    status, body = post(port, "/v1/usage", {"domain": "llm", "tenant": "a" * 32,
                                             "limits": [{"name": "tpm", "capacity": 10, "window_ms": 60_000}]}, DATA)
    assert status == 403 and "closed" in body["error"], body


def test_rotation_accepts_the_old_and_the_new_credential(stack):
    _, redis_port = stack.redis()
    new = "rotated-data-plane-0123456789"
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", f"{new},{DATA}", admin_token=ADMIN)
    assert charge(port, "b" * 32, 1)[0] == 200
    assert post(port, "/v1/token_bucket", {"domain": "llm", "tenant": "b" * 32, "limits": [limit(cost=1)]},
                new)[0] == 200


def test_an_unbacked_credit_is_refused_counted_and_logged(stack, companion):
    tenant = "c" * 32
    assert charge(companion, tenant, 10)[1]["allowed"]
    assert not charge(companion, tenant, 1)[1]["allowed"], "exhausted"
    # The attack: a positive credit with no reservation behind it.
    for once in (None, "forged1"):
        status, body = settle(companion, tenant, 10, once=once)
        assert status == 200, body
    assert not charge(companion, tenant, 1)[1]["allowed"], "still exhausted: nothing came back"
    assert metric(companion, "llm_ratelimit_companion_credits_refused_total{outcome=\"unbacked\"}") == 2, http_get(f"http://127.0.0.1:{companion}/metrics")[1].decode()[-1500:]
    assert "2 credit(s) refused" in "".join(p.log_path.read_text() for p in stack.processes) or \
        "credit(s) refused with nothing behind them" in "".join(p.log_path.read_text() for p in stack.processes)


def test_a_credit_larger_than_its_reservation_is_capped(companion):
    tenant = "d" * 32
    assert charge(companion, tenant, 3, reservation="r1")[1]["allowed"]
    assert charge(companion, tenant, 6)[1]["allowed"]  # another request's 6: 1 left
    status, body = settle(companion, tenant, 9, reservation="r1")
    assert status == 200 and body["results"] == ["applied"], body
    # 1 + the 3 it took back: four more fit, not ten.
    assert [charge(companion, tenant, 1)[1]["allowed"] for _ in range(5)] == [True] * 4 + [False]
    assert metric(companion, 'llm_ratelimit_companion_credits_refused_total{outcome="capped"}') == 1


def run_companion(url, env=None, extra=()):
    return subprocess.run([str(COMPANION_BIN), "--listen", f"127.0.0.1:{free_port()}", "--redis-url", url,
                           "--startup-wait", "20s", *extra],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "LLMRL_COMPANION_TOKEN": DATA, **(env or {})})


@pytest.mark.parametrize("token, field", [
    ("change-me", "placeholder"),
    ("short-token", "11 bytes"),
])
def test_placeholder_and_short_credentials_are_refused_at_start(stack, token, field):
    _, redis_port = stack.redis()
    result = run_companion(f"redis://127.0.0.1:{redis_port}", env={"LLMRL_COMPANION_TOKEN": token})
    assert result.returncode != 0
    assert "--token (LLMRL_COMPANION_TOKEN), credential 1" in result.stderr and field in result.stderr, result.stderr
    result = run_companion(f"redis://127.0.0.1:{redis_port}", env={"LLMRL_ADMIN_TOKEN": token})
    assert result.returncode != 0 and "--admin-token (LLMRL_ADMIN_TOKEN)" in result.stderr, result.stderr


def redis_with(stack, *args):
    port = free_port()
    proc = stack.spawn(f"redis-auth-{port}", ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                              "no", "--port", str(port), *args])
    wait_until(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, 10, "redis", proc)
    return port


def test_the_companion_works_against_redis_with_auth_and_acl_users(stack, tmp_path):
    port = redis_with(stack, "--requirepass", "redis-password-0123")
    # The password from the environment, and from a file; never on the command line.
    _, companion = stack.companion(f"redis://127.0.0.1:{port}", DATA,
                                   env={"LLMRL_REDIS_PASSWORD": "redis-password-0123"})
    assert charge(companion, "e" * 32, 1)[1]["allowed"]
    password_file = tmp_path / "redis-password"
    password_file.write_text("redis-password-0123\n")
    _, companion = stack.companion(f"redis://127.0.0.1:{port}", DATA,
                                   extra=["--redis-password-file", str(password_file)], name="companion-file")
    assert charge(companion, "e" * 32, 1)[1]["allowed"]
    # An ACL user with only what the companion needs.
    acl = redis_with(stack, "--user", "default", "off",
                     "--user", "llmrl", "on", ">acl-password-0123", "~llmrl:*", "+@all")
    _, companion = stack.companion(f"redis://llmrl@127.0.0.1:{acl}", DATA, name="companion-acl",
                                   env={"LLMRL_REDIS_PASSWORD": "acl-password-0123"})
    assert charge(companion, "e" * 32, 1)[1]["allowed"]


def test_a_wrong_redis_password_ends_the_start_with_a_clear_message(stack):
    port = redis_with(stack, "--requirepass", "redis-password-0123")
    for env in ({"LLMRL_REDIS_PASSWORD": "not-the-password"}, {}):
        result = run_companion(f"redis://127.0.0.1:{port}", env=env)
        assert result.returncode != 0, result.stderr
        assert "Redis refused the companion's credentials" in result.stderr, result.stderr
        # A connection timed out on a loaded machine may be retried before Redis answers;
        # once Redis has refused the credentials, nothing is (waiting cannot mend that).
        refused_then = result.stderr.split("Redis refused the companion's credentials", 1)[1]
        assert "waiting for Redis" not in refused_then, "no retrying what waiting cannot mend"
        assert "not-the-password" not in result.stderr


def tls_redis(stack, certs, *extra):
    port = free_port()
    proc = stack.spawn(f"redis-tls-{port}", [
        "redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--port", "0",
        "--tls-port", str(port), "--tls-cert-file", str(certs / "server.pem"),
        "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.pem"), *extra])
    wait_until(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, 10, "redis tls", proc)
    return port


def test_the_companion_works_against_redis_with_tls_and_client_certificates(stack, tmp_path):
    certs = make_certificates(tmp_path)
    port = tls_redis(stack, certs, "--tls-auth-clients", "yes", "--requirepass", "redis-password-0123")
    tls = ["--redis-ca-file", str(certs / "ca.pem"), "--redis-client-cert", str(certs / "client.pem"),
           "--redis-client-key", str(certs / "client.key")]
    _, companion = stack.companion(f"rediss://127.0.0.1:{port}", DATA, extra=tls,
                                   env={"LLMRL_REDIS_PASSWORD": "redis-password-0123"})
    assert charge(companion, "f" * 32, 1)[1]["allowed"]
    # A CA that did not sign the server's certificate: refused at once, saying why.
    other = make_certificates((tmp_path / "other").resolve()) if (tmp_path / "other").mkdir() is None else None
    bad = ["--redis-ca-file", str(other / "ca.pem"), *tls[2:]]
    result = run_companion(f"rediss://127.0.0.1:{port}", env={"LLMRL_REDIS_PASSWORD": "redis-password-0123"},
                           extra=bad)
    assert result.returncode != 0 and "cannot connect to Redis" in result.stderr, result.stderr
    assert "waiting for Redis" not in result.stderr


def test_the_demo_token_is_absent_from_envoys_config_dump(stack):
    """The demo configuration as committed: the filter takes its credential from Envoy's
    environment, the requests are charged with it, and /config_dump never shows it."""
    from stack import envoy_config, send
    _, redis_port = stack.redis()
    secret = "demo-secret-" + "5f3a9c1e7b2d4086"
    _, companion_port = stack.companion(f"redis://127.0.0.1:{redis_port}", secret)
    _, mock_port = stack.mock()
    listen, admin = free_port(), free_port()
    config = envoy_config(listen_port=listen, admin_port=admin, upstream_port=mock_port,
                          companion_port=companion_port, filter_config=None)
    stack.envoy(config, env={"LLMRL_COMPANION_TOKEN": secret})
    assert send(listen, key="sk-dump")[0] == 200, "charged through the companion with the environment's token"
    status, dump = http_get(f"http://127.0.0.1:{admin}/config_dump?include_eds")
    assert status == 200 and b"token_env" in dump
    assert secret.encode() not in dump


def test_the_filter_refuses_a_placeholder_from_the_environment(stack):
    from stack import envoy_config
    _, mock_port = stack.mock()
    listen, admin = free_port(), free_port()
    config = envoy_config(listen_port=listen, admin_port=admin, upstream_port=mock_port, companion_port=free_port(),
                          filter_config=None)
    proc, _ = stack.envoy(config, env={"LLMRL_COMPANION_TOKEN": "change-me"}, wait=False)
    # Envoy may log the refusal and exit (the plugin fails closed) before a poll of the log:
    # either ends the wait, and the log must hold the refusal naming the field.
    wait_until(lambda: proc.popen.poll() is not None or b"companion.token_env" in proc.log_path.read_bytes(), 60,
               "the refusal")
    log = proc.log_path.read_bytes()
    assert b"field `companion.token_env`: is a placeholder" in log, proc.log_tail()


def tls_cluster(stack, certs, password, nodes=3):
    """A Redis Cluster speaking only TLS (clients, the bus, `redis-cli --cluster create`),
    with client certificates and a password."""
    tls = ["--tls-cert-file", str(certs / "server.pem"), "--tls-key-file", str(certs / "server.key"),
           "--tls-ca-cert-file", str(certs / "ca.pem")]
    ports = []
    for _ in range(nodes):
        port = free_cluster_port()
        data = stack.workdir / f"redis-tls-cluster-{port}"
        data.mkdir()
        proc = stack.spawn(f"redis-tls-cluster-{port}", [
            "redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(data),
            "--port", "0", "--tls-port", str(port), *tls, "--tls-cluster", "yes", "--tls-auth-clients", "yes",
            "--cluster-enabled", "yes", "--cluster-config-file", str(data / "nodes.conf"),
            "--requirepass", password, "--masterauth", password])
        wait_until(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, 10, "redis tls", proc)
        ports.append(port)
    cli = ["redis-cli", "--tls", "--cacert", str(certs / "ca.pem"), "--cert", str(certs / "client.pem"),
           "--key", str(certs / "client.key"), "--no-auth-warning", "-a", password]
    subprocess.run([*cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "0",
                    "--cluster-yes"], check=True, capture_output=True, timeout=60)
    wait_until(lambda: all("cluster_state:ok" in subprocess.run([*cli, "-p", str(p), "cluster", "info"],
                                                                capture_output=True, text=True).stdout
                           for p in ports), 30, "redis tls cluster")
    return ports, cli


def test_the_companion_works_against_a_tls_redis_cluster_with_auth(stack, tmp_path):
    certs = make_certificates(tmp_path)
    password = "cluster-password-0123"
    ports, cli = tls_cluster(stack, certs, password)
    tls = ["--redis-ca-file", str(certs / "ca.pem"), "--redis-client-cert", str(certs / "client.pem"),
           "--redis-client-key", str(certs / "client.key")]
    seeds = ",".join(f"127.0.0.1:{p}" for p in ports)
    _, companion = stack.companion(f"rediss+cluster://{seeds}", DATA, extra=tls, env={"LLMRL_REDIS_PASSWORD": password})
    # Tenants whose keys fall in different hash slots, so on different nodes: each is
    # charged its whole budget, then refused, then given back exactly what its
    # reservation took (a larger credit capped), all through TLS.
    tenants = [f"{i:x}" * 32 for i in range(1, 9)]
    for tenant in tenants:
        status, body = charge(companion, tenant, 10, reservation=f"res-{tenant[:4]}")
        assert status == 200 and body["allowed"], body
        assert not charge(companion, tenant, 1)[1]["allowed"], "exhausted: the state is in the cluster"
        status, body = settle(companion, tenant, 25, reservation=f"res-{tenant[:4]}")
        assert status == 200, body
        assert charge(companion, tenant, 10)[1]["allowed"], "the reservation's 10 came back"
        assert not charge(companion, tenant, 1)[1]["allowed"], "and no more than 10 (25 was capped)"
    holding = [p for p in ports
               if subprocess.run([*cli, "-p", str(p), "--scan", "--pattern", "llmrl:*"], capture_output=True,
                                 text=True, check=True).stdout.strip()]
    assert len(holding) >= 2, "the tenants' keys spread over the cluster's nodes"
    # A wrong password ends the start with a clear message, as on a single node.
    result = run_companion(f"rediss+cluster://{seeds}", env={"LLMRL_REDIS_PASSWORD": "wrong-password-0123"},
                           extra=tls)
    assert result.returncode != 0, result.stderr
    assert "Redis refused the companion's credentials" in result.stderr, result.stderr
    assert "waiting for Redis" not in result.stderr and "wrong-password-0123" not in result.stderr
    # And so does a CA that did not sign the nodes' certificates.
    (tmp_path / "other").mkdir()
    other = make_certificates((tmp_path / "other").resolve())
    result = run_companion(f"rediss+cluster://{seeds}", env={"LLMRL_REDIS_PASSWORD": password},
                           extra=["--redis-ca-file", str(other / "ca.pem"), *tls[2:]])
    assert result.returncode != 0 and "cannot connect to Redis" in result.stderr, result.stderr
    assert "waiting for Redis" not in result.stderr


def test_the_admin_credential_and_the_redis_password_rotate_as_the_readme_says(stack):
    """docs/credentials.md#rotating-credentials, each step run: the admin list holds the old and the
    new credential while operators switch; an ACL user's second password (`ACL SETUSER
    <user> >new`) lets companions started with either work, and once the old one is
    removed (`<old`) a companion with it is refused at start with a clear message while
    those on the new one go on. Every credential is read at start: each step is a restart."""
    import redis as redis_client

    acl = redis_with(stack, "--user", "default", "off",
                     "--user", "llmrl", "on", ">old-redis-password-0123", "~llmrl:*", "+@all")
    url = f"redis://llmrl@127.0.0.1:{acl}"
    new_admin = "rotated-admin-credential-0123"
    usage = {"domain": "llm", "tenant": "f" * 32, "limits": [limit(capacity=10)]}
    # Step 1: the new admin credential added beside the old; both are served.
    _, before = stack.companion(url, DATA, admin_token=f"{new_admin},{ADMIN}", name="companion-old-password",
                                env={"LLMRL_REDIS_PASSWORD": "old-redis-password-0123"})
    assert post(before, "/v1/usage", usage, ADMIN)[0] == 200
    assert post(before, "/v1/usage", usage, new_admin)[0] == 200
    assert charge(before, "f" * 32, 1)[1]["allowed"]
    # The Redis password: a second one added; a companion started with the new one works
    # beside the one still on the old.
    operator = redis_client.Redis(port=acl, username="llmrl", password="old-redis-password-0123")
    operator.execute_command("ACL", "SETUSER", "llmrl", ">new-redis-password-0123")
    _, after = stack.companion(url, DATA, admin_token=new_admin, name="companion-new-password",
                               env={"LLMRL_REDIS_PASSWORD": "new-redis-password-0123"})
    assert charge(after, "f" * 32, 1)[1]["allowed"]
    assert charge(before, "f" * 32, 1)[1]["allowed"]
    # Step 3: the old admin credential is gone from the new companion's list; the old
    # Redis password removed: a companion started with it is refused, clearly.
    assert post(after, "/v1/usage", usage, ADMIN)[0] == 401
    assert post(after, "/v1/usage", usage, new_admin)[1]["limits"][0]["used"] == 3
    operator.execute_command("ACL", "SETUSER", "llmrl", "<old-redis-password-0123")
    refused = run_companion(url, env={"LLMRL_REDIS_PASSWORD": "old-redis-password-0123"})
    assert refused.returncode != 0 and "Redis refused the companion's credentials" in refused.stderr, refused.stderr
    assert charge(after, "f" * 32, 1)[1]["allowed"]


def test_the_redis_ca_rotates_through_a_bundle_of_both(stack, tmp_path):
    """docs/credentials.md#rotating-credentials: "put the new CA in the bundle beside the old
    (`--redis-ca-file`), roll the companions, then switch the server's certificate". A
    companion with the bundle trusts the server before and after the switch; one with the
    old CA alone is refused by the new certificate, saying why."""
    old = make_certificates((tmp_path / "old").resolve()) if (tmp_path / "old").mkdir() is None else None
    new = make_certificates((tmp_path / "new").resolve()) if (tmp_path / "new").mkdir() is None else None
    bundle = tmp_path / "bundle.pem"
    bundle.write_text((old / "ca.pem").read_text() + (new / "ca.pem").read_text())
    port = tls_redis(stack, old, "--tls-auth-clients", "no")
    _, companion = stack.companion(f"rediss://127.0.0.1:{port}", DATA, extra=["--redis-ca-file", str(bundle)],
                                   name="companion-bundle")
    assert charge(companion, "a" * 32, 1)[1]["allowed"]
    # The server switches to the certificate the new CA signed (a restart on the same port).
    for proc in [p for p in stack.processes if p.name == f"redis-tls-{port}"]:
        proc.stop()
        stack.processes.remove(proc)
    proc = stack.spawn(f"redis-tls-new-{port}", [
        "redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--port", "0",
        "--tls-port", str(port), "--tls-cert-file", str(new / "server.pem"), "--tls-key-file", str(new / "server.key"),
        "--tls-ca-cert-file", str(new / "ca.pem"), "--tls-auth-clients", "no"])
    wait_until(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, 10, "redis tls", proc)
    # The companion reconnects to the new certificate without a restart of its own.
    wait_until(lambda: charge(companion, "a" * 32, 1)[1].get("allowed"), 20, "a charge after the switch")
    old_only = run_companion(f"rediss://127.0.0.1:{port}", extra=["--redis-ca-file", str(old / "ca.pem")])
    assert old_only.returncode != 0 and "cannot connect to Redis" in old_only.stderr, old_only.stderr
    bundled = stack.companion(f"rediss://127.0.0.1:{port}", DATA, extra=["--redis-ca-file", str(bundle)],
                              name="companion-bundle-restarted")[1]
    assert charge(bundled, "a" * 32, 1)[1]["allowed"]
