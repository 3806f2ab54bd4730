"""Policy options end to end: shadow mode, header styles, and the bypass list."""

import json
import time

import pytest

import redis

from stack import after_a_tick, bucket_level, chat, filter_metric, send, tenant_of, wait_until
from helpers import companion_metric as metric, companion_scrape as scrape


@pytest.fixture
def start(backend):
    def start_envoy(**options):
        limits = [{"name": "rpm", "requests": 2, "window": "1h"}]
        return backend.envoy(backend.filter_config(limits, **options))[0]

    start_envoy.backend = backend
    return start_envoy


def test_shadow_mode_never_refuses_but_says_what_would_have_happened(start):
    backend = start.backend
    port, admin = backend.envoy_for([{"name": "rpm", "requests": 2, "window": "1h"}], mode="shadow")
    results = [send(port) for _ in range(4)]
    assert [r[0] for r in results] == [200] * 4
    assert [r[1].get("x-llm-ratelimit-shadow") for r in results] == [None, None, "429", "429"]
    assert results[3][1]["x-ratelimit-remaining-requests"] == "0"
    assert "retry-after" not in results[3][1]
    assert start.backend.upstream_received() == 4
    # Redis really decided: two charges applied, two refused, and the bucket is spent
    # (refill: 2 an hour); the proxy counted the two refusals it let through.
    samples = scrape(backend.companion_port)
    assert metric(samples, "decisions_total", op="charge", outcome="allowed") == 2
    assert metric(samples, "decisions_total", op="charge", outcome="limited") == 2
    assert bucket_level(redis.Redis(port=backend.redis_port), "sk-test", "rpm") < 0.01

    def shadow_refusals():
        return filter_metric(admin, "llm_ratelimit_shadow_refusals_total") or 0

    wait_until(lambda: shadow_refusals() == 2, 10, f"shadow_refusals_total at 2 (now {shadow_refusals()})")


@pytest.mark.parametrize(
    "styles, present, absent",
    [
        (["classic"], ["x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"], ["x-ratelimit-limit-requests", "ratelimit"]),
        (["ietf"], ["ratelimit", "ratelimit-policy"], ["x-ratelimit-limit-requests", "x-ratelimit-limit"]),
        (["openai", "ietf", "classic"], ["x-ratelimit-limit-requests", "ratelimit", "x-ratelimit-limit"], []),
    ],
)
def test_header_styles_appear_as_configured(start, styles, present, absent):
    port = start(headers=styles)
    results = [send(port) for _ in range(3)]
    assert [r[0] for r in results] == [200, 200, 429]
    for status, headers, _ in results:
        for name in present:
            assert name in headers, (styles, name)
        for name in absent:
            assert name not in headers, (styles, name)
    assert results[2][1]["retry-after"]  # always on a 429
    if "classic" in styles:
        assert results[1][1]["x-ratelimit-remaining"] == "0"


def test_bypassed_paths_and_tenants_are_never_limited(start):
    vip = "sk-vip"
    port = start(bypass={"paths": ["/v1/models*"], "tenants": [tenant_of(vip)]})
    assert [send(port, path="/v1/models")[0] for _ in range(4)] == [404] * 4  # the mock's answer, unlimited
    assert all("x-ratelimit-limit-requests" not in send(port, key=vip)[1] for _ in range(4))
    assert [send(port)[0] for _ in range(3)] == [200, 200, 429]  # others are limited as usual


@pytest.mark.parametrize("lease", [False, True], ids=["direct", "lease"])
def test_a_per_model_limit_applies_across_its_models_only(start, lease):
    backend = start.backend
    limits = [{"name": "rpm", "requests": 100, "window": "1h"},
              {"name": "gpt4o-rph", "requests": 3, "window": "1h", "models": ["gpt-4o*"]}]
    port, _ = backend.envoy(backend.filter_config(limits, lease={"enabled": lease}))
    variants = ["gpt-4o", "gpt-4o-mini", "gpt-4o-2024-08-06", "gpt-4o"]
    results = [send(port, body=chat(model=model)) for model in variants]
    assert [r[0] for r in results] == [200, 200, 200, 429]
    assert "gpt4o-rph" in results[0][1]["ratelimit-policy"]
    # Another model is charged against the tenant's limits only, and hears nothing of it.
    status, headers, _ = send(port, body=chat(model="o3-mini"))
    assert status == 200 and "gpt4o-rph" not in headers["ratelimit-policy"]


def test_each_tier_gets_its_own_limits(start):
    backend = start.backend
    limits = [{"name": "rph-free", "requests": 2, "window": "1h", "tiers": ["free"]},
              {"name": "rph-gold", "requests": 4, "window": "1h", "tiers": ["gold"]},
              {"name": "rph-special", "requests": 1, "window": "1h", "tiers": ["special"]}]
    tier = {"header": "x-tenant-tier", "default": "free", "tenants": {tenant_of("sk-special"): "special"}}
    port, _ = backend.envoy(backend.filter_config(limits, tier=tier))
    # A per-tenant override wins over the header.
    special = [send(port, "sk-special", headers={"x-tenant-tier": "gold"})[0] for _ in range(2)]
    assert special == [200, 429]
    gold = [send(port, "sk-gold", headers={"x-tenant-tier": "gold"})[0] for _ in range(5)]
    free = [send(port, "sk-free", headers={"x-tenant-tier": "free"})[0] for _ in range(3)]
    unknown = [send(port, "sk-other", headers={"x-tenant-tier": "platinum"})[0] for _ in range(3)]
    assert gold == [200] * 4 + [429]
    assert free == [200] * 2 + [429]
    assert unknown == [200] * 2 + [429], "an unknown tier is the default tier"


def test_sliding_windows_through_envoy(start):
    backend = start.backend
    limits = [{"name": "rps", "requests": 3, "window": "1s", "algorithm": "sliding_window"},
              {"name": "tph", "tokens": 1000, "window": "1h", "algorithm": "sliding_window"}]
    port, _ = backend.envoy(backend.filter_config(limits))
    body_600 = chat(max_tokens=600)

    # Each reserves ~610 of 1000 tokens but uses ~20: only the settlement, a correction at
    # the time of the charge, makes room for the next.
    def settled(count):
        wait_until(lambda: metric(scrape(backend.companion_port), "settlements_total", outcome="applied") == count, 5,
                   f"{count} settlements applied")

    first = send(port, "sk-sw", body_600)
    assert first[0] == 200 and int(first[1]["x-llm-ratelimit-reserved-tokens"]) > 600
    settled(1)
    assert send(port, "sk-sw", body_600)[0] == 200
    # Three requests per second, in any second.
    settled(2)
    status, headers, _ = send(port, "sk-sw", body_600)
    assert status == 200
    status, headers, _ = send(port, "sk-sw", body_600)
    assert status == 429 and headers["retry-after"] == "1"
    while time.monotonic() < first.done + 1.05:  # time, not state: the first leaves the window
        time.sleep(0.05)
    assert send(port, "sk-sw", body_600)[0] == 200


def test_a_cost_budget_charges_real_usage_and_rejects_once_spent(start):
    backend = start.backend
    # $0.01 a day; gpt-4o-mini at $10 in and $40 out per million tokens (deliberately dear).
    limits = [{"name": "daily", "usd": 0.01, "window": "1d"}]
    prices = [{"match": "gpt-4o-mini*", "input": 10, "output": 40}]
    port, _ = backend.envoy(backend.filter_config(limits, prices=prices))

    def spend(model="gpt-4o-mini"):
        return send(port, "sk-budget", chat(model=model, max_tokens=150), headers={"x-mock-completion-tokens": "50"})

    # The first request reserves 8 prompt and 150 output tokens (6,080 micro-dollars); later
    # ones 1.5 x the running average of 50 (3,080). Each really costs what the upstream
    # reports at the table's prices: 2 prompt tokens x 10 + 50 output x 40 = 2,020. Without
    # settlement 2 requests would fit in 10,000; with it, exactly 4 (8,080 spent, 1,920
    # left < 3,080).
    store, spent = redis.Redis(port=backend.redis_port), 0
    statuses = []
    for _ in range(8):
        status, headers, body = spend()
        statuses.append(status)
        if status == 429:
            break
        spent += int(headers["x-mock-prompt-tokens"]) * 10 + int(headers["x-mock-completion-tokens"]) * 40
        # Settled in Redis at that price, to the micro-dollar (refill: 0.12 a second).
        wait_until(lambda: abs(bucket_level(store, "sk-budget", "daily") - (10_000 - spent)) < 1, 15,
                   f"the budget at {10_000 - spent}")
        after_a_tick()  # the running average, for whichever worker takes the next request
    assert statuses == [200] * 4 + [429]
    assert spent == 4 * 2_020
    # Refilling at 0.12 micro-dollars a second, the 1,160 missing take hours: past the
    # retry horizon, a spent quota (issue 45).
    error = json.loads(body)["error"]
    assert error["type"] == "insufficient_quota" and "$0.01" in error["message"]
    # A model with no price is refused explicitly while a budget applies to it.
    status, _, body = spend(model="mystery-model")
    assert status == 403 and json.loads(body)["error"]["code"] == "model_not_priced"
