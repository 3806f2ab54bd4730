"""Token-aware limits end to end through Envoy: prompts counted in the proxy, a
reservation charged before the request goes upstream, and the real usage settled after,
for OpenAI and Anthropic, JSON and streams, completed, failed and interrupted."""

import concurrent.futures
import json
import socket
from types import SimpleNamespace

import pytest
import redis

from conftest import openai_chat_prompt_tokens
from stack import anthropic, bucket_key, chat, send, wait_until
from helpers import companion_metric as metric, companion_scrape as scrape

# A budget so long-lived that refill during a test is below one token.
BIG = 1_000_000
LONG = "366d"
STORY = "Tell me a story about rate limits."
pytestmark = pytest.mark.backend(mock_args=["--completion-tokens", "20"])


@pytest.fixture
def env(backend):
    def start(limits, tokens=None, name="envoy", **extra):
        return backend.envoy(backend.filter_config(limits, tokens=tokens or None, **extra), name=name)[0]

    return SimpleNamespace(redis=redis.Redis(port=backend.redis_port), start=start)


def bucket_level(env, key, limit="tpm"):
    raw = env.redis.hget(bucket_key(key, limit), "tokens")
    return None if raw is None else float(raw)


def wait_level(env, key, expected, limit="tpm"):
    """Settlement is asynchronous (the next tick): wait for the bucket to show it (to the
    token: a 366-day window refills 0.03 a second), longer
    than a settlement's retries take (about 11 s, docs/failures.md)."""
    return wait_until(lambda: bucket_level(env, key, limit) is not None and abs(bucket_level(env, key, limit) - expected) < 0.6,
                      15, f"bucket {limit} at {expected} (now {bucket_level(env, key, limit)})")


def sse_events(body):
    return [e for e in body.decode().split("\n\n") if e.strip()]


@pytest.mark.parametrize(
    "path, body, streamed",
    [
        ("/v1/chat/completions", chat(STORY, max_tokens=500), False),
        ("/v1/chat/completions", chat(STORY, max_tokens=500, stream=True, stream_options={"include_usage": True}), True),
        ("/v1/messages", anthropic(STORY), False),
        ("/v1/messages", anthropic(STORY, stream=True), True),
    ],
    ids=["openai-json", "openai-stream", "anthropic-json", "anthropic-stream"],
)
def test_the_reported_usage_is_charged_not_the_estimate(env, path, body, streamed):
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    key = "sk-usage"
    status, headers, payload = send(port, key, body, path=path)
    assert status == 200
    reserved = int(headers["x-llm-ratelimit-reserved-tokens"])
    cap = body.get("max_tokens")
    assert reserved > cap  # the prompt, counted in the proxy, plus the output cap
    # Each caller reads its provider's headers (tests/e2e/test_api_answers.py).
    convention = "anthropic-ratelimit-tokens-{}" if path == "/v1/messages" else "x-ratelimit-{}-tokens"
    assert int(headers[convention.format("remaining")]) == BIG - reserved
    assert headers[convention.format("limit")] == str(BIG)
    actual = int(headers["x-mock-prompt-tokens"]) + int(headers["x-mock-completion-tokens"])
    assert actual < reserved
    if streamed:
        assert sse_events(payload)[-1] in ("data: [DONE]", 'event: message_stop\ndata: {"type":"message_stop"}')
    wait_level(env, key, BIG - actual)


def story_prompt(tiktoken_encodings):
    """The prompt of `chat(STORY)` as OpenAI counts it (tiktoken, o200k_base)."""
    return openai_chat_prompt_tokens(tiktoken_encodings["o200k_base"], [{"role": "user", "content": STORY}])


def test_a_stream_without_usage_is_charged_its_counted_text(env, tiktoken_encodings):
    # Without the usage chunk asked for (the default asks), a model that shows all it
    # spends is charged what it streamed.
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}], tokens={"request_stream_usage": False})
    status, headers, _ = send(port, "sk-nousage", chat(STORY, max_tokens=500, stream=True),
                              headers={"x-mock-completion-tokens": "30"})
    assert status == 200
    # The mock streams one token per chunk: 30, and the prompt as tiktoken counts it.
    wait_level(env, "sk-nousage", BIG - (story_prompt(tiktoken_encodings) + 30))


def test_the_filter_can_ask_for_stream_usage_and_hide_it_from_the_client(env):
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}], tokens={"request_stream_usage": True})
    status, headers, payload = send(port, "sk-inject", chat(STORY, max_tokens=500, stream=True))
    assert status == 200
    events = sse_events(payload)
    assert events[-1] == "data: [DONE]"
    assert not any('"choices":[]' in e for e in events), "the client did not ask for the usage chunk"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)
    # Charged what the provider reported (its own prompt count), not what the proxy counted.
    actual = int(headers["x-mock-prompt-tokens"]) + int(headers["x-mock-completion-tokens"])
    wait_level(env, "sk-inject", BIG - actual)


def test_an_upstream_error_is_charged_the_prompt_only(env, tiktoken_encodings):
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    status, headers, _ = send(port, "sk-error", chat(STORY, max_tokens=800), headers={"x-mock-status": "500"})
    assert status == 500
    wait_level(env, "sk-error", BIG - story_prompt(tiktoken_encodings))


def open_stream(port, key, mock_headers: bytes):
    """A raw connection that has sent a streamed chat of STORY (max_tokens 1,000) with
    these x-mock-* header lines, for a test that reads the reply as it comes."""
    body = json.dumps(chat(STORY, max_tokens=1000, stream=True)).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\r\n"
                 + mock_headers + b"content-type: application/json\r\n"
                 + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_an_upstream_reset_mid_stream_is_settled_exactly_once(env, backend, tiktoken_encodings):
    """The upstream breaks the connection in the middle of a stream (after 1,500 bytes of
    it): the request is settled once, at no less than its reservation (the prompt, OpenAI's
    count by tiktoken, and max_tokens 1,000), though fewer tokens were streamed."""
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    messages = [{"role": "user", "content": STORY}]
    sock = open_stream(port, "sk-reset", b"x-mock-completion-tokens: 1000\r\nx-mock-abort-after-bytes: 1500\r\n")
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    head, _, stream = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"[DONE]" not in stream, "the stream was cut"
    # The content deltas that arrived whole (the chunked framing aside: each event is one
    # JSON line, and a cut one does not parse).
    streamed = 0
    for line in stream.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = json.loads(line[len(b"data: "):])
            except json.JSONDecodeError:
                continue
            streamed += 1 if event["choices"][0]["delta"].get("content") else 0
    assert 0 < streamed < 1000
    prompt = openai_chat_prompt_tokens(tiktoken_encodings["o200k_base"], messages)
    wait_level(env, "sk-reset", BIG - (prompt + 1000))
    # Settled at the reservation, so there is nothing to give back (no settlement is sent);
    # applied twice or with the streamed count the level would differ.
    assert abs(bucket_level(env, "sk-reset") - (BIG - (prompt + 1000))) < 0.01


def test_a_client_that_disconnects_mid_stream_is_charged_its_reservation(env, tiktoken_encodings):
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    sock = open_stream(port, "sk-leaver", b"x-mock-completion-tokens: 1000\r\nx-mock-chunk-delay-ms: 20\r\n")
    received = b""
    while received.count(b"data: ") < 12:
        received += sock.recv(65536)
    sock.close()
    prompt = story_prompt(tiktoken_encodings)
    # The upstream goes on generating (and the provider bills it): the reservation (the
    # prompt and max_tokens 1,000) stands, not the dozen tokens the client saw
    # (tests/adversarial/test_adversarial_replies.py).
    wait_level(env, "sk-leaver", BIG - (prompt + 1000))


def test_a_token_limit_rejects_with_its_own_429(env):
    # An hour's window, retried within the horizon: the retryable 429 (issue 45).
    port = env.start([{"name": "rpm", "requests": 100, "window": "1m"}, {"name": "tpm", "tokens": 1000, "window": "1h"}],
                     refusals={"retry_horizon": "1h"})
    status, headers, _ = send(port, "sk-tokens", chat(STORY, max_tokens=600), headers={"x-mock-completion-tokens": "600"})
    assert status == 200
    wait_level(env, "sk-tokens", 1000 - 600 - int(headers["x-mock-prompt-tokens"]))
    status, headers, payload = send(port, "sk-tokens", chat(STORY, max_tokens=600))
    assert status == 429
    error = json.loads(payload)["error"]
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
    assert '"tpm"' in error["message"] and "this request needs" in error["message"]
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-requests"] == "99"  # the rejected request charged nothing
    # A request that could never fit says so, without a Retry-After.
    status, headers, payload = send(port, "sk-huge", chat(STORY, max_tokens=5000))
    assert status == 429 and "retry-after" not in headers
    assert "can never be admitted" in json.loads(payload)["error"]["message"]


def test_clamping_shrinks_max_tokens_to_what_is_left(env):
    port = env.start([{"name": "tpm", "tokens": 1000, "window": LONG}],
                     tokens={"clamp_max_tokens": True, "min_output_tokens": 50})
    status, headers, _ = send(port, "sk-clamp", chat(STORY, max_tokens=600), headers={"x-mock-completion-tokens": "600"})
    assert status == 200 and headers["x-mock-completion-tokens"] == "600"
    first = int(headers["x-mock-prompt-tokens"]) + 600
    wait_level(env, "sk-clamp", 1000 - first)
    # What is left is less than this request's upper bound: it is admitted with a smaller
    # max_tokens, which the upstream sees and honours.
    status, headers, _ = send(port, "sk-clamp", chat(STORY, max_tokens=600), headers={"x-mock-completion-tokens": "600"})
    assert status == 200
    granted = int(headers["x-mock-completion-tokens"])
    reserved = int(headers["x-llm-ratelimit-reserved-tokens"])
    assert 50 <= granted < 600
    assert int(headers["x-ratelimit-remaining-tokens"]) == 0
    assert reserved == 1000 - first  # exactly what was left
    # Nothing useful is left now: a 429, not a uselessly small grant; refilling over 366
    # days, a spent quota (issue 45).
    wait_level(env, "sk-clamp", 1000 - first - int(headers["x-mock-prompt-tokens"]) - granted)
    status, _, payload = send(port, "sk-clamp", chat(STORY, max_tokens=600))
    assert status == 429 and json.loads(payload)["error"]["code"] == "insufficient_quota"


@pytest.mark.parametrize("clamp", [False, True], ids=["reserve", "reserve-and-clamp"])
def test_parallel_long_completions_never_overshoot_the_limit(env, clamp):
    """40 parallel streams of long completions against a TPM limit: the reservations
    (prompt + max_tokens) hold the limit; settlement only gives back what was unused.
    With clamping, the last admissions shrink their max_tokens to fill the limit exactly."""
    limit = 20_000
    port = env.start([{"name": "tpm", "tokens": limit, "window": LONG}],
                     tokens={"clamp_max_tokens": clamp, "min_output_tokens": 100})

    def one(i):
        body = chat(f"Request {i}: write a long essay.", max_tokens=1000, stream=True, stream_options={"include_usage": True})
        status, headers, payload = send(port, "sk-burst", body,
                                        headers={"x-mock-completion-tokens": "1000", "x-mock-chunk-delay-ms": "1"})
        if status != 200:
            return status, 0, None
        usage = json.loads(sse_events(payload)[-2][len("data: "):])["usage"]
        # What the upstream saw as max_tokens: the mock completes min(1000, max_tokens).
        return status, usage["total_tokens"], int(headers["x-mock-completion-tokens"])

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(one, range(40)))
    admitted = sum(tokens for status, tokens, _ in results if status == 200)
    statuses = [status for status, _, _ in results]
    caps = [cap for status, _, cap in results if status == 200]
    if clamp:
        # Clamping rewrote max_tokens of the admissions that did not fit whole: the
        # upstream saw a cap below the 1,000 asked for, never below min_output_tokens.
        assert any(cap < 1000 for cap in caps), caps
        assert all(100 <= cap <= 1000 for cap in caps), caps
    else:
        assert caps == [1000] * len(caps), "without clamping the request goes upstream as sent"
    assert statuses.count(200) + statuses.count(429) == 40
    assert 0 < statuses.count(200) < 40
    overshoot = (admitted - limit) / limit
    print(f"\n{'clamped' if clamp else 'reserved'}: admitted {admitted} tokens of {limit} in {statuses.count(200)} requests: "
          f"overshoot {overshoot:+.2%}")
    assert admitted <= limit
    wait_level(env, "sk-burst", limit - admitted)


def test_a_request_without_a_body_costs_the_fallback(env):
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}], tokens={"unparsed_request_cost": 123})
    status, headers, _ = send(port, "sk-nobody", None)
    assert status == 400  # the mock's answer
    assert headers["x-llm-ratelimit-reserved-tokens"] == "123"
    # What the filter cannot read is charged the configured fallback, in Redis.
    wait_level(env, "sk-nobody", BIG - 123)


@pytest.mark.parametrize("body", [b"not json at all", b"[1, 2]"], ids=["not-json", "not-an-object"])
def test_bad_bodies_are_refused_by_default(env, body):
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}], tokens={"unparsed_request_cost": 123})
    status, _, payload = send(port, "sk-bad", body)
    assert status == 400 and json.loads(payload)["error"]["code"] == "invalid_body"
    # Refused by the filter: nothing reached the upstream, nothing was charged.
    assert bucket_level(env, "sk-bad") in (None, BIG)


def test_bad_bodies_are_charged_the_most_when_configured(env):
    # tokens.unreadable_body: charge_most: its bytes as tokens plus the output cap.
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}],
                     tokens={"unreadable_body": "charge_most", "default_max_output": 4096})
    status, headers, _ = send(port, "sk-most", b"not json at all")
    assert status == 400  # the mock's answer; the filter charged the most
    most = len(b"not json at all") + 4096
    assert headers["x-llm-ratelimit-reserved-tokens"] == str(most)
    # Never settled: once a later request's settlement has landed (any settlement of the
    # first would have gone out before it), the charge still stands whole.
    status, barrier, _ = send(port, "sk-barrier", chat("hello"))
    assert status == 200
    wait_level(env, "sk-barrier", BIG - int(barrier["x-mock-prompt-tokens"]) - int(barrier["x-mock-completion-tokens"]))
    assert abs(bucket_level(env, "sk-most", "tpm") - (BIG - most)) < 0.6


def test_a_body_over_the_limit_is_refused_with_413(env):
    port = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}], tokens={"max_request_bytes": 2048})
    status, _, payload = send(port, "sk-big", chat("x" * 4096))
    assert status == 413 and json.loads(payload)["error"]["code"] == "request_too_large"
