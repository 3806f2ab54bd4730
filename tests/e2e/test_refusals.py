"""Refusals a program can act on (issue 45), end to end through Envoy with the official
openai and anthropic SDKs at their DEFAULT retry settings (max_retries=2): a request
that can never fit and a budget spent past the retry horizon are answered once, with
`x-should-retry: false` and each API's code for a spent quota, so one call of the SDK is
one request; a limit that frees within a second is still retried by the SDK, after
`retry-after-ms`, to success.

The requests are counted where they arrive: Envoy's own `http.llm.downstream_rq_total`
(the demo's `stat_prefix`), read from its admin before and after each call. Each call
runs in a thread given DEADLINE seconds: an SDK that sleeps through a long `Retry-After`
(the Anthropic SDK sleeps as long as it is told) fails the test instead of holding it."""

import threading
from datetime import datetime, timedelta, timezone

import anthropic as anthropic_sdk
import openai
import pytest

from stack import http_get

pytestmark = pytest.mark.backend(mock_args=["--completion-tokens", "20"])

DEADLINE = 20.0
ASK_OPENAI = dict(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=64)
ASK_ANTHROPIC = dict(model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}])


def requests_seen(admin: int) -> int:
    """The requests Envoy's listener has received (its connection manager's counter)."""
    status, body = http_get(f"http://127.0.0.1:{admin}/stats?filter=http.llm.downstream_rq_total", timeout=5)
    assert status == 200, status
    for line in body.decode().splitlines():
        name, _, value = line.partition(": ")
        if name == "http.llm.downstream_rq_total":
            return int(value)
    return 0


def one_call(admin: int, call) -> tuple[object, int]:
    """Runs one SDK call (retries and all): what it returned or raised, and how many HTTP
    requests reached Envoy meanwhile. A call still running after DEADLINE fails the test."""
    before = requests_seen(admin)
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as error:  # the SDK's exception is the outcome under test
            outcome["value"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    sent = requests_seen(admin) - before
    assert not thread.is_alive(), f"the SDK is still retrying after {DEADLINE}s, {sent} requests so far"
    return outcome["value"], sent


def clients(port: int, key: str):
    """The official SDKs with their default retries (max_retries=2 in both)."""
    return (openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key),
            anthropic_sdk.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key))


def test_a_request_that_can_never_fit_is_one_request_per_sdk_call(backend):
    port, admin = backend.envoy_for([{"name": "tpm", "tokens": 1000, "window": "1m"}])
    oai, ant = clients(port, "sk-never-fits")
    refused, sent = one_call(admin, lambda: oai.chat.completions.create(**{**ASK_OPENAI, "max_tokens": 5000}))
    assert isinstance(refused, openai.RateLimitError), refused
    assert sent == 1, f"one call of the openai SDK made {sent} requests"
    assert (refused.code, refused.type) == ("rate_limit_exceeded", "tokens")
    assert "can never be admitted" in refused.message
    assert refused.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.response.headers

    refused, sent = one_call(admin, lambda: ant.messages.create(**{**ASK_ANTHROPIC, "max_tokens": 5000}))
    assert isinstance(refused, anthropic_sdk.RateLimitError), refused
    assert sent == 1, f"one call of the anthropic SDK made {sent} requests"
    assert refused.body["error"]["type"] == "rate_limit_error"
    assert refused.response.headers["x-should-retry"] == "false"
    assert backend.upstream_received() == 0


def test_a_spent_calendar_budget_is_one_request_and_says_when_it_frees(backend):
    now = datetime.now(timezone.utc)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    if midnight - now < timedelta(minutes=3):
        pytest.skip("the day ends within three minutes: the budget would free within the retry horizon")
    port, admin = backend.envoy_for([{"name": "daily", "requests": 2, "window": {"calendar": "day"}}])
    for sdk, key in (("openai", "sk-spent-openai"), ("anthropic", "sk-spent-anthropic")):
        oai, ant = clients(port, key)
        ask = ((lambda: oai.chat.completions.create(**ASK_OPENAI)) if sdk == "openai"
               else (lambda: ant.messages.create(**ASK_ANTHROPIC)))
        ask()
        ask()
        refused, sent = one_call(admin, ask)
        assert sent == 1, f"one call of the {sdk} SDK made {sent} requests"
        assert refused.status_code == 429, sdk
        assert refused.response.headers["x-should-retry"] == "false"
        # Retry-After says when it frees: midnight UTC.
        wait = int(refused.response.headers["retry-after"])
        assert abs(wait - (midnight - datetime.now(timezone.utc)).total_seconds()) <= 5, wait
        if sdk == "openai":
            assert isinstance(refused, openai.RateLimitError), refused
            assert (refused.code, refused.type) == ("insufficient_quota", "insufficient_quota")
            message = refused.message
        else:
            assert isinstance(refused, anthropic_sdk.RateLimitError), refused
            assert refused.body["error"]["type"] == "billing_error"
            message = refused.body["error"]["message"]
        assert f"ends, at {midnight:%Y-%m-%dT%H:%M:%SZ}" in message, message
    assert backend.upstream_received() == 4


def test_a_client_is_warned_while_a_budget_runs_low(backend):
    limits = [{"name": "rpm", "requests": 100, "window": "1m"},
              {"name": "daily", "requests": 4, "window": {"calendar": "day"}},
              {"name": "weekly", "requests": 100, "window": "7d"}]
    port, _ = backend.envoy_for(limits, refusals={"warn_below": 0.5})
    oai, ant = clients(port, "sk-warned")
    raw = [oai.chat.completions.with_raw_response.create(**ASK_OPENAI),
           ant.messages.with_raw_response.create(**ASK_ANTHROPIC),
           oai.chat.completions.with_raw_response.create(**ASK_OPENAI)]
    # 3 of 4 left, then 2 (not below half), then 1: only "daily" is named, never a
    # per-minute limit.
    assert [r.headers.get("x-llm-ratelimit-budget-low") for r in raw] == [None, None, "daily"]
    # Off by default.
    port, _ = backend.envoy_for(limits, name="envoy-default")
    oai, _ = clients(port, "sk-warned")
    assert "x-llm-ratelimit-budget-low" not in oai.chat.completions.with_raw_response.create(**ASK_OPENAI).headers


def test_a_limit_that_frees_past_the_horizon_is_spent_not_retried(backend):
    """90 s: past the default horizon of 60 s, within the openai SDK's 120 s (which would
    sleep it out twice) and any wait the anthropic SDK takes."""
    port, admin = backend.envoy_for([{"name": "per-90s", "requests": 1, "window": "90s"}])
    for sdk, key in (("openai", "sk-slow-openai"), ("anthropic", "sk-slow-anthropic")):
        oai, ant = clients(port, key)
        ask = ((lambda: oai.chat.completions.create(**ASK_OPENAI)) if sdk == "openai"
               else (lambda: ant.messages.create(**ASK_ANTHROPIC)))
        ask()
        refused, sent = one_call(admin, ask)
        assert sent == 1, f"one call of the {sdk} SDK made {sent} requests"
        assert refused.status_code == 429 and refused.response.headers["x-should-retry"] == "false", refused
        assert 80 <= int(refused.response.headers["retry-after"]) <= 90


def test_a_spent_budget_may_be_a_403(backend):
    port, admin = backend.envoy_for([{"name": "hourly", "requests": 1, "window": "1h"}],
                                    refusals={"spent_status": 403})
    oai, ant = clients(port, "sk-forbidden")
    oai.chat.completions.create(**ASK_OPENAI)
    refused, sent = one_call(admin, lambda: oai.chat.completions.create(**ASK_OPENAI))
    assert isinstance(refused, openai.PermissionDeniedError) and sent == 1, (refused, sent)
    assert refused.code == "insufficient_quota"
    refused, sent = one_call(admin, lambda: ant.messages.create(**ASK_ANTHROPIC))
    assert isinstance(refused, anthropic_sdk.PermissionDeniedError) and sent == 1, (refused, sent)
    assert refused.body["error"]["type"] == "billing_error"


def test_a_limit_that_frees_within_a_second_is_still_retried_to_success(backend):
    port, admin = backend.envoy_for([{"name": "per-second", "requests": 1, "window": "1s"}])
    for sdk, key in (("openai", "sk-retry-openai"), ("anthropic", "sk-retry-anthropic")):
        oai, ant = clients(port, key)
        ask = ((lambda: oai.chat.completions.create(**ASK_OPENAI)) if sdk == "openai"
               else (lambda: ant.messages.create(**ASK_ANTHROPIC)))
        ask()
        answered, sent = one_call(admin, ask)
        assert not isinstance(answered, Exception), answered
        assert sent in (2, 3), f"the {sdk} SDK retried the 429 to success in {sent} requests"
