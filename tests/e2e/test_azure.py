"""Azure OpenAI through Envoy, with the `openai` SDK's AzureOpenAI client: the deployment
in the path mapped to its model by the config's `deployments` (per-model limits follow
it), the newer `/openai/v1/` paths with the deployment in the body's `model`, settlement
at the reported usage (JSON and streamed, Azure's content-filter chunk first), an unmapped
deployment's cost settled at the price of the model its reply names, and a 429 the SDK
raises as its rate-limit error."""

import concurrent.futures
import json

import openai
import pytest

from conftest import openai_chat_prompt_tokens
from stack import bucket_level, wait_bucket, wait_until

BIG = 1_000_000
LONG = "366d"
API_VERSION = "2024-10-21"
STORY = [{"role": "user", "content": "Tell me a story about rate limits."}]
pytestmark = pytest.mark.backend(mock_args=["--completion-tokens", "20"])


def azure(port, key):
    return openai.AzureOpenAI(api_key=key, api_version=API_VERSION, azure_endpoint=f"http://127.0.0.1:{port}",
                              max_retries=0)


def limits_with_model(model):
    return [{"name": "tpm", "tokens": BIG, "window": LONG},
            {"name": "model-tpm", "tokens": BIG, "window": LONG, "models": [model]}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_mapped_deployment_is_limited_as_its_model_and_settled_at_its_usage(provider_env, stream):
    port = provider_env.start(limits_with_model("gpt-4o"), deployments={"prod-4o": "gpt-4o"})
    client = azure(port, "ak-mapped")
    raw = client.chat.completions.with_raw_response.create(
        model="prod-4o", messages=STORY, max_tokens=300, stream=stream,
        extra_headers={"x-mock-model": "gpt-4o-2024-11-20"},
        **({"stream_options": {"include_usage": True}} if stream else {}))
    reserved = int(raw.headers["x-llm-ratelimit-reserved-tokens"])
    assert reserved > 300
    reply = raw.parse()
    if stream:
        chunks = list(reply)
        assert chunks[0].choices == [] and chunks[0].prompt_filter_results, "Azure's content-filter chunk first"
        usage = chunks[-1].usage
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith(" The quick")
    else:
        usage = reply.usage
        assert reply.model == "gpt-4o-2024-11-20"
    used = usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens == 20
    wait_bucket(provider_env.redis, "ak-mapped", "tpm", BIG - used)
    wait_bucket(provider_env.redis, "ak-mapped", "model-tpm", BIG - used)  # the deployment is gpt-4o


def test_the_v1_paths_map_the_deployment_named_in_the_body(provider_env):
    port = provider_env.start(limits_with_model("gpt-4o"), deployments={"prod-4o": "gpt-4o"})
    client = openai.OpenAI(api_key="ak-v1", base_url=f"http://127.0.0.1:{port}/openai/v1", max_retries=0)
    reply = client.chat.completions.create(model="prod-4o", messages=STORY, max_tokens=300)
    used = reply.usage.prompt_tokens + reply.usage.completion_tokens
    wait_bucket(provider_env.redis, "ak-v1", "tpm", BIG - used)
    wait_bucket(provider_env.redis, "ak-v1", "model-tpm", BIG - used)


def test_an_unmapped_deployment_is_reserved_at_the_dearest_price_and_settled_at_its_replys(provider_env, tiktoken_encodings):
    prices = [{"match": "gpt-4o-mini*", "input": 1, "output": 2}, {"match": "gpt-4o*", "input": 10, "output": 40}]
    dearest_in, dearest_out = max(p["input"] for p in prices), max(p["output"] for p in prices)
    budget_micro = 10_000_000  # $10
    port = provider_env.start(limits_with_model("gpt-4o") + [{"name": "usd", "usd": 10, "window": LONG}], prices=prices)
    client = azure(port, "ak-unmapped")
    # The upstream answers after 1.5 s: meanwhile Redis holds the reservation alone.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.chat.completions.with_raw_response.create, model="team-x", messages=STORY,
                              max_tokens=300, extra_headers={"x-mock-model": "gpt-4o-mini-2024-07-18",
                                                             "x-mock-first-token-delay-ms": "1500"})
        wait_until(lambda: bucket_level(provider_env.redis, "ak-unmapped", "usd") is not None, 10, "the budget charged")
        reserved_micro = budget_micro - bucket_level(provider_env.redis, "ak-unmapped", "usd")
        raw = pending.result()
    reserved = int(raw.headers["x-llm-ratelimit-reserved-tokens"])
    reply = raw.parse()
    assert reply.model == "gpt-4o-mini-2024-07-18"
    # Reserved at the table's dearest prices ($10 in, $40 out per million: micro-dollars a
    # token): the prompt as OpenAI counts it, and the completion allowance (what the
    # reservation holds beyond the prompt, at most the cap).
    prompt = openai_chat_prompt_tokens(tiktoken_encodings["o200k_base"], STORY)
    allowance = reserved - prompt
    assert 0 < allowance <= 300
    assert reserved_micro == pytest.approx(prompt * dearest_in + allowance * dearest_out, abs=1)
    # Settled at gpt-4o-mini's price, the model the reply named.
    cost = reply.usage.prompt_tokens * 1 + reply.usage.completion_tokens * 2
    wait_bucket(provider_env.redis, "ak-unmapped", "usd", budget_micro - cost)
    # The per-model limit did not know the deployment: it was not charged.
    assert bucket_level(provider_env.redis, "ak-unmapped", "model-tpm") in (None, BIG)


def test_a_429_is_the_sdks_rate_limit_error(provider_env):
    port = provider_env.start([{"name": "rpm", "requests": 1, "window": "1m"}], deployments={"prod-4o": "gpt-4o"})
    client = azure(port, "ak-limited")
    client.chat.completions.create(model="prod-4o", messages=STORY)
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model="prod-4o", messages=STORY)
    assert raised.value.status_code == 429 and "rpm" in json.dumps(raised.value.body)
    assert provider_env.backend.upstream_received() == 1
