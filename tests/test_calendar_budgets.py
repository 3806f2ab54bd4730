"""Calendar budgets end to end (issue 22): a monthly budget in Europe/Amsterdam through a
real Envoy, companion and Redis, spent and refused until midnight on the 1st, which every
header, the Redis key's expiry and `llm-ratelimit usage` say. Expected values come from
Python's zoneinfo (the system's IANA database), not from the filter's.

Crossing the boundary itself needs a clock the test can move: that is pinned against a real
Redis by tests/test_lua_calendar.py (bounds placed around Redis's own TIME) and on the fake
host by the core's `lifecycle::calendar_tests` (both hosts); here the clocks are real."""

import json
import os
import subprocess
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
import redis

from stack import ROOT, COMPANION_BIN, envoy_config, filter_config, free_port, send, tenant_of, wait_until

CLI = ROOT / "target/release/llm-ratelimit"
TOKEN = "calendar-companion-token"
AMSTERDAM = ZoneInfo("Europe/Amsterdam")
ADMIN = "calendar-admin-credential"
AMSTERDAM_MONTH = {"calendar": "month", "time_zone": "Europe/Amsterdam"}
KEY = "sk-calendar-0001"


def ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


@pytest.fixture
def calendar(stack, tmp_path):
    """Redis, the companion, the mock upstream and an Envoy whose filter keeps a monthly
    budget of 3 requests (and a token budget) in Amsterdam."""
    _, redis_port = stack.redis()
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
                             companion_port=companion_port, filter_config=config))

    def usage():
        done = subprocess.run(
            [str(CLI), "usage", "--config", str(config_file), "--companion", f"http://127.0.0.1:{companion_port}",
             "--json"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "LLMRL_API_KEY": KEY, "LLMRL_ADMIN_TOKEN": ADMIN})
        assert done.returncode == 0, done.stderr
        return {limit["name"]: limit for limit in json.loads(done.stdout)["limits"]}

    return {"port": port, "redis": redis.Redis(port=redis_port), "usage": usage}


def this_month_in_amsterdam(now: datetime) -> tuple[datetime, datetime]:
    """The start of the month `now` is in, and of the next, as Amsterdam's clocks count."""
    local = now.astimezone(AMSTERDAM)
    start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    following = (start + timedelta(days=32)).replace(day=1)
    return start, following


def redis_now_ms(client) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def reset_instant(header: str) -> datetime:
    return datetime.fromisoformat(header.replace("Z", "+00:00"))


def test_a_monthly_budget_is_refused_until_midnight_on_the_1st_in_amsterdam(calendar):
    client, port = calendar["redis"], calendar["port"]
    now = datetime.fromtimestamp(redis_now_ms(client) / 1000, timezone.utc)
    start, following = this_month_in_amsterdam(now)
    if following - now < timedelta(minutes=2):
        pytest.skip("the month ends within two minutes: the expected values would move under the test")
    end = following.astimezone(timezone.utc)
    length_s = int((following.astimezone(timezone.utc) - start.astimezone(timezone.utc)).total_seconds())

    replies = [send(port, key=KEY) for _ in range(3)]
    assert [r.status for r in replies] == [200] * 3, [r.body for r in replies]
    last = replies[-1].headers
    assert last["x-ratelimit-remaining-requests"] == "0"
    # The reset is midnight on the 1st, not a refill over the month.
    assert abs(reset_instant(last["anthropic-ratelimit-requests-reset"]) - end) <= timedelta(seconds=1)
    assert f'"monthly";q=3;w={length_s}' in last["ratelimit-policy"], "the month's own length, DST included"
    reset_s = int(last["ratelimit"].split('"monthly";r=0;t=')[1].split(",")[0])
    assert abs(reset_s - (end - datetime.now(timezone.utc)).total_seconds()) <= 5

    refused = send(port, key=KEY)
    assert refused.status == 429
    assert abs(int(refused.headers["retry-after"]) - (end - datetime.now(timezone.utc)).total_seconds()) <= 5
    assert "per calendar month (Europe/Amsterdam)" in json.loads(refused.body)["error"]["message"]

    # What the companion holds: the requests, and the tokens settled at what the upstream
    # reported (the reservations replaced by the usage once settled).
    used_tokens = sum(json.loads(r.body)["usage"]["total_tokens"] for r in replies)
    held = wait_until(lambda: (u := calendar["usage"]())["monthly-tokens"]["used"] == used_tokens and u, 15,
                      "the settlements")
    assert (held["monthly"]["used"], held["monthly"]["remaining"]) == (3, 0)
    assert held["monthly"]["kind"] == "calendar"
    assert held["monthly"]["resets_at"] == following.isoformat()
    key = f"llmrl:{{llm:{tenant_of(KEY)}}}:cal:monthly"
    assert client.execute_command("PEXPIRETIME", key) == ms(end), "the key lives exactly until midnight"
