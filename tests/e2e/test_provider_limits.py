"""The provider's own word on its limits, end to end through two Envoys (2 workers each)
sharing one companion: the mock upstream plays a provider with limits per credential
(`--provider-requests` per `--provider-window-ms`), answering in each provider's own
shape (mock-llm/src/provider_limits.rs). With `provider_limits` on:

- after the provider's first 429, neither proxy forwards that credential's requests into
  certain refusals: they answer them with the caller's API's 429 and the provider's
  retry time, and one probe (for the whole fleet) goes once that time has passed;
- a configured limit is charged at what the provider says is left, when that is less.

Each provider's shape: OpenAI's (remaining and reset headers, a 429 without retry-after),
Anthropic's (`anthropic-ratelimit-*` with RFC 3339 resets, `retry-after` on its 429),
Google's (only its 429's RetryInfo) and Bedrock's (a ThrottlingException with no retry
time: `default_retry` stands in), each credential the provider's own (an API key, or
SigV4's access key id). What the provider refused is counted by the mock itself
(`throttled` in /mock/stats)."""

import json
import time

import pytest

from bedrock_client import bedrock, converse_args
from provider_bench import gemini, offer
from stack import anthropic, filter_metric, http_get, send, wait_until

WINDOW_MS = 3000
pytestmark = pytest.mark.backend(mock_args=["--provider-requests", "3", "--provider-window-ms", str(WINDOW_MS)])
BIG = 1_000_000
LIMITS = [{"name": "rpm", "requests": BIG, "window": "1m"}, {"name": "tpm", "tokens": BIG, "window": "1m"}]


def counter(admin: int, name: str) -> int:
    return filter_metric(admin, f"llm_ratelimit_{name}_total") or 0


def mock_stats(backend) -> dict:
    return json.loads(http_get(f"http://127.0.0.1:{backend.mock_port}/mock/stats")[1])


def fleet(backend, **provider_limits):
    """Two Envoys on the backend with provider_limits on: [(port, admin)] * 2."""
    options = {"provider_limits": {"enabled": True, **provider_limits}}
    return [backend.envoy_for(LIMITS, name=f"envoy-{i}", **options) for i in range(2)]


def spend_directly(backend, key: str, times: int, **kwargs):
    """Another application sharing the key spends the provider's quota, not through a proxy."""
    for _ in range(times):
        assert send(backend.mock_port, key, **kwargs).status == 200


def test_after_the_providers_429_the_fleet_answers_locally_with_its_retry_time(backend):
    (a, a_admin), (b, b_admin) = fleet(backend)
    spend_directly(backend, "sk-shared", 3)
    # The provider's own 429 (OpenAI's: its reset header says when), forwarded as it is.
    first = send(a, "sk-shared")
    assert first.status == 429 and "x-llm-ratelimit-provider" not in first.headers
    assert json.loads(first.body)["error"]["code"] == "rate_limit_exceeded"
    assert mock_stats(backend)["throttled"] == 1
    # The other proxy hears of it through the companion ...
    wait_until(lambda: counter(b_admin, "provider_fleet_words") >= 1, 10, "the fleet's word taken in by B")
    for port in (b, a):
        local = send(port, "sk-shared")
        assert local.status == 429, local
        assert local.headers["x-llm-ratelimit-provider"] == "refused"
        body = json.loads(local.body)
        assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
        # ... and says the provider's retry time: what was left of its window.
        assert 1 <= int(local.headers["retry-after"]) <= WINDOW_MS // 1000, local.headers
        assert 0 < int(local.headers["retry-after-ms"]) <= WINDOW_MS
    assert mock_stats(backend)["throttled"] == 1, "no request went into a certain refusal"
    # Another credential is not held up.
    assert send(b, "sk-other").status == 200
    # Counters reach the host on the VM's 50 ms tick.
    answered = lambda: counter(a_admin, "provider_refusals_answered") + counter(b_admin, "provider_refusals_answered")
    wait_until(lambda: answered() >= 2, 5, "the local answers counted")
    # Past the retry time one probe goes (for the whole fleet) and the provider serves again.
    # The new window holds 3: the loop stops at its third success, since the other proxy
    # may not have heard yet that nothing is left, and may send one request into it (the
    # docs/provider-limits.md: "a proxy that has not yet heard ... can send one request into it itself").
    statuses, served_by = [], []
    deadline = time.monotonic() + WINDOW_MS / 1000 + 4
    while time.monotonic() < deadline and statuses.count(200) < 3:
        for port in (a, b):
            status = send(port, "sk-shared").status
            statuses.append(status)
            if status == 200:
                served_by.append(port)
            if statuses.count(200) == 3:
                break
    assert statuses.count(200) == 3, statuses
    probes = lambda: counter(a_admin, "provider_probes") + counter(b_admin, "provider_probes")
    wait_until(lambda: probes() >= 1, 5, "the probe counted")
    assert probes() == 1, f"one probe for the fleet, not one per proxy: {probes()}"
    assert mock_stats(backend)["throttled"] == 1, "no refusal while the new window had room"
    # The window's last request said nothing is left: the proxy that sent it answers the
    # next request itself, with no second refusal from the provider.
    after = send(served_by[-1], "sk-shared")
    assert after.status == 429 and after.headers["x-llm-ratelimit-provider"] == "refused", after
    assert mock_stats(backend)["throttled"] == 1, "the new window's last request said so: no more refusals"


def test_a_provider_without_headers_is_sent_at_most_one_refused_request_per_retry_period_per_proxy(backend):
    """Google's API says nothing on a success: only its 429 (with RetryInfo) tells. With the
    mock at 3 requests per 3 s and one client per proxy offering 20 requests/s, the
    proxies send it at most one request it refuses per retry period each; without
    provider_limits it refuses most of them."""
    seconds = 3 * WINDOW_MS / 1000
    periods = seconds / (WINDOW_MS / 1000) + 1
    off = [backend.envoy_for(LIMITS, name=f"plain-{i}")[0] for i in range(2)]
    before = mock_stats(backend)["throttled"]
    offer(off, "AIza-off", gemini, 20, seconds)
    refused_without = mock_stats(backend)["throttled"] - before
    on = [port for port, _ in fleet(backend)]
    before = mock_stats(backend)["throttled"]
    statuses = offer(on, "AIza-on", gemini, 20, seconds)
    refused_with = mock_stats(backend)["throttled"] - before
    print(f"refused by the provider over {seconds:.0f}s: without provider_limits {refused_without}, with {refused_with}")
    assert refused_with <= 2 * periods, (refused_with, periods)
    assert refused_without > 5 * refused_with, (refused_without, refused_with)
    assert statuses.count(200) >= 3 * (periods - 1) - 1, statuses.count(200)


def test_a_limit_is_lowered_to_what_the_provider_says_is_left(backend):
    """The mock allows 3 requests per window and says how many are left: the proxy's own
    requests limit (1,000,000 a minute) is charged at what the provider says is left."""
    (a, _), _ = fleet(backend)
    first = send(a, "sk-lower")
    assert first.status == 200
    # The provider said 2 requests are left: the limit's size is 2 now, 1 left after this one.
    second = send(a, "sk-lower")
    assert second.status == 200
    assert second.headers["x-llm-ratelimit-provider"] == "lowered"
    assert (second.headers["x-ratelimit-limit-requests"], second.headers["x-ratelimit-remaining-requests"]) == ("2", "1")


def messages(port: int, key: str):
    """An Anthropic Messages request with `key` in x-api-key."""
    return send(port, None, anthropic(), path="/v1/messages", headers={"x-api-key": key, "anthropic-version": "2023-06-01"})


def test_anthropics_429_is_answered_by_the_fleet_in_its_shape_with_its_retry_time(backend):
    (a, _), (b, b_admin) = fleet(backend)
    for _ in range(3):
        assert messages(backend.mock_port, "sk-ant-shared").status == 200
    first = messages(a, "sk-ant-shared")
    assert first.status == 429 and "x-llm-ratelimit-provider" not in first.headers, first
    assert json.loads(first.body)["error"]["type"] == "rate_limit_error", "Anthropic's own refusal, forwarded"
    assert mock_stats(backend)["throttled"] == 1
    wait_until(lambda: counter(b_admin, "provider_fleet_words") >= 1, 10, "the fleet's word taken in by B")
    for port in (b, a):
        local = messages(port, "sk-ant-shared")
        assert local.status == 429 and local.headers["x-llm-ratelimit-provider"] == "refused", local
        body = json.loads(local.body)
        assert (body["type"], body["error"]["type"]) == ("error", "rate_limit_error"), body
        assert 1 <= int(local.headers["retry-after"]) <= WINDOW_MS // 1000, local.headers
    assert mock_stats(backend)["throttled"] == 1, "no request went into a certain refusal"
    assert messages(b, "sk-ant-other").status == 200


def test_anthropics_remaining_headers_lower_a_limit(backend):
    (a, _), _ = fleet(backend)
    assert messages(a, "sk-ant-lower").status == 200
    # anthropic-ratelimit-requests-remaining: 2, reset an RFC 3339 time: the limit's size is 2.
    second = messages(a, "sk-ant-lower")
    assert second.status == 200 and second.headers["x-llm-ratelimit-provider"] == "lowered"
    limit = (second.headers["anthropic-ratelimit-requests-limit"], second.headers["anthropic-ratelimit-requests-remaining"])
    assert limit == ("2", "1")


def test_bedrocks_throttling_is_answered_by_the_fleet_for_default_retry(backend):
    """Bedrock names no retry time: `default_retry` stands in. Its credential is SigV4's
    access key id."""
    (a, _), (b, b_admin) = fleet(backend, default_retry="2s")
    direct = bedrock(backend.mock_port, "AKIDSHAREDBEDROCK")
    for _ in range(3):
        direct.converse(**converse_args())
    through_a = bedrock(a, "AKIDSHAREDBEDROCK")
    with pytest.raises(through_a.exceptions.ThrottlingException) as first:
        through_a.converse(**converse_args())
    assert "x-llm-ratelimit-provider" not in first.value.response["ResponseMetadata"]["HTTPHeaders"]
    assert mock_stats(backend)["throttled"] == 1
    wait_until(lambda: counter(b_admin, "provider_fleet_words") >= 1, 10, "the fleet's word taken in by B")
    for port in (b, a):
        client = bedrock(port, "AKIDSHAREDBEDROCK")
        with pytest.raises(client.exceptions.ThrottlingException) as local:
            client.converse(**converse_args())
        headers = local.value.response["ResponseMetadata"]["HTTPHeaders"]
        assert headers["x-llm-ratelimit-provider"] == "refused", headers
        assert 1 <= int(headers["retry-after"]) <= 2, headers
    assert mock_stats(backend)["throttled"] == 1, "no request went into a certain refusal"
    bedrock(b, "AKIDOTHERBEDROCK").converse(**converse_args())
