"""Google Gemini and Vertex AI through Envoy: the model from the path, the prompt counted in
the proxy (an estimate: Gemini's tokenizer is not public), the reservation, and the
settlement equal to the usage the reply reported in `usageMetadata` (thinking tokens
billed as output), for JSON replies and both stream framings (SSE with `alt=sse`, a JSON
array without), with Google's own SDK where it applies; a 429 in Google's error shape,
which the SDK raises as its rate-limit error."""

import json

import pytest
from google import genai
from google.genai import errors, types

from stack import bucket_level, send, wait_bucket, wait_until

BIG = 1_000_000
LONG = "366d"
STORY = "Tell me a story about rate limits."
MODEL = "gemini-2.5-flash"
pytestmark = pytest.mark.backend(mock_args=["--completion-tokens", "20"])


def gemini_body(text=STORY, max_output=500):
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], "generationConfig": {"maxOutputTokens": max_output}}


# A prompt whose count the proxy's tests pin: "hello world" is 2 tokens in o200k_base.
HELLO, HELLO_TOKENS = "hello world", 2


def sdk(port, key):
    """Google's SDK pointed at Envoy, with its retries off so a 429 surfaces at once."""
    return genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=f"http://127.0.0.1:{port}", retry_options=types.HttpRetryOptions(attempts=1)))


VERTEX = "/v1/projects/p-1/locations/us-central1/publishers/google/models"


@pytest.mark.parametrize(
    "path, chunk_bytes",
    [
        (f"/v1beta/models/{MODEL}:generateContent", None),
        (f"/v1beta/models/{MODEL}:streamGenerateContent?alt=sse", None),
        (f"/v1beta/models/{MODEL}:streamGenerateContent", None),
        (f"/v1beta/models/{MODEL}:streamGenerateContent", 7),
        (f"{VERTEX}/{MODEL}:streamGenerateContent?alt=sse", 5),
        (f"{VERTEX}/{MODEL}:streamGenerateContent", 3),
    ],
    ids=["json", "sse", "array", "array-in-7-byte-pieces", "vertex-sse-in-5-byte-pieces", "vertex-array-in-3-byte-pieces"],
)
def test_the_reported_usage_is_settled_thinking_included(provider_env, path, chunk_bytes):
    port = provider_env.start([{"name": "tpm", "tokens": BIG, "window": LONG},
                      {"name": "flash-tpm", "tokens": BIG, "window": LONG, "models": ["gemini-2.5-flash*"]}])
    key = "gk-usage"
    # Vertex AI takes an OAuth access token, the Gemini API its key.
    credential = {"authorization": f"Bearer {key}"} if path.startswith(VERTEX) else {"x-goog-api-key": key}
    headers = {**credential, "x-mock-thoughts-tokens": "7", "x-mock-cached-tokens": "3"}
    if chunk_bytes:
        headers["x-mock-chunk-bytes"] = str(chunk_bytes)
    status, reply_headers, payload = send(port, None, gemini_body(HELLO), path=path, headers=headers)
    assert status == 200, payload
    reserved = int(reply_headers["x-llm-ratelimit-reserved-tokens"])
    assert reserved == HELLO_TOKENS + 500  # the prompt estimated in the proxy, plus maxOutputTokens
    # Google publishes no rate-limit headers of its own: its callers get the IETF ones.
    assert f'"tpm";r={BIG - reserved};' in reply_headers["ratelimit"], reply_headers["ratelimit"]
    prompt, output = int(reply_headers["x-mock-prompt-tokens"]), int(reply_headers["x-mock-completion-tokens"])
    assert output == 20 + 7  # candidates and thoughts, both billed as output
    if "alt=sse" in path:
        events = [e for e in payload.decode().split("\r\n\r\n") if e]
        assert len(events) == 20 and all(e.startswith("data: ") for e in events)
        last = json.loads(events[-1][len("data: "):])
    elif "stream" in path:
        responses = json.loads(payload)  # one JSON array, however it was cut on the way
        assert len(responses) == 20
        last = responses[-1]
    else:
        last = json.loads(payload)
    assert last["usageMetadata"]["thoughtsTokenCount"] == 7 and last["candidates"][0]["finishReason"] == "STOP"
    # Settled at what the reply reported, on the limit for every model and on the one for
    # the model the path names.
    wait_bucket(provider_env.redis, key, "tpm", BIG - (prompt + output))
    wait_bucket(provider_env.redis, key, "flash-tpm", BIG - (prompt + output))


def test_googles_sdk_through_the_proxy_is_charged_what_it_reports(provider_env):
    port = provider_env.start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    client = sdk(port, "gk-sdk")
    config = types.GenerateContentConfig(max_output_tokens=400)
    reply = client.models.generate_content(model=MODEL, contents=STORY, config=config)
    used = reply.usage_metadata.total_token_count
    assert reply.text.startswith(" The quick") and used == reply.usage_metadata.prompt_token_count + 20
    wait_bucket(provider_env.redis, "gk-sdk", "tpm", BIG - used)
    chunks = list(client.models.generate_content_stream(model=MODEL, contents=STORY, config=config))
    assert len(chunks) == 20 and "".join(c.text for c in chunks).startswith(" The quick")
    streamed = chunks[-1].usage_metadata.total_token_count
    wait_bucket(provider_env.redis, "gk-sdk", "tpm", BIG - used - streamed)


def test_a_429_is_googles_error_which_the_sdk_raises(provider_env):
    port = provider_env.start([{"name": "rpm", "requests": 1, "window": "1m"}])
    client = sdk(port, "gk-limited")
    client.models.generate_content(model=MODEL, contents="hi")
    with pytest.raises(errors.ClientError) as raised:
        client.models.generate_content(model=MODEL, contents="hi")
    assert raised.value.code == 429 and raised.value.status == "RESOURCE_EXHAUSTED"
    assert "rpm" in raised.value.message
    status, headers, body = send(port, None, gemini_body(), path=f"/v1beta/models/{MODEL}:generateContent",
                                 headers={"x-goog-api-key": "gk-limited"})
    error = json.loads(body)["error"]
    assert (status, error["code"], error["status"]) == (429, 429, "RESOURCE_EXHAUSTED")
    assert error["details"][0] == {"@type": "type.googleapis.com/google.rpc.RetryInfo",
                                   "retryDelay": f"{headers['retry-after']}s"}
    assert provider_env.backend.upstream_received() == 1, "the refused requests never reached the upstream"


@pytest.mark.parametrize("path", [
    "/v1beta/tunedModels/my-tune:generateContent",
    f"/v1beta/models/{MODEL}%3AgenerateContent",
    f"/v1beta/models/{MODEL}%3AcountTokens",
], ids=["tuned-model", "encoded-colon-generate", "encoded-colon-count-tokens"])
def test_every_path_charged_as_gemini_is_refused_in_googles_shape(provider_env, path):
    """Google's API serves tuned models and accepts the method's colon percent-encoded;
    the filter charges those paths as Gemini's, so its refusal must be Google's too (it
    was OpenAI's: the answer's shape was read from the path by a second router)."""
    port = provider_env.start([{"name": "rpm", "requests": 1, "window": "1m"}])
    key = f"gk-shape-{path.rsplit('/', 1)[-1][-12:]}"
    first = send(port, None, gemini_body(), path=path, headers={"x-goog-api-key": key})
    assert first.status == 200, first.body
    status, headers, body = send(port, None, gemini_body(), path=path, headers={"x-goog-api-key": key})
    assert status == 429
    error = json.loads(body)["error"]
    assert (error["code"], error["status"]) == (429, "RESOURCE_EXHAUSTED"), error
    assert set(error) == {"code", "message", "status", "details"}, "Google's error, not OpenAI's"
    assert "x-ratelimit-remaining-requests" not in headers, "Google publishes no rate-limit headers"
    assert provider_env.backend.upstream_received() == 1


def test_count_tokens_costs_a_request_and_no_tokens(provider_env):
    port = provider_env.start([{"name": "rpm", "requests": 100, "window": LONG}, {"name": "tpm", "tokens": BIG, "window": LONG}])
    client = sdk(port, "gk-count")
    assert client.models.count_tokens(model=MODEL, contents=STORY).total_tokens > 0
    wait_until(lambda: bucket_level(provider_env.redis, "gk-count", "rpm") is not None, 10, "the request charged")
    assert bucket_level(provider_env.redis, "gk-count", "rpm") == pytest.approx(99, abs=0.01)
    assert bucket_level(provider_env.redis, "gk-count", "tpm") in (None, BIG), "no tokens charged"


def test_clamping_writes_the_cap_into_generation_config(provider_env):
    port = provider_env.start([{"name": "tpm", "tokens": 600, "window": LONG}],
                     tokens={"clamp_max_tokens": True, "min_output_tokens": 10})
    # 600 tokens: the prompt's bound (its bytes) leaves less than the 1000 asked for.
    status, headers, payload = send(port, None, gemini_body(max_output=1000),
                                    path=f"/v1beta/models/{MODEL}:generateContent",
                                    headers={"x-goog-api-key": "gk-clamp", "x-mock-completion-tokens": "2000"})
    assert status == 200, payload
    granted = int(headers["x-mock-completion-tokens"])  # the mock generates up to the cap it was sent
    assert 10 <= granted < 1000 and json.loads(payload)["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert int(headers["x-llm-ratelimit-reserved-tokens"]) == 600
