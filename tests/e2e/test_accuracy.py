"""Accuracy when the provider counts a prompt differently from the proxy, end to end
through Envoy (2 workers): the reservation learns the provider's count from settled
replies, a tenant without history reserves the model's learned completion length, and
with clamping the limit holds from the very first requests.

The mock upstream reports 0.25 prompt tokens per byte of the request body: 35 to 50 for
the requests here, whose text the proxy counts as about 19 (tiktoken, o200k_base): what a
proxy that has learned nothing reserves for the prompt shows its own count."""

import concurrent.futures
import json

import pytest
import redis

from stack import after_a_tick, chat, filter_metric, send, wait_until

BIG = 1_000_000
LONG = "366d"
PER_BYTE = 0.25
pytestmark = pytest.mark.backend(mock_args=["--prompt-tokens-per-byte", str(PER_BYTE), "--completion-tokens", "100"])


def gauge(admin, name, rule):
    return filter_metric(admin, f"llm_ratelimit_{name}", model_rule=rule)


ESSAY = "Request {i}: write a long essay about rate limits."


@pytest.fixture
def start(backend):
    def start_envoy(limits, tokens=None):
        return backend.envoy_for(limits, tokens=tokens)

    start_envoy.backend = backend
    return start_envoy


def test_the_reservation_learns_the_providers_prompt_count(start):
    port, admin = start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    reserved_prompts, provider_prompts = [], []
    for i in range(12):
        body = chat(ESSAY.format(i=i), max_tokens=100)
        status, headers, _ = send(port, f"sk-learn-{i}", body)
        assert status == 200
        # Replies are as long as the cap, so the completion allowance is the cap.
        reserved_prompts.append(int(headers["x-llm-ratelimit-reserved-tokens"]) - 100)
        provider_prompts.append(int(headers["x-mock-prompt-tokens"]))
        after_a_tick()
    # Nothing learned yet: the first request reserved the proxy's own count, well short of
    # what the provider then counted.
    counted = reserved_prompts[0]
    assert 10 < counted and provider_prompts[0] > 1.5 * counted
    # Learned from the replies settled since (in whichever worker): the later requests
    # reserve what the provider counts, and not much more.
    for reserved, provider in list(zip(reserved_prompts, provider_prompts))[3:]:
        assert provider <= reserved <= provider + 4, (reserved_prompts, provider_prompts)
    factor = gauge(admin, "prompt_factor_thousandths", "gpt-4o")
    assert factor is not None and abs(factor / 1000 - provider_prompts[0] / counted) < 0.2, factor
    assert gauge(admin, "prompt_factor_thousandths", "other") == 1000, "a rule without replies keeps its configured factor"


def test_a_proxy_started_later_reserves_at_what_the_fleet_learned(start):
    limits = [{"name": "tpm", "tokens": BIG, "window": LONG}]
    first, _ = start(limits)
    for i in range(4):
        assert send(first, f"sk-fleet-{i}", chat(ESSAY.format(i=i), max_tokens=100)).status == 200
        after_a_tick()
    # Each worker hands in what it learned about once a second: wait until the fleet's
    # figures in Redis hold all four prompts' samples.
    store = redis.Redis(port=start.backend.redis_port)

    def samples_handed_in():
        # Each field: "<prompt ratios>|<outputs>", each "mean deviation samples" or "-".
        ratios = [v.split(b"|")[0].split() for v in store.hgetall(b"llmrl:{llm:models}:cal:rules").values()]
        return max((int(r[2]) for r in ratios if len(r) == 3), default=0)

    wait_until(lambda: samples_handed_in() >= 4, 10, f"four samples in Redis (now {samples_handed_in()})")
    # The hash lives 7 days after the last exchange (docs/configuration.md, tokens.share_calibration):
    # each exchange, about once a second here, sets it again.
    week_ms = 7 * 86_400_000
    assert week_ms - 60_000 < store.pttl(b"llmrl:{llm:models}:cal:rules") <= week_ms

    def first_reservation(port, key, admin=None):
        if admin is not None:  # the new proxy's first tick asks the fleet
            wait_until(lambda: (gauge(admin, "prompt_factor_thousandths", "gpt-4o") or 0) > 1500, 10, "the fleet's factor taken in")
        status, headers, _ = send(port, key, chat(ESSAY.format(i=99), max_tokens=100))
        assert status == 200
        return int(headers["x-llm-ratelimit-reserved-tokens"]) - 100, int(headers["x-mock-prompt-tokens"])

    # A second proxy's very first request reserves what the provider counts ...
    second, admin = start(limits)
    reserved, provider = first_reservation(second, "sk-fleet-second", admin)
    assert provider <= reserved <= provider + 4, (reserved, provider)
    assert gauge(admin, "prompt_factor_thousandths", "gpt-4o") > 1500
    # ... and one that does not share reserves its own count, well short of it.
    alone, alone_admin = start(limits, tokens={"share_calibration": False})
    # Its tick runs as the other's did (and its factor gauge says it learned nothing).
    wait_until(lambda: gauge(alone_admin, "prompt_factor_thousandths", "gpt-4o") == 1000, 10, "its own factor published")
    reserved, provider = first_reservation(alone, "sk-fleet-alone")
    assert reserved * 1.5 < provider, (reserved, provider)


def test_a_new_tenant_reserves_the_models_learned_completion_length(start):
    port, admin = start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    short = {"x-mock-completion-tokens": "20"}
    for i in range(3):
        status, headers, _ = send(port, f"sk-known-{i}", chat("hi", max_tokens=1000), headers=short)
        assert status == 200
        assert int(headers["x-llm-ratelimit-reserved-tokens"]) > 1000, "no history anywhere yet: the cap"
        after_a_tick()
    wait_until(lambda: gauge(admin, "output_prior_tokens", "gpt-4o") == 20, 10, "the model's completion length learned")
    # The gauge shows the write of whichever worker wrote last; the other reads it within
    # a tick (a worker reads a rule's value at most once a tick).
    after_a_tick()
    # A tenant never seen before reserves 1.5 x the model's 20, not its cap of 1,000.
    status, headers, _ = send(port, "sk-newcomer", chat("hi", max_tokens=1000), headers=short)
    assert status == 200
    assert int(headers["x-llm-ratelimit-reserved-tokens"]) < 100


def proxy_count(start):
    """The proxy's own count of ESSAY's prompt: what a proxy of its own that has learned
    nothing reserves for it beyond the output cap."""
    port, _ = start([{"name": "tpm", "tokens": BIG, "window": LONG}])
    status, headers, _ = send(port, "sk-probe", chat(ESSAY.format(i=0), max_tokens=100))
    assert status == 200
    return int(headers["x-llm-ratelimit-reserved-tokens"]) - 100


@pytest.mark.parametrize("algorithm", ["sliding_window", "token_bucket"])
def test_clamping_holds_the_limit_from_the_first_requests(start, algorithm):
    """40 parallel long streams from a tenant of a fresh proxy (nothing learned), the
    provider counting each prompt at more than twice the proxy's count: the completions
    admitted plus the provider's prompts stay within the limit."""
    limit = 10_000
    counted = proxy_count(start)
    port, _ = start([{"name": "tpm", "tokens": limit, "window": LONG, "algorithm": algorithm}],
                    tokens={"clamp_max_tokens": True, "min_output_tokens": 64})

    def one(i):
        body = chat(ESSAY.format(i=i), max_tokens=980, stream=True,
                    stream_options={"include_usage": True})
        status, headers, payload = send(port, "sk-clamped", body, headers={"x-mock-completion-tokens": "980"})
        if status != 200:
            return status, 0, 0, 0
        usage = json.loads([e for e in payload.decode().split("\n\n") if e.strip()][-2][len("data: "):])["usage"]
        return status, usage["prompt_tokens"], usage["total_tokens"], int(headers["x-llm-ratelimit-reserved-tokens"])

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(one, range(40)))
    admitted = [r for r in results if r[0] == 200]
    assert len(admitted) + sum(1 for r in results if r[0] == 429) == 40
    used = sum(total for _, _, total, _ in admitted)
    reserved = sum(r for _, _, _, r in admitted)
    provider = sum(prompt for _, prompt, _, _ in admitted)
    print(f"\n{algorithm}: {len(admitted)} admitted, {used} tokens of {limit} ({(used - limit) / limit:+.2%}); "
          f"prompts: provider {provider}, proxy about {len(admitted) * counted}")
    assert provider > 2 * len(admitted) * counted, "the provider counted more than the proxy"
    assert used <= limit
    # The reservations filled the limit: no room was left for one more clamped request
    # (its prompt bound, under 200 bytes, and the smallest useful completion).
    assert reserved >= limit - 200 - 64, reserved
