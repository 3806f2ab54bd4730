"""Shared pools (`limits[].per`) and per-limit shadow, end to end: real Envoys, the
companion and Redis, on one Redis server and on a three-node Redis Cluster (where the
counters of a key, a team and the upstream live in different hash slots, and the
companion charges them in order, rolling back on refusal: companion/src/pools.rs).

The race test prints what a race over shared pools admits on the cluster against each
pool's capacity (`make pools-race` runs it alone), the figure
docs/benchmark.md quotes (Shared pools on a cluster)."""

import json
import socket

import pytest
import redis

from helpers import pool_owner
from pool_setup import RACE_LIMITS, WINDOW, Setup, chat_as, race
from stack import chat, filter_metric, free_port, send, tenant_of, wait_until

@pytest.fixture(params=["single", "cluster"])
def setup(stack, request):
    return Setup(stack, request.param)


KEY_TEAM_UPSTREAM = [
    {"name": "key", "requests": 4, "window": WINDOW},
    {"name": "team", "requests": 3, "window": WINDOW, "per": {"header": "x-team-id"}},
    {"name": "upstream", "requests": 5, "window": WINDOW, "per": "all", "models": ["gpt-4o*"]},
]


def test_a_key_team_and_upstream_limit_are_charged_together_and_refused_together(setup):
    port = setup.envoy(KEY_TEAM_UPSTREAM)
    team_a, team_b = pool_owner("x-team-id", "team-a"), pool_owner("x-team-id", "team-b")
    assert [chat_as(port, "sk-a", "team-a").status for _ in range(3)] == [200, 200, 200]
    refused = chat_as(port, "sk-a", "team-a")
    assert refused.status == 429, refused.body
    assert json.loads(refused.body)["error"]["message"], refused.body
    # Refused by the team's pool, charged nowhere: on the cluster the key's part was
    # charged first and rolled back.
    assert setup.level(tenant_of("sk-a"), "key") == pytest.approx(1, abs=0.05)
    assert setup.level(team_a, "team") == pytest.approx(0, abs=0.05)
    assert setup.level("all", "upstream") == pytest.approx(2, abs=0.05)
    # Another key in another team shares only the upstream's quota, which two more spend.
    assert [chat_as(port, "sk-b", "team-b").status for _ in range(2)] == [200, 200]
    assert chat_as(port, "sk-b", "team-b").status == 429, "the upstream quota is spent"
    assert setup.level(tenant_of("sk-b"), "key") == pytest.approx(2, abs=0.05)
    assert setup.level(team_b, "team") == pytest.approx(1, abs=0.05)
    assert setup.level("all", "upstream") == pytest.approx(0, abs=0.05)
    # A model the upstream quota does not cover still goes, on the key's and team's.
    assert chat_as(port, "sk-b", "team-b", model="o3").status == 200
    # No key names a team in clear.
    if isinstance(setup.redis, redis.RedisCluster):
        keys = setup.redis.keys(target_nodes=redis.RedisCluster.ALL_NODES)
    else:
        keys = setup.redis.keys()
    assert keys and not any(b"team-" in k for k in keys), keys


def raw(port: int, head: str, body: bytes) -> tuple[int, bytes]:
    """This request line and these headers exactly as written (a header given twice stays
    twice); returns the status and the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(f"{head}Host: x\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return int(received.split(b" ", 2)[1]), received.split(b"\r\n\r\n", 1)[1]


def test_a_repeated_team_header_is_refused_and_a_missing_one_leaves_the_team_limit_out(setup):
    port = setup.envoy(KEY_TEAM_UPSTREAM)
    body = json.dumps(chat(model="gpt-4o")).encode()
    status, reply = raw(port, "POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
                              "Authorization: Bearer sk-c\r\nx-team-id: team-a\r\nx-team-id: team-b\r\n", body)
    assert status == 400, reply
    assert json.loads(reply)["error"]["code"] == "repeated_header", reply
    assert setup.level(tenant_of("sk-c"), "key") is None, "a refused request is charged nothing"
    missing = send(port, key="sk-c", body=chat(model="gpt-4o"))
    assert missing.status == 200, "no team header: the team limit does not apply"
    assert setup.level(tenant_of("sk-c"), "key") == pytest.approx(3, abs=0.05)
    assert setup.level("all", "upstream") == pytest.approx(4, abs=0.05)


def test_a_shadow_limit_is_charged_and_counted_but_refuses_nothing(setup):
    limits = [
        {"name": "key", "requests": 10, "window": WINDOW},
        {"name": "trial", "requests": 2, "window": WINDOW, "per": "all", "mode": "shadow"},
    ]
    admin = free_port()
    port = setup.envoy(limits, admin=admin)
    assert [send(port, key="sk-shadow").status for _ in range(4)] == [200] * 4
    assert setup.level(tenant_of("sk-shadow"), "key") == pytest.approx(6, abs=0.05)
    assert setup.level("all", "trial") == pytest.approx(-2, abs=0.05), "charged as if enforced"
    # docs/pools.md: `decision="shadow"` counts the requests it would have
    # refused, the two past its 2; each of the four counts once under the limit.
    trial = lambda decision: filter_metric(admin, "llm_ratelimit_decisions_total", limit="trial", decision=decision) or 0
    wait_until(lambda: trial("allowed") + trial("shadow") == 4, 5, "the four requests counted under trial")
    assert (trial("allowed"), trial("shadow"), trial("limited")) == (2, 2, 0)


def test_a_shadow_output_limit_does_not_clamp_max_tokens(stack):
    """docs/pools.md / `limits[].mode`: a shadow limit "refuses nothing (nor clamps
    a completion allowance)". With clamping on and a shadow output limit of 100, a request
    asking 600 reaches the upstream with its 600 (the mock completes min(asked, max_tokens))."""
    setup = Setup(stack, "single")
    limits = [{"name": "otpm-trial", "tokens": 100, "window": WINDOW, "count": "output", "mode": "shadow"}]
    port = setup.envoy(limits, tokens={"clamp_max_tokens": True, "min_output_tokens": 10})
    reply = send(port, key="sk-shadow-clamp", body=chat(max_tokens=600), headers={"x-mock-completion-tokens": "600"})
    assert reply.status == 200, reply.body
    assert reply.headers["x-mock-completion-tokens"] == "600", "max_tokens reached the upstream unclamped"


@pytest.mark.parametrize("topology", ["cluster"])
def test_a_race_on_the_cluster_never_admits_more_than_a_pool_holds(stack, topology):
    setup = Setup(stack, topology, companions=2)
    ports = [setup.envoy(RACE_LIMITS, name=f"envoy-{i}", companion=i) for i in range(2)]
    # 24 keys in 4 teams: 72 key units, 48 team units, 30 upstream units; 96 requests.
    results = race(ports, clients=24, per_client=4)
    admitted = {key: statuses.count(200) for key, statuses in results.items()}
    assert all(s in (200, 429) for statuses in results.values() for s in statuses), results
    by_team = {}
    for (key, team), n in admitted.items():
        by_team[team] = by_team.get(team, 0) + n
        assert n <= 3, (key, n)
    total = sum(admitted.values())
    upstream_left = setup.level("all", "upstream")
    teams_left = {team: setup.level(pool_owner("x-team-id", team), "team") for team in by_team}
    print(f"\npools race on a 3-node cluster, 2 Envoys, 2 companions, 96 requests at once: "
          f"admitted {total} of the upstream's 30 (over-admitted {max(0, total - 30)}), "
          f"teams {sorted(by_team.values())} of 12 each, upstream left {upstream_left:.2f}, "
          f"teams left {sorted(round(v or 12, 2) for v in teams_left.values())}")
    assert total <= 30, "the upstream's quota is never over-admitted"
    assert all(n <= 12 for n in by_team.values()), by_team
    # Rollbacks give back what refused requests took: what is left is what was not admitted.
    assert upstream_left == pytest.approx(30 - total, abs=0.05)
    # Refusals a race adds (a request refused while a rolled-back part held capacity):
    # with 96 requests for 30 upstream units, the upstream is spent by the end.
    assert total >= 28, f"admitted {total}: rollbacks refused more than a race should"


def script_calls(setup) -> int:
    """Script calls Redis has run (on every node of a cluster)."""
    nodes = (setup.redis.get_nodes() if isinstance(setup.redis, redis.RedisCluster) else [setup.redis])
    total = 0
    for node in nodes:
        client = redis.Redis(host=node.host, port=node.port) if isinstance(setup.redis, redis.RedisCluster) else node
        stats = client.info("commandstats")
        total += sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("eval", "evalsha"))
    return total


def test_in_direct_mode_a_pool_every_request_touches_costs_no_script_call_of_its_own(setup):
    """docs/pools.md: "In direct mode a pool every request touches costs no round
    trip of its own": on one Redis server the key's and the pool's counters are charged in
    the request's one script call; on a cluster the pool's hash slot takes a call of its
    own per batch (here, one request at a time, one per request)."""
    only_key = setup.envoy([{"name": "key", "requests": 1000, "window": WINDOW}], name="envoy-key")
    with_pool = setup.envoy([{"name": "key", "requests": 1000, "window": WINDOW},
                             {"name": "upstream", "requests": 1000, "window": WINDOW, "per": "all"}], name="envoy-pool")

    def calls_per_request(port, key):
        before = script_calls(setup)
        for _ in range(10):
            assert send(port, key=key).status == 200
        return (script_calls(setup) - before) / 10

    alone = calls_per_request(only_key, "sk-direct-alone")
    pooled = calls_per_request(with_pool, "sk-direct-pooled")
    assert alone == 1, alone
    cluster = isinstance(setup.redis, redis.RedisCluster)
    assert pooled == (2 if cluster else 1), pooled
    assert setup.level("all", "upstream") == pytest.approx(990, abs=0.05)
