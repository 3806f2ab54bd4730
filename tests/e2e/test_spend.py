"""The spend ledger end to end (issue 45): mixed traffic through Envoy (two workers) -
several API keys, two teams (a pool per `x-team`), two priced models, JSON and streamed
replies, cached tokens, an upstream error and a refusal - with the companion killed in the
middle (requests then decided by the degraded mode) and restarted on the same port; then
`llm-ratelimit spend` (the built CLI) equals, to the token and the micro-dollar, the sums
of the requests' records in Envoy's access log, by tenant, by team and by model."""

import csv
import hashlib
import io
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from helpers import access_log_records as records
from stack import chat, send, wait_until

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("LLMRL_CLI_BIN", ROOT / "target/release/llm-ratelimit"))
PRICES = [{"match": "gpt-4o*", "input": 2.5, "output": 10.0},
          {"match": "o3*", "input": 1.1, "output": 4.4, "cached_input": 0.55}]
LIMITS = [{"name": "rpm", "requests": 12, "window": "1m"},
          {"name": "tpm", "tokens": 10_000_000, "window": "1h"},
          {"name": "team-tpm", "tokens": 10_000_000, "window": "1h", "per": {"header": "x-team"}},
          {"name": "usd", "usd": 1000, "window": "1d"}]
KEYS = {"sk-spend-1": "team-a", "sk-spend-2": "team-a", "sk-spend-3": "team-b", "sk-spend-4": None}
PARTS = ["requests", "input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens", "cost_micro_usd"]


def pool_owner(header: str, value: str) -> str:
    """The filter's owner id of a pool (crates/core/src/plan/pools.rs)."""
    digest = hashlib.sha256(b"llm-ratelimit/pool/v1\0" + header.encode() + b"\0" + value.encode()).digest()
    return "p" + digest[:16].hex()




def traffic(port: int, round_: int) -> list[int]:
    """One round of mixed traffic; returns the statuses."""
    statuses = []
    for n, (key, team) in enumerate(KEYS.items()):
        headers = {"x-team": team} if team else {}
        model = "gpt-4o" if (n + round_) % 2 == 0 else "o3-mini"
        statuses.append(send(port, key, chat(f"round {round_} key {n}", model=model), headers=headers).status)
        streamed = chat(f"stream {round_} {n}", model=model, stream=True)
        statuses.append(send(port, key, streamed, headers={**headers, "x-mock-cached-tokens": "3"}).status)
    # An upstream error: charged its prompt.
    statuses.append(send(port, "sk-spend-1", chat("fail", model="o3-mini"),
                         headers={"x-team": "team-a", "x-mock-status": "500"}).status)
    return statuses


def expected(lines: list[dict]) -> dict:
    """The records' sums by tenant, by team and by model (refusals that used nothing add nothing)."""
    sums = {"tenant": defaultdict(lambda: [0] * 6), "team": defaultdict(lambda: [0] * 6),
            "model": defaultdict(lambda: [0] * 6)}
    for line in lines:
        record = line["record"]
        if not record or not record["tenant"]:
            continue
        if record["decision"] == "refused" and not any(record[part] for part in PARTS[1:]):
            continue  # a refusal that used nothing is not a request served
        counts = [1] + [record[part] for part in PARTS[1:]]
        groups = [("tenant", record["tenant"]), ("model", record["model"] or "unknown")]
        team = record["owners"].get("team-tpm")
        if team:
            groups.append(("team", team))  # the owner id: a team name is never kept in clear
        for dim, value in groups:
            sums[dim][value] = [a + b for a, b in zip(sums[dim][value], counts)]
    return {dim: dict(values) for dim, values in sums.items()}


def spend(companion_port: int, by: str, fmt: str = "json", admin_env: dict | None = None) -> str:
    today = time.strftime("%Y-%m-%d", time.gmtime())
    result = subprocess.run(
        [str(CLI), "spend", "--companion", f"http://127.0.0.1:{companion_port}", "--from", today, "--to", today,
         "--by", by, "--format", fmt, *(["--admin-token-env", "SPEND_ADMIN"] if admin_env else [])],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, **(admin_env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout


def ledger(companion_port: int, admin_token: str, by: str) -> dict:
    reply = json.loads(spend(companion_port, by, admin_env={"SPEND_ADMIN": admin_token}))
    return {row[by]: [row[part] for part in PARTS] for row in reply["rows"]}


def test_spend_equals_the_access_log_across_a_companion_restart(backend, stack):
    config = backend.filter_config(LIMITS, prices=PRICES, failure_mode="local",
                                   fallback={"instances": 1, "breaker_failures": 1,
                                             "breaker_cooldown": "1s"})
    port, envoy = backend.envoy(config)

    first = traffic(port, 0)
    assert first.count(200) == len(first) - 1 and first.count(500) == 1, first
    # The companion dies: what is decided meanwhile (locally) is counted all the same.
    backend.companion_proc.kill()
    second = traffic(port, 1)
    assert all(status in (200, 500) for status in second), second
    stack.companion(f"redis://127.0.0.1:{backend.redis_port}", backend.token, port=backend.companion_port,
                              admin_token=backend.admin_token, name="companion-restarted")
    time.sleep(1.2)  # the breaker's cooldown: the next request probes the companion again
    third = traffic(port, 2)
    # A key past its rpm: refused, and refusals add nothing.
    last = [send(port, "sk-spend-4", chat("one too many", model="gpt-4o")).status]
    while last[-1] != 429 and len(last) < 13:
        last.append(send(port, "sk-spend-4", chat("one too many", model="gpt-4o")).status)
    assert last[-1] == 429, last
    assert 200 in third

    total = len(first) + len(second) + len(third) + len(last)
    wait_until(lambda: len(records(envoy)) >= total, 15, "every request's access log line")
    assert len(records(envoy)) == total
    want = expected(records(envoy))
    assert len(want["tenant"]) == 4 and len(want["team"]) == 2 and set(want["model"]) == {"gpt-4o", "o3-mini"}
    decisions = {line["record"]["decision"] for line in records(envoy)}
    assert {"charge", "degraded", "refused"} <= decisions, decisions
    assert sum(r[3] for r in want["model"].values()) > 0, "cached tokens were recorded"

    # The workers send their aggregate once a second, and resend what the companion did not take.
    def matches():
        return all(ledger(backend.companion_port, backend.admin_token, by) == want[by]
                   for by in ("tenant", "team", "model"))
    wait_until(matches, 20, "the ledger to match the access log")
    # Stays so (nothing is added twice by a late resend).
    time.sleep(2.5)
    for by in ("tenant", "team", "model"):
        assert ledger(backend.companion_port, backend.admin_token, by) == want[by], by

    # The other formats say the same.
    rows = list(csv.DictReader(io.StringIO(spend(backend.companion_port, "team,model", "csv",
                                                 {"SPEND_ADMIN": backend.admin_token}))))
    assert sum(int(r["cost_micro_usd"]) for r in rows) == sum(v[5] for v in want["team"].values())
    table = spend(backend.companion_port, "model", "table", {"SPEND_ADMIN": backend.admin_token})
    assert "gpt-4o" in table and "o3-mini" in table, table


def test_spend_takes_the_admin_credential_only(backend):
    today = time.strftime("%Y-%m-%d", time.gmtime())
    url = f"http://127.0.0.1:{backend.companion_port}"
    for token in (backend.token, "wrong"):
        result = subprocess.run([str(CLI), "spend", "--companion", url, "--from", today, "--to", today],
                                capture_output=True, text=True, timeout=30,
                                env={**os.environ, "LLMRL_ADMIN_TOKEN": token})
        assert result.returncode != 0 and "401" in result.stderr, result.stderr
    result = subprocess.run([str(CLI), "spend", "--companion", url, "--from", today, "--to", today, "--by",
                             "tenant,team"], capture_output=True, text=True, timeout=30,
                            env={**os.environ, "LLMRL_ADMIN_TOKEN": backend.admin_token})
    assert result.returncode != 0 and "400" in result.stderr, result.stderr


TOKEN, ADMIN = "ledger-test-data-plane-token", "ledger-test-admin-credential"


def call(port: int, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"x-llmrl-token": token, "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.mark.parametrize("topology", ["single", "cluster"])
def test_the_companion_adds_a_batch_once_per_owner_on_one_server_and_on_a_cluster(stack, topology):
    if topology == "cluster":
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in stack.redis_cluster(3))
    else:
        url = f"redis://127.0.0.1:{stack.redis()[1]}"
    _, port = stack.companion(url, TOKEN, admin_token=ADMIN)
    tenants = [hashlib.sha256(f"t{n}".encode()).hexdigest()[:32] for n in range(3)]
    team = pool_owner("x-team", "team-a")

    def row(owner, label, model, day, requests, micro):
        return {"owner": owner, "label": label, "model": model, "day": day, "requests": requests,
                "input_tokens": 10 * requests, "output_tokens": 5 * requests, "cached_tokens": 0,
                "reasoning_tokens": 0, "cost_micro_usd": micro}

    rows = [row(tenants[0], "tenant", "gpt-4o", 20261130, 2, 700), row(tenants[0], "tenant", "gpt-4o", 20261201, 1, 5),
            row(tenants[1], "tenant", "o3-mini", 20261130, 1, 9), row(tenants[2], "tenant", "gpt-4o", 20261201, 4, 40),
            row(team, "x-team=team-a", "gpt-4o", 20261130, 2, 700), row(team, "x-team=team-a", "o3-mini", 20261130, 1, 9)]
    batch = {"domain": "llm", "vm": "00aa11bb22cc33dd", "seq": 1, "rows": rows}
    assert call(port, "POST", "/v1/ledger", ADMIN, batch)[0] == 401, "the data-plane path takes the data-plane token"
    assert call(port, "POST", "/v1/ledger", TOKEN, batch) == (200, {"added": 4, "already": 0})
    assert call(port, "POST", "/v1/ledger", TOKEN, batch) == (200, {"added": 0, "already": 4}), "resent: once"
    assert call(port, "POST", "/v1/ledger", TOKEN, {**batch, "rows": [{**rows[0], "owner": "{x}"}]})[0] == 400

    query = "/v1/admin/spend?domain=llm&from=2026-11-30&to=2026-12-01&by="
    assert call(port, "GET", query + "tenant", TOKEN)[0] == 401, "the admin path takes the admin credential"
    status, reply = call(port, "GET", query + "tenant", ADMIN)
    assert status == 200, reply
    by_tenant = {r["keys"][0][1]: (r["requests"], r["cost_micro_usd"]) for r in reply["rows"]}
    assert by_tenant == {tenants[0]: (3, 705), tenants[1]: (1, 9), tenants[2]: (4, 40)}
    _, reply = call(port, "GET", query + "team,model", ADMIN)
    assert [(r["keys"], r["requests"], r["input_tokens"]) for r in reply["rows"]] == [
        ([["team", "team-a"], ["model", "gpt-4o"]], 2, 20), ([["team", "team-a"], ["model", "o3-mini"]], 1, 10)]
    _, reply = call(port, "GET", query + "day", ADMIN)
    assert [(r["keys"][0][1], r["requests"]) for r in reply["rows"]] == [("2026-11-30", 3), ("2026-12-01", 5)]
    _, reply = call(port, "GET", "/v1/admin/spend?domain=llm&from=2026-12-01&to=2026-12-01", ADMIN)
    assert [(r["requests"], r["cost_micro_usd"]) for r in reply["rows"]] == [(5, 45)], "one total row"
