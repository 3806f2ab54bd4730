"""End to end through real Envoy (--concurrency 2) with the wasm filter, the companion, a
real Redis and the mock LLM upstream."""

import json
import time

import pytest
import redis

from stack import anthropic, chat, filter_config, free_port, send

TOKEN = "e2e-companion-token"
# The logs must never show the token. The mock answers key-less requests as a provider
# behind a route that adds the operator's key does (the anonymous pool's case).
pytestmark = pytest.mark.backend(token=TOKEN, mock_args=["--accept-anonymous"])


def test_each_tenant_gets_exactly_its_limit_and_refills(backend):
    port = backend.envoy(backend.filter_config([{"name": "rpm", "requests": 5, "window": "4s"}]))[0]

    results = [send(port, key="sk-tenant-a") for _ in range(10)]
    fifth_taken = results[4].done
    assert [r[0] for r in results] == [200] * 5 + [429] * 5
    allowed_remaining = [int(r[1]["x-ratelimit-remaining-requests"]) for r in results[:5]]
    assert allowed_remaining == [4, 3, 2, 1, 0]
    for status, headers, body in results:
        assert headers["x-ratelimit-limit-requests"] == "5"
        assert headers["x-ratelimit-reset-requests"].endswith("s")
    for status, headers, body in results[5:]:
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(headers["retry-after"]) <= 1  # one token per 0.8 s, rounded up
        error = json.loads(body)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert '"rpm" allows 5 per 4s' in error["message"]
    assert json.loads(results[0][2])["object"] == "chat.completion"  # the upstream's reply

    # Another tenant has its own budget.
    assert [send(port, key="sk-tenant-b")[0] for _ in range(5)] == [200] * 5

    # A full window after its fifth admission, tenant A has its whole budget again, and no
    # more. (Time, not state: the bucket refills with the clock.)
    while time.monotonic() < fifth_taken + 4.2:
        time.sleep(0.05)
    assert [send(port, key="sk-tenant-a")[0] for _ in range(6)] == [200] * 5 + [429]


@pytest.mark.parametrize("body_bytes", [0, 60, 256 * 1024])
def test_a_rejected_request_never_reaches_the_upstream(backend, body_bytes):
    """Regression: with allow_on_headers_stop_iteration Envoy delivers the body while the
    headers wait, and letting the body continue released the request before the decision."""
    port = backend.envoy(backend.filter_config([{"name": "rpm", "requests": 3, "window": "1h"}]))[0]
    body = chat("x" * body_bytes) if body_bytes else None
    results = [send(port, body=body) for _ in range(6)]
    upstream_status = 200 if body else 400  # the mock refuses a chat request without a body
    assert [r[0] for r in results] == [upstream_status] * 3 + [429] * 3
    assert all("x-ratelimit-remaining-requests" in r[1] for r in results)
    assert backend.upstream_received() == 3


def test_several_windows_are_charged_together(backend):
    limits = [{"name": "burst", "requests": 3, "window": "1h"}, {"name": "hourly", "requests": 2, "window": "1h"}]
    port = backend.envoy(backend.filter_config(limits))[0]
    results = [send(port) for _ in range(3)]
    assert [r[0] for r in results] == [200, 200, 429]
    # The 429 names the limit that is out, and the headers describe the tightest one.
    assert '"hourly"' in json.loads(results[2][2])["error"]["message"]
    assert results[1][1]["x-ratelimit-limit-requests"] == "2"
    # The rejected request charged nothing: "burst" still has 1 left.
    keys = redis.Redis(port=backend.redis_port)
    burst = [k for k in keys.keys("*") if k.endswith(b":burst")]
    assert len(burst) == 1 and float(keys.hget(burst[0], "tokens")) == pytest.approx(1, abs=0.01)


def test_streams_pass_through_untouched_with_headers(backend):
    port = backend.envoy(backend.filter_config([{"name": "rpm", "requests": 100, "window": "1m"}]))[0]
    stream_body = chat("Say hello", stream=True, stream_options={"include_usage": True})
    status, headers, body = send(port, body=stream_body, headers={"x-mock-completion-tokens": "5"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-ratelimit-remaining-requests"] == "99"
    events = [line for line in body.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 5

    status, headers, body = send(port, key=None, path="/v1/messages", body=anthropic("Hi", max_tokens=64, stream=True),
                                 headers={"x-api-key": "ak-tenant"})
    # An Anthropic caller reads Anthropic's headers (tests/e2e/test_api_answers.py).
    assert status == 200 and headers["anthropic-ratelimit-requests-remaining"] == "99"
    assert body.decode().rstrip().endswith('data: {"type":"message_stop"}')


def test_missing_identity_is_rejected_or_pooled_as_configured(backend):
    limits = [{"name": "rpm", "requests": 2, "window": "1m"}]
    reject, _ = backend.envoy(backend.filter_config(limits), name="envoy-reject")
    status, headers, body = send(reject, key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "missing_api_key"
    status, _, _ = send(reject, key=None, headers={"authorization": "Basic dXNlcjpwdw=="})
    assert status == 401

    pooled_config = backend.filter_config(limits, identity={"missing": "anonymous"}, domain="pooled")
    pooled, _ = backend.envoy(pooled_config, name="envoy-anon")
    assert [send(pooled, key=None)[0] for _ in range(3)] == [200, 200, 429]
    assert send(pooled, key="sk-has-a-key")[0] == 200


@pytest.mark.parametrize("mode, status", [("allow", 200), ("deny", 503)])
def test_failure_mode_when_the_companion_is_unreachable(backend, mode, status):
    config = backend.filter_config([{"name": "rpm", "requests": 1, "window": "1m"}], failure_mode=mode, companion_timeout="200ms")
    port, _ = backend.envoy(config, companion_port=free_port())  # nothing listens there
    results = [send(port) for _ in range(3)]
    assert [r[0] for r in results] == [status] * 3
    if mode == "allow":
        assert all(r[1]["x-llm-ratelimit-degraded"] == "companion-unavailable" for r in results)
    else:
        assert results[0][1]["retry-after"] == "1"
        assert json.loads(results[0][2])["error"]["code"] == "rate_limiter_unavailable"


@pytest.mark.parametrize(
    "config, field",
    [
        (filter_config([{"name": "rpm", "requests": 5, "window": "1x"}], token=TOKEN), "limits[0].window"),
        (filter_config([{"name": "rpm", "requests": 5, "window": "1m", "burst": 2}], token=TOKEN), "limits[0].burst"),
        (filter_config([{"name": "rpm", "requests": 5, "window": "1m"}], token=TOKEN, failure_mode="open"), "failure_mode"),
        ('{"companion": ', "companion"),
        ("not json", "(top level)"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(backend, config, field):
    _, proc = backend.envoy(config, name="envoy-bad", wait=False)
    assert proc.popen.wait(timeout=60) != 0
    log = proc.log_path.read_text()
    assert f"invalid filter config: field `{field}`" in log


def test_two_envoys_hold_one_global_limit(backend):
    config = backend.filter_config([{"name": "rpm", "requests": 10, "window": "1m"}])
    ports = [backend.envoy(config, name="envoy-1")[0], backend.envoy(config, name="envoy-2")[0]]
    statuses = [send(ports[i % 2])[0] for i in range(20)]
    assert statuses.count(200) == 10 and statuses.count(429) == 10
    # Both proxies admitted some: the limit really is shared, not per proxy.
    assert 200 in statuses[0::2] and 200 in statuses[1::2]


def redis_contents(store) -> bytes:
    """Every key in Redis and every value under it, whatever its type, as one byte string."""
    parts = []
    for key in store.scan_iter(count=1000):
        parts.append(key)
        kind = store.type(key).decode()
        if kind == "string":
            parts.append(store.get(key) or b"")
        elif kind == "hash":
            parts.extend(b for pair in store.hgetall(key).items() for b in pair)
        elif kind == "zset":
            parts.extend(member for member, _ in store.zrange(key, 0, -1, withscores=True))
        elif kind == "set":
            parts.extend(store.smembers(key))
        elif kind == "list":
            parts.extend(store.lrange(key, 0, -1))
        elif kind == "stream":
            parts.extend(b for _, fields in store.xrange(key) for pair in fields.items() for b in pair)
        elif kind == "none":
            continue  # expired between the scan and this read (seen under load): nothing left in it
        else:
            raise AssertionError(f"a key of a type this check cannot read: {key!r} ({kind})")
    return b"\n".join(parts)


def test_api_keys_and_pool_header_values_never_reach_redis_or_logs(backend):
    secret = "sk-live-SECRET-0123456789"
    # The kinds of key the companion writes: buckets, a sliding window, slots,
    # reservations (a token limit), the queue, a lease.
    limits = [{"name": "rpm", "requests": 2, "window": "1m"}, {"name": "tpm", "tokens": 100_000, "window": "1m"},
              {"name": "rps", "requests": 100, "window": "1s", "algorithm": "sliding_window"},
              {"name": "inflight", "concurrency": 5},
              {"name": "team-rpm", "requests": 100, "window": "1m", "per": {"header": "x-team-id"}}]
    team = "team-SECRET-4242"  # a pool's header value: never in clear either
    port = backend.envoy(backend.filter_config(limits, queue={"max_wait": "200ms"}))[0]
    leased = backend.envoy(backend.filter_config([{"name": "rph", "requests": 100, "window": "1h"}],
                                                 lease={"enabled": True}), name="envoy-lease")[0]
    assert [send(port, key=secret, headers={"x-team-id": team})[0] for _ in range(3)] == [200, 200, 429]
    assert send(port, key=None, path="/v1/messages", body=anthropic("hi", max_tokens=16),
                headers={"x-api-key": secret + "-ant", "x-team-id": team})[0] == 200
    assert [send(leased, key=secret)[0] for _ in range(3)] == [200] * 3
    contents = redis_contents(redis.Redis(port=backend.redis_port))
    assert b":tb:" in contents and b":sw:" in contents
    assert secret.encode() not in contents and secret[3:].encode() not in contents
    assert TOKEN.encode() not in contents and team.encode() not in contents
    for proc in backend.stack.processes:
        assert secret not in proc.log_path.read_text(errors="replace"), proc.name
        assert team not in proc.log_path.read_text(errors="replace"), proc.name
        assert TOKEN not in proc.log_path.read_text(errors="replace"), proc.name
