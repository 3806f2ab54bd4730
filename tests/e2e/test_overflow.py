"""Overflow instead of a 429, end to end through Envoy with two mock upstreams: the route
table sends a request carrying `x-llm-ratelimit-overflow: backup` to the second one. The
filter sets that header on a request a limit with `"overflow": "backup"` refuses (or, with
`provider_limits.overflow`, while the provider refuses), once the body is read and the
decision made; that the request reaches the second upstream shows Envoy clears its route
cache when a Wasm filter changes a request header. The fallback's own limits
(`"backend": "backup"`) are charged for it, not the limit that refused; a client's own
overflow header is removed before anything routes on it."""

import json

import pytest
import redis

from stack import bucket_key, envoy_config, filter_metric, free_port, http_get, send, wait_until

OVERFLOW = "x-llm-ratelimit-overflow"
LIMITS = [
    {"name": "primary-rpm", "requests": 2, "window": "1h", "overflow": "backup"},
    {"name": "backup-rpm", "requests": 3, "window": "1h", "backend": "backup"},
    # A token limit: the decision waits for the body, with the headers held.
    {"name": "tenant-tpm", "tokens": 1_000_000, "window": "1h"},
]


def received(port: int) -> int:
    return json.loads(http_get(f"http://127.0.0.1:{port}/mock/stats")[1])["received"]


def envoy_with_fallback(backend, limits, name="envoy-overflow", **options):
    """An Envoy whose route table sends `x-llm-ratelimit-overflow: backup` to a second mock;
    returns (listener, admin, fallback mock port)."""
    _, fallback = backend.stack.mock(extra=["--completion-tokens", "7"])
    port, admin = free_port(), free_port()
    config = envoy_config(listen_port=port, admin_port=admin, upstream_port=backend.mock_port,
                          companion_port=backend.companion_port, filter_config=backend.filter_config(limits, **options))
    primary = next(c for c in config["static_resources"]["clusters"] if c["name"] == "llm_upstream")
    second = json.loads(json.dumps(primary).replace("llm_upstream", "llm_fallback"))
    second["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"] = fallback
    config["static_resources"]["clusters"].append(second)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(0, {"match": {"prefix": "/", "headers": [{"name": OVERFLOW, "string_match": {"exact": "backup"}}]},
                      "route": {"cluster": "llm_fallback", "timeout": "300s"}})
    backend.stack.envoy(config, name=name)
    return port, admin, fallback


def test_a_refused_request_goes_to_the_fallback_charged_on_its_limits(backend):
    port, admin, fallback = envoy_with_fallback(backend, LIMITS)
    r = redis.Redis(port=backend.redis_port)
    primary_before = received(backend.mock_port)
    first = [send(port, "sk-over") for _ in range(2)]
    assert [f.status for f in first] == [200, 200]
    assert all(OVERFLOW not in f.headers for f in first)
    over = [send(port, "sk-over") for _ in range(3)]
    assert [o.status for o in over] == [200, 200, 200], [o.body for o in over]
    assert all(o.headers[OVERFLOW] == "backup" for o in over)
    # The fallback's reply (its 7 completion tokens), not the primary's.
    assert all(json.loads(o.body)["usage"]["completion_tokens"] == 7 for o in over)
    assert received(fallback) == 3, "the route table sent them to the second upstream"
    assert received(backend.mock_port) - primary_before == 2
    # Charged on the fallback's limit, not on the one that refused.
    assert float(r.hget(bucket_key("sk-over", "backup-rpm"), "tokens")) < 1
    assert float(r.hget(bucket_key("sk-over", "primary-rpm"), "tokens")) < 1
    assert over[-1].headers["x-ratelimit-limit-requests"] == "3", "the headers speak of the fallback's limit"
    # The fallback's own limit spent: the 429 names it, and nothing went upstream.
    refused = send(port, "sk-over")
    assert refused.status == 429 and "backup-rpm" in json.loads(refused.body)["error"]["message"]
    assert received(fallback) == 3 and received(backend.mock_port) - primary_before == 2
    metric = lambda limit, decision: filter_metric(admin, "llm_ratelimit_decisions_total", limit=limit, decision=decision)
    # Counters are read while the last request may still be counting: poll them together.
    counts = lambda: (metric("primary-rpm", "overflowed"), metric("backup-rpm", "allowed"), metric("backup-rpm", "limited"))
    try:
        wait_until(lambda: counts() == (4, 3, 1), 5, "overflows under the refusing limit, the fallback's own decisions")
    except TimeoutError:
        pass
    assert counts() == (4, 3, 1), "overflowed, the fallback's allowed and limited"
    assert metric("primary-rpm", "limited") == 0, "an overflow is not a refusal"


def test_a_clients_own_overflow_header_is_removed(backend):
    port, _, fallback = envoy_with_fallback(backend, LIMITS, name="envoy-forged")
    sent = send(port, "sk-forge", headers={OVERFLOW: "backup"})
    assert sent.status == 200 and OVERFLOW not in sent.headers
    assert received(fallback) == 0, "the client's header never reached the route table"


def test_while_the_provider_refuses_requests_go_to_the_fallback(backend):
    port, admin, fallback = envoy_with_fallback(
        backend, [{"name": "rpm", "requests": 1000, "window": "1h"}], name="envoy-provider",
        provider_limits={"enabled": True, "share": False, "overflow": "backup"})
    # The primary provider's 429, with its retry time (a header the mock sets on request).
    refused = send(port, "sk-prov", headers={"x-mock-status": "429", "x-mock-set-retry-after": "30"})
    assert refused.status == 429 and OVERFLOW not in refused.headers
    before = received(backend.mock_port)
    over = [send(port, "sk-prov") for _ in range(3)]
    assert all(o.status == 200 and o.headers[OVERFLOW] == "backup" for o in over)
    assert received(fallback) == 3 and received(backend.mock_port) == before
    wait_until(lambda: (filter_metric(admin, "llm_ratelimit_provider_overflowed_requests_total") or 0) == 3, 5,
               "overflows for the provider counted")
    assert (filter_metric(admin, "llm_ratelimit_provider_refusals_answered_total") or 0) == 0


def test_in_shadow_mode_nothing_is_refused_so_nothing_overflows(backend):
    """docs/overflow.md: "in shadow mode nothing is refused, so nothing
    overflows". Past `primary-rpm`'s 2, the requests still go to the primary, with no
    overflow header; the fallback gets nothing and its limit is charged nothing."""
    port, admin, fallback = envoy_with_fallback(backend, LIMITS, name="envoy-shadow", mode="shadow")
    before = received(backend.mock_port)
    replies = [send(port, "sk-shadow-over") for _ in range(4)]
    assert [r.status for r in replies] == [200] * 4, [r.body for r in replies]
    assert [OVERFLOW in r.headers for r in replies] == [False] * 4
    # Enforcement would have sent the last two to the fallback: their shadow mark says so.
    assert [r.headers.get("x-llm-ratelimit-shadow") for r in replies] == [None, None, "overflow", "overflow"]
    assert received(backend.mock_port) - before == 4 and received(fallback) == 0
    assert redis.Redis(port=backend.redis_port).hget(bucket_key("sk-shadow-over", "backup-rpm"), "tokens") is None
    metric = lambda limit, decision: filter_metric(admin, "llm_ratelimit_decisions_total", limit=limit, decision=decision)
    # docs/metrics.md: `shadow`, "this limit would have refused it; shadow mode let it through".
    wait_until(lambda: metric("primary-rpm", "shadow") == 2, 5, "the two shadow refusals counted")
    assert metric("primary-rpm", "overflowed") == 0 and metric("backup-rpm", "allowed") == 0
