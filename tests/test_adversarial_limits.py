"""Issue 26, as an adversarial tenant would try it, through real Envoy, the companion,
Redis and the mock: limits that do not apply, the degraded mode's local buckets, the
queue's share, and a tier header sent twice. Each test fails on the build before the fix
(README "What a client cannot do")."""

import time

from stack import anthropic, chat, send, tenant_of


def wait_until(condition, timeout=10.0, what="condition"):
    """Polls `condition` until it returns a truthy value (returned), or fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_overdrawn_per_model_limit_refuses_only_its_models(backend):
    """Item 7: the provider reports far more than was reserved for gpt-4o, overdrawing the
    `gpt-4o*` token limit; other models (OpenAI's and Anthropic's paths) are still served,
    and gpt-4o is refused until the debt is waited off."""
    limits = [{"name": "rpm", "requests": 1000, "window": "1m"},
              {"name": "gpt4o-tpm", "tokens": 2000, "window": "1m", "models": ["gpt-4o*"]}]
    port, _ = backend.envoy(backend.filter_config(limits))
    first = send(port, "sk-over", chat(model="gpt-4o"), headers={"x-mock-completion-tokens": "6000"})
    assert first.status == 200 and first.headers["x-mock-completion-tokens"] == "6000"
    # The settlement's debit reaches Redis on a tick: gpt-4o is refused once it has.
    refused = wait_until(lambda: (r := send(port, "sk-over", chat(model="gpt-4o"))).status == 429 and r,
                         what="the overdrawn gpt-4o limit to refuse")
    assert "gpt4o-tpm" in refused.headers.get("ratelimit-policy", "") or refused.headers.get("retry-after")
    others = [send(port, "sk-over", chat(model="gpt-4.1-mini")).status for _ in range(3)]
    others.append(send(port, "sk-over", anthropic(model="claude-sonnet-4-5"), path="/v1/messages",
                       headers={"anthropic-version": "2023-06-01"}).status)
    assert others == [200] * 4, "a limit for gpt-4o* refused other models"
    assert send(port, "sk-over", chat(model="gpt-4o")).status == 429


def test_a_tier_header_sent_twice_is_the_default_tier(backend):
    """Item 11: a client adds its own `gold` before the `free` a trusted component
    appended. Neither copy counts: the request is the default tier's (free)."""
    limits = [{"name": "rph-free", "requests": 2, "window": "1h", "tiers": ["free"]},
              {"name": "rph-gold", "requests": 100, "window": "1h", "tiers": ["gold"]}]
    tier = {"header": "x-tenant-tier", "default": "free"}
    port, _ = backend.envoy(backend.filter_config(limits, tier=tier))
    twice = [("x-tenant-tier", "gold"), ("x-tenant-tier", "free")]
    statuses = [send_headers(port, "sk-twice", twice) for _ in range(4)]
    assert statuses == [200, 200, 429, 429], "the client's first copy chose the gold tier"
    # One copy is read as before.
    assert [send(port, "sk-gold", headers={"x-tenant-tier": "gold"}).status for _ in range(4)] == [200] * 4


def send_headers(port, key, headers):
    """A chat POST with these (possibly repeated) headers; its status."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps(chat())
        conn.putrequest("POST", "/v1/chat/completions")
        for name, value in [("content-type", "application/json"), ("authorization", f"Bearer {key}"),
                            ("content-length", str(len(body))), *headers]:
            conn.putheader(name, value)
        conn.endheaders(body.encode())
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()
