"""Calendar budgets end to end (issue 22): a monthly budget in Europe/Amsterdam through a
real Envoy, companion and Redis, spent, refused until midnight on the 1st (which every
header and `llm-ratelimit usage` say), and whole again at that instant.

Time: the wall clocks of Redis (whose TIME decides the period), Envoy (whose filter sends
the period's boundaries) and the CLI are moved together by tests/clock/offset_clock.c,
preloaded, which reads its offset from a file: the processes start on the real time,
then the test writes an offset putting them LEAD_S before the end of February 2027
(midnight in Amsterdam is 2027-02-28T23:00:00Z, CET). Expected values are the calendar's:
February 2027 has 28 days; March 2027 has 31 less the hour of the change to summer time
on the 28th, and ends at 2027-03-31T22:00:00Z (CEST)."""

import json
import os
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest
import redis

from stack import ROOT, COMPANION_BIN, envoy_config, filter_config, free_port, send, tenant_of, wait_until

CLI = ROOT / "target/release/llm-ratelimit"
TOKEN = "calendar-companion-token"
ADMIN = "calendar-admin-credential"
MARCH_1 = datetime(2027, 2, 28, 23, 0, tzinfo=timezone.utc)  # 00:00 on 1 March in Amsterdam
APRIL_1 = datetime(2027, 3, 31, 22, 0, tzinfo=timezone.utc)  # 00:00 on 1 April in Amsterdam
LEAD_S = 6.0
AMSTERDAM_MONTH = {"calendar": "month", "time_zone": "Europe/Amsterdam"}
KEY = "sk-calendar-0001"


def ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


@pytest.fixture
def shifted(stack, tmp_path):
    """Redis, the companion, the mock upstream and an Envoy, Redis's and Envoy's clocks
    on the offset in `offset_file` (0 at first); returns what the test needs."""
    shim = tmp_path / "offset_clock.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(ROOT / "tests/clock/offset_clock.c")],
                   check=True, capture_output=True)
    offset_file = tmp_path / "clock-offset-ms"
    offset_file.write_text("0")
    env = {"LD_PRELOAD": str(shim), "LLMRL_CLOCK_OFFSET_FILE": str(offset_file)}
    _, redis_port = stack.redis(env=env)
    _, companion_port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, admin_token=ADMIN)
    _, mock_port = stack.mock()
    limits = [
        {"name": "monthly", "requests": 3, "window": AMSTERDAM_MONTH},
        {"name": "monthly-tokens", "tokens": 1_000_000, "window": AMSTERDAM_MONTH},
    ]
    config = filter_config(limits, token=TOKEN, headers=["provider", "anthropic", "ietf"])
    config_file = tmp_path / "filter.json"
    config_file.write_text(json.dumps(config))
    port = free_port()
    stack.envoy(envoy_config(listen_port=port, admin_port=free_port(), upstream_port=mock_port,
                             companion_port=companion_port, filter_config=config), env=env)

    def usage():
        done = subprocess.run(
            [str(CLI), "usage", "--config", str(config_file), "--companion", f"http://127.0.0.1:{companion_port}",
             "--json"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, **env, "LLMRL_API_KEY": KEY, "LLMRL_ADMIN_TOKEN": ADMIN})
        assert done.returncode == 0, done.stderr
        return {limit["name"]: limit for limit in json.loads(done.stdout)["limits"]}

    return {"port": port, "offset_file": offset_file, "redis": redis.Redis(port=redis_port), "usage": usage}


def set_offset(shifted, lead_s: float) -> int:
    """Moves every shifted clock to `lead_s` before midnight on 1 March; the offset (ms)."""
    offset = ms(MARCH_1) - int(time.time() * 1000) - int(lead_s * 1000)
    shifted["offset_file"].write_text(str(offset))
    return offset


def redis_now_ms(client) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def reset_instant(header: str) -> datetime:
    return datetime.fromisoformat(header.replace("Z", "+00:00"))


def test_a_monthly_budget_resets_at_midnight_on_the_1st_in_amsterdam(shifted):
    offset = set_offset(shifted, LEAD_S)
    client = shifted["redis"]
    assert abs(redis_now_ms(client) - (ms(MARCH_1) - LEAD_S * 1000)) < 2000, "Redis's clock moved"
    port = shifted["port"]

    replies = [send(port, key=KEY) for _ in range(3)]
    assert [r.status for r in replies] == [200] * 3, [r.body for r in replies]
    last = replies[-1].headers
    assert last["x-ratelimit-remaining-requests"] == "0"
    # The reset is midnight, seconds away, not a refill over the month.
    assert reset_instant(last["anthropic-ratelimit-requests-reset"]) - MARCH_1 <= timedelta(seconds=1)
    assert reset_instant(last["anthropic-ratelimit-requests-reset"]) >= MARCH_1
    assert '"monthly";q=3;w=2419200' in last["ratelimit-policy"], "February 2027: 28 days"
    reset_s = int(last["ratelimit"].split('"monthly";r=0;t=')[1].split(",")[0])
    assert 1 <= reset_s <= LEAD_S + 1

    refused = send(port, key=KEY)
    assert refused.status == 429
    assert 1 <= int(refused.headers["retry-after"]) <= LEAD_S + 1, refused.headers
    assert "per calendar month (Europe/Amsterdam)" in json.loads(refused.body)["error"]["message"]

    # What the companion holds: the requests, and the tokens settled at what the upstream
    # reported (the reservations replaced by the usage once settled).
    used_tokens = sum(json.loads(r.body)["usage"]["total_tokens"] for r in replies)
    before = wait_until(lambda: (u := shifted["usage"]())["monthly-tokens"]["used"] == used_tokens and u, 15,
                        "the settlements")
    assert (before["monthly"]["used"], before["monthly"]["remaining"]) == (3, 0)
    assert before["monthly"]["kind"] == "calendar"
    assert before["monthly"]["resets_at"] == "2027-03-01T00:00:00+01:00"
    key = f"llmrl:{{llm:{tenant_of(KEY)}}}:cal:monthly"
    assert client.execute_command("PEXPIRETIME", key) == ms(MARCH_1), "the key lives exactly until midnight"

    # Refused until midnight by Redis's clock, admitted from then on (a refused request
    # charges nothing, so asking again is free).
    def admitted():
        sent_at = time.time()
        reply = send(port, key=KEY)
        return (sent_at, time.time(), reply) if reply.status == 200 else None

    sent_at, answered_at, march = wait_until(admitted, LEAD_S + 10, "March's budget")
    assert answered_at * 1000 + offset >= ms(MARCH_1), "not before midnight"
    assert sent_at * 1000 + offset - ms(MARCH_1) < 2000, "at midnight, give or take a poll"
    assert march.headers["x-ratelimit-remaining-requests"] == "2"
    assert '"monthly";q=3;w=2674800' in march.headers["ratelimit-policy"], "March 2027: 31 days less an hour"
    assert reset_instant(march.headers["anthropic-ratelimit-requests-reset"]) - APRIL_1 <= timedelta(seconds=1)
    # March's tokens are March's alone: the request's, settled at its reported usage.
    march_tokens = json.loads(march.body)["usage"]["total_tokens"]
    after = wait_until(lambda: (u := shifted["usage"]())["monthly-tokens"]["used"] == march_tokens and u, 15,
                       "March's settlement")
    assert (after["monthly"]["used"], after["monthly"]["resets_at"]) == (1, "2027-04-01T00:00:00+02:00")
    assert client.execute_command("PEXPIRETIME", key) == ms(APRIL_1)
