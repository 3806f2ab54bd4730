"""The pools' end-to-end setup, shared by test_pools.py and test_pool_leases.py: Setup
(Redis, one server or a three-node cluster, companions, the mock upstream and Envoys),
chat_as (a chat as a key of a team, the team in `x-team-id`), and the race over shared
pools (RACE_LIMITS, race) whose figures docs/benchmark.md quotes."""

import threading

import redis

from stack import chat, envoy_config, free_port, redis_key, send

TOKEN = "pools-test-token-0123"
ADMIN = "pools-admin-credential"
WINDOW = "366d"  # windows long enough that refill during a test stays far below 0.01 of a unit


class Setup:
    """Redis (one server or a cluster), companions, the mock upstream, and Envoys."""

    def __init__(self, stack, topology: str, companions: int = 1):
        self.stack = stack
        if topology == "cluster":
            ports = stack.redis_cluster(3)
            url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
            self.redis = redis.RedisCluster(host="127.0.0.1", port=ports[0])
        else:
            _, port = stack.redis()
            url = f"redis://127.0.0.1:{port}"
            self.redis = redis.Redis(port=port)
        self.companion_ports = [
            stack.companion(url, TOKEN, name=f"companion-{i}", admin_token=ADMIN)[1] for i in range(companions)
        ]
        _, self.mock_port = stack.mock()

    def envoy(self, limits: list[dict], name: str = "envoy", companion: int = 0, admin: int | None = None,
              **options) -> int:
        config = {
            "companion": {"upstream": "llm_ratelimit_companion", "token": TOKEN, "timeout": "2s"},
            "failure_mode": "deny",
            "limits": limits,
            **options,
        }
        port = free_port()
        self.stack.envoy(
            envoy_config(listen_port=port, admin_port=admin or free_port(), upstream_port=self.mock_port,
                         companion_port=self.companion_ports[companion], filter_config=config),
            name=name,
        )
        return port

    def level(self, owner: str, limit: str) -> float | None:
        raw = self.redis.hget(redis_key("llmrl:", "llm", owner, "tb", limit), "tokens")
        return None if raw is None else float(raw)


def chat_as(port, key, team, model="gpt-4o"):
    return send(port, key=key, body=chat(model=model), headers={"x-team-id": team})


RACE_LIMITS = [
    {"name": "key", "requests": 3, "window": WINDOW},
    {"name": "team", "requests": 12, "window": WINDOW, "per": {"header": "x-team-id"}},
    {"name": "upstream", "requests": 30, "window": WINDOW, "per": "all"},
]


def race(ports, clients: int, per_client: int):
    """Every client sends `per_client` chats at once through its Envoy; returns the
    statuses by (key, team)."""
    results = {}
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(i):
        key, team = f"sk-race-{i}", f"team-{i % 4}"
        start.wait()
        statuses = [chat_as(ports[i % len(ports)], key, team).status for _ in range(per_client)]
        with lock:
            results[(key, team)] = statuses

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results
