"""Plans at runtime (issue 44), end to end through two Envoys sharing one companion and
Redis: a plan written into Redis (crates/protocol/src/plans.rs has the format) holds from
either proxy's next charge, with no config push.

The plans are written straight into Redis with `set_plan` (HSET, and PEXPIREAT for a plan
that reverts at its expiry), in the documented format, not through the admin API: what is
tested here is the data plane (lua/limits.lua reading the plan in the call that charges,
the companion and the filter). The last test goes through the operator's CLI and the admin
API instead, for end users of a shared key."""

import concurrent.futures
import json
import os
import subprocess
import random
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis

from helpers import pool_owner, redis_now_ms
from stack import chat, redis_key, send, tenant_of, wait_until

PREFIX = "llmrl:"  # the companion's --key-prefix default
DOMAIN = "llm"  # the filter's `domain` default


def plan_key(owner: str, domain: str = DOMAIN) -> str:
    return redis_key(PREFIX, domain, owner, "plan", "limits")


def set_plan(client, owner: str, *, domain: str = DOMAIN, caps: dict | None = None, **fields) -> str:
    """Replaces `owner`'s plan, atomically (one MULTI: no call sees it half written):
    `caps` by limit name (`cap:<name>`), and the other fields as they are (`suspended`,
    `expires_ms`, `at_expiry`, `note`). A plan that reverts at its expiry also expires
    then, as the admin API writes it. Returns the key."""
    key = plan_key(owner, domain)
    mapping = {f"cap:{name}": str(capacity) for name, capacity in (caps or {}).items()}
    mapping.update({name: str(value) for name, value in fields.items()})
    with client.pipeline(transaction=True) as tx:
        tx.delete(key)
        if mapping:
            tx.hset(key, mapping=mapping)
            if "expires_ms" in fields and fields.get("at_expiry", "revert") == "revert":
                tx.pexpireat(key, int(fields["expires_ms"]))
        tx.execute()
    return key


def delete_plan(client, owner: str, domain: str = DOMAIN) -> None:
    client.delete(plan_key(owner, domain))




def error_of(reply) -> dict:
    return json.loads(reply.body)["error"]


def assert_suspended(reply, reason: str, who: str = "This API key") -> None:
    """A suspension as OpenAI's API would answer it: 403, not retryable, no Retry-After,
    OpenAI's error shape with the operator's reason."""
    assert reply.status == 403, (reply.status, reply.body)
    assert reply.headers.get("x-should-retry") == "false", reply.headers
    assert "retry-after" not in reply.headers, reply.headers
    error = error_of(reply)
    assert (error["type"], error["code"]) == ("permission_error", "account_suspended"), error
    assert f"{who} is suspended: {reason}" in error["message"], error


@pytest.fixture
def proxies(backend):
    """Two Envoys with the same filter config on one companion and Redis:
    `proxies.start(limits, **options)` returns both listener ports."""
    class Proxies:
        redis = redis.Redis(port=backend.redis_port)

        def start(self, limits, **options):
            return [backend.envoy_for(limits, name=f"envoy-{name}", **options)[0] for name in ("a", "b")]

    return Proxies()


# a. Raising a limit -----------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["sliding_window", "token_bucket"])
def test_raising_a_keys_rpm_lets_either_proxys_next_request_through_at_the_new_capacity(proxies, algorithm):
    a, b = proxies.start([{"name": "rpm", "requests": 2, "window": "1h", "algorithm": algorithm}])
    key = "sk-plan-raise"
    first, second = send(a, key), send(b, key)
    assert (first.status, second.status) == (200, 200), (first.body, second.body)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    refused = send(a, key)
    assert refused.status == 429 and refused.headers["x-ratelimit-limit-requests"] == "2", refused
    set_plan(proxies.redis, tenant_of(key), caps={"rpm": 5}, note="enterprise trial")
    # Either proxy's next request: the plan's capacity, 3 more than the 2 already spent.
    for port in (b, a, b):
        reply = send(port, key)
        assert reply.status == 200, (port, reply.status, reply.body)
        assert reply.headers["x-ratelimit-limit-requests"] == "5", reply.headers
    over = send(a, key)
    assert over.status == 429 and over.headers["x-ratelimit-limit-requests"] == "5", over
    # Another key keeps the config's capacity.
    other = send(b, "sk-plan-other")
    assert other.status == 200 and other.headers["x-ratelimit-limit-requests"] == "2"


def test_a_plan_set_before_a_keys_first_request_holds_on_both_proxies(proxies):
    """The token bucket (the default algorithm) with a plan in place before the bucket is
    charged: a raised capacity admits up to it, a lowered one refuses at it."""
    a, b = proxies.start([{"name": "rpm", "requests": 2, "window": "1h"}])
    set_plan(proxies.redis, tenant_of("sk-plan-up"), caps={"rpm": 4})
    set_plan(proxies.redis, tenant_of("sk-plan-down"), caps={"rpm": 1})
    up = [send(port, "sk-plan-up") for port in (a, b, a, b, a)]
    assert [r.status for r in up] == [200, 200, 200, 200, 429], [r.body for r in up]
    assert {r.headers["x-ratelimit-limit-requests"] for r in up} == {"4"}
    assert [r.headers["x-ratelimit-remaining-requests"] for r in up[:4]] == ["3", "2", "1", "0"]
    down = [send(port, "sk-plan-down") for port in (b, a)]
    assert [r.status for r in down] == [200, 429]
    assert {r.headers["x-ratelimit-limit-requests"] for r in down} == {"1"}


# b. Suspensions ---------------------------------------------------------------------------
def test_a_suspension_refuses_the_next_request_on_either_proxy_and_lifting_it_lets_requests_through(proxies):
    a, b = proxies.start([{"name": "rpm", "requests": 100, "window": "1m"}])
    key, reason = "sk-plan-suspend", "key leaked, rotate it"
    assert (send(a, key).status, send(b, key).status) == (200, 200)
    set_plan(proxies.redis, tenant_of(key), suspended=reason)
    for port in (a, b, a):
        assert_suspended(send(port, key), reason)
    assert send(b, "sk-plan-unsuspended").status == 200, "another key is not touched"
    # A suspension writes nothing: the key's bucket holds the two requests admitted.
    level = float(proxies.redis.hget(redis_key(PREFIX, DOMAIN, tenant_of(key), "tb", "rpm"), "tokens"))
    assert level == pytest.approx(98, abs=0.5)
    delete_plan(proxies.redis, tenant_of(key))
    assert [send(port, key).status for port in (b, a)] == [200, 200]


LEASE_TTL_S = 2.0


def test_a_suspension_ends_leasing_proxies_admissions_within_one_lease_ttl(proxies):
    """In lease mode each proxy admits from its grant without asking: the suspension
    reaches it at its next grant or renewal, and its lease ends then, so both proxies
    refuse within one `lease.ttl` of the change, and every request after that too."""
    lease = {"enabled": True, "ttl": f"{LEASE_TTL_S:g}s", "initial_fraction": 0.2, "max_fraction": 0.5}
    a, b = proxies.start([{"name": "rpm", "requests": 1000, "window": "1m"}], lease=lease)
    key, reason = "sk-plan-lease", "invoice unpaid"
    for port in (a, b, a, b):
        assert send(port, key).status == 200
    started = time.monotonic()
    set_plan(proxies.redis, tenant_of(key), suspended=reason)
    refused_after = {}
    deadline = started + LEASE_TTL_S + 3  # the bound, and room for a loaded machine to show a miss
    while len(refused_after) < 2 and time.monotonic() < deadline:
        for port in (a, b):
            if port in refused_after:
                continue
            reply = send(port, key)
            if reply.status == 403:
                assert_suspended(reply, reason)
                # When the request was sent: the proxy knew of the suspension by then.
                refused_after[port] = reply.started - started
            else:
                assert reply.status == 200, reply
        time.sleep(0.02)
    print(f"\nsuspension seen after: {', '.join(f'{s:.2f} s' for s in refused_after.values())} (lease.ttl {LEASE_TTL_S} s)")
    assert len(refused_after) == 2, f"a proxy still admitted {LEASE_TTL_S + 3} s after the suspension: {refused_after}"
    # The bound: one lease.ttl, and a tick (50 ms) and the request's own round trip.
    assert max(refused_after.values()) <= LEASE_TTL_S + 0.5, refused_after
    # Once refused, refused: the proxy's lease of the key is gone.
    for port in (a, b, a, b):
        assert_suspended(send(port, key), reason)
    assert send(a, "sk-plan-lease-other").status == 200, "another key is not touched"
    lifted = time.monotonic()
    delete_plan(proxies.redis, tenant_of(key))
    for port in (a, b):
        wait_until(lambda: send(port, key).status == 200, LEASE_TTL_S + 3, f"proxy {port} admitting the lifted key")
    print(f"lifted: both proxies admit after {time.monotonic() - lifted:.2f} s")


# c. Expiry by Redis's clock ---------------------------------------------------------------
def test_a_plan_expires_by_redis_clock_back_to_the_config_or_into_a_suspension(proxies):
    a, b = proxies.start([{"name": "rpm", "requests": 1, "window": "1h"}])
    reverting, suspending = tenant_of("sk-plan-revert"), tenant_of("sk-plan-expire")
    expires_ms = int(redis_now_ms(proxies.redis)) + 2500
    set_plan(proxies.redis, reverting, caps={"rpm": 3}, expires_ms=expires_ms, at_expiry="revert")
    set_plan(proxies.redis, suspending, caps={"rpm": 3}, expires_ms=expires_ms, at_expiry="suspend")
    before = [send(a, "sk-plan-revert"), send(b, "sk-plan-expire")]
    if redis_now_ms(proxies.redis) >= expires_ms:
        pytest.skip("the machine took 2.5 s for two requests: the plans expired before they were checked")
    assert [r.status for r in before] == [200, 200], [r.body for r in before]
    assert [r.headers["x-ratelimit-limit-requests"] for r in before] == ["3", "3"]
    assert proxies.redis.pexpiretime(plan_key(reverting)) == expires_ms, "a reverting plan's key ends with it"
    assert proxies.redis.pexpiretime(plan_key(suspending)) == -1, "a suspending plan's key stays"
    wait_until(lambda: redis_now_ms(proxies.redis) > expires_ms + 10, 10, "Redis's clock past the expiry")
    # Back to the config: capacity 1, and what was spent under the plan stays spent (1 of
    # 1), as a sliding window would count it: refused, showing the config's capacity.
    refused = send(b, "sk-plan-revert")
    assert refused.status == 429 and refused.headers["x-ratelimit-limit-requests"] == "1", refused
    assert not proxies.redis.exists(plan_key(reverting)), "Redis expired the reverted plan's key"
    # The other owner: suspended, saying so, on either proxy.
    for port in (a, b):
        assert_suspended(send(port, "sk-plan-expire"), "the plan expired")


# d. A team's plan -------------------------------------------------------------------------
def test_a_teams_plan_holds_for_the_team_and_not_for_another(proxies):
    """A plan of a pool's claimant (the `x-team-id` header's value) changes the team's
    limit and suspends the team, while another team of the same key is unaffected.
    (End users of a shared key as owners, `per` naming the end user, are being added
    separately: not covered here.)"""
    a, b = proxies.start([
        {"name": "rpm", "requests": 100, "window": "1h"},
        # A token bucket (the default): a capacity raised after it is spent frees room at once.
        {"name": "team-rpm", "requests": 3, "window": "1h", "per": {"header": "x-team-id"}},
    ])
    key = "sk-plan-team"

    def as_team(port, team):
        return send(port, key, headers={"x-team-id": team})

    red, blue = pool_owner("x-team-id", "red"), pool_owner("x-team-id", "blue")
    set_plan(proxies.redis, red, caps={"team-rpm": 1})
    red_replies = [as_team(port, "red") for port in (a, b)]
    assert [r.status for r in red_replies] == [200, 429], [r.body for r in red_replies]
    assert '"team-rpm";q=1;' in red_replies[1].headers["ratelimit-policy"], red_replies[1].headers
    blue_replies = [as_team(port, "blue") for port in (b, a, b, a)]
    assert [r.status for r in blue_replies] == [200, 200, 200, 429], [r.body for r in blue_replies]
    assert '"team-rpm";q=3;' in blue_replies[0].headers["ratelimit-policy"], blue_replies[0].headers
    # Raised, then suspended: the team's members are refused as the team, blue is not.
    set_plan(proxies.redis, blue, caps={"team-rpm": 10})
    assert [as_team(port, "blue").status for port in (a, b)] == [200, 200]
    set_plan(proxies.redis, red, suspended="team budget frozen")
    for port in (a, b):
        reply = as_team(port, "red")
        assert_suspended(reply, "team budget frozen", who="The x-team-id this request counts under")
        assert "red" not in error_of(reply)["message"], "the header's value is not echoed"
    assert as_team(b, "blue").status == 200
    assert send(a, key).status == 200, "without a team header only the key's limit applies"
    assert proxies.redis.hget(plan_key(red), "suspended") == b"team budget frozen"
    assert proxies.redis.hget(plan_key(tenant_of(key)), "suspended") is None


# e. No charge lost while a plan changes under load ----------------------------------------
CLIENTS = 8
MIN_REQUESTS_PER_CLIENT = 10
PLAN_CHANGES = 8  # raised (0.6 s), lowered (0.2 s), raised, ...
MONTH = "month"  # calendar budgets: Redis holds what was spent exactly, no refill


def test_a_plan_changed_under_load_loses_no_charge(proxies):
    """8 clients through both proxies, token-charged requests (reserved at the estimate,
    settled at the usage the upstream reports), while the key's plan changes the budgets'
    capacities several times, down to just above what is spent (some requests refused)
    and up again. Then what Redis holds as spent is exactly what the admitted replies'
    usage says: a settlement lost would leave a reservation's estimate in it, a settlement
    applied twice would take a reply's tokens out twice."""
    now = datetime.fromtimestamp(redis_now_ms(proxies.redis) / 1000, timezone.utc)
    following = (now.replace(day=1, hour=0, minute=0, second=0, microsecond=0) + timedelta(days=32)).replace(day=1)
    if following - now < timedelta(minutes=5):
        pytest.skip("the month (UTC) ends within 5 minutes: the budgets would start again under the test")
    a, b = proxies.start([
        {"name": "monthly-requests", "requests": 1_000_000, "window": MONTH},
        {"name": "monthly-tokens", "tokens": 10_000_000, "window": MONTH},
    ])
    key = "sk-plan-load"
    tenant = tenant_of(key)
    spent_key = {name: redis_key(PREFIX, DOMAIN, tenant, "cal", name) for name in ("monthly-requests", "monthly-tokens")}

    def spent(name) -> int:
        raw = proxies.redis.hget(spent_key[name], "spent")
        return 0 if raw is None else round(float(raw))

    replies, lock, done = [], threading.Lock(), threading.Event()

    def client(index: int):
        rng = random.Random(index)
        i = 0
        while not done.is_set() or i < MIN_REQUESTS_PER_CLIENT:
            completion = rng.randint(1, 120)
            body = chat(f"client {index} request {i}: " + "word " * rng.randint(1, 60), max_tokens=150)
            reply = send((a, b)[(index + i) % 2], key, body, headers={"x-mock-completion-tokens": str(completion)})
            with lock:
                replies.append(reply)
            if reply.status == 429:
                time.sleep(0.02)
            i += 1

    changes = []

    def changer():
        """Raises and lowers the budgets' capacities while the clients run: lowered to
        just above what is spent now, so the next requests are refused, then raised."""
        rng = random.Random(99)
        try:
            for change in range(PLAN_CHANGES):
                if change % 2 == 1:
                    caps = {"monthly-tokens": spent("monthly-tokens") + rng.randint(50, 400),
                            "monthly-requests": spent("monthly-requests") + rng.randint(2, 8)}
                else:
                    caps = {"monthly-tokens": rng.choice([2_000_000, 20_000_000]), "monthly-requests": 5_000}
                set_plan(proxies.redis, tenant, caps=caps, note=f"change {change}")
                changes.append(caps)
                time.sleep(0.2 if change % 2 == 1 else 0.6)
        finally:
            done.set()

    changing = threading.Thread(target=changer)
    changing.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(client, range(CLIENTS)))
    finally:
        done.set()
        changing.join()
    statuses = [r.status for r in replies]
    assert set(statuses) <= {200, 429}, {s: statuses.count(s) for s in set(statuses)}
    admitted = [r for r in replies if r.status == 200]
    refused = len(replies) - len(admitted)
    used = sum(json.loads(r.body)["usage"]["total_tokens"] for r in admitted)
    reserved = sum(int(r.headers["x-llm-ratelimit-reserved-tokens"]) for r in admitted)
    inexact = sum(int(r.headers["x-llm-ratelimit-reserved-tokens"]) != json.loads(r.body)["usage"]["total_tokens"]
                  for r in admitted)
    print(f"\n{len(replies)} requests, {len(admitted)} admitted, {refused} refused; {len(changes)} plan changes; "
          f"reserved {reserved} tokens, used {used} ({inexact} reservations not the usage)")
    assert len(changes) == PLAN_CHANGES
    assert refused, "a lowered capacity refused some requests"
    assert admitted, "some requests were admitted"
    # The test can see a lost or doubled settlement only if settlements move the sum.
    # (each admitted reply whose reservation differs from its usage: its settlement lost or
    # applied twice moves the sum by that difference)
    assert inexact >= len(admitted) // 2, f"only {inexact} reservations differ from the usage"
    # Settlements are asynchronous: wait for them all.
    wait_until(lambda: spent("monthly-tokens") == used, 20,
               f"spent tokens at {used} (now {spent('monthly-tokens')}, reserved {reserved})")
    assert spent("monthly-requests") == len(admitted)
    time.sleep(1)  # nothing more arrives later (no charge applied twice, late)
    assert (spent("monthly-tokens"), spent("monthly-requests")) == (used, len(admitted))


# f. The operator's workflow: the CLI, end users, usage and history ------------------------
CLI = Path(__file__).resolve().parents[2] / "target/release/llm-ratelimit"


def test_an_operator_sets_end_users_plans_with_the_cli_and_both_proxies_hold_them(proxies, backend, tmp_path):
    """Through the CLI and the admin API: one user of a shared key raised, another
    suspended, a third unaffected, on either proxy's next request; `usage` shows the plan's
    capacity; `plan history` shows each change with its before and after."""
    limits = [{"name": "user-rpm", "requests": 1, "window": "1h", "per": "end_user"}]
    a, b = proxies.start(limits)
    config_file = tmp_path / "filter.json"
    config_file.write_text(json.dumps(backend.filter_config(limits)))
    env = {**os.environ, "LLMRL_ADMIN_TOKEN": backend.admin_token,
           "LLMRL_COMPANION_URL": f"http://127.0.0.1:{backend.companion_port}"}

    def cli(*args: str) -> str:
        done = subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    key = "sk-plan-shared-app"
    as_user = lambda user: chat(user=user)  # noqa: E731
    assert [send(p, key, as_user("alice")).status for p in (a, b)] == [200, 429]
    cli("plan", "set", "--config", str(config_file), "--key", key, "--user", "alice", "user-rpm=3")
    cli("plan", "set", "--config", str(config_file), "--key", key, "--user", "mallory", "--suspend", "abuse")
    # Alice: 1 used of 3 now, on either proxy.
    replies = [send(p, key, as_user("alice")) for p in (b, a, b)]
    assert [r.status for r in replies] == [200, 200, 429], [r.body for r in replies]
    assert replies[0].headers["x-ratelimit-limit-requests"] == "3"
    assert_suspended(send(a, key, as_user("mallory")), "abuse", who="This end user")
    assert [send(p, key, as_user("bob")).status for p in (a, b)] == [200, 429], "bob keeps the config's 1"
    missing = send(a, key, chat())
    assert missing.status == 400 and error_of(missing)["code"] == "missing_end_user", missing.body
    # An invented user costs no plan and no memory that lasts: it is counted like bob.
    assert send(b, key, as_user("someone-new")).status == 200
    usage = json.loads(cli("usage", "--config", str(config_file), "--key", key, "--user", "alice", "--json"))
    assert [(l["name"], l["limit"], l["remaining"]) for l in usage["limits"]] == [("user-rpm", 3, 0)], usage
    history = [json.loads(line) for line in cli("plan", "history", "--config", str(config_file), "--limit", "10").splitlines()]
    assert len(history) == 2 and {h["op"] for h in history} == {"set"}, history
    assert all(h["before"] in (None, {}) for h in history), history
    afters = sorted(json.dumps(h["after"], sort_keys=True) for h in history)
    assert any('"cap:user-rpm": "3"' in a or '"user-rpm": 3' in a for a in afters), afters
    assert any("abuse" in a for a in afters), afters
