"""Fair shares of a scarce pool (`limits[].fair_share`), measured (`make fairness`; not
part of `make test`, which runs a shorter version: tests/e2e/test_fair_share.py).

One pool counted for every caller (`per: "all"`), of `--pool` tokens per `--window`
seconds, through 3 Envoys (2 workers each), each with its own companion, one Redis and
the mock upstream. One heavy tenant offers `--heavy` times the pool; `--light` tenants
offer `--light-share` of it each. Every client is paced (open loop: a refused request is
not retried, the next one comes on time) and sends each request through the next Envoy.
The run is made twice: the pool with `fair_share`, then without it (first come, first
served), each on fresh tenants.

Printed per run: what each tenant asked and got (tokens, as the replies' usage reports
them), the max-min fair allocation of what the pool supplied over the run (its capacity
at the start plus its refill) given those demands, Jain's index over the tenants' got /
fair allocation (1 is perfectly fair), and the most the tenants were admitted over any
interval beyond the pool's refill in it (a token bucket admits at most its capacity
beyond its refill: more would be over-admission)."""

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import Backend, Stack, chat, send  # noqa: E402

TOKEN = "fairness-token-0123456789"
# Tokens per request: the completion (the mock answers `max_tokens`, which the proxy
# reserves) plus the prompt.
COMPLETION = 90


def max_min(demands: dict[str, float], supply: float) -> dict[str, float]:
    """The max-min fair allocation of `supply` among `demands` (equal weights): each gets
    its demand or the water level, whichever is less; the level uses up the supply."""
    allocation, left, open_ = {}, supply, sorted(demands, key=demands.get)
    while open_:
        level = left / len(open_)
        tenant = open_[0]
        if demands[tenant] > level:
            for t in open_:
                allocation[t] = level
            return allocation
        allocation[tenant] = demands[tenant]
        left -= demands[tenant]
        open_.pop(0)
    return allocation


def jain(xs: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 when all are equal."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def most_beyond_refill(admissions: list[tuple[float, float]], per_second: float) -> float:
    """The most admitted over any interval beyond the refill in it: max over a <= b of
    (tokens admitted in [a, b]) - per_second x (b - a). `admissions`: (time s, tokens)."""
    worst, lowest, running = 0.0, 0.0, 0.0
    for at, tokens in sorted(admissions):
        # f(t) = admitted up to t - per_second x t; the answer is max f(b) - min f(a-).
        lowest = min(lowest, running - per_second * at)
        running += tokens
        worst = max(worst, running - per_second * at - lowest)
    return worst


class Fleet:
    """Redis, the mock, and 3 companions each behind its own Envoy."""

    def __init__(self, stack: Stack, envoys: int = 3):
        self.backend = Backend(stack, token=TOKEN, mock_args=["--completion-tokens", str(COMPLETION)])
        self.stack = stack
        self.companions = [self.backend.companion_port] + [
            stack.companion(f"redis://127.0.0.1:{self.backend.redis_port}", TOKEN, name=f"companion-{i}")[1]
            for i in range(1, envoys)
        ]
        self.serial = 0

    def envoys(self, limits: list[dict]) -> list[int]:
        self.serial += 1
        config = self.backend.filter_config(limits)
        return [self.backend.envoy(config, name=f"envoy-{self.serial}-{i}", companion_port=port)[0]
                for i, port in enumerate(self.companions)]


def pool_limits(pool: int, window_s: float, fair: bool, between: dict | None = None) -> list[dict]:
    """One pool for every caller; `fair`: with fair shares (between tenants, or as
    `between` says)."""
    limit = {"name": "pool", "tokens": pool, "window": f"{window_s:g}s", "per": "all"}
    if fair:
        limit["fair_share"] = {"between": between} if between else {}
    return [limit]


def offer(ports: list[int], tenants: dict[str, float], seconds: float, request_tokens: float, seed: int = 1,
          headers: dict[str, dict] | None = None):
    """Each tenant (key -> tokens per second offered) sends paced requests for `seconds`,
    through the ports in turn, with its `headers` (key -> headers, e.g. its team's);
    returns, per key, [(start time s, status, tokens used)]."""
    results = {key: [] for key in tenants}
    lock = threading.Lock()
    rng = random.Random(seed)
    begin = time.monotonic() + 0.5
    # A heavy tenant's requests overlap: its load is spread over threads, each paced.
    plans = []
    for key, rate in tenants.items():
        per_second = rate / request_tokens
        threads = max(1, int(per_second / 4) + 1)
        for t in range(threads):
            plans.append((key, per_second / threads, rng.random()))

    def client(key, per_second, phase):
        interval = 1 / per_second
        n = 0
        turn = hash(key) % len(ports)
        while True:
            at = begin + (phase + n) * interval
            if at - begin >= seconds:
                return
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            started = time.monotonic() - begin
            turn = (turn + 1) % len(ports)
            reply = send(ports[turn], key, chat(max_tokens=COMPLETION), headers=(headers or {}).get(key))
            used = json.loads(reply.body)["usage"]["total_tokens"] if reply.status == 200 else 0
            with lock:
                results[key].append((started, reply.status, used))
            n += 1

    workers = [threading.Thread(target=client, args=plan) for plan in plans]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return results


def measure(ports, pool, window_s, heavy, light, light_share, seconds):
    """One run: the figures of the module's docstring, as a dict."""
    request_tokens = COMPLETION + 9  # what one request reserves, about: the pacing's unit
    per_second = pool / window_s
    tenants = {"sk-fair-heavy": heavy * per_second}
    tenants.update({f"sk-fair-light-{i}": light_share * per_second for i in range(light)})
    tag = f"{time.monotonic_ns():x}"
    tenants = {f"{key}-{tag}": rate for key, rate in tenants.items()}
    results = offer(ports, tenants, seconds, request_tokens)
    used_per_request = max((u for rs in results.values() for _, s, u in rs if s == 200), default=request_tokens)
    asked = {key: len(rs) * used_per_request for key, rs in results.items()}
    got = {key: sum(u for _, _, u in rs) for key, rs in results.items()}
    statuses = sorted({s for rs in results.values() for _, s, _ in rs})
    supply = pool + per_second * seconds
    fair = max_min(asked, supply)
    index = jain([got[k] / fair[k] for k in asked if fair[k] > 0])
    admissions = [(at, u) for rs in results.values() for at, s, u in rs if s == 200]
    heavy_key = next(k for k in asked if "heavy" in k)
    lights = [k for k in asked if k != heavy_key]
    return {
        "asked": asked, "got": got, "fair": fair, "jain": index, "statuses": statuses,
        "heavy": heavy_key, "lights": lights, "supply": supply, "total": sum(got.values()),
        "beyond_refill": most_beyond_refill(admissions, per_second),
        # What borrowing leaves in the pool for the light tenants: one request each.
        "reserve": len(lights) * used_per_request,
        "light_refused": sum(1 for k in lights for _, s, _ in results[k] if s != 200),
        "light_sent": sum(len(results[k]) for k in lights),
    }


def summary(label: str, m: dict, pool: int) -> str:
    lights_asked = sum(m["asked"][k] for k in m["lights"])
    lights_got = sum(m["got"][k] for k in m["lights"])
    heavy = m["heavy"]
    return (f"{label:18} lights got {lights_got:,.0f} of {lights_asked:,.0f} asked "
            f"({m['light_refused']} of {m['light_sent']} requests refused); heavy got {m['got'][heavy]:,.0f} "
            f"(max-min fair {m['fair'][heavy]:,.0f}, less the light tenants' reserve {m['reserve']:,.0f}) "
            f"of {m['asked'][heavy]:,.0f} asked; "
            f"Jain's index {m['jain']:.3f}; admitted {m['total']:,.0f} of the {m['supply']:,.0f} supplied, "
            f"at most {m['beyond_refill']:,.0f} beyond the refill over any interval (capacity {pool:,})")


def redis_cost(stack: Stack, sizes=(0, 8, 64, 256), calls: int = 500) -> list[tuple[int, float]]:
    """Redis's own time per charge of a pool (commandstats' usec_per_call of EVALSHA)
    whose fair hash holds `n` active tenants, for each n of `sizes` (0: no fair_share)."""
    import redis

    _, port = stack.redis(name="redis-cost")
    client = redis.Redis(port=port)
    sha = client.script_load((Path(__file__).resolve().parent.parent / "lua/limits.lua").read_text())
    rows = []
    for n in sizes:
        key = f"llmrl:{{cost:all}}:tb:pool{n}"
        tenants = [f"{i:032x}" for i in range(max(n, 1))]

        def charge(i):
            limit = {"kind": "tb", "capacity": 10**12, "window_ms": 60_000, "cost": 100, "min_cost": 100}
            if n:
                limit["fair"] = {"id": tenants[i % n], "weight": 1, "max": max(n, 2), "idle_ms": 60_000}
            client.evalsha(sha, 1, key, json.dumps({"op": "charge", "limits": [limit]}))

        for i in range(n):
            charge(i)
        client.config_resetstat()
        for i in range(calls):
            charge(i)
        rows.append((n, float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", type=int, default=10_000, help="tokens per window (default 10000)")
    parser.add_argument("--window", type=float, default=60, help="the pool's window, s (default 60)")
    parser.add_argument("--heavy", type=float, default=10, help="the heavy tenant's offer, times the pool")
    parser.add_argument("--light", type=int, default=9, help="light tenants")
    parser.add_argument("--light-share", type=float, default=0.05, help="each light tenant's offer, of the pool")
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--no-compare", action="store_true", help="skip the run without fair_share")
    parser.add_argument("--cost", action="store_true", help="only Redis's time per charge by active tenants")
    args = parser.parse_args()
    stack = Stack(Path(__file__).resolve().parent.parent / "run" / "fairness")
    try:
        if args.cost:
            print("Redis's time per charge of one pool (commandstats, EVALSHA usec_per_call, 500 calls):")
            for n, usec in redis_cost(stack):
                print(f"  {'no fair_share' if n == 0 else f'{n} active tenants':20} {usec:8.1f} us")
            return
        fleet = Fleet(stack)
        print(f"pool {args.pool:,} tokens per {args.window:g} s (per: all), 3 Envoys, 3 companions, one Redis; "
              f"1 tenant offering {args.heavy:g}x the pool, {args.light} offering {args.light_share:.0%} each, "
              f"for {args.seconds:g} s")
        runs = [("fair_share", True)] + ([] if args.no_compare else [("first come", False)])
        for label, fair in runs:
            ports = fleet.envoys(pool_limits(args.pool, args.window, fair))
            m = measure(ports, args.pool, args.window, args.heavy, args.light, args.light_share, args.seconds)
            print(summary(label, m, args.pool), flush=True)
    finally:
        stack.stop_all()


if __name__ == "__main__":
    main()
