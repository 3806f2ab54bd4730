"""When Redis or the companion fails or hangs: no 5xx caused by the filter, admissions
within the local bound, no timeout added to every request while the breaker is open,
recovery by itself, and what was admitted locally reconciled with Redis."""

import statistics
import time
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


def recovery_seconds(env, key):
    started = time.monotonic()
    wait_until(lambda: "x-llm-ratelimit-degraded" not in send(env.port, key)[1], 10, "leaving degraded mode")
    return time.monotonic() - started


@pytest.mark.parametrize("env", ["token_bucket", "sliding_window"], indirect=True)
def test_redis_killed_under_load(env):
    assert [send(env.port, "sk-r")[0] for _ in range(10)] == [200] * 10
    env.redis_proc.kill()
    admitted = outage(env, "sk-r")
    # The local bucket starts full: during the outage this proxy admits at most the limit.
    assert admitted == LIMIT
    env.stack.redis(env.redis_port, name="redis-again")  # empty: it lost everything
    seconds = recovery_seconds(env, "sk-r")
    print(f"\nRedis back: decisions central again after {seconds:.2f}s")
    assert seconds < 1.5
    # What was admitted locally is reconciled: the fresh Redis learns of the 50 local
    # admissions (and the probe's), so this tenant has nothing left.
    wait_until(lambda: (level(env, "sk-r") or LIMIT) < 1, 10, "local admissions reconciled")
    assert send(env.port, "sk-r")[0] == 429


def test_companion_killed_and_restarted(env):
    assert send(env.port, "sk-c")[0] == 200
    env.companion.kill()
    admitted = outage(env, "sk-c", requests=30)
    assert admitted == 30
    env.stack.companion(f"redis://127.0.0.1:{env.redis_port}", env.backend.token, port=env.companion_port,
                        name="companion-again", redis_timeout="40ms")
    seconds = recovery_seconds(env, "sk-c")
    print(f"\ncompanion back: decisions central again after {seconds:.2f}s")
    assert seconds < 1.5
    # 1 before, 30 during, and the requests that probed: all in Redis once reconciled.
    wait_until(lambda: (level(env, "sk-c") or LIMIT) <= LIMIT - 31, 10, "reconciled")


def test_a_paused_redis_takes_the_timeout_path_not_a_hang(env):
    assert send(env.port, "sk-p")[0] == 200
    redis.Redis(port=env.redis_port).execute_command("CLIENT", "PAUSE", "3000", "ALL")
    results = [send(env.port, "sk-p") for _ in range(20)]
    assert all(r[0] == 200 for r in results)
    assert all(r[1].get("x-llm-ratelimit-degraded") == "local" for r in results)
    assert max(r.elapsed for r in results) < 1.0, "no request waited for Redis"
    time.sleep(3)
    assert recovery_seconds(env, "sk-p") < 1.5
