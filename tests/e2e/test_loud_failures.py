"""Misconfigurations that used to degrade quietly say so, loudly, once: a filter whose
companion token is not the companion's gets every decision made locally (that part is the
degraded mode's job); the proxy now logs it as a credential mismatch, distinct from an
outage, once per VM rather than per request, and counts it in its own metric; the
companion logs the refused credentials, at most one line per interval."""

import time

from helpers import envoy_scrape as scrape
from stack import free_port, send, wait_until

WRONG_TOKEN = "a-token-that-is-not-the-companions-0123456789"
LIMITS = [{"name": "rpm", "requests": 1_000_000, "window": "1m"}]
MISMATCH = "credential mismatch"
REFUSALS = "llm_ratelimit_callout_credential_refusals_total"


def counter(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_a_wrong_companion_token_is_logged_once_as_a_credential_mismatch_and_counted(backend):
    config = backend.filter_config(LIMITS, failure_mode="local", fallback={"instances": 1, "breaker_cooldown": "200ms"})
    config["companion"]["token"] = WRONG_TOKEN
    admin = free_port()
    port, envoy = backend.envoy(config, admin_port=admin)
    # Requests until the companion has refused more callouts than there are VMs to log
    # (each probe after the breaker's cooldown is refused again).
    replies, deadline = [], time.monotonic() + 30
    while counter(scrape(admin), REFUSALS) < 8 and time.monotonic() < deadline:
        replies.append(send(port, key="sk-loud"))
    assert counter(scrape(admin), REFUSALS) >= 8, envoy.log_tail()
    # What the client sees is the degraded mode's, as before.
    assert all(r.status == 200 and r.headers.get("x-llm-ratelimit-degraded") == "local" for r in replies), \
        sorted({(r.status, r.headers.get("x-llm-ratelimit-degraded")) for r in replies})
    wait_until(lambda: MISMATCH in envoy.log_path.read_text(errors="replace"), 10, "the mismatch logged", envoy)
    log = envoy.log_path.read_text(errors="replace")
    # Once per VM (Envoy's two workers and the main thread's VMs), never once per request.
    lines = [line for line in log.splitlines() if MISMATCH in line]
    assert 1 <= len(lines) <= 3, lines
    assert "companion.token" in lines[0] and "not an outage" in lines[0]
    assert WRONG_TOKEN not in log and backend.token not in log, "a token in clear in the log"

    companion_log = backend.companion_proc.log_path.read_text(errors="replace")
    refused = [line for line in companion_log.splitlines() if "refused credentials" in line]
    assert len(refused) == 1, f"one line per interval, not one per call: {refused}"
    assert "a wrong x-llmrl-token" in refused[0]
    assert WRONG_TOKEN not in companion_log and backend.token not in companion_log


def test_an_unreachable_companion_is_an_outage_not_a_credential_mismatch(backend):
    config = backend.filter_config(LIMITS, failure_mode="local", companion_timeout="100ms", fallback={"instances": 1})
    admin = free_port()
    port, envoy = backend.envoy(config, companion_port=free_port(), admin_port=admin)
    replies = [send(port, key="sk-outage") for _ in range(4)]
    assert all(r.headers.get("x-llm-ratelimit-degraded") == "local" for r in replies)
    wait_until(lambda: "failed callouts in a row" in envoy.log_path.read_text(errors="replace"), 10,
               "the breaker opening logged", envoy)
    assert MISMATCH not in envoy.log_path.read_text(errors="replace")
    assert counter(scrape(admin), REFUSALS) == 0


def test_a_refusal_reaches_the_access_log_at_once(backend):
    """The demo's access log (envoy/demo.yaml, Envoy started as the demo starts it) shows a
    429 within a second, not when Envoy's 10 s flush comes round."""
    port, envoy = backend.envoy(backend.filter_config([{"name": "rpm", "requests": 1, "window": "1m"}]))
    assert [send(port, key="sk-logged").status for _ in range(2)] == [200, 429]
    refused_at = time.monotonic()
    wait_until(lambda: '"status":429' in envoy.log_path.read_text(errors="replace"), 2, "the 429's access log line",
               envoy)
    assert time.monotonic() - refused_at < 2
