"""What a client sees of the filter's own replies, end to end through Envoy: the wait in
`retry-after-ms` as the OpenAI and Anthropic SDKs read it first, the IETF `RateLimit`
header agreeing with `Retry-After` where nothing is left (draft-ietf-httpapi-ratelimit-headers:
`t` is when the quota is worth asking again), a request id on every reply of the filter's
own, and a 401 that names the credential of the caller's own API."""

import json
import re
import time

from stack import anthropic, send

LIMITS = [{"name": "rpm", "requests": 2, "window": "1m"}]


def test_a_429_carries_retry_after_ms_and_an_ietf_t_that_agrees_with_retry_after(backend):
    port, _ = backend.envoy(backend.filter_config(LIMITS))
    replies = [send(port, key="sk-surface") for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 429]
    refused = replies[2].headers
    retry_after, retry_after_ms = int(refused["retry-after"]), int(refused["retry-after-ms"])
    # A 2-per-minute bucket refills one request every 30 s.
    assert 25_000 < retry_after_ms <= 30_000, refused
    assert retry_after == -(-retry_after_ms // 1000), "retry-after is retry-after-ms rounded up"
    t = int(re.search(r'"rpm";r=0;t=(\d+)', refused["ratelimit"]).group(1))
    assert t == retry_after, f"IETF t={t} beside retry-after {retry_after}: {refused['ratelimit']}"
    # The filter's own reply has a request id under both names; the upstream's replies are its own.
    assert refused["x-request-id"] and refused["request-id"] == refused["x-request-id"]


def test_a_client_that_waits_retry_after_finds_room(backend):
    """docs/clients.md: "`Retry-After` is in whole seconds, rounded up: a
    client that waits that long finds room." One request per 3 s: the refusal's wait is
    under 3 s, and a client that waits its `Retry-After` from the refusal's arrival is
    admitted. A wait rounded down (2 s for 2.9) sends that client back too early: refused."""
    port, _ = backend.envoy(backend.filter_config([{"name": "rp3s", "requests": 1, "window": "3s"}]))
    assert send(port, key="sk-waits").status == 200
    refused = send(port, key="sk-waits")
    assert refused.status == 429, refused
    wait, wait_ms = int(refused.headers["retry-after"]), int(refused.headers["retry-after-ms"])
    assert 1 <= wait <= 3 and 0 < wait_ms <= 3_000, refused.headers
    # The client's side of the contract is time, not state: it waits that long, then asks.
    while time.monotonic() < refused.done + wait:
        time.sleep(0.01)
    admitted = send(port, key="sk-waits")
    assert admitted.status == 200, (wait, wait_ms, admitted)


def test_the_401_names_each_apis_own_credential_and_carries_a_request_id(backend):
    port, _ = backend.envoy(backend.filter_config(LIMITS))
    claude = send(port, key=None, body=anthropic(), path="/v1/messages")
    assert claude.status == 401
    message = json.loads(claude.body)["error"]["message"]
    assert "x-api-key" in message and "Bearer" not in message, message
    assert claude.headers.get("request-id"), claude.headers
    openai = send(port, key=None)
    assert openai.status == 401 and "Authorization: Bearer" in json.loads(openai.body)["error"]["message"]
    # Two replies, two ids.
    assert openai.headers["x-request-id"] != claude.headers["x-request-id"]
