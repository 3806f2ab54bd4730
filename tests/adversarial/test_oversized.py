"""Oversized request bodies, as a client sees them through Envoy (envoy/demo.yaml).

Two limits apply to a body the filter reads to count tokens: the filter's own
`tokens.max_request_bytes` (1 MiB by default), answered with its JSON 413, and Envoy's
buffer limit (`per_connection_buffer_limit_bytes` on the listener: 2 MiB in the demo),
answered by Envoy itself. Envoy's own 413 is plain text `Payload Too Large` unless the
connection manager's `local_reply_config` rewrites it: the demo's mapper turns it into
OpenAI's error JSON, and leaves the filter's 413 (JSON already) alone.

Both answers come while the client is still uploading: Envoy replies, with `connection:
close`, as soon as the limit is passed. A client that reads the response while it sends
(as the helper below does, and as urllib3/requests do when the upload fails) gets the
413; one that insists on finishing the upload first may see the connection reset instead.
"""

import json

import pytest
import requests

from helpers import chat_of_size as body_of, post_reading_early, too_large_message as too_large
from stack import chat, envoy_config, free_port, send

LIMITS = [{"name": "rpm", "requests": 1_000_000, "window": "1m"},
          {"name": "tpm", "tokens": 10**12, "window": "1m"}]  # a token limit: the filter reads the body
MiB = 1 << 20


def policy(backend, limits=LIMITS, **options) -> dict:
    """A filter config; the companion timeout is generous because the first requests after
    Envoy starts wait for the vocabularies to be built (longer on a busy machine)."""
    return backend.filter_config(limits, companion_timeout="10s", **options)


def openai_error(headers: dict, payload: bytes) -> dict:
    """The `error` object of an OpenAI-shaped error response (one JSON object, not two)."""
    assert headers["content-type"] == "application/json"
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] is None
    return error


def test_a_body_over_max_request_bytes_gets_the_filters_json_413(backend):
    """1.5 MB: over the filter's 1 MiB, under Envoy's 2 MiB buffer. The filter answers, and
    its JSON passes the local reply mapper unchanged (no double wrapping)."""
    port = backend.envoy(policy(backend))[0]
    status, headers, payload, _ = post_reading_early(port, body_of(1_500_000))
    assert status == 413
    error = openai_error(headers, payload)
    assert error["code"] == "request_too_large"
    assert error["message"] == too_large(1048576)
    assert backend.upstream_received() == 0


def test_an_8mb_body_gets_a_json_413_from_the_filter_under_the_demo_config(backend):
    """What a client sending 8 MB sees with the demo config: the filter's 413, byte for
    byte. (When the body arrives in reads large enough to pass both limits at once, Envoy's
    buffer limit trips first, as the filter's reply is sent from the next event-loop turn;
    the mapper's reply is then the same bytes.)"""
    port = backend.envoy(policy(backend))[0]
    status, headers, payload, _ = post_reading_early(port, body_of(8_000_000))
    assert status == 413 and headers["connection"] == "close"
    openai_error(headers, payload)
    assert json.loads(payload) == {"error": {"code": "request_too_large", "message": too_large(1048576), "param": None,
                                             "type": "invalid_request_error"}}
    assert payload == (b'{"error":{"code":"request_too_large","message":"' + too_large(1048576).encode()
                       + b'","param":null,"type":"invalid_request_error"}}')
    assert backend.upstream_received() == 0


def test_a_body_over_envoys_buffer_limit_gets_a_json_413(backend):
    """The filter would read 16 MiB, but Envoy buffers at most 2 MiB (the demo's listener
    limit): Envoy answers, and the mapper makes its plain-text `Payload Too Large` into
    OpenAI's error JSON. Without the mapper the client saw `content-type: text/plain` and
    the body `Payload Too Large`."""
    port = backend.envoy(policy(backend, tokens={"max_request_bytes": 16 * MiB}))[0]
    status, headers, payload, _ = post_reading_early(port, body_of(8_000_000))
    assert status == 413 and headers["connection"] == "close"
    error = openai_error(headers, payload)
    assert error == {"message": too_large(2097152), "type": "invalid_request_error", "param": None,
                     "code": "request_too_large"}
    assert backend.upstream_received() == 0


def test_another_buffer_limit_is_named_in_envoys_413(backend, stack):
    """`envoy_config(buffer_limit=...)` sets the listener's limit and the number in the
    mapped reply (the smaller of it and the filter's 16 MiB)."""
    port = free_port()
    stack.envoy(envoy_config(listen_port=port, admin_port=free_port(), upstream_port=backend.mock_port,
                             companion_port=backend.companion_port, buffer_limit=3 * MiB,
                             filter_config=policy(backend, tokens={"max_request_bytes": 16 * MiB})),
                name="envoy-3mib")
    status, headers, payload, _ = post_reading_early(port, body_of(8_000_000))
    assert status == 413
    assert openai_error(headers, payload)["message"] == too_large(3 * MiB)
    # Under both limits (and under the mock upstream's own 2 MiB): counted and forwarded.
    reply = send(port, key="sk-small-enough", body=body_of(2_000_000), timeout=60)
    assert reply.status == 200 and int(reply.headers["x-llm-ratelimit-reserved-tokens"]) > 200_000


def test_a_python_client_reads_the_413_of_an_8mb_upload(backend):
    """requests (urllib3 2) reads the response when the server answers and closes during
    the upload: the client gets the 413 and its JSON, not a connection reset. (The
    official `openai` SDK is not installed here; it uses httpx.)"""
    port = backend.envoy(policy(backend, tokens={"max_request_bytes": 16 * MiB}))[0]
    response = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=body_of(8_000_000), timeout=30,
                             headers={"authorization": "Bearer sk-requests", "content-type": "application/json"})
    assert response.status_code == 413
    error = openai_error({k.lower(): v for k, v in response.headers.items()}, response.content)
    assert error["message"] == too_large(2 * MiB)


@pytest.mark.parametrize("size", [0, 200_000, 1_000_000])
def test_requests_under_the_limits_still_pass(backend, size):
    port = backend.envoy(policy(backend))[0]
    reply = send(port, key="sk-normal", body=body_of(size) if size else chat("Say hello"), timeout=60)
    assert reply.status == 200, reply.body[:300]
    assert json.loads(reply.body)["object"] == "chat.completion"
    assert int(reply.headers["x-llm-ratelimit-reserved-tokens"]) > size // 10
    assert backend.upstream_received() == 1


def test_other_local_replies_are_not_rewritten(backend):
    """The mapper touches Envoy's 413 only: the filter's 429 keeps its JSON and headers."""
    # Per minute: a retryable 429 (an hour's would be a spent quota's, issue 45).
    port = backend.envoy(policy(backend, [{"name": "rpm", "requests": 1, "window": "1m"}]))[0]
    assert send(port, key="sk-limited").status == 200
    status, headers, payload = send(port, key="sk-limited")
    assert status == 429 and headers["content-type"] == "application/json" and "retry-after" in headers
    assert json.loads(payload)["error"]["code"] == "rate_limit_exceeded"
