"""The fault suite's policy, load and timings, and the helpers every part uses."""

from __future__ import annotations

import time

TOKEN = "faults-companion-token-0123456789"  # at least 16 bytes: the companion refuses shorter
DOMAIN = "faults"
PREFIX = "llmrl:"
WINDOW_S = 20.0
REQ_LIMIT = 60  # requests per 20 s: 3/s
TOK_LIMIT = 8000  # tokens per 20 s: 400/s
CONC_LIMIT = 4
INSTANCES = 2
RESERVATION_TTL_S = 5.0
SLOTS_TTL_S = 3.0
CLIENT_TIMEOUT_S = 15.0
READ_LATENCY_MARGIN_S = 0.020
LIGHT_TENANTS = 300
LIGHT_THREADS = 24
LIGHT_RATE = 50.0  # requests/s, all light tenants together
CYCLE_S = 75.0
FIRST_CYCLE_AT = 15.0
QUIET_TAIL_S = 12.0

LIMITS = [
    {"name": "rq", "requests": REQ_LIMIT, "window": f"{WINDOW_S:g}s"},
    {"name": "tk", "tokens": TOK_LIMIT, "window": f"{WINDOW_S:g}s"},
    {"name": "inflight", "concurrency": CONC_LIMIT},
]
FILTER_CONFIG = {
    "companion": {"upstream": "llm_ratelimit_companion", "token": TOKEN, "timeout": "250ms"},
    "domain": DOMAIN,
    "failure_mode": "local",
    "fallback": {"instances": INSTANCES, "breaker_failures": 3, "breaker_cooldown": "300ms"},
    "limits": LIMITS,
    "tokens": {"reservation_ttl": f"{RESERVATION_TTL_S:g}s"},
    "slots": {"ttl": f"{SLOTS_TTL_S:g}s"},
}

# Heavy tenants: each pushes one limit past its bound, from several client threads.
HEAVY = {
    # Small requests at 8/s against 3/s: the request limit binds.
    "heavy-req-1": {"threads": 2, "rate": 4.0, "kind": "small"},
    "heavy-req-2": {"threads": 2, "rate": 4.0, "kind": "small"},
    # ~270 tokens reserved each at 3/s against 400 tokens/s: the token limit binds.
    "heavy-tok": {"threads": 2, "rate": 1.5, "kind": "big"},
    # 2 s streams from 8 threads against 4 slots: the concurrency limit binds.
    "heavy-conc": {"threads": 8, "rate": None, "kind": "slow-stream"},
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def now() -> float:
    return time.monotonic()



def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)

