"""Each request's record in Envoy's own access log (issue 45): the filter publishes what it
decided and what the request cost as filter state, and the demo's access log
(envoy/demo.yaml) prints it with `%FILTER_STATE(wasm.llm_ratelimit:PLAIN)%`. Checked
against what the mock upstream billed and what the filter charged, for a JSON reply, an
SSE stream, an upstream error, a client that hangs up mid-stream, and a refusal."""

import json
import socket

import pytest

from helpers import access_log_records as records
from stack import chat, filter_metric, send, wait_until

PRICES = [{"match": "gpt-4o*", "input": 2.5, "output": 10.0}]
LIMITS = [{"name": "tpm", "tokens": 10_000_000, "window": "1h"}, {"name": "rpm", "requests": 6, "window": "1m"},
          {"name": "usd", "usd": 1000, "window": "1d"}]


def micro_usd(input_tokens: int, output_tokens: int) -> int:
    """What the filter charges a cost limit, in micro-dollars, rounded up."""
    return -(-(input_tokens * 2_500_000 + output_tokens * 10_000_000) // 1_000_000)


@pytest.fixture
def proxy(backend):
    config = backend.filter_config(LIMITS, prices=PRICES)
    port, envoy = backend.envoy(config)
    return port, envoy


def next_record(envoy, seen: int) -> dict:
    wait_until(lambda: len(records(envoy)) > seen, 10, "the access log line")
    return records(envoy)[seen]


def test_each_request_is_recorded_with_what_it_used_and_cost(proxy):
    port, envoy = proxy
    # A JSON reply: the record carries the usage the upstream billed.
    reply = send(port, "sk-record", chat("hello there", model="gpt-4o"))
    assert reply.status == 200
    billed_in, billed_out = int(reply.headers["x-mock-prompt-tokens"]), int(reply.headers["x-mock-completion-tokens"])
    entry = next_record(envoy, 0)
    record = entry["record"]
    assert entry["status"] == 200
    assert (record["input_tokens"], record["output_tokens"]) == (billed_in, billed_out)
    assert record["cost_micro_usd"] == micro_usd(billed_in, billed_out)
    assert (record["decision"], record["provider"], record["api"], record["model"]) == (
        "charge", "openai", "chat_completions", "gpt-4o")
    assert len(record["tenant"]) == 32 and "sk-record" not in json.dumps(entry), "the tenant's id, never its key"

    # An SSE stream: its usage chunk (asked for by the filter) is what is recorded.
    reply = send(port, "sk-record", chat("stream it", model="gpt-4o", stream=True))
    assert reply.status == 200
    streamed = next_record(envoy, 1)["record"]
    billed_in, billed_out = int(reply.headers["x-mock-prompt-tokens"]), int(reply.headers["x-mock-completion-tokens"])
    assert (streamed["input_tokens"], streamed["output_tokens"]) == (billed_in, billed_out)
    assert streamed["cost_micro_usd"] == micro_usd(billed_in, billed_out)

    # An upstream error: the prompt alone (`tokens.on_upstream_error`'s default).
    reply = send(port, "sk-record", chat("fail", model="gpt-4o"), headers={"x-mock-status": "500"})
    assert reply.status == 500
    failed = next_record(envoy, 2)["record"]
    assert failed["output_tokens"] == 0 and failed["input_tokens"] > 0
    assert failed["cost_micro_usd"] == micro_usd(failed["input_tokens"], 0)


def test_a_leased_stream_asks_for_usage_and_is_recorded_at_what_the_upstream_billed(backend):
    # Admitted from a lease, with no callout: the body is still rewritten to ask for the
    # usage chunk (`tokens.request_stream_usage`), which the client does not see. Before,
    # only callout and local-store admissions were: a leased stream was charged its text
    # as the proxy counted it, not what the upstream billed.
    config = backend.filter_config(LIMITS, prices=PRICES, lease={"enabled": True})
    port, envoy = backend.envoy(config)
    # The first request asks for the tenant's lease; the others are admitted from it.
    for i in range(3):
        reply = send(port, "sk-leased-stream", chat("stream it, please, at some length", model="gpt-4o", stream=True))
        assert reply.status == 200
        assert '"choices":[]' not in reply.body.decode(), "the client did not ask for the usage chunk"
        billed_in, billed_out = int(reply.headers["x-mock-prompt-tokens"]), int(reply.headers["x-mock-completion-tokens"])
        record = next_record(envoy, i)["record"]
        assert (record["input_tokens"], record["output_tokens"]) == (billed_in, billed_out), (i, record)
        assert record["cost_micro_usd"] == micro_usd(billed_in, billed_out)


def test_a_client_that_hangs_up_mid_stream_is_recorded_at_what_it_was_charged(backend, proxy):
    port, envoy = proxy
    admin_port = json.loads((envoy.log_path.parent / "envoy.json").read_text())["admin"]["address"]["socket_address"]["port_value"]
    charged_before = filter_metric(admin_port, "llm_ratelimit_tokens_charged_total") or 0
    body = json.dumps(chat("a long story", model="gpt-4o", stream=True, max_tokens=2000)).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hangup\r\n"
        b"content-type: application/json\r\nx-mock-completion-tokens: 2000\r\nx-mock-chunk-delay-ms: 20\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while received.count(b"data: ") < 5:
        chunk = sock.recv(4096)
        assert chunk, "the stream ended early"
        received += chunk
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()
    record = next_record(envoy, 0)["record"]
    wait_until(lambda: (filter_metric(admin_port, "llm_ratelimit_tokens_charged_total") or 0) > charged_before, 10,
               "the settlement")
    charged = (filter_metric(admin_port, "llm_ratelimit_tokens_charged_total") or 0) - charged_before
    assert record["input_tokens"] + record["output_tokens"] == charged, (record, charged)
    assert record["output_tokens"] >= 2000, "cut off after its headers: at least its reservation"
    assert record["cost_micro_usd"] == micro_usd(record["input_tokens"], record["output_tokens"])


def test_a_refusal_is_recorded_with_the_limit_that_refused_it(proxy):
    port, envoy = proxy
    statuses = [send(port, "sk-refused", chat("hi", model="gpt-4o")).status for _ in range(7)]
    assert statuses == [200] * 6 + [429]
    wait_until(lambda: len(records(envoy)) >= 7, 10, "seven access log lines")
    refused = records(envoy)[6]
    assert refused["status"] == 429
    assert (refused["record"]["decision"], refused["record"]["refused_by"]) == ("refused", "rpm")
    assert refused["record"]["cost_micro_usd"] == 0
