"""Calendar budgets end to end (issue 22): a monthly budget in Europe/Amsterdam through a
real Envoy, companion and Redis, spent and refused until midnight on the 1st, which every
header, the Redis key's expiry and `llm-ratelimit usage` say. Expected values come from
Python's zoneinfo (the system's IANA database), not from the filter's.

The boundary itself is crossed through the same real processes with Redis's clock (and
the companion's) moved by Debian's libfaketime: Redis's clock picks the period (the proxy
sends the boundaries around its own, lua/limits.lua), so a Redis at 23:59:5x on the last
day of the month, Amsterdam time, refuses the spent budget and gives it back whole at
midnight. Envoy's clock stays real: libfaketime cannot run Envoy (see `faked_clock`).
"""

import json
import math
import os
import re
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import redis

from stack import ROOT, COMPANION_BIN, envoy_config, filter_config, free_port, send, tenant_of, wait_until
from helpers import redis_now_ms

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

    def usage(as_json=True):
        """`llm-ratelimit usage` for KEY: its `--json` limits by name, or (`as_json=False`) its table."""
        done = subprocess.run(
            [str(CLI), "usage", "--config", str(config_file), "--companion", f"http://127.0.0.1:{companion_port}",
             *(["--json"] if as_json else [])],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "LLMRL_API_KEY": KEY, "LLMRL_ADMIN_TOKEN": ADMIN})
        assert done.returncode == 0, done.stderr
        return {limit["name"]: limit for limit in json.loads(done.stdout)["limits"]} if as_json else done.stdout

    return {"port": port, "redis": redis.Redis(port=redis_port), "usage": usage}


def this_month_in_amsterdam(now: datetime) -> tuple[datetime, datetime]:
    """The start of the month `now` is in, and of the next, as Amsterdam's clocks count."""
    local = now.astimezone(AMSTERDAM)
    start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    following = (start + timedelta(days=32)).replace(day=1)
    return start, following




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


def test_usage_tables_full_in_is_the_local_time_of_the_periods_end_and_counts_names_the_period(calendar):
    """docs/configuration.md#calendar-budgets: `llm-ratelimit usage` "shows the local time in its `full
    in` column, `counts` names the period (`tokens (calendar month (Europe/Amsterdam))`)".
    The local time is midnight on the 1st in Amsterdam by zoneinfo, written as the CLI
    writes local times (`2026-04-01 00:00 +02:00`, to the minute with the offset)."""
    now = datetime.fromtimestamp(redis_now_ms(calendar["redis"]) / 1000, timezone.utc)
    _, following = this_month_in_amsterdam(now)
    if following - now < timedelta(minutes=2):
        pytest.skip("the month ends within two minutes: the expected values would move under the test")
    assert send(calendar["port"], key=KEY).status == 200
    lines = [re.split(r" {2,}", line.strip()) for line in calendar["usage"](as_json=False).splitlines()]
    header = next(cells for cells in lines if cells[0] == "limit")
    rows = {cells[0]: dict(zip(header, cells)) for cells in lines if cells[0] in ("monthly", "monthly-tokens")}
    offset = int(following.utcoffset().total_seconds()) // 60
    local = f"{following:%Y-%m-%d %H:%M} {'+' if offset >= 0 else '-'}{abs(offset) // 60:02d}:{abs(offset) % 60:02d}"
    for name, unit in (("monthly", "requests"), ("monthly-tokens", "tokens")):
        assert rows[name]["counts"] == f"{unit} (calendar month (Europe/Amsterdam))", rows[name]
        assert local in rows[name]["full in"], rows[name]


def multiarch(pattern: str) -> Path:
    """The library `pattern` names in this machine's multiarch folder (Debian's layout)."""
    found = sorted(Path("/").glob(pattern))
    assert found, f"/{pattern} is missing: run make setup (it installs Debian's faketime)"
    return found[0]


LIBFAKETIME_PATTERN = "usr/lib/*-linux-gnu/faketime/libfaketime.so.1"
# Debian's redis-server allocates with jemalloc, which libfaketime cannot start under: its
# set-up calls dlsym, which allocates, and jemalloc's first allocation reads the clock
# before libfaketime is ready, so redis-server hangs (libfaketime issue #130, unfixed).
# glibc's own malloc-debugging library, preloaded first, takes malloc from jemalloc.
GLIBC_MALLOC_PATTERN = "usr/lib/*-linux-gnu/libc_malloc_debug.so.0"


def faked_clock(offset_s: float) -> dict:
    """The environment that runs a process with its wall clock `offset_s` ahead (libfaketime,
    installed by scripts/setup.sh); its monotonic clock stays real, so timeouts and timers
    behave.

    Envoy cannot be run so: its tcmalloc (linked in) calls poll() while it initialises,
    libfaketime's poll() initialises libfaketime, whose dlsym allocates, which waits on
    tcmalloc's initialisation: a deadlock before the first log line (seen with gdb on
    Envoy 1.40). Nor can V8's clocks be told apart from Envoy's. So the proxy keeps the
    real time and the Redis side is moved, which is the clock that decides."""
    preload = f"{multiarch(GLIBC_MALLOC_PATTERN)}:{multiarch(LIBFAKETIME_PATTERN)}"
    return {"LD_PRELOAD": preload, "FAKETIME": f"+{offset_s:.3f}", "DONT_FAKE_MONOTONIC": "1"}


def test_the_budget_spent_before_midnight_is_whole_after_it_through_envoy(stack):
    """Redis's clock (and the companion's) at 23:59:5x on the month's last day in
    Amsterdam: three requests spend the monthly budget, the fourth is refused until
    midnight by Redis's clock (Retry-After, RateLimit's t, OpenAI's and Anthropic's resets
    all say the same seconds); once Redis's clock passes midnight the budget is whole
    again, and the headers and the key's expiry say the next month's end."""
    # Envoy and the mock first (the slow starts), on the real clock; the companion's port
    # chosen now, the companion started last.
    _, mock_port = stack.mock()
    companion_port = free_port()
    limits = [{"name": "monthly", "requests": 3, "window": AMSTERDAM_MONTH}]
    config = filter_config(limits, token=TOKEN, headers=["provider", "anthropic", "ietf"])
    port = free_port()
    stack.envoy(envoy_config(listen_port=port, admin_port=free_port(), upstream_port=mock_port,
                             companion_port=companion_port, filter_config=config))

    # The boundary: the next 1st at 00:00 in Amsterdam after the real now. Redis starts
    # LEAD seconds before it, by its clock.
    lead_s = 8.0
    _, midnight = this_month_in_amsterdam(datetime.now(timezone.utc))
    _, after_next = this_month_in_amsterdam(midnight + timedelta(days=1))
    offset = midnight.timestamp() - lead_s - time.time()
    faked = faked_clock(offset)
    _, redis_port = stack.redis(env=faked)
    stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, port=companion_port, admin_token=ADMIN, env=faked)
    client = redis.Redis(port=redis_port)
    before = redis_now_ms(client)
    assert abs(before / 1000 - (time.time() + offset)) < 1, "Redis runs on the faked clock"
    assert 0 < ms(midnight) - before <= lead_s * 1000, "Redis's clock is just before midnight on the 1st"

    replies = [send(port, key=KEY) for _ in range(3)]
    assert [r.status for r in replies] == [200] * 3, [r.body for r in replies]
    refused = send(port, key=KEY)
    left_ms = ms(midnight) - redis_now_ms(client)
    assert left_ms > 0, "still before midnight by Redis's clock: the test ran too slowly to see the refusal"
    assert refused.status == 429, refused.body
    # Every header says the wait to midnight by Redis's clock, in its own form.
    seconds_left = math.ceil(left_ms / 1000)
    retry_after = int(refused.headers["retry-after"])
    assert seconds_left <= retry_after <= seconds_left + 1, (retry_after, left_ms)
    assert left_ms <= int(refused.headers["retry-after-ms"]) <= left_ms + 1000
    assert f'"monthly";r=0;t={retry_after}' in refused.headers["ratelimit"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    reset = refused.headers["x-ratelimit-reset-requests"]  # Go's form: "5.2s", "800ms"
    reset_s = float(reset[:-2]) / 1000 if reset.endswith("ms") else float(reset.rstrip("s"))
    assert left_ms / 1000 - 0.01 <= reset_s <= retry_after, reset
    # Anthropic's is an instant on the proxy's (real) clock: its now plus that wait.
    anthropic_reset = reset_instant(refused.headers["anthropic-ratelimit-requests-reset"]).timestamp()
    assert abs(anthropic_reset - (time.time() + left_ms / 1000)) <= 2

    # Midnight passes on Redis's clock: the next month's budget is whole.
    wait_until(lambda: redis_now_ms(client) > ms(midnight) + 100, lead_s + 5, "midnight by Redis's clock")
    again = send(port, key=KEY)
    assert again.status == 200, again.body
    assert again.headers["x-ratelimit-remaining-requests"] == "2", "one of the new month's three"
    to_next_ms = ms(after_next) - redis_now_ms(client)
    next_reset = reset_instant(again.headers["anthropic-ratelimit-requests-reset"]).timestamp()
    assert abs(next_reset - (time.time() + to_next_ms / 1000)) <= 2, "the end of the next month"
    assert abs(int(again.headers["ratelimit"].split('"monthly";r=2;t=')[1].split(",")[0]) - to_next_ms / 1000) <= 2
    key = f"llmrl:{{llm:{tenant_of(KEY)}}}:cal:monthly"
    assert client.execute_command("PEXPIRETIME", key) == ms(after_next), "the key lives until the next 1st"
    assert float(client.hget(key, "spent")) == 1
