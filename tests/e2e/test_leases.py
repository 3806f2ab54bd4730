"""Leased budgets end to end: each Envoy process admits from a lease in shared data with
no callout, workers never double-spend it, and what is unused goes back to Redis."""

import collections
import concurrent.futures
import http.client
import http.server
import json
import threading
import time

import pytest
import redis

from stack import bucket_key, chat, filter_metric, free_port, send, wait_until

BODY = chat(max_tokens=20)


@pytest.fixture
def env(backend):
    class Env:
        store = redis.Redis(port=backend.redis_port)

        def start(self, limits, lease=None, name="envoy", tokens=None):
            return backend.envoy_for(limits, name=name, lease={"enabled": True, **(lease or {})}, tokens=tokens or None)

        def script_calls(self):
            stats = self.store.info("commandstats")
            return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))

        def level(self, key, limit):
            raw = self.store.hget(bucket_key(key, limit), "tokens")
            return None if raw is None else float(raw)

    return Env()


def metric(admin, name, **labels):
    return filter_metric(admin, f"llm_ratelimit_{name}", **labels) or 0


def counted(admin, allowed):
    """Waits until the filter's counters show `allowed` admissions: they reach Envoy on
    each VM's next 50 ms tick, so every other counter of the same requests is then in."""
    wait_until(lambda: metric(admin, "requests_allowed_total") == allowed, 10,
               f"requests_allowed_total at {allowed} (now {metric(admin, 'requests_allowed_total')})")


def test_workers_never_double_spend_a_lease(env):
    """Two worker VMs, 16 parallel clients, one tenant: exactly the limit is admitted, the
    admissions past the first came from leases, and once Redis has refused, the refusal
    is remembered: the requests over the limit cost no script call each. (How many round
    trips a request costs is a rate: `make bench` measures it, "Redis trips/req".)"""
    limit = 300
    port, admin = env.start([{"name": "rph", "requests": limit, "window": "1h"}], lease={"initial_fraction": 0.05})
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda _: send(port, "sk-lease", BODY)[0], range(limit + 50)))
    assert statuses.count(200) == limit and statuses.count(429) == 50, collections.Counter(statuses)
    counted(admin, limit)
    leased = metric(admin, "lease_admissions_total")
    print(f"\n{limit} requests: {leased} admitted from the lease")
    # Each request is admitted from a lease or by a callout of its own (the first, and
    # any that found the lease empty): at least one admission came from a lease, and no
    # more than were admitted.
    assert 0 < leased < limit
    before = env.script_calls()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        over = list(pool.map(lambda _: send(port, "sk-lease", BODY)[0], range(100)))
    assert over == [429] * 100
    # Redis's refusal of a grant is remembered in shared data until its retry time (the
    # hour's end): these 100 requests ask Redis at most once per client thread (those in
    # flight as a refusal lands), not once each.
    assert env.script_calls() - before <= 16
    assert metric(admin, "lease_bound", limit="rph") == 30  # max_fraction 0.1 of 300


def test_two_proxies_in_lease_mode_hold_one_global_limit(env):
    limit = 200
    limits = [{"name": "rph", "requests": limit, "window": "1h"}]
    ports = [env.start(limits, name="envoy-a")[0], env.start(limits, name="envoy-b")[0]]

    def one(i):
        return send(ports[i % 2], "sk-two", BODY)[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(2 * limit)))
    admitted = statuses.count(200)
    # Leases are charged in Redis when granted: together the proxies can never admit more
    # than the limit. Budget left in one proxy's lease at the end is the most they can
    # fall short by: max_fraction (10%) of the limit per proxy.
    print(f"\ntwo proxies admitted {admitted} of {limit}")
    assert admitted <= limit
    assert admitted >= limit - 2 * 0.1 * limit


def test_an_expired_lease_goes_back_to_redis(env):
    port, _ = env.start([{"name": "rpd", "requests": 1000, "window": "366d"}], lease={"ttl": "1s", "initial_fraction": 0.05})
    # A tenant seen once is charged directly; its second request leases.
    assert send(port, "sk-return", BODY)[0] == 200
    assert env.level("sk-return", "rpd") == pytest.approx(999, abs=0.5)
    assert send(port, "sk-return", BODY)[0] == 200
    # The grant (50) was charged in Redis; the second request used one of it.
    assert env.level("sk-return", "rpd") == pytest.approx(949, abs=0.5)
    wait_until(lambda: abs((env.level("sk-return", "rpd") or 0) - 998) < 0.5, 10, "the unused 49 returned")


def test_token_settlements_go_into_the_lease_and_then_to_redis(env):
    big = 1_000_000
    port, admin = env.start([{"name": "tpm", "tokens": big, "window": "366d"}], lease={"ttl": "1s"})
    used, started = 0, time.monotonic()
    # A tenant's first request is charged directly; its second asks for a lease, which
    # admits it; its third is admitted from that lease, with no callout.
    for admitted, (completion, leased) in enumerate(((15, 0), (9, 0), (7, 1)), start=1):
        status, headers, _ = send(port, "sk-tok", BODY, headers={"x-mock-completion-tokens": str(completion)})
        assert status == 200
        used += int(headers["x-mock-prompt-tokens"]) + int(headers["x-mock-completion-tokens"])
        counted(admin, admitted)
        assert metric(admin, "lease_admissions_total") == leased
    assert metric(admin, "lease_callouts_total") >= 1
    # After expiry the lease, corrected by both settlements, returns all but what was
    # used: Redis holds the limit less the usage the upstream reported, to the token, plus
    # what the bucket refilled since (1,000,000 tokens per 366 days: 0.03 a second).
    def exact():
        refilled = (time.monotonic() - started) * big / (366 * 86_400)
        return big - used - 0.001 <= (env.level("sk-tok", "tpm") or 0) <= big - used + refilled + 0.001

    wait_until(exact, 10, f"Redis at {big - used} (now {env.level('sk-tok', 'tpm')})")


class SlowLeaseForwarder:
    """Between Envoy and the companion: forwards every call, holds each lease renewal
    (a lease call that needs nothing, `min_cost` 0 everywhere: asked in the background,
    not for a waiting request) for `delay` seconds, and records the most renewals of one
    tenant in flight at once. With `every_grant`, a request's own lease ask counts (and
    waits) as a renewal does: the most grants of one tenant out at once."""

    def __init__(self, companion_port, delay, every_grant=False):
        lock = threading.Lock()
        self.in_flight, self.most, self.renewals = collections.Counter(), 0, 0
        self.closed = False
        forwarder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                renewal = None
                if self.path == "/v1/lease":
                    ask = json.loads(body)
                    if every_grant or all(limit.get("min_cost", 0) == 0 for limit in ask["limits"]):
                        renewal = ask["tenant"]
                if renewal:
                    with lock:
                        forwarder.renewals += 1
                        forwarder.in_flight[renewal] += 1
                        forwarder.most = max(forwarder.most, forwarder.in_flight[renewal])
                    time.sleep(delay)  # the slow companion this stands for
                try:
                    if forwarder.closed:
                        # The test is over and its companion is being stopped: a call still
                        # held here (or sent since on a kept-alive connection) is dropped,
                        # not forwarded, so that no refused connection is reported in the
                        # next test's output as if that test's companion had gone.
                        self.close_connection = True
                        return
                    conn = http.client.HTTPConnection("127.0.0.1", companion_port, timeout=10)
                    conn.request("POST", self.path, body=body, headers={
                        k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")})
                    reply = conn.getresponse()
                    payload = reply.read()
                    conn.close()
                finally:
                    if renewal:
                        with lock:
                            forwarder.in_flight[renewal] -= 1
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                        self.send_header(name, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.closed = True
        self.server.shutdown()
        self.server.server_close()


def hammer(port, key, clients, seconds):
    """`clients` connections sending `key`'s chats back to back for `seconds`: the statuses."""
    deadline = time.monotonic() + seconds

    def client(_):
        statuses = []
        while time.monotonic() < deadline:
            statuses.append(send(port, key, BODY)[0])
        return statuses

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [s for batch in pool.map(client, range(clients)) for s in batch]


# Before the fix the two workers' renewals met in most runs (2 in flight in 4 of 5), not
# in every one: a failure then was likely, a pass not proof; since, it passes every run.
def test_never_more_than_one_renewal_in_flight_per_tenant(backend):
    """However slow the companion answers (here 1.5 s, within the callout timeout of 2 s),
    a proxy has at most one background renewal of a tenant's lease out at a time: a
    renewal asked is awaited in shared data for as long as its callout may be out
    (issue 28; before, workers waited 1 s only and renewed one tenant twice at once)."""
    delay = 1.5
    forwarder = SlowLeaseForwarder(backend.companion_port, delay)
    try:
        config = backend.filter_config([{"name": "rph", "requests": 1_000_000, "window": "1h"}],
                                       lease={"enabled": True, "initial_fraction": 0.0002, "max_fraction": 0.0002})
        port, _ = backend.envoy(config, companion_port=forwarder.port)
        statuses = hammer(port, "sk-renew", clients=8, seconds=6 * delay)
        assert set(statuses) == {200}
        print(f"\n{forwarder.renewals} renewals, at most {forwarder.most} of one tenant at once")
        assert forwarder.renewals >= 1, "the leases ran low and were renewed in the background"
        assert forwarder.most == 1, f"{forwarder.most} renewals of one tenant in flight at once"
    finally:
        forwarder.close()


def test_a_dry_lease_is_asked_for_once_per_proxy_and_the_other_requests_wait(backend):
    """Issue 28: one tenant at 16 connections over two workers, a lease of 20-100 requests
    and a companion that takes 0.3 s per grant: the lease runs dry again and again, and
    each time one grant is out for the tenant in the whole proxy (a renewal, or the ask of
    the first request that found it dry); every other request that finds it dry waits for
    that grant and takes from it. Before, each such request asked Redis for its own."""
    forwarder = SlowLeaseForwarder(backend.companion_port, 0.3, every_grant=True)
    try:
        config = backend.filter_config([{"name": "rph", "requests": 100_000, "window": "1h"}],
                                       lease={"enabled": True, "initial_fraction": 0.0002, "max_fraction": 0.001})
        admin = free_port()
        port, _ = backend.envoy(config, companion_port=forwarder.port, admin_port=admin)
        statuses = hammer(port, "sk-hot", clients=16, seconds=4)
        assert set(statuses) == {200}
        print(f"\n{len(statuses)} requests, {forwarder.renewals} grants asked, "
              f"at most {forwarder.most} of the tenant out at once")
        assert forwarder.renewals >= 5, "the lease ran dry again and again"
        assert forwarder.most == 1, f"{forwarder.most} grants of one tenant out at once"
        # Nearly every request came from a lease: a grant per dry-out, not per request. The
        # others: the grants' askers, and the tenant's first requests, charged directly
        # (at most one per connection, those in flight as the tenant is first seen).
        wait_until(lambda: metric(admin, "requests_allowed_total") == len(statuses), 10, "counters in")
        assert metric(admin, "lease_admissions_total") >= len(statuses) - forwarder.renewals - 16
    finally:
        forwarder.close()
