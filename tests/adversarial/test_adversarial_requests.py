"""A tenant who shapes its request to pay less (issue 26, items 1, 5, 6 and 8), through real
Envoy, the companion, Redis and the mock upstream: a credential of its own choosing beside
the one the upstream authenticates, a credential header sent twice, forged Bedrock requests
naming a victim, `n: 64` at the price of one, bodies and paths the filter would read
differently from the upstream, the Batch and Realtime APIs. Each test fails on the build
before the fix (docs/clients.md#what-a-client-cannot-do, request side); the figures in
each docstring are the old filter's."""

import hashlib
import json
import socket
import uuid

import boto3
import botocore.exceptions
import pytest
import redis
from botocore.config import Config

from conftest import openai_chat_prompt_tokens
from stack import bucket_level, chat, send, tenant_of, wait_until

LONG = "366d"
RPM = [{"name": "rpm", "requests": 20, "window": LONG}]
BIG = 10_000_000
TPM = [{"name": "tpm", "tokens": BIG, "window": LONG}]
AZURE = "/openai/deployments/prod/chat/completions?api-version=2024-10-21"
GEMINI = "/v1beta/models/gemini-2.5-flash:generateContent"
NOVA = "us.amazon.nova-lite-v1:0"
BEDROCK_SECRET = "mock-bedrock-secret"  # what the mock checks every signature with
pytestmark = pytest.mark.backend(mock_args=["--completion-tokens", "20"])


def random_key() -> str:
    return f"sk-{uuid.uuid4().hex}"


def billed(reply) -> str:
    """The credential the upstream authenticated, as the mock marks its answer (the
    SHA-256 of the key it read, from the place its API reads it)."""
    return reply.headers.get("x-mock-credential", "")


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def admitted(statuses) -> int:
    assert set(statuses) <= {200, 429}, statuses
    return statuses.count(200)


def gemini_body():
    return {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 50}}


def error_code(reply) -> str:
    """The `code` of an OpenAI-shaped error body."""
    return json.loads(reply.body)["error"]["code"]


def tenant_keys(client: redis.Redis, key: str) -> list:
    """Every Redis key of the tenant this credential names."""
    return client.keys(f"*{tenant_of(key)}*")


def raw(port: int, head: str | bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Sends this request line and these headers exactly as written (nothing normalised or
    merged by a client library; bytes when a value is not text); returns the status and
    the body."""
    head = head if isinstance(head, bytes) else head.encode()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(head + f"Host: x\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status = int(received.split(b" ", 2)[1])
    return status, received.split(b"\r\n\r\n", 1)[1]


def test_azure_a_random_x_api_key_beside_the_api_key_does_not_make_a_new_tenant(backend):
    """Item 1, old filter: 24/24 admitted (keyed on the random `x-api-key`)."""
    port, _ = backend.envoy_for(RPM)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    replies = [send(port, None, body, path=AZURE, headers={"api-key": "ak-real", "x-api-key": random_key()})
               for _ in range(24)]
    assert admitted([r.status for r in replies]) == 20, replies
    # The tenant charged is the account the upstream bills: the one behind `api-key`.
    assert {billed(r) for r in replies if r.status == 200} == {fingerprint("ak-real")}
    assert bucket_level(redis.Redis(port=backend.redis_port), "ak-real", "rpm") is not None


def bedrock(port, access_key, headers):
    """boto3's bedrock-runtime client aimed at Envoy, retries off; `headers` are added after
    signing (a client can add any header to a signed request)."""
    client = boto3.client(
        "bedrock-runtime", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
        aws_access_key_id=access_key, aws_secret_access_key=BEDROCK_SECRET,
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}, read_timeout=30))

    def add_headers(request, **_):
        for name, value in headers.items():
            request.headers[name] = value
    client.meta.events.register("before-send.bedrock-runtime.*", add_headers)
    return client


def converse_status(port, access_key, headers=None) -> int:
    client = bedrock(port, access_key, headers or {})
    try:
        client.converse(modelId=NOVA, messages=[{"role": "user", "content": [{"text": "hi"}]}],
                        inferenceConfig={"maxTokens": 50})
        return 200
    except botocore.exceptions.ClientError as error:
        return error.response["ResponseMetadata"]["HTTPStatusCode"]


def test_bedrock_a_random_x_api_key_beside_the_signature_does_not_make_a_new_tenant(backend):
    """Item 1, old filter: 24/24 admitted."""
    port, _ = backend.envoy_for(RPM)
    statuses = [converse_status(port, "AKIASIGNED", {"x-api-key": random_key()}) for _ in range(24)]
    assert admitted(statuses) == 20, statuses


def test_gemini_the_query_key_is_the_tenant_and_a_random_x_api_key_does_not_change_it(backend):
    """Item 1, old filter: 24/24 admitted with a random `x-api-key`; `?key=` alone 401."""
    port, _ = backend.envoy_for(RPM)
    alone = send(port, None, gemini_body(), path=f"{GEMINI}?key=gk-alone")
    assert alone.status == 200, alone
    assert bucket_level(redis.Redis(port=backend.redis_port), "gk-alone", "rpm") is not None, "keyed on ?key="
    replies = [send(port, None, gemini_body(), path=f"{GEMINI}?key=gk-real", headers={"x-api-key": random_key()})
               for _ in range(24)]
    assert admitted([r.status for r in replies]) == 20, replies
    assert {billed(r) for r in replies if r.status == 200} == {fingerprint("gk-real")}


def test_two_authorization_headers_are_refused_and_charge_no_one(backend):
    """Item 1, old filter: keyed on one of the two and forwarded (200)."""
    port, _ = backend.envoy_for(RPM)
    before = backend.upstream_received()
    body = json.dumps(chat()).encode()
    status, reply = raw(port, "POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
                              "Authorization: Bearer sk-first\r\nAuthorization: Bearer sk-second\r\n", body)
    assert status == 400, reply
    assert json.loads(reply)["error"]["code"] == "conflicting_credentials"
    client = redis.Redis(port=backend.redis_port)
    assert tenant_keys(client, "sk-first") == [] and tenant_keys(client, "sk-second") == []
    assert backend.upstream_received() == before


def forged_converse(port, victim) -> int:
    """An unsigned request naming the victim's access key id: a signature of zeros."""
    authorization = (f"AWS4-HMAC-SHA256 Credential={victim}/20261201/us-east-1/bedrock/aws4_request, "
                     f"SignedHeaders=content-type;host;x-amz-date, Signature={'0' * 64}")
    body = {"messages": [{"role": "user", "content": [{"text": "hi"}]}], "inferenceConfig": {"maxTokens": 50}}
    return send(port, None, body, path=f"/model/{NOVA}/converse",
                headers={"authorization": authorization, "x-amz-date": "20261201T000000Z"}).status


def test_forged_bedrock_requests_naming_a_victim_cost_it_nothing(backend):
    """Item 8, old filter: 20 forged requests spend the victim's 20; its own signed
    requests then get 0/24."""
    port, _ = backend.envoy_for(RPM)
    client = redis.Redis(port=backend.redis_port)
    forged = [forged_converse(port, "AKIAVICTIM") for _ in range(24)]
    assert set(forged) <= {403, 429} and forged.count(403) >= 20, forged  # the mock checks the signature
    # Each 403 is refunded on a tick: the victim's bucket is whole again (a full bucket's
    # key is dropped).
    whole = lambda: (level := bucket_level(client, "AKIAVICTIM", "rpm")) is None or level > 19.99
    wait_until(whole, 10, f"the refunds (bucket at {bucket_level(client, 'AKIAVICTIM', 'rpm')})")
    statuses = [converse_status(port, "AKIAVICTIM") for _ in range(24)]
    assert admitted(statuses) == 20, statuses


WRONG_KEYS = {
    # API: (path, body, the headers carrying a key the upstream refuses, its status)
    "openai": ("/v1/chat/completions", chat(), {"authorization": "Bearer invalid-victim"}, 401),
    "anthropic": ("/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 50,
                                   "messages": [{"role": "user", "content": "hi"}]},
                  {"x-api-key": "invalid-victim"}, 401),
    "azure": (AZURE, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
              {"api-key": "invalid-victim"}, 401),
}


@pytest.mark.parametrize("api", list(WRONG_KEYS))
def test_requests_the_upstream_refuses_for_their_key_cost_that_key_nothing(backend, api):
    """Item 8 for the key-based APIs: each answer the upstream refuses for its credential
    (401 in the API's own shape, from the mock authenticating as the provider does) gives
    back the request's charge, so 24 of them under a 20-request limit leave the bucket
    whole. Before the fix (a requests-only charge kept no reservation record) the refund
    was refused as unbacked: the bucket ended empty."""
    path, body, headers, status = WRONG_KEYS[api]
    port, _ = backend.envoy_for(RPM)
    client = redis.Redis(port=backend.redis_port)
    key = next(iter(headers.values())).removeprefix("Bearer ")
    replies = [send(port, None, body, path=path, headers=headers) for _ in range(24)]
    assert {r.status for r in replies} <= {status, 429} and [r.status for r in replies].count(status) >= 20, replies
    whole = lambda: (level := bucket_level(client, key, "rpm")) is None or level > 19.99
    wait_until(whole, 10, f"the refunds (bucket at {bucket_level(client, key, 'rpm')})")


def test_n_choices_reserve_n_times_the_output_allowance(backend, tiktoken_encodings):
    """Item 5, old filter: `n: 64` reserved what `n: 1` does. Expected from the contract:
    the prompt as tiktoken counts it plus n x max_tokens (a tenant without history, nothing
    learned: the allowance is the cap)."""
    port, _ = backend.envoy_for(TPM, tokens={"calibrate": False})
    messages = [{"role": "user", "content": "Tell me a story about rate limits."}]
    prompt = openai_chat_prompt_tokens(tiktoken_encodings["o200k_base"], messages)
    reserved = {}
    for n in (1, 64):
        body = {"model": "gpt-4o-mini", "messages": messages, "max_tokens": 100, "n": n}
        reply = send(port, f"sk-n{n}", body)
        assert reply.status == 200, reply
        reserved[n] = int(reply.headers["x-llm-ratelimit-reserved-tokens"])
    assert reserved == {1: prompt + 100, 64: prompt + 64 * 100}


CHAT_START = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": '
UNREADABLE = {
    "1e400": CHAT_START + b'"hi"}], "temperature": 1e400}',
    "lone-surrogate": CHAT_START + b'"\\ud800"}]}',
    "duplicate-model": b'{"model": "gpt-4o-mini", "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}',
}


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_a_body_the_filter_cannot_read_is_refused_by_default(backend, name):
    """Item 6, old filter: forwarded, reserved a flat 1,000 with no model."""
    port, _ = backend.envoy_for(TPM)
    before = backend.upstream_received()
    reply = send(port, f"sk-bad-{name}", UNREADABLE[name])
    assert reply.status == 400 and error_code(reply) == "invalid_body", reply
    assert backend.upstream_received() == before
    assert tenant_keys(redis.Redis(port=backend.redis_port), f"sk-bad-{name}") == []
    # A byte order mark before good JSON is read past, as Python's json reads bytes.
    bom = send(port, "sk-bom", b"\xef\xbb\xbf" + json.dumps(chat()).encode())
    assert bom.status == 200, bom


def test_a_body_the_filter_cannot_read_is_charged_its_bytes_plus_the_cap_with_charge_most(backend):
    """Item 6, old filter: a flat 1,000. With `charge_most`: the body's bytes as prompt
    tokens plus `tokens.default_max_output` (4,096 by default)."""
    port, _ = backend.envoy_for(TPM, tokens={"unreadable_body": "charge_most"})
    body = UNREADABLE["1e400"]
    reply = send(port, "sk-most", body)
    assert int(reply.headers["x-llm-ratelimit-reserved-tokens"]) == len(body) + 4096, reply
    # Whatever the upstream makes of it (the mock, reading with serde_json, refuses 1e400
    # with a 400), the charge is never settled. A later request's settlement landing is
    # the barrier: any settlement of the first would have gone out before it.
    assert reply.status == 400, reply
    barrier = send(port, "sk-barrier", chat())
    assert barrier.status == 200, barrier
    used = int(barrier.headers["x-mock-prompt-tokens"]) + int(barrier.headers["x-mock-completion-tokens"])
    client = redis.Redis(port=backend.redis_port)
    wait_until(lambda: (level := bucket_level(client, "sk-barrier", "tpm")) is not None and abs(level - (BIG - used)) < 5,
               15, "the later request's settlement")
    level = bucket_level(client, "sk-most", "tpm")
    assert BIG - (len(body) + 4096) <= level < BIG - (len(body) + 4096) + 5, level  # < 5: the refill meanwhile


@pytest.mark.parametrize("path", ["/v1/models/../chat/completions", "/v1/models/%2e%2e/chat/completions"],
                         ids=["dots", "encoded-dots"])
def test_a_dot_segment_path_is_charged_not_bypassed(backend, path):
    """Item 6, old filter: `/v1/models*` matched the raw path, so the chat request was
    never limited (3/3 admitted under a limit of 2)."""
    port, _ = backend.envoy_for([{"name": "rpm", "requests": 2, "window": LONG}], bypass={"paths": ["/v1/models*"]})
    body = json.dumps(chat()).encode()
    head = f"POST {path} HTTP/1.1\r\ncontent-type: application/json\r\nAuthorization: Bearer sk-dots\r\n"
    before = backend.upstream_received()
    statuses = [raw(port, head, body)[0] for _ in range(3)]
    # Envoy (no `normalize_path` here) forwards the raw path; the mock, which resolves no
    # dot segments, answers 404 (an upstream that resolves them would serve the chat).
    assert statuses == [404, 404, 429], statuses
    assert backend.upstream_received() == before + 2
    assert bucket_level(redis.Redis(port=backend.redis_port), "sk-dots", "rpm") is not None


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/realtime?model=gpt-4o-realtime-preview"])
def test_batch_and_realtime_are_refused_by_default(backend, path):
    """Item 6, old filter: charged a flat 1,000 tokens and forwarded."""
    port, _ = backend.envoy_for(TPM)
    before = backend.upstream_received()
    reply = send(port, "sk-batch", {"input_file_id": "file-1", "endpoint": "/v1/chat/completions",
                                    "completion_window": "24h"}, path=path)
    assert reply.status == 400 and error_code(reply) == "unsupported_path", reply
    assert backend.upstream_received() == before
    assert tenant_keys(redis.Redis(port=backend.redis_port), "sk-batch") == []


def test_header_values_that_are_not_utf8_are_read_and_kill_no_worker(backend):
    """A header value is bytes, and HTTP/1.1 lets a client send any byte above 0x7F in one.
    Old filter: the SDK's header read panicked on the first such value (a credential, an
    `x-request-id`, a reply's `content-encoding`), killing the worker's VM: two requests
    made Envoy answer 503 to every later request on both workers. Now such a value is read
    lossily (its bad bytes become U+FFFD): the credential is a tenant whose limit holds,
    and every worker goes on serving."""
    port, _ = backend.envoy_for([{"name": "rpm", "requests": 3, "window": LONG}, *TPM])
    body = json.dumps(chat()).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
    # One credential with bytes that are not UTF-8, on six connections (both workers).
    bad_key = b"Authorization: Bearer sk-\xff\xfe" + uuid.uuid4().hex.encode() + b"\r\n"
    statuses = [raw(port, head + bad_key, body)[0] for _ in range(6)]
    # Forwarded three times (the mock refuses such a key: 401), then refused by its limit.
    assert statuses == [401, 401, 401, 429, 429, 429], statuses
    # A request id, and a reply header the filter reads (`content-encoding`, set by the
    # mock from `x-mock-set-content-encoding`), neither of them UTF-8.
    for extra in (b"x-request-id: \xff\xff\r\n", b"x-mock-set-content-encoding: \xfe\xff\r\n"):
        for _ in range(4):
            key = f"Authorization: Bearer {random_key()}\r\n".encode()
            status, reply = raw(port, head + key + extra, body)
            assert status == 200, (extra, status, reply)
    # Every worker still decides: fresh tenants are served, one past its limit refused.
    assert [send(port, key=random_key(), body=chat()).status for _ in range(10)] == [200] * 10
    key = random_key()
    assert [send(port, key=key, body=chat()).status for _ in range(4)] == [200, 200, 200, 429]
    log = "".join(p.log_path.read_text(errors="replace") for p in backend.stack.processes if p.name == "envoy")
    assert "panicked" not in log, [line for line in log.splitlines() if "panicked" in line][:3]
