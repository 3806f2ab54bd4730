"""AWS Bedrock end to end through Envoy, driven by AWS's own SDK (boto3) with fake
credentials pointed at Envoy: Converse, ConverseStream, InvokeModel and
InvokeModelWithResponseStream (Anthropic's messages on Bedrock). The prompt is estimated
in the proxy, reserved with the output cap, and the usage the reply reported (JSON or
event stream) is settled. The mock verifies every request's SigV4 signature, so a body
the filter rewrote would fail as AWS fails it. A refusal reaches boto3 as its
ThrottlingException."""

import json
from types import SimpleNamespace

import botocore.exceptions
import pytest
import redis

from bedrock_client import MAX_TOKENS, NOVA, STORY, bedrock, converse_args, invoke_args
from conftest import openai_chat_prompt_tokens
from stack import bucket_key, filter_metric, tenant_of, wait_until

BIG = 1_000_000
LONG = "366d"
pytestmark = pytest.mark.backend(mock_args=["--completion-tokens", "20"])


@pytest.fixture
def env(backend):
    def start(limits, tokens=None):
        return backend.envoy_for(limits, tokens=tokens)

    return SimpleNamespace(backend=backend, redis=redis.Redis(port=backend.redis_port), start=start)


def level(env, key, limit="tpm"):
    raw = env.redis.hget(bucket_key(key, limit), "tokens")
    return None if raw is None else float(raw)


def wait_level(env, key, expected, limit="tpm"):
    """Settlement is asynchronous (the next tick): wait for the bucket to show it."""
    wait_until(lambda: level(env, key, limit) is not None and abs(level(env, key, limit) - expected) < 1.5,
               10, f"bucket {limit} at {expected} (now {level(env, key, limit)})")


def prompt_estimate(tiktoken_encodings):
    """What the proxy counts for STORY as one user message in OpenAI's shape (3 to prime
    the reply, 3 for the message, its role and text in o200k_base): a Bedrock body with
    the same message is estimated the same way. Counted by OpenAI's tiktoken."""
    return openai_chat_prompt_tokens(tiktoken_encodings["o200k_base"], [{"role": "user", "content": STORY}])


def run_converse(client):
    reply = client.converse(**converse_args())
    return reply, (reply["usage"]["inputTokens"], reply["usage"]["outputTokens"]), reply["output"]["message"]["content"][0]["text"]


def run_converse_stream(client):
    reply = client.converse_stream(**converse_args())
    text, usage = "", None
    for event in reply["stream"]:
        text += event.get("contentBlockDelta", {}).get("delta", {}).get("text", "")
        if "metadata" in event:
            usage = (event["metadata"]["usage"]["inputTokens"], event["metadata"]["usage"]["outputTokens"])
    return reply, usage, text


def run_invoke(client):
    reply = client.invoke_model(**invoke_args())
    body = json.loads(reply["body"].read())
    return reply, (body["usage"]["input_tokens"], body["usage"]["output_tokens"]), body["content"][0]["text"]


def run_invoke_stream(client):
    reply = client.invoke_model_with_response_stream(**invoke_args())
    text, usage = "", None
    for event in reply["body"]:
        chunk = json.loads(event["chunk"]["bytes"])
        if chunk["type"] == "content_block_delta":
            text += chunk["delta"]["text"]
        metrics = chunk.get("amazon-bedrock-invocationMetrics")
        if metrics:
            usage = (metrics["inputTokenCount"], metrics["outputTokenCount"])
    return reply, usage, text


OPERATIONS = {"converse": run_converse, "converse_stream": run_converse_stream,
              "invoke_model": run_invoke, "invoke_model_with_response_stream": run_invoke_stream}


@pytest.mark.parametrize("operation", OPERATIONS)
def test_the_prompt_is_estimated_reserved_and_the_reported_usage_settled(env, operation, tiktoken_encodings):
    port, _ = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    key = f"AKIDUSAGE{operation.upper().replace('_', '')}"[:20]
    # Streamed events 5 ms apart, so the filter reads them across many body callbacks.
    reply, usage, text = OPERATIONS[operation](bedrock(port, key, headers={"x-mock-chunk-delay-ms": "5"}))
    headers = reply["ResponseMetadata"]["HTTPHeaders"]
    assert reply["ResponseMetadata"]["HTTPStatusCode"] == 200
    # Reserved: the prompt as the proxy estimates it, plus the output cap.
    reserved = int(headers["x-llm-ratelimit-reserved-tokens"])
    assert reserved == prompt_estimate(tiktoken_encodings) + MAX_TOKENS
    # Bedrock publishes no rate-limit headers of its own: its callers get the IETF ones.
    assert f'"tpm";r={BIG - reserved};' in headers["ratelimit"], headers["ratelimit"]
    # What the SDK read from the reply is what the mock reported, and it is what settles.
    reported = (int(headers["x-mock-prompt-tokens"]), int(headers["x-mock-completion-tokens"]))
    assert usage == reported
    assert text == " The quick brown fox jumps over the lazy dog." * 2  # the mock's 20 tokens
    wait_level(env, key, BIG - sum(reported))


def test_a_refusal_is_boto3s_throttling_exception(env):
    port, _ = env.start([{"name": "rpm", "requests": 1, "window": "1m"}])
    client = bedrock(port, "AKIDTHROTTLED")
    client.converse(**converse_args())
    before = env.backend.upstream_received()
    with pytest.raises(client.exceptions.ThrottlingException) as refused:
        client.converse_stream(**converse_args())
    error = refused.value.response
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 429
    assert error["Error"]["Code"] == "ThrottlingException"
    assert "rpm" in error["Error"]["Message"]
    assert int(error["ResponseMetadata"]["HTTPHeaders"]["retry-after"]) >= 1
    assert env.backend.upstream_received() == before, "a refused request never reaches Bedrock"
    # Another access key is another tenant.
    bedrock(port, "AKIDOTHERTENANT").converse(**converse_args())


def test_the_model_is_the_paths_even_as_an_arn(env):
    """boto3 sends an inference profile's ARN percent-encoded (its `:` and `/`): the filter
    decodes it and a per-model limit matches it; another model is not limited by it."""
    arn = "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-3-5-haiku-20241022-v1:0"
    # The pattern's `:` and `/` match only once the path's %3A and %2F are decoded.
    pattern = "arn:aws:bedrock:*:inference-profile/us.anthropic.claude*"
    port, _ = env.start([{"name": "claude-rpm", "requests": 1, "window": "1m", "models": [pattern]}])
    client = bedrock(port, "AKIDARNTENANT")
    client.converse(**converse_args(model=arn))
    with pytest.raises(client.exceptions.ThrottlingException):
        client.converse(**converse_args(model=arn))
    for _ in range(3):
        client.converse(**converse_args(model=NOVA))


def stat(admin, name):
    return filter_metric(admin, f"llm_ratelimit_{name}") or 0


@pytest.mark.parametrize("operation", ["converse", "invoke_model"])
def test_clamping_never_rewrites_a_signed_body(env, operation):
    # The prompt's bound (each text in bytes) plus the whole cap fits once; after the first
    # settles (30 tokens used) 280 of output remain for the second: an OpenAI request
    # would be sent with max_tokens clamped to 280, a signed one is refused instead.
    bound = 3 + 3 + len("user") + len(STORY)
    port, admin = env.start([{"name": "tpm", "tokens": bound + MAX_TOKENS + 10, "window": LONG}],
                            tokens={"clamp_max_tokens": True, "min_output_tokens": 20})
    client = bedrock(port, f"AKIDCLAMP{operation.upper()[:8]}")
    # The mock checks the signature over the body: a rewritten body would be a 403.
    reply, usage, _ = OPERATIONS[operation](client)
    assert reply["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert int(reply["ResponseMetadata"]["HTTPHeaders"]["x-llm-ratelimit-reserved-tokens"]) == bound + MAX_TOKENS
    # Refilling over 366 days: a spent quota, Bedrock's ServiceQuotaExceededException (issue 45).
    with pytest.raises(client.exceptions.ServiceQuotaExceededException):
        OPERATIONS[operation](client)
    # Counters reach Envoy on the filter's next tick.
    wait_until(lambda: stat(admin, "signed_requests_not_clamped_total") >= 1, 5, "the signed_requests_not_clamped_total counter")


def test_the_mock_refuses_a_bad_signature_through_envoy(env):
    """The control for the test above: the signature check is live through Envoy."""
    port, _ = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    client = bedrock(port, "AKIDWRONGSECRET", secret="not-the-secret")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        client.converse(**converse_args())
    assert refused.value.response["Error"]["Code"] == "InvalidSignatureException"


def test_throttling_mid_stream_settles_as_billed_and_is_the_providers_refusal(env, tiktoken_encodings):
    """A `throttlingException` event mid-stream is the provider's rate limit stopping the
    model: charged the prompt and the one token streamed before it (" The"), not the
    reservation; with provider_limits the credential's next request is answered here."""
    config = env.backend.filter_config([{"name": "tpm", "tokens": BIG, "window": LONG}],
                                       provider_limits={"enabled": True, "share": False, "default_retry": "5s"})
    port, _ = env.backend.envoy(config, name="envoy-throttled")
    client = bedrock(port, "AKIDMIDSTREAM", headers={"x-mock-stream-exception": "throttlingException"})
    reply = client.converse_stream(**converse_args())
    with pytest.raises(botocore.exceptions.EventStreamError) as broken:
        list(reply["stream"])
    assert broken.value.response["Error"]["Code"] == "throttlingException"
    wait_level(env, "AKIDMIDSTREAM", BIG - (prompt_estimate(tiktoken_encodings) + 1))
    plain = bedrock(port, "AKIDMIDSTREAM")
    before = env.backend.upstream_received()
    with pytest.raises(plain.exceptions.ThrottlingException) as refused:
        plain.converse(**converse_args())
    headers = refused.value.response["ResponseMetadata"]["HTTPHeaders"]
    assert (headers["x-llm-ratelimit-provider"], headers["retry-after"]) == ("refused", "5"), headers
    assert env.backend.upstream_received() == before, "not forwarded into a certain refusal"


def test_an_exception_inside_the_stream_settles_at_no_less_than_its_reservation(env, tiktoken_encodings):
    port, _ = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    headers = {"x-mock-stream-exception": "modelStreamErrorException"}
    # A stream cut by an exception after its headers is an interrupted reply: the provider
    # may have generated more than it sent, so it is charged at least its reservation, part
    # by part (docs/clients.md#what-a-client-cannot-do). Converse: the prompt as estimated and
    # the whole output cap, not the one token streamed.
    client = bedrock(port, "AKIDEXCCONVERSE", headers=headers)
    reply = client.converse_stream(**converse_args())
    with pytest.raises(botocore.exceptions.EventStreamError) as broken:
        list(reply["stream"])
    assert broken.value.response["Error"]["Code"] == "modelStreamErrorException"
    wait_level(env, "AKIDEXCCONVERSE", BIG - (prompt_estimate(tiktoken_encodings) + MAX_TOKENS))
    # Invoke: Anthropic's message_start came first, with the provider's prompt count (more
    # than the estimate counts for the input) and one output token (less than the cap).
    client = bedrock(port, "AKIDEXCINVOKE", headers=headers)
    reply = client.invoke_model_with_response_stream(**invoke_args())
    with pytest.raises(botocore.exceptions.EventStreamError):
        list(reply["body"])
    prompt = int(reply["ResponseMetadata"]["HTTPHeaders"]["x-mock-prompt-tokens"])
    wait_level(env, "AKIDEXCINVOKE", BIG - (max(prompt, prompt_estimate(tiktoken_encodings)) + MAX_TOKENS))


# Other models' own invoke bodies (docs/providers.md#aws-bedrock), each with its cap in its
# own field, and the completion allowance it says is reserved for it: "from `max_tokens`
# where the body has it", else `tokens.default_max_output` (4096, docs/configuration.md `tokens`).
DEFAULT_MAX_OUTPUT = 4096
TITAN = "amazon.titan-text-express-v1"
OTHER_BODIES = {
    TITAN: ({"inputText": STORY, "textGenerationConfig": {"maxTokenCount": MAX_TOKENS}}, DEFAULT_MAX_OUTPUT),
    "meta.llama3-8b-instruct-v1:0": ({"prompt": STORY, "max_gen_len": MAX_TOKENS}, DEFAULT_MAX_OUTPUT),
    "mistral.mistral-7b-instruct-v0:2": ({"prompt": f"<s>[INST] {STORY} [/INST]", "max_tokens": MAX_TOKENS}, MAX_TOKENS),
}


def other_invoke_args(model):
    return {"modelId": model, "body": json.dumps(OTHER_BODIES[model][0]), "contentType": "application/json",
            "accept": "application/json"}


def open_reservations(env, key):
    """The tenant's reservation records in Redis: a settlement deletes its request's."""
    return list(env.redis.scan_iter(match=f"llmrl:{{llm:{tenant_of(key)}}}:res:*"))


@pytest.mark.parametrize("model", OTHER_BODIES)
def test_another_models_invoke_reserves_no_prompt_and_settles_at_that_estimate(env, model):
    """docs/providers.md#aws-bedrock: other models' invoke bodies "are not parsed: their prompt is
    estimated at 0 (the completion allowance is reserved as usual, from `max_tokens` where
    the body has it); their JSON replies settle at that estimate (their usage fields are
    not read)". Titan's `maxTokenCount` and Llama's `max_gen_len` are not `max_tokens`.
    The concurrency limit makes the filter send a settlement (to free the slot), whose
    record's removal from Redis says it was applied; with nothing to correct and no slot,
    none is sent and the reservation simply stands."""
    port, _ = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}, {"name": "inflight", "concurrency": 4}])
    key = f"AKIDOTHER{model.split('.')[0].upper()}"
    reply = bedrock(port, key).invoke_model(**other_invoke_args(model))
    headers = reply["ResponseMetadata"]["HTTPHeaders"]
    assert reply["ResponseMetadata"]["HTTPStatusCode"] == 200 and json.loads(reply["body"].read())
    allowance = OTHER_BODIES[model][1]
    assert int(headers["x-llm-ratelimit-reserved-tokens"]) == 0 + allowance
    reported = int(headers["x-mock-prompt-tokens"]) + int(headers["x-mock-completion-tokens"])
    assert reported < allowance, "settling at the reply's usage would show"
    wait_until(lambda: not open_reservations(env, key), 10, "the settlement")
    assert level(env, key) == pytest.approx(BIG - allowance, abs=1)


def test_another_models_stream_settles_at_its_invocation_metrics(env):
    """docs/providers.md#aws-bedrock: other models' streams settle "at the
    `amazon-bedrock-invocationMetrics` of the last chunk" (a Titan stream as boto3 reads it)."""
    port, _ = env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    client = bedrock(port, "AKIDTITANSTREAM", headers={"x-mock-chunk-delay-ms": "5"})
    reply = client.invoke_model_with_response_stream(**other_invoke_args(TITAN))
    chunks = [json.loads(event["chunk"]["bytes"]) for event in reply["body"]]
    assert "".join(c["outputText"] for c in chunks) == " The quick brown fox jumps over the lazy dog." * 2
    assert int(reply["ResponseMetadata"]["HTTPHeaders"]["x-llm-ratelimit-reserved-tokens"]) == DEFAULT_MAX_OUTPUT
    metrics = chunks[-1]["amazon-bedrock-invocationMetrics"]
    wait_level(env, "AKIDTITANSTREAM", BIG - metrics["inputTokenCount"] - metrics["outputTokenCount"])
