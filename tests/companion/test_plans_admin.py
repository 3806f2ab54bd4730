"""Plans' admin API and `llm-ratelimit plan` (issue 44), against a real Redis, a real
companion and the built CLI: set, show, delete, list by prefix a page at a time, import of
20,000 lines and export round trip, the audit log (before, after, the admin's
fingerprint), a `revert` plan's key expiring at the plan's end, and every kind of bad input
refused with an error naming it AND leaving Redis exactly as it was. The same operations
on a Redis Cluster, where the index and the log are in another hash slot than the plans."""

import calendar
import hashlib
import json
import os
import random
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import redis

from stack import ROOT, tenant_of, wait_until

CLI = ROOT / "target/release/llm-ratelimit"
TOKEN = "plans-data-plane-token-0123456789"
ADMIN = "plans-admin-credential-0123456789"
DOMAIN = "plans"
INDEX = f"llmrl:{{{DOMAIN}:plans}}:plan-index:owners"
AUDIT = f"llmrl:{{{DOMAIN}:plans}}:plan-audit:log"
CONFIG = {
    "companion": {"upstream": "llm_ratelimit_companion", "token": TOKEN},
    "domain": DOMAIN,
    "prices": [{"match": "*", "input": 1, "output": 1}],
    "limits": [
        {"name": "rpm", "requests": 20, "window": "1m"},
        {"name": "tpm", "tokens": 100_000, "window": "1m"},
        {"name": "monthly-usd", "usd": 100, "window": "30d"},
        {"name": "team-tpm", "tokens": 1_000_000, "window": "1m", "per": {"header": "x-team"}},
        {"name": "upstream", "tokens": 5_000_000, "window": "1m", "per": "all"},
    ],
}


# A plan's end two years ahead (the companion refuses more than ten): January 1st, UTC.
END_DATE = f"{time.gmtime().tm_year + 2}-01-01"
END_MS = calendar.timegm((time.gmtime().tm_year + 2, 1, 1, 0, 0, 0)) * 1000


def plan_key(owner: str) -> str:
    return f"llmrl:{{{DOMAIN}:{owner}}}:plan:limits"


def fingerprint(credential: str) -> str:
    """As the companion names an admin in the log (companion/src/plans.rs)."""
    return "admin:" + hashlib.sha256(b"llm-ratelimit/admin/v1\0" + credential.encode()).hexdigest()[:16]


def pool_owner(header: str, value: str) -> str:
    return "p" + hashlib.sha256(b"llm-ratelimit/pool/v1\0" + header.encode() + b"\0" + value.encode()).hexdigest()[:32]


def end_user_owner(tenant: str, user: str) -> str:
    return "u" + hashlib.sha256(b"llm-ratelimit/end-user/v1\0" + tenant.encode() + b"\0" + user.encode()).hexdigest()[:32]


@pytest.fixture
def plans_env(stack, tmp_path):
    _, redis_port = stack.redis()
    _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, admin_token=ADMIN)
    config = tmp_path / "filter.json"
    config.write_text(json.dumps(CONFIG))
    client = redis.Redis(port=redis_port, decode_responses=True)
    yield port, client, config
    client.close()


def cli(port: int, *args: str, token: str | None = ADMIN, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMRL_")}
    env["LLMRL_COMPANION_URL"] = f"http://127.0.0.1:{port}"
    if token is not None:
        env["LLMRL_ADMIN_TOKEN"] = token
    return subprocess.run([str(CLI), "plan", *args], capture_output=True, text=True, timeout=300, env=env, input=stdin)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def call(port: int, method: str, path: str, body=None, token: str | None = ADMIN) -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"content-type": "application/json", **({"x-llmrl-token": token} if token is not None else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def snapshot(client: redis.Redis) -> dict:
    """Everything in Redis, by key: a hash's fields, a set's members, a stream's entries, TTLs."""
    state = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == "hash":
            value = client.hgetall(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            value = client.xrange(key)
        else:
            value = client.dump(key)
        state[key] = (kind, value, client.pexpiretime(key))
    return state


def test_set_show_delete_and_the_audit_log(plans_env):
    port, client, config = plans_env
    key, tenant = "sk-plans-enterprise", tenant_of("sk-plans-enterprise")
    common = ["--config", str(config)]
    reply = json.loads(ok(cli(port, "set", *common, "--key", key, "tpm=2000000", "monthly-usd=500",
                              "--expires", END_DATE, "--note", "enterprise trial")))
    assert reply["owner"] == tenant and reply["before"] is None
    fields = client.hgetall(plan_key(tenant))
    expires_ms = END_MS
    assert {k: v for k, v in fields.items() if not k.startswith("updated_")} == {
        "cap:tpm": "2000000", "cap:monthly-usd": "500000000", "expires_ms": str(expires_ms),
        "at_expiry": "revert", "note": "enterprise trial"}
    assert fields["updated_by"] == fingerprint(ADMIN) and ADMIN not in json.dumps(fields)
    # A revert plan's key ends with the plan, by Redis's clock.
    assert client.pexpiretime(plan_key(tenant)) == expires_ms
    assert client.zrange(INDEX, 0, -1) == [tenant]

    # A change merges: a suspension added, one override removed, the rest kept.
    reply = json.loads(ok(cli(port, "set", *common, "--key", key, "--suspend", "leaked key", "--clear", "tpm",
                              "--at-expiry", "suspend")))
    assert reply["after"]["capacities"] == {"monthly-usd": 500_000_000}
    assert reply["after"]["suspended"] == "leaked key" and reply["after"]["at_expiry"] == "suspend"
    assert client.pexpiretime(plan_key(tenant)) == -1, "a plan that suspends at its end stays until deleted"
    shown = json.loads(ok(cli(port, "show", "--domain", DOMAIN, "--tenant", tenant)))
    assert shown == reply["after"]

    # Owners by what the filter counts: a team's pool and an end user of the key.
    team = json.loads(ok(cli(port, "set", *common, "--per-value", "team-a", "team-tpm=0")))
    assert team["owner"] == pool_owner("x-team", "team-a")
    assert client.hget(plan_key(team["owner"]), "cap:team-tpm") == "0"
    user = json.loads(ok(cli(port, "set", *common, "--key", key, "--user", "alice", "--suspend", "abuse")))
    assert user["owner"] == end_user_owner(tenant, "alice")
    ok(cli(port, "set", *common, "--all", "upstream=4000000"))

    # Unsuspended with nothing else left but a note: kept; cleared of everything: gone.
    ok(cli(port, "set", *common, "--key", key, "--user", "alice", "--unsuspend", "--note", "ok now"))
    emptied = json.loads(ok(cli(port, "set", *common, "--key", key, "--user", "alice", "--note", "")))
    assert emptied["after"] is None and not client.exists(plan_key(user["owner"]))

    deleted = json.loads(ok(cli(port, "delete", "--domain", DOMAIN, "--key", key)))
    assert deleted["before"]["suspended"] == "leaked key" and deleted["after"] is None
    assert not client.exists(plan_key(tenant)) and tenant not in client.zrange(INDEX, 0, -1)
    gone = cli(port, "show", "--domain", DOMAIN, "--key", key)
    assert gone.returncode == 1 and "404" in gone.stderr and "has no plan" in gone.stderr

    history = [json.loads(line) for line in ok(cli(port, "history", "--domain", DOMAIN, "--key", key)).splitlines()]
    assert [e["op"] for e in history] == ["delete", "set", "set"], "newest first"
    assert all(e["by"] == fingerprint(ADMIN) and e["owner"] == tenant for e in history)
    assert history[2]["before"] is None and history[2]["after"]["capacities"]["tpm"] == 2_000_000
    assert history[1]["before"] == history[2]["after"] and history[1]["after"] == history[0]["before"]
    assert history[0]["after"] is None
    assert all(abs(e["at_ms"] - time.time() * 1000) < 60_000 for e in history)
    everyone = [json.loads(l) for l in ok(cli(port, "history", "--domain", DOMAIN, "--limit", "100")).splitlines()]
    assert len(everyone) == 8 and {e["owner"] for e in everyone} >= {tenant, team["owner"], user["owner"], "all"}
    assert ADMIN not in json.dumps(list(client.xrange(AUDIT)))
    assert ok(cli(port, "whoami")).strip() == fingerprint(ADMIN)


def test_bad_input_gets_a_clear_error_and_changes_nothing(plans_env):
    port, client, config = plans_env
    common = ["--config", str(config)]
    tenant = tenant_of("sk-plans-bad")
    ok(cli(port, "set", *common, "--tenant", tenant, "rpm=50", "--note", "before"))
    before = snapshot(client)

    def refused_by_cli(args, says, token=ADMIN):
        done = cli(port, *args, token=token)
        assert done.returncode != 0 and says in done.stderr, (args, done.stderr)

    refused_by_cli(["set", *common, "--tenant", tenant, "rmp=5"],
                   'the config has no limit "rmp" (it has rpm, tpm, monthly-usd, team-tpm, upstream)')
    refused_by_cli(["set", *common, "--tenant", tenant, "--clear", "tmp"], 'the config has no limit "tmp"')
    refused_by_cli(["set", *common, "--tenant", tenant, "rpm=-5"], "rpm=-5: a capacity is 0 or more")
    refused_by_cli(["set", *common, "--tenant", tenant, "rpm=1.5"], "not a whole number")
    refused_by_cli(["set", *common, "--tenant", tenant, "rpm=1000000000001"], "above the largest capacity")
    refused_by_cli(["set", *common, "--tenant", tenant, "monthly-usd=2000000"], "above the largest capacity, $1000000")
    refused_by_cli(["set", *common, "--tenant", tenant, "team-tpm=5"], 'team-tpm is counted per the header "x-team"')
    refused_by_cli(["set", *common, "--tenant", "sk-live-123", "rpm=5"], "--tenant takes a tenant id")
    refused_by_cli(["set", *common, "--tenant", tenant.upper(), "rpm=5"], "--tenant takes a tenant id")
    refused_by_cli(["set", *common, "--owner", "sk-live-123", "rpm=5"], "not an owner id")
    refused_by_cli(["set", *common, "--tenant", tenant, "--expires", "2001-01-01"], "is in the past")
    refused_by_cli(["set", *common, "--tenant", tenant, "--expires", "2999-01-01"], "more than ten years ahead")
    refused_by_cli(["set", *common, "--tenant", tenant, "--expires", "soon"], "give an RFC 3339 instant")
    refused_by_cli(["set", *common, "--tenant", tenant, "--suspend", "x" * 201], "suspend: 201 characters")
    refused_by_cli(["set", *common, "--tenant", tenant, "rpm=5"], "the companion answered 401", token="wrong-admin-credential")
    refused_by_cli(["set", *common, "--tenant", tenant, "rpm=5"], "admin credential is required", token=None)
    refused_by_cli(["set", *common, "--tenant", tenant, "rpm=5"], "data-plane credential, which cannot administer",
                   token=TOKEN)
    refused_by_cli(["delete", "--domain", DOMAIN, "--tenant", tenant], "401", token=TOKEN)

    good = {"domain": DOMAIN, "owner": tenant, "capacities": {"rpm": 5}}
    for body, token, status, says in [
        (good, None, 401, "missing or wrong x-llmrl-token"),
        (good, "wrong-admin-credential", 401, "takes an admin credential"),
        (good, TOKEN, 401, "data-plane credential"),
        ({**good, "capacities": {"rpm": -5}}, ADMIN, 400, "capacities.rpm: -5 is negative"),
        ({**good, "capacities": {"rpm": 10**13}}, ADMIN, 400, "capacities.rpm: 10000000000000 is above"),
        ({**good, "capacities": {"rpm": 2.5}}, ADMIN, 400, "capacities.rpm: 2.5 is not a whole number"),
        ({**good, "capacities": {"Bad Name": 5}}, ADMIN, 400, 'capacities: "Bad Name" is not a limit name'),
        ({**good, "owner": "sk-live-123"}, ADMIN, 400, 'owner: "sk-live-123" is not an owner id'),
        ({**good, "owner": tenant[:31]}, ADMIN, 400, "is not an owner id"),
        ({**good, "expires_ms": int(time.time())}, ADMIN, 400, "expires_ms:"),
        ({**good, "note": "n" * 501}, ADMIN, 400, "note: 501 characters"),
        ({**good, "capacity": {"rpm": 5}}, ADMIN, 400, "unknown field `capacity`"),
        ({**good, "at_expiry": "suspend"}, ADMIN, 400, "at_expiry: the plan has no expires_ms"),
    ]:
        code, reply = call(port, "POST", "/v1/admin/plan", body, token=token)
        assert code == status and says in reply["error"], (body, code, reply)
    for path in [f"/v1/admin/plans?domain={DOMAIN}", f"/v1/admin/plan?domain={DOMAIN}&owner={tenant}",
                 f"/v1/admin/plans/history?domain={DOMAIN}"]:
        assert call(port, "GET", path, token=TOKEN)[0] == 401, path
    assert call(port, "DELETE", f"/v1/admin/plan?domain={DOMAIN}&owner=not-an-owner")[0] == 400

    # An import with one bad line among good ones: every bad line named, nothing written.
    lines = [json.dumps({"owner": f"{n:032x}", "capacities": {"rpm": n}}) for n in range(1, 50)]
    lines[9] = json.dumps({"owner": f"{10:032x}", "capacities": {"rpm": -1}})
    lines[19] = json.dumps({"owner": "sk-oops", "capacities": {"rpm": 1}})
    lines[29] = '{"owner": '
    lines[39] = json.dumps({"owner": f"{1:032x}", "capacities": {"rpm": 1}})
    code, reply = call(port, "POST", f"/v1/admin/plans/import?domain={DOMAIN}", "\n".join(lines).encode())
    assert code == 400 and reply["import"]["written"] == 0 and reply["import"]["bad_lines"] == 4, reply
    assert [(e["line"], e["error"][:30]) for e in reply["import"]["errors"]] == [
        (10, "capacities.rpm: -1 is negative"[:30]), (20, 'owner: "sk-oops" is not an owne'[:30]),
        (30, "not a plan: EOF while parsing "[:30]), (40, f"owner {1:032x} is on line 1 too"[:30])]
    bad_file = config.parent / "bad.jsonl"
    bad_file.write_text("\n".join(lines[:5] + [json.dumps({"owner": tenant, "capacities": {"rpn": 1}})]) + "\n")
    refused_by_cli(["import", str(bad_file), *common], 'line 6: the config has no limit "rpn"')

    assert snapshot(client) == before, "a refused change wrote nothing"


def test_list_by_prefix_import_of_20000_plans_and_export_round_trip(plans_env, tmp_path):
    port, client, config = plans_env
    rng = random.Random(44)
    plans = {}
    for n in range(20_000):
        owner = ("p" if n % 4 == 0 else "") + f"{rng.getrandbits(128):032x}"
        plan = {"owner": owner, "capacities": {"team-tpm" if owner[0] == "p" else "tpm": rng.randrange(0, 10**9)}}
        if n % 7 == 0:
            plan["suspended"] = f"reason {n}"
        if n % 5 == 0:
            plan["note"] = f"customer {n} \"quoted\" é"
        if n % 11 == 0:
            plan["expires_ms"] = END_MS
            plan["at_expiry"] = "suspend" if n % 2 else "revert"
        plans[owner] = plan
    source = tmp_path / "plans.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in plans.values()))

    started = time.monotonic()
    done = cli(port, "import", str(source), "--config", str(config))
    took = time.monotonic() - started
    ok(done)
    assert "imported 20000 plans" in done.stderr
    print(f"import of 20,000 plans: {took:.2f} s")
    assert client.zcard(INDEX) == 20_000 and client.xlen(AUDIT) >= 20_000
    sample = next(p for p in plans.values() if p.get("at_expiry") == "revert")
    assert client.pexpiretime(plan_key(sample["owner"])) == END_MS

    # Pages by prefix: every owner starting with it, once, in order, with a stable cursor.
    for prefix in ["p", "a", "p3", "0f"]:
        expected = sorted(o for o in plans if o.startswith(prefix))
        seen, after = [], None
        while True:
            args = ["list", "--domain", DOMAIN, "--prefix", prefix, "--limit", "250"]
            run = cli(port, *args, *(["--after", after] if after else []))
            seen += [json.loads(line)["owner"] for line in ok(run).splitlines()]
            if "(end)" in run.stderr:
                break
            after = run.stderr.split("--after ")[1].strip()
        assert seen == expected, prefix

    exported = tmp_path / "export.jsonl"
    ok(cli(port, "export", "--domain", DOMAIN, "-o", str(exported)))
    lines = [json.loads(line) for line in exported.read_text().splitlines()]
    assert len(lines) == 20_000 and [l["owner"] for l in lines] == sorted(plans)
    for line in lines:
        written = {k: v for k, v in line.items() if not k.startswith("updated_")}
        wanted = dict(plans[line["owner"]])
        if "expires_ms" in wanted:
            wanted.setdefault("at_expiry", "revert")
        assert written == wanted, line
        assert line["updated_by"] == fingerprint(ADMIN)
    # The export imports again as it is (a restore): the same plans.
    ok(cli(port, "import", str(exported), "--config", str(config), "--dry-run"))
    client.delete(*[plan_key(o) for o in list(plans)[:100]])
    ok(cli(port, "import", str(exported), "--config", str(config)))
    again = tmp_path / "again.jsonl"
    ok(cli(port, "export", "--domain", DOMAIN, "-o", str(again)))
    strip = lambda text: [{k: v for k, v in json.loads(l).items() if not k.startswith("updated_")}
                          for l in text.splitlines()]
    assert strip(again.read_text()) == strip(exported.read_text())


def test_a_revert_plan_ends_by_redis_clock_and_leaves_the_list(plans_env):
    port, client, _ = plans_env
    owner = tenant_of("sk-plans-short")
    seconds, micros = client.time()
    expires_ms = seconds * 1000 + micros // 1000 + 1500
    code, reply = call(port, "POST", "/v1/admin/plan",
                       {"domain": DOMAIN, "owner": owner, "capacities": {"rpm": 1000}, "expires_ms": expires_ms})
    assert code == 200 and reply["after"]["at_expiry"] == "revert", reply
    assert client.pexpiretime(plan_key(owner)) == expires_ms
    assert call(port, "GET", f"/v1/admin/plans?domain={DOMAIN}")[1]["plans"][0]["owner"] == owner
    wait_until(lambda: not client.exists(plan_key(owner)), 10, "the plan's key expired")
    assert client.zrange(INDEX, 0, -1) == [owner], "the index still names it until a list looks"
    assert call(port, "GET", f"/v1/admin/plans?domain={DOMAIN}") == (200, {"plans": [], "next": None})
    assert client.zcard(INDEX) == 0, "the list removed the gone plan from the index"


def test_plans_on_a_cluster(cluster, module_stack):
    ports = [n.port for n in cluster.get_nodes()]
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    _, port = module_stack.companion(url, TOKEN, admin_token=ADMIN, name="companion-plans-cluster")
    owners = [tenant_of(f"sk-cluster-{n}") for n in range(20)]
    for n, owner in enumerate(owners):
        code, reply = call(port, "POST", "/v1/admin/plan", {"domain": DOMAIN, "owner": owner, "capacities": {"rpm": n}})
        assert code == 200, reply
    assert cluster.zcard(INDEX) == 20
    page = call(port, "GET", f"/v1/admin/plans?domain={DOMAIN}&limit=1000")[1]
    assert [p["owner"] for p in page["plans"]] == sorted(owners) and page["next"] is None
    assert call(port, "DELETE", f"/v1/admin/plan?domain={DOMAIN}&owner={owners[0]}")[0] == 200
    assert not cluster.exists(plan_key(owners[0])) and cluster.zcard(INDEX) == 19
    history = call(port, "GET", f"/v1/admin/plans/history?domain={DOMAIN}&owner={owners[0]}")[1]["entries"]
    assert [e["op"] for e in history] == ["delete", "set"] and history[0]["before"]["capacities"] == {"rpm": 0}
    assert all(e["by"] == fingerprint(ADMIN) for e in history)
    lines = "\n".join(json.dumps({"owner": o, "capacities": {"rpm": 7}}) for o in owners)
    code, reply = call(port, "POST", f"/v1/admin/plans/import?domain={DOMAIN}", lines.encode())
    assert code == 200 and reply["written"] == 20, reply
    assert all(cluster.hget(plan_key(o), "cap:rpm") == b"7" for o in owners) and cluster.zcard(INDEX) == 20
