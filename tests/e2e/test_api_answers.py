"""Each caller answered in its own API's conventions, end to end through Envoy and checked
with the providers' official SDKs: a 429 (and 413, 503) that the SDK raises as its own
rate-limit (size, availability) exception, and the rate-limit headers it expects. Then
token limits that count one part of the tokens (input, output, cached input), reserved
and settled apart against the usage the upstream reported."""

import datetime
import http.client
import math
import time
import json

import anthropic as anthropic_sdk
import boto3
import openai
import pytest
import redis
from botocore.config import Config
from google import genai

from helpers import chat_of_size as body_of, post_reading_early, too_large_message as too_large
from stack import anthropic, bucket_key, chat, free_port, send, wait_until

BIG = 1_000_000
LONG = "366d"
pytestmark = pytest.mark.backend(mock_args=["--completion-tokens", "20"])


def test_the_anthropic_sdk_raises_its_rate_limit_error_and_reads_our_headers(backend):
    limits = [{"name": "rpm", "requests": 2, "window": "1m"}, {"name": "tpm", "tokens": BIG, "window": LONG}]
    port, _ = backend.envoy(backend.filter_config(limits))
    client = anthropic_sdk.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="sk-ant-sdk", max_retries=0)
    ask = dict(model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}])

    raw = client.messages.with_raw_response.create(**ask)
    assert raw.parse().usage.output_tokens == 20
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "1"
    reserved = int(raw.headers["x-llm-ratelimit-reserved-tokens"])
    assert raw.headers["anthropic-ratelimit-tokens-remaining"] == str(BIG - reserved)
    # The reset is an RFC 3339 time: when the request budget is full again, within its
    # one-minute window of now.
    reset = datetime.datetime.fromisoformat(raw.headers["anthropic-ratelimit-requests-reset"])
    now = datetime.datetime.now(datetime.timezone.utc)
    assert now < reset <= now + datetime.timedelta(seconds=61), reset
    assert "x-ratelimit-remaining-requests" not in raw.headers, "not OpenAI's headers"

    client.messages.create(**ask)
    with pytest.raises(anthropic_sdk.RateLimitError) as refused:
        client.messages.create(**ask)
    error = refused.value
    assert error.status_code == 429
    assert error.body == {"type": "error", "error": {"type": "rate_limit_error", "message": error.body["error"]["message"]}}
    assert 'limit "rpm" allows 2 per 1m0s' in error.body["error"]["message"]
    assert error.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert 1 <= int(error.response.headers["retry-after"]) <= 60
    assert backend.upstream_received() == 2, "the refused request never reached the upstream"


def test_the_anthropic_sdk_reads_our_413_and_503(backend):
    limits = [{"name": "tpm", "tokens": BIG, "window": LONG}]
    port, _ = backend.envoy(backend.filter_config(limits, tokens={"max_request_bytes": 1024}))
    client = anthropic_sdk.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="sk-ant-sdk", max_retries=0)
    with pytest.raises(anthropic_sdk.ContentTooLargeError) as too_large:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "x" * 4000}])
    assert too_large.value.status_code == 413
    assert too_large.value.body["error"]["type"] == "request_too_large"

    # The companion unreachable and failure_mode deny: 503, Anthropic's overloaded_error.
    down, _ = backend.envoy(backend.filter_config(limits, companion_timeout="200ms"), name="envoy-down",
                            companion_port=free_port())
    client = anthropic_sdk.Anthropic(base_url=f"http://127.0.0.1:{down}", api_key="sk-ant-sdk", max_retries=0)
    with pytest.raises(anthropic_sdk.ServiceUnavailableError) as unavailable:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["error"]["type"] == "overloaded_error"
    assert unavailable.value.response.headers["retry-after"] == "1"


def test_the_openai_sdk_still_raises_its_rate_limit_error(backend):
    limits = [{"name": "rpm", "requests": 1, "window": "1m"}]
    port, _ = backend.envoy(backend.filter_config(limits))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-openai-sdk", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert "anthropic-ratelimit-requests-remaining" not in raw.headers
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    error = refused.value
    assert (error.code, error.type) == ("rate_limit_exceeded", "requests")
    assert error.response.headers["x-ratelimit-limit-requests"] == "1"


def test_google_genai_raises_resource_exhausted_on_geminis_path(backend):
    limits = [{"name": "rpm", "requests": 1, "window": "1m"}]
    config = backend.filter_config(limits, identity={"sources": [{"header": "x-goog-api-key"}]})
    port, _ = backend.envoy(config)
    path = "/v1beta/models/gemini-2.0-flash:generateContent"
    # The tenant's one request of the minute.
    first = send(port, None, {"contents": [{"parts": [{"text": "hi"}]}]}, path=path, headers={"x-goog-api-key": "g-key"})
    assert first.status == 200
    client = genai.Client(api_key="g-key", http_options=genai.types.HttpOptions(base_url=f"http://127.0.0.1:{port}"))
    with pytest.raises(genai.errors.ClientError) as refused:
        client.models.generate_content(model="gemini-2.0-flash", contents="hi")
    error = refused.value
    assert (error.code, error.status) == (429, "RESOURCE_EXHAUSTED")
    assert 'limit "rpm" allows 1' in error.message
    retry = error.details["error"]["details"][0]
    assert retry["@type"] == "type.googleapis.com/google.rpc.RetryInfo" and retry["retryDelay"].endswith("s")


def test_boto3_raises_throttling_exception_on_bedrocks_path(backend):
    # SigV4 signs every request anew, so the tenant is the pooled anonymous one here.
    limits = [{"name": "rpm", "requests": 1, "window": "1m"}]
    config = backend.filter_config(limits, identity={"sources": [{"header": "x-tenant"}], "missing": "anonymous"})
    port, _ = backend.envoy(config)
    client = boto3.client("bedrock-runtime", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="mock-bedrock-secret",
                          config=Config(retries={"total_max_attempts": 1}))
    ask = dict(modelId="anthropic.claude-3-haiku-20240307-v1:0", messages=[{"role": "user", "content": [{"text": "hi"}]}])
    admitted = client.converse(**ask)  # the mock speaks Bedrock and checks the signature
    assert admitted["ResponseMetadata"]["HTTPStatusCode"] == 200
    with pytest.raises(client.exceptions.ThrottlingException) as refused:
        client.converse(**ask)
    error = refused.value.response
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 429
    assert error["Error"]["Code"] == "ThrottlingException"
    assert 'limit "rpm" allows 1' in error["Error"]["Message"]


def test_error_format_fixes_the_shape_whatever_the_path(backend):
    limits = [{"name": "rpm", "requests": 1, "window": "1m"}]
    port, _ = backend.envoy(backend.filter_config(limits, error_format="google"))
    assert send(port, "sk-fixed").status == 200
    status, headers, body = send(port, "sk-fixed")
    assert status == 429
    assert json.loads(body)["error"]["status"] == "RESOURCE_EXHAUSTED"
    assert "x-ratelimit-remaining-requests" not in headers, "Google publishes no rate-limit headers"
    assert headers["ratelimit"].startswith('"rpm";r=0')

    # A format the filter does not know is refused at load, naming the field.
    _, proc = backend.envoy(backend.filter_config(limits, error_format="cohere"), name="envoy-bad", wait=False)
    assert proc.popen.wait(timeout=60) != 0
    assert "invalid filter config: field `error_format`" in proc.log_path.read_text()


@pytest.mark.parametrize("path, shape", [
    ("/v1/messages", "anthropic"),
    ("/v1beta/models/gemini-2.0-flash:generateContent", "google"),
    ("/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse", "bedrock"),
    ("/v1/chat/completions", "openai"),
])
def test_envoys_own_413_is_mapped_into_the_callers_shape(backend, path, shape):
    """A body past Envoy's buffer limit (2 MiB in envoy/demo.yaml) is refused by Envoy
    before the filter can answer; the demo's local reply mappers put it in the shape the
    filter would have used for that path."""
    port, _ = backend.envoy(backend.filter_config([{"name": "tpm", "tokens": BIG, "window": LONG}],
                                                  tokens={"max_request_bytes": 16 << 20}))
    status, headers, payload, _ = post_reading_early(port, body_of(8_000_000), path=path)
    assert status == 413 and headers["content-type"] == "application/json"
    message = too_large(2 << 20)
    expected = {
        "anthropic": {"type": "error", "error": {"type": "request_too_large", "message": message}},
        "google": {"error": {"code": 413, "message": message, "status": "INVALID_ARGUMENT", "details": []}},
        "bedrock": {"message": message},
        "openai": {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}},
    }[shape]
    assert json.loads(payload) == expected
    assert headers.get("x-amzn-errortype") == ("ValidationException" if shape == "bedrock" else None)
    assert backend.upstream_received() == 0


# Token dimensions --------------------------------------------------------------------
def level(env_redis, key, limit):
    raw = env_redis.hget(bucket_key(key, limit), "tokens")
    return None if raw is None else float(raw)


def wait_level(env_redis, key, limit, expected):
    wait_until(lambda: level(env_redis, key, limit) is not None and abs(level(env_redis, key, limit) - expected) < 1.5,
               10, f"{limit} at {expected} (now {level(env_redis, key, limit)})")


def test_input_output_and_cached_limits_are_charged_and_settled_apart(backend):
    limits = [
        {"name": "itpm", "tokens": BIG, "window": LONG, "count": "input"},
        {"name": "otpm", "tokens": 500, "window": LONG, "count": "output"},
        {"name": "ctpm", "tokens": BIG, "window": LONG, "count": "cached_input"},
    ]
    port, _ = backend.envoy(backend.filter_config(limits))
    r = redis.Redis(port=backend.redis_port)
    key = "sk-dimensions"
    body = anthropic("Tell me a story about rate limits.", max_tokens=300)
    first = send(port, key, body, path="/v1/messages",
                 headers={"x-mock-completion-tokens": "300", "x-mock-cached-tokens": "5"})
    assert first.status == 200
    # Reserved: the prompt as counted against the input limit, max_tokens against the
    # output limit; the headers Anthropic's clients read say so.
    reserved_total = int(first.headers["x-llm-ratelimit-reserved-tokens"])
    reserved_input = reserved_total - 300
    assert first.headers["anthropic-ratelimit-input-tokens-remaining"] == str(BIG - reserved_input)
    assert first.headers["anthropic-ratelimit-output-tokens-remaining"] == "200"
    assert first.headers["anthropic-ratelimit-output-tokens-limit"] == "500"
    # Settled: each limit to its own part of what the upstream reported.
    prompt, output = int(first.headers["x-mock-prompt-tokens"]), int(first.headers["x-mock-completion-tokens"])
    assert output == 300 and prompt != reserved_input, "the settlement must move the input limit"
    wait_level(r, key, "itpm", BIG - prompt)
    wait_level(r, key, "otpm", 500 - 300)
    wait_level(r, key, "ctpm", BIG - 5)

    # The output limit has 200 left; the next request needs 300 of it: a 429 naming it,
    # while the input limit had plenty. Refilling over 366 days, the 100 missing take
    # weeks: past the retry horizon, so a spent quota (issue 45), not a rate limit.
    refused = send(port, key, body, path="/v1/messages")
    assert refused.status == 429
    error = json.loads(refused.body)["error"]
    assert error["type"] == "billing_error"
    assert 'Budget spent: limit "otpm" allows 500 output tokens' in error["message"]
    assert "this request needs 300 output tokens (its completion allowance)" in error["message"]
    assert refused.headers["anthropic-ratelimit-output-tokens-remaining"] == "200"
    assert refused.headers["x-should-retry"] == "false"

    # An OpenAI caller of the same tenant: refused by the same limit, in OpenAI's words.
    refused = send(port, key, chat("hi", max_tokens=300))
    assert refused.status == 429
    assert json.loads(refused.body)["error"]["code"] == "insufficient_quota"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "200", "the tightest token limit"


def test_anthropics_reset_is_when_the_bucket_is_full_again_rounded_up(backend):
    """docs/clients.md: the reset is "the time the limit is full again (RFC 3339, UTC, by the
    proxy's clock, rounded up to the second)". Ten requests per 10 s refill one a second:
    three requests taken at once are back three seconds after they were taken."""
    port, _ = backend.envoy(backend.filter_config([{"name": "rp10s", "requests": 10, "window": "10s"}]))
    first = time.time()
    replies = [send(port, None, anthropic("hi", max_tokens=16), path="/v1/messages", headers={"x-api-key": "sk-ant-reset"})
               for _ in range(3)]
    last = time.time()
    assert [r.status for r in replies] == [200] * 3
    reset = datetime.datetime.fromisoformat(replies[-1].headers["anthropic-ratelimit-requests-reset"])
    assert reset.tzinfo == datetime.timezone.utc and reset.microsecond == 0
    # Full again 3 s after the first was taken at the earliest, 3 s after the last at the
    # latest; rounded up to the whole second.
    assert math.ceil(first + 3) <= reset.timestamp() <= math.ceil(last + 3), (first, reset.timestamp(), last)


@pytest.mark.parametrize("path, body, ours", [
    ("/v1/chat/completions", chat(max_tokens=16), ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                                                    "x-ratelimit-reset-requests", "ratelimit-policy", "ratelimit"]),
    ("/v1/messages", anthropic("hi", max_tokens=16), ["anthropic-ratelimit-requests-limit",
                                                      "anthropic-ratelimit-requests-remaining",
                                                      "anthropic-ratelimit-requests-reset", "ratelimit"]),
], ids=["openai", "anthropic"])
def test_our_headers_replace_the_upstreams_of_the_same_name(backend, path, body, ours):
    """docs/clients.md: "The filter's headers replace any of the same name from the upstream". The
    mock sends each of them itself (x-mock-set-<name>), with a value the filter never would;
    the client sees the filter's, once; a header the filter does not set passes."""
    port, _ = backend.envoy(backend.filter_config([{"name": "rpm", "requests": 20, "window": "1m"}]))
    sent = {"authorization": "Bearer sk-hdr", "x-api-key": "sk-hdr", "content-type": "application/json",
            "x-mock-set-x-upstream-own": "kept"}
    sent.update({f"x-mock-set-{name}": "upstream-999" for name in ours})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body), headers=sent)
        resp = conn.getresponse()
        resp.read()
        received = [(k.lower(), v) for k, v in resp.getheaders()]
    finally:
        conn.close()
    assert resp.status == 200
    assert ("x-upstream-own", "kept") in received, "the mock's switch works: an unrelated header passes"
    for name in ours:
        values = [v for k, v in received if k == name]
        assert len(values) == 1 and "upstream-999" not in values[0], (name, values)
    limit_header = "x-ratelimit-limit-requests" if path.endswith("completions") else "anthropic-ratelimit-requests-limit"
    assert dict(received)[limit_header] == "20"
