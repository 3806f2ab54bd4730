"""When Redis or the companion fails or hangs: no 5xx caused by the filter, admissions
within the local bound, no timeout added to every request while the breaker is open,
recovery by itself, and what was admitted locally reconciled with Redis."""

import itertools
import json
import signal
import statistics
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
import redis

from stack import bucket_key, send, wait_until

LIMIT = 50
pytestmark = pytest.mark.backend(redis_timeout="40ms")


@pytest.fixture
def env(backend, request):
    # Tests may ask for the limit's algorithm (indirect parametrization); token bucket else.
    algorithm = getattr(request, "param", "token_bucket")
    config = backend.filter_config(
        [{"name": "rph", "requests": LIMIT, "window": "1h", "algorithm": algorithm}],
        companion_timeout="250ms",
        failure_mode="local",
        fallback={"instances": 1, "breaker_failures": 3, "breaker_cooldown": "300ms"},
    )
    port, _ = backend.envoy(config)
    return SimpleNamespace(stack=backend.stack, backend=backend, port=port, redis_port=backend.redis_port,
                           redis_proc=backend.redis_proc, companion=backend.companion_proc,
                           companion_port=backend.companion_port, algorithm=algorithm)


def level(env, key):
    """What the tenant has left in Redis (None: nothing recorded yet)."""
    store = redis.Redis(port=env.redis_port)
    if env.algorithm == "sliding_window":
        # The window's running sum is stored as the member "~sum", scored -(sum) - 1.
        score = store.zscore(bucket_key(key, "rph").replace(":tb:", ":sw:"), "~sum")
        return None if score is None else LIMIT - (-score - 1)
    raw = store.hget(bucket_key(key, "rph"), "tokens")
    return None if raw is None else float(raw)


def outage(env, key, requests=80):
    results = [send(env.port, key) for _ in range(requests)]
    statuses = [r[0] for r in results]
    assert not [s for s in statuses if s >= 500], f"the filter caused 5xx: {statuses}"
    assert all(r[1].get("x-llm-ratelimit-degraded") == "local" for r in results[3:]), "decided locally"
    # The breaker opened after 3 failures: the rest did not wait for a timeout each.
    assert statuses.count(200) <= LIMIT
    assert statistics.median(r.elapsed for r in results[5:]) < 0.1
    return statuses.count(200)


# docs/failures.md's promise: decisions are central again within this long after Redis or the
# companion answers again (`fallback.breaker_cooldown` 300 ms here, then one probe).
RECOVERY_BOUND = 1.0


def companion_answers(env) -> bool:
    """Whether a charge sent straight to the companion (for a tenant of its own) is
    answered: Redis and the companion serve again, as the filter's probe will find them."""
    body = json.dumps({"domain": "llm", "tenant": "recovery-check",
                       "limits": [{"name": "check", "capacity": 1_000_000, "window_ms": 60_000, "cost": 1}]})
    request = urllib.request.Request(f"http://127.0.0.1:{env.companion_port}/v1/token_bucket", data=body.encode(),
                                     headers={"content-type": "application/json", "x-llmrl-token": env.backend.token})
    try:
        with urllib.request.urlopen(request, timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


def recovery(env, key):
    """Sends a request every 50 ms, as clients keep doing, until a decision is central
    again, asking the companion straight before each: (seconds from the companion
    answering again to the filter's first central decision, requests admitted meanwhile).
    The traffic keeps the breaker probing and failing until then, so its cooldown runs
    from a failed probe, not from an idle wait. How long the companion takes to reach a
    restarted Redis (its client's reconnection) is printed apart: on a loaded machine it
    alone passed a second once, and it is not the filter's recovery."""
    returned = time.monotonic()
    deadline = returned + 10
    answered_at, admitted = None, []
    while True:
        if answered_at is None and companion_answers(env):
            answered_at = time.monotonic()
        reply = send(env.port, key)
        admitted.append(reply.status == 200)
        if "x-llm-ratelimit-degraded" not in reply.headers:
            break
        assert time.monotonic() < deadline, "still deciding locally 10 s after the outage ended"
        time.sleep(0.05)
    # Central before the companion was seen answering: the filter found it first.
    answered_at = answered_at or reply.started
    print(f"\nthe companion answered {answered_at - returned:.2f}s after its Redis or itself was back")
    return max(0.0, reply.done - answered_at), sum(admitted)


def reconciled_exactly(env, key, expected):
    """Waits for Redis to hold `expected` left: every admission applied once, no more
    (less would be a debit applied twice), up to what the bucket refilled meanwhile
    (50 per hour: 0.014 a second)."""
    started = time.monotonic()

    def exact():
        left = level(env, key)
        return left is not None and expected - 0.01 <= left <= expected + 0.02 * (time.monotonic() - started + 5)

    try:
        wait_until(exact, 15, f"Redis at {expected} left")
    except TimeoutError:
        # Said at the end: the level when the wait gave up, not when it began.
        raise AssertionError(f"Redis holds {level(env, key)} left after 15 s, expected {expected}") from None


@pytest.mark.parametrize("env", ["token_bucket", "sliding_window"], indirect=True)
def test_redis_killed_under_load(env):
    assert [send(env.port, "sk-r")[0] for _ in range(10)] == [200] * 10
    env.redis_proc.kill()
    # Fewer than the limit, so that what Redis learns of them can be counted exactly.
    admitted = outage(env, "sk-r", requests=30)
    # The local bucket starts full: during the outage this proxy admits all 30.
    assert admitted == 30
    env.stack.redis(env.redis_port, name="redis-again")  # empty: it lost everything
    seconds, probing = recovery(env, "sk-r")
    print(f"\nRedis back: decisions central again after {seconds:.2f}s")
    assert seconds < RECOVERY_BOUND
    # What was admitted locally is reconciled: the fresh Redis learns of the 30 local
    # admissions and those while recovering, each exactly once.
    reconciled_exactly(env, "sk-r", LIMIT - 30 - probing)


@pytest.mark.parametrize("env", ["token_bucket"], indirect=True)
def test_the_local_bound_holds_through_an_outage(env):
    env.redis_proc.kill()
    # The local bucket starts full: during the outage this proxy admits at most the limit.
    assert outage(env, "sk-bound") == LIMIT


def test_companion_killed_and_restarted(env):
    assert send(env.port, "sk-c")[0] == 200
    env.companion.kill()
    admitted = outage(env, "sk-c", requests=30)
    assert admitted == 30
    env.stack.companion(f"redis://127.0.0.1:{env.redis_port}", env.backend.token, port=env.companion_port,
                        name="companion-again", redis_timeout="40ms")
    seconds, probing = recovery(env, "sk-c")
    print(f"\ncompanion back: decisions central again after {seconds:.2f}s")
    assert seconds < RECOVERY_BOUND
    # 1 before, 30 during, and the requests that probed: each in Redis exactly once.
    reconciled_exactly(env, "sk-c", LIMIT - 1 - 30 - probing)


def test_a_paused_redis_takes_the_timeout_path_not_a_hang(env):
    assert send(env.port, "sk-p")[0] == 200
    redis.Redis(port=env.redis_port).execute_command("CLIENT", "PAUSE", "3000", "ALL")
    results = [send(env.port, "sk-p") for _ in range(20)]
    assert all(r[0] == 200 for r in results)
    assert all(r[1].get("x-llm-ratelimit-degraded") == "local" for r in results)
    assert max(r.elapsed for r in results) < 1.0, "no request waited for Redis"
    # The pause ends (3 s after it began): Redis answers again, and runs the charges the
    # companion gave up on (they waited in Redis's input buffer).
    wait_until(lambda: redis.Redis(port=env.redis_port, socket_timeout=0.1).ping(), 10, "Redis unpaused")
    seconds, probing = recovery(env, "sk-p")
    print(f"\nRedis unpaused: decisions central again after {seconds:.2f}s")
    assert seconds < RECOVERY_BOUND
    # Each request counted once: a charge that ran late and the local debit standing in
    # for it do not both count.
    reconciled_exactly(env, "sk-p", LIMIT - 1 - 20 - probing)


def test_a_paused_companion_counts_each_request_once(env):
    """The companion stopped (SIGSTOP) with charges on their way: the filter times out,
    admits locally and stands in for them; resumed, the companion runs them late. Found
    on a real Nginx: both counted (here, before the fix, 2 of the 3 charges that timed out
    ran late and counted twice: 31 left for 33). Now each counts once, whichever came first."""
    assert send(env.port, "sk-z")[0] == 200
    env.companion.popen.send_signal(signal.SIGSTOP)
    try:
        results = [send(env.port, "sk-z") for _ in range(10)]
    finally:
        env.companion.popen.send_signal(signal.SIGCONT)
    assert [r.status for r in results] == [200] * 10
    assert all(r.headers.get("x-llm-ratelimit-degraded") == "local" for r in results)
    seconds, probing = recovery(env, "sk-z")
    assert seconds < RECOVERY_BOUND
    reconciled_exactly(env, "sk-z", LIMIT - 1 - 10 - probing)


def test_tokens_admitted_locally_settle_at_their_usage(backend):
    """A request admitted locally while the companion was away settles in Redis at what
    its reply says it used. Found on a real Nginx: such requests were charged their
    reservation, because their settlement's credit was a stand-alone credit with no debit
    behind it, which the companion refuses. The stand-in's record now backs it."""
    budget = 100_000
    config = backend.filter_config([{"name": "tpm30", "tokens": budget, "window": "30d"}],
                                   companion_timeout="250ms", failure_mode="local",
                                   fallback={"instances": 1, "breaker_failures": 3, "breaker_cooldown": "300ms"})
    port, _ = backend.envoy(config)

    def used(reply):
        assert reply.status == 200, reply
        return json.loads(reply.body)["usage"]["total_tokens"]

    spent = used(send(port, "sk-tok"))
    backend.companion_proc.popen.send_signal(signal.SIGSTOP)
    try:
        local = [send(port, "sk-tok") for _ in range(6)]
    finally:
        backend.companion_proc.popen.send_signal(signal.SIGCONT)
    assert all(r.headers.get("x-llm-ratelimit-degraded") == "local" for r in local)
    reserved = sum(int(r.headers["x-llm-ratelimit-reserved-tokens"]) for r in local)
    used_locally = sum(used(r) for r in local)
    assert reserved >= used_locally + 6, "the reservations are above the usage, so the two tell apart"
    spent += used_locally
    # Central again, then every settlement applied: Redis at the budget less the usage.
    deadline = time.monotonic() + 10
    while "x-llm-ratelimit-degraded" in (reply := send(port, "sk-tok")).headers:
        spent += used(reply)
        assert time.monotonic() < deadline, "still local 10 s after the companion resumed"
        time.sleep(0.05)
    spent += used(reply)
    store = redis.Redis(port=backend.redis_port)

    def left():
        raw = store.hget(bucket_key("sk-tok", "tpm30"), "tokens")
        return None if raw is None else float(raw)

    # 100,000 per 30 days refill 0.04 a second: nothing to speak of in the test's time.
    try:
        wait_until(lambda: left() is not None and abs(left() - (budget - spent)) < 1, 15, "settled")
    except TimeoutError:
        raise AssertionError(f"Redis holds {left()} left, expected {budget - spent} (reserved {reserved})") from None



def test_new_tenants_arriving_while_redis_is_down_are_all_decided_locally(backend):
    """Issue 43 item 1: a gateway sees new users arrive all the time. With a day's limit no
    local entry was ever idle for a whole window, so once a newcomer found all its places
    in the proxy's table taken it was answered 503 (the demo: 18 to 281 of ~20,000
    requests, 1.9 to 3.6 s into a 4 s outage). A small table here fills in a fraction of a
    second. Four clients send a new API key on every request, Redis is stopped mid-load
    and started again: no 5xx at all, every request during the outage decided locally."""
    config = backend.filter_config(
        [{"name": "rpm", "requests": 20, "window": "1m"}, {"name": "rpd", "requests": 1000, "window": "1d"}],
        companion_timeout="250ms", failure_mode="local", memory={"tenant_slots": 64},
        fallback={"instances": 1, "breaker_failures": 3, "breaker_cooldown": "300ms"})
    port, _ = backend.envoy(config)
    phase = {"name": "before"}
    replies: list[tuple[str, int, str | None]] = []
    stop = threading.Event()

    def client(n: int):
        for i in itertools.count():
            if stop.is_set():
                return
            name = phase["name"]
            reply = send(port, f"sk-new-{n}-{i}", timeout=10)
            replies.append((name, reply.status, reply.headers.get("x-llm-ratelimit-degraded")))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1)
        phase["name"] = "outage"
        backend.redis_proc.kill()
        time.sleep(3)
        phase["name"] = "after"
        backend.stack.redis(backend.redis_port, name="redis-again")
        time.sleep(2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(15)
    outage = [r for r in replies if r[0] == "outage"]
    failed = [r for r in replies if r[1] >= 500]
    print(f"\n{len(replies)} requests, {len(outage)} during the outage, "
          f"{sum(1 for r in outage if r[2] == 'local')} of them decided locally, {len(failed)} 5xx")
    assert len(outage) > 200, "enough new tenants to fill the 64-slot table several times"
    assert not failed, f"{len(failed)} answered 5xx: {failed[:5]}"
    assert all(r[1] == 200 for r in replies), "a new tenant's first request is within every limit"
    # Past the first few (before the breaker opened), each was decided locally.
    assert sum(1 for r in outage[20:] if r[2] != "local") == 0
