"""End to end through real Envoy (--concurrency 2) with the wasm filter, the companion, a
real Redis and the mock LLM upstream."""

import http.client
import json
import time
from types import SimpleNamespace

import pytest
import redis

from stack import envoy_config, free_port, http_get

TOKEN = "e2e-companion-token"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}]}


def filter_config(limits, **overrides):
    config = {
        "companion": {"upstream": "llm_ratelimit_companion", "token": TOKEN, "timeout": "2s"},
        # Tests count exact admissions: a slow callout must show up as a 503, not a pass.
        "failure_mode": "deny",
        "limits": limits,
    }
    config.update(overrides)
    return config


@pytest.fixture
def backend(stack):
    _, redis_port = stack.redis()
    _, companion_port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN)
    _, mock_port = stack.mock()
    return SimpleNamespace(stack=stack, redis_port=redis_port, companion_port=companion_port, mock_port=mock_port)


def start_envoy(backend, config, name="envoy", companion_port=None):
    listen_port = free_port()
    proc, _ = backend.stack.envoy(
        envoy_config(
            listen_port=listen_port,
            admin_port=free_port(),
            upstream_port=backend.mock_port,
            companion_port=companion_port or backend.companion_port,
            filter_config=config,
        ),
        name=name,
    )
    return listen_port


def send(port, key="sk-tenant-a", path="/v1/chat/completions", body=CHAT, headers=None):
    """One request on a fresh connection; returns status, lower-cased headers, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    all_headers = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        all_headers["authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", path, body=None if body is None else json.dumps(body), headers=all_headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_each_tenant_gets_exactly_its_limit_and_refills(backend):
    port = start_envoy(backend, filter_config([{"name": "rpm", "requests": 5, "window": "4s"}]))

    results = [send(port, key="sk-tenant-a") for _ in range(10)]
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

    # After a full window, tenant A has its whole budget again, and no more.
    time.sleep(4.2)
    assert [send(port, key="sk-tenant-a")[0] for _ in range(6)] == [200] * 5 + [429]


def upstream_received(backend):
    return json.loads(http_get(f"http://127.0.0.1:{backend.mock_port}/mock/stats")[1])["received"]


@pytest.mark.parametrize("body_bytes", [0, 60, 256 * 1024])
def test_a_rejected_request_never_reaches_the_upstream(backend, body_bytes):
    """Regression: with allow_on_headers_stop_iteration Envoy delivers the body while the
    headers wait, and letting the body continue released the request before the decision."""
    port = start_envoy(backend, filter_config([{"name": "rpm", "requests": 3, "window": "1h"}]))
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * body_bytes}]} if body_bytes else None
    results = [send(port, body=body) for _ in range(6)]
    upstream_status = 200 if body else 400  # the mock refuses a chat request without a body
    assert [r[0] for r in results] == [upstream_status] * 3 + [429] * 3
    assert all("x-ratelimit-remaining-requests" in r[1] for r in results)
    assert upstream_received(backend) == 3


def test_several_windows_are_charged_together(backend):
    limits = [{"name": "burst", "requests": 3, "window": "1h"}, {"name": "hourly", "requests": 2, "window": "1h"}]
    port = start_envoy(backend, filter_config(limits))
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
    port = start_envoy(backend, filter_config([{"name": "rpm", "requests": 100, "window": "1m"}]))
    stream_body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, body = send(port, body=stream_body, headers={"x-mock-completion-tokens": "5"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["x-ratelimit-remaining-requests"] == "99"
    events = [line for line in body.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] == 5

    anthropic = {"model": "claude-sonnet-4-5", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    status, headers, body = send(port, key=None, path="/v1/messages", body=anthropic, headers={"x-api-key": "ak-tenant"})
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "99"
    assert body.decode().rstrip().endswith('data: {"type":"message_stop"}')


def test_missing_identity_is_rejected_or_pooled_as_configured(backend):
    limits = [{"name": "rpm", "requests": 2, "window": "1m"}]
    reject = start_envoy(backend, filter_config(limits), name="envoy-reject")
    status, headers, body = send(reject, key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "missing_api_key"
    status, _, _ = send(reject, key=None, headers={"authorization": "Basic dXNlcjpwdw=="})
    assert status == 401

    pooled = start_envoy(backend, filter_config(limits, identity={"missing": "anonymous"}, domain="pooled"), name="envoy-anon")
    assert [send(pooled, key=None)[0] for _ in range(3)] == [200, 200, 429]
    assert send(pooled, key="sk-has-a-key")[0] == 200


@pytest.mark.parametrize("mode, status", [("allow", 200), ("deny", 503)])
def test_failure_mode_when_the_companion_is_unreachable(backend, mode, status):
    config = filter_config([{"name": "rpm", "requests": 1, "window": "1m"}], failure_mode=mode)
    config["companion"]["timeout"] = "200ms"
    port = start_envoy(backend, config, companion_port=free_port())  # nothing listens there
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
        (filter_config([{"name": "rpm", "requests": 5, "window": "1x"}]), "limits[0].window"),
        (filter_config([{"name": "rpm", "requests": 5, "window": "1m", "burst": 2}]), "limits[0].burst"),
        (filter_config([{"name": "rpm", "requests": 5, "window": "1m"}], failure_mode="open"), "failure_mode"),
        ('{"companion": ', "companion"),
        ("not json", "(top level)"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(backend, config, field):
    proc, _ = backend.stack.envoy(
        envoy_config(listen_port=free_port(), admin_port=free_port(), upstream_port=backend.mock_port,
                     companion_port=backend.companion_port, filter_config=config),
        name="envoy-bad", wait=False,
    )
    assert proc.popen.wait(timeout=60) != 0
    log = proc.log_path.read_text()
    assert f"invalid filter config: field `{field}`" in log


def test_two_envoys_hold_one_global_limit(backend):
    config = filter_config([{"name": "rpm", "requests": 10, "window": "1m"}])
    ports = [start_envoy(backend, config, name="envoy-1"), start_envoy(backend, config, name="envoy-2")]
    statuses = [send(ports[i % 2])[0] for i in range(20)]
    assert statuses.count(200) == 10 and statuses.count(429) == 10
    # Both proxies admitted some: the limit really is shared, not per proxy.
    assert 200 in statuses[0::2] and 200 in statuses[1::2]


def test_api_keys_never_reach_redis_or_logs(backend):
    secret = "sk-live-SECRET-0123456789"
    port = start_envoy(backend, filter_config([{"name": "rpm", "requests": 1, "window": "1m"}]))
    assert [send(port, key=secret)[0] for _ in range(2)] == [200, 429]
    keys = b" ".join(redis.Redis(port=backend.redis_port).keys("*"))
    assert keys and secret.encode() not in keys
    for proc in backend.stack.processes:
        assert secret not in proc.log_path.read_text(errors="replace"), proc.name
        assert TOKEN not in proc.log_path.read_text(errors="replace"), proc.name
