"""Capacity planning, measured on this machine (`make capacity`; not part of `make test`).

1. Redis memory per tenant for each kind of limit: a fresh redis-server, N tenants
   written by lua/limits.lua exactly as the companion writes them (its key names, its
   script), INFO memory's used_memory before and after, divided by N; and MEMORY USAGE
   of one key of each kind. Kinds: token buckets (one limit, two), sliding windows
   holding 1, 10 and 100 entries (one per charge in the window), concurrency slots (1
   and 4 held), and reservation records in flight.
2. What one Redis shard sustains running the script: redis-benchmark sends EVALSHA
   of charges (two token buckets, a typical request + token policy; and one sliding
   window) to random tenants, alone and in the batch form the companion uses under
   load (10 and 100 calls per script call), at saturation. Reported: script calls/s and
   charges/s the client saw; Redis's time inside the script per charge (INFO
   commandstats, wall time); and the CPU time of the Redis process per charge (INFO cpu,
   user + system: the script and the reading and answering of its calls), whose inverse
   is what one core of Redis can run. On a loaded machine the CPU time is the figure to
   trust: wall times grow with every other process that takes the core.

Prints a table and writes the figures as JSON (--out); then the planning table derived
from them (`plan`, also alone from saved figures: --plan FILE), with the assumptions it
states. Redis calls per request in each mode come from `make bench`
(docs/benchmark.md).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from stack import ROOT, Stack

SCRIPT = (ROOT / "lua/limits.lua").read_text()
PREFIX = "llmrl:"


def tenant_key(tenant: str, kind: str, name: str) -> str:
    """As the companion names keys (crates/protocol/src/keys.rs)."""
    return f"{PREFIX}{{llm:{tenant}}}:{kind}:{name}"


def limit(kind: str, capacity: int, window_ms: int, **amounts) -> dict:
    return {"kind": kind, "capacity": capacity, "window_ms": window_ms, **amounts}


def charge_argument(limits: list[dict], reservation_ttl_ms: int = 0) -> str:
    return json.dumps({"op": "charge", "reservation_ttl_ms": reservation_ttl_ms,
                       "limits": [{**l, "min_cost": l["cost"]} for l in limits]})


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


# Each scenario: (name, share of --tenants, charges per tenant, limits as (kind, name,
# capacity, window_ms, cost), and what each charge names of its request: None, "member"
# (the request's key, a slot's member, as the filter sends for slot limits) or "record"
# (also a reservation record, as for token limits, living an hour)). A bucket's key
# expires when it would be full again, so each charge takes 9% of its bucket: the keys
# live 5 minutes or more, longer than writing the tenants takes.
HOUR = 3_600_000
SCENARIOS = [
    ("token bucket, 1 limit", 1.0, 1, [("tb", "rpm", 1000, HOUR, 90)], None),
    ("token buckets, 2 limits (requests + tokens)", 1.0, 1, [("tb", "rpm", 1000, HOUR, 90), ("tb", "tpm", 10**6, HOUR, 90_000)], None),
    ("sliding window, 1 entry", 1.0, 1, [("sw", "rpm", 1000, HOUR, 1)], None),
    ("sliding window, 10 entries", 0.5, 10, [("sw", "rpm", 1000, HOUR, 1)], None),
    ("sliding window, 100 entries", 0.1, 100, [("sw", "rpm", 1000, HOUR, 1)], None),
    ("concurrency slots, 1 held", 1.0, 1, [("slots", "inflight", 100, HOUR, 1)], "member"),
    ("concurrency slots, 4 held", 0.5, 4, [("slots", "inflight", 100, HOUR, 1)], "member"),
    ("token bucket + 10 reservations in flight", 0.5, 10, [("tb", "tpm", 10**6, HOUR, 90_000)], "record"),
]


def memory_per_tenant(client: redis.Redis, sha: str, tenants: int) -> list[dict]:
    results = []
    for name, share, charges, limits, request in SCENARIOS:
        n = max(100, int(tenants * share))
        client.flushall()
        time.sleep(0.2)
        before = used_memory(client)
        ttl = HOUR if request == "record" else 0
        argument = charge_argument([limit(k, c, w, cost=cost) for k, _, c, w, cost in limits], ttl)
        sample_keys = []
        pipe = client.pipeline(transaction=False)
        for t in range(n):
            tenant = uuid.uuid4().hex
            keys = [tenant_key(tenant, kind, lname) for kind, lname, *_ in limits]
            for c in range(charges):
                extra = [tenant_key(tenant, "res", f"r{c}")] if request else []
                pipe.evalsha(sha, len(keys) + len(extra), *keys, *extra, argument)
            if t == 0:
                sample_keys = keys + ([tenant_key(tenant, "res", "r0")] if ttl else [])
            if len(pipe) >= 2000:
                check(pipe.execute())
        check(pipe.execute())
        after = used_memory(client)
        if client.dbsize() < n:
            raise RuntimeError(f"{name}: keys expired while the tenants were written; the figure would be low")
        per_key = {key.split(":", 3)[-1]: client.memory_usage(key, samples=0) for key in sample_keys}
        results.append({"scenario": name, "tenants": n, "bytes_per_tenant": (after - before) / n,
                        "memory_usage_of_one_tenant": per_key})
    client.flushall()
    return results


def check(replies):
    refused = [r for r in replies if not (isinstance(r, list) and r[0] == 1)]
    if refused:
        raise RuntimeError(f"{len(refused)} charges refused or failed, e.g. {refused[0]!r}")


def commandstats(client: redis.Redis) -> dict:
    """EVALSHA's calls and time in Redis (wall time inside the command), and the CPU time
    the Redis process used (user + system: the commands, and reading and answering them),
    which a loaded machine does not inflate as it does wall time."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    cpu = client.info("cpu")
    return {"calls": int(stats.get("calls", 0)), "usec": int(stats.get("usec", 0)),
            "cpu_seconds": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])}


def benchmark(port: int, client: redis.Redis, sha: str, limits: list[dict], batch: int, requests: int,
              connections: int, plans: int = 0) -> dict:
    """redis-benchmark at saturation: EVALSHA of `batch` charges (random tenants). With
    `plans`, each call reads its tenant's plan (as the companion sends every charge), and
    that many tenants, every one the benchmark draws, have one (a capacity per limit and a
    note, the capacities the config's: the same load). redis-benchmark draws each
    `__rand_int__` apart, so a call's plan is another drawn tenant's: the same reads and
    writes as its own."""
    call = json.loads(charge_argument(limits))
    one = [f"{PREFIX}{{llm:__rand_int__}}:{l['kind']}:l{i}" for i, l in enumerate(limits)]
    call = {**call, "plans": 1, "limits": [{**l, "plan": {"at": 1, "name": f"l{i}"}} for i, l in enumerate(call["limits"])]}
    one.append(f"{PREFIX}{{llm:__rand_int__}}:plan:limits")
    keys_per_call = len(one)
    keys = one * batch
    argument = json.dumps(call) if batch == 1 else json.dumps(
        {"calls": [{"keys": keys_per_call, "call": call} for _ in range(batch)]})
    client.flushall()
    with client.pipeline(transaction=False) as pipe:
        for tenant in range(plans):
            fields = {f"cap:l{i}": str(l["capacity"]) for i, l in enumerate(limits)}
            pipe.hset(f"{PREFIX}{{llm:{tenant:012d}}}:plan:limits", mapping={**fields, "note": "capacity run"})
            if tenant % 10_000 == 9_999:
                pipe.execute()
        pipe.execute()
    before = commandstats(client)
    started = time.monotonic()
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-c", str(connections), "-n", str(requests),
         "-r", str(plans or 100000000), "-q",
         "--csv", "EVALSHA", sha, str(len(keys)), *keys, argument],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout
    elapsed = time.monotonic() - started
    after = commandstats(client)
    # The CSV's second column is requests/s (script calls/s), then six latencies; the first,
    # the command, holds the JSON's quotes unescaped, so the row is read from its end.
    rows = [line for line in out.splitlines() if line.startswith('"EVALSHA')]
    calls_per_second = float(rows[-1].rsplit(",", 7)[1].strip('"')) if rows else requests / elapsed
    calls = after["calls"] - before["calls"]
    usec_per_call = (after["usec"] - before["usec"]) / max(1, calls)
    cpu_usec_per_charge = (after["cpu_seconds"] - before["cpu_seconds"]) * 1e6 / max(1, calls * batch)
    return {
        "batch": batch,
        "script_calls_per_second": calls_per_second,
        "charges_per_second": calls_per_second * batch,
        "redis_usec_per_script_call": usec_per_call,
        "redis_usec_per_charge": usec_per_call / batch,
        "redis_cpu_usec_per_charge": cpu_usec_per_charge,
        "charges_per_redis_core_second": 1e6 / cpu_usec_per_charge if cpu_usec_per_charge else 0,
    }


# What the planning table assumes, beyond what this script measures.
# The companion, one thread: charges/s at 16 connections, the companion alone
# (docs/benchmark.md#the-companions-threads).
COMPANION_CHARGES_PER_SECOND = 17_800
# Script calls per request from `make bench` (docs/benchmark.md, commit 5a9b8f3): lease
# mode with 1,000 tenants, each with ~13 requests/s.
LEASE_CALLS_PER_REQUEST = 0.03
# Direct mode: each request is charged, and settled (token or cost limits), by a call of
# its own (batched with others into script calls).
DIRECT_CALLS_PER_REQUEST = 2
# Plan each Redis shard (one core runs the scripts) and each companion at half of what
# they sustain: headroom for bursts, failover and persistence.
UTILISATION = 0.5
SHARD_MEMORY_BYTES = 16 * 2**30
# A request holds its reservation from its charge to its settlement: a streamed completion
# takes seconds.
SECONDS_IN_FLIGHT = 5
LEASE_TTL_SECONDS = 10  # the filter's default lease.ttl
# Tenants drawn by the plans' rows, each with a plan (a million plans is ~200 MB: this is
# enough to be past any cache and quick to write).
PLAN_TENANTS = 100_000


def plan(figures: dict) -> list[str]:
    """The planning table, from measured figures: lines to print."""
    memory = {row["scenario"]: row["bytes_per_tenant"] for row in figures["memory"]}
    per_tenant = memory["token buckets, 2 limits (requests + tokens)"]
    per_reservation = (memory["token bucket + 10 reservations in flight"] - memory["token bucket, 1 limit"]) / 10
    batched = next(r for r in figures["throughput"] if r["limits"] == "2 token buckets" and r["batch"] == 10)
    alone = next(r for r in figures["throughput"] if r["limits"] == "2 token buckets" and r["batch"] == 1)
    cpu_batched, cpu_alone = batched["redis_cpu_usec_per_charge"], alone["redis_cpu_usec_per_charge"]
    lines = [
        "Policy: requests + tokens, two token buckets per tenant, every tenant active within the window (its keys",
        f"live until its buckets are full again); requests in flight {SECONDS_IN_FLIGHT} s each (a reservation each).",
        f"  memory  = tenants x {per_tenant:.0f} B + requests/s x {SECONDS_IN_FLIGHT} s x {per_reservation:.0f} B",
        f"  direct: Redis CPU = requests/s x {DIRECT_CALLS_PER_REQUEST} calls x {cpu_batched:.1f} us (batched, 10 per script call)",
        f"  lease:  Redis CPU = requests/s x {LEASE_CALLS_PER_REQUEST} calls x {cpu_alone:.1f} us (calls alone), where leases apply",
        f"  shards  = max(Redis CPU / {UTILISATION:.0%} of a core, memory / {SHARD_MEMORY_BYTES / 2**30:.0f} GiB)",
        f"  companions (one thread each) = requests/s / ({UTILISATION:.0%} x {COMPANION_CHARGES_PER_SECOND:,} charges/s) in direct mode",
        "",
        f"{'tenants':>11} {'requests/s':>11} {'memory':>9} {'direct: shards':>15} {'companions':>11}  lease mode",
    ]
    for tenants in (1_000, 1_000_000, 100_000_000):
        for rate in (10_000, 100_000, 1_000_000):
            bytes_needed = tenants * per_tenant + rate * SECONDS_IN_FLIGHT * per_reservation
            by_memory = bytes_needed / SHARD_MEMORY_BYTES
            direct_cores = rate * DIRECT_CALLS_PER_REQUEST * cpu_batched / 1e6
            direct_shards = max(1, -(-max(direct_cores / UTILISATION, by_memory) // 1))
            companions = max(1, -(-rate // (UTILISATION * COMPANION_CHARGES_PER_SECOND)))
            per_tenant_rate = rate / tenants
            # A lease pays when a tenant's proxy admits many requests per grant: at least
            # one grant per lease.ttl, so a tenant needs several requests per ttl.
            if per_tenant_rate * LEASE_TTL_SECONDS >= 100:
                lease_cores = rate * LEASE_CALLS_PER_REQUEST * cpu_alone / 1e6
                shards = max(1, -(-max(lease_cores / UTILISATION, by_memory) // 1))
                lease = f"{shards:.0f} shard(s): lease.enabled, max_fraction 0.1, ttl 10s ({per_tenant_rate:,.0f} req/s per tenant)"
            else:
                lease = f"no gain: {per_tenant_rate:g} req/s per tenant, {per_tenant_rate * LEASE_TTL_SECONDS:.2g} per lease.ttl"
            lines.append(f"{tenants:>11,} {rate:>11,} {human_bytes(bytes_needed):>9} {direct_shards:>15.0f} "
                         f"{companions:>11.0f}  {lease}")
    return lines


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=50_000, help="tenants written per memory scenario")
    parser.add_argument("--requests", type=int, default=100_000, help="script calls per throughput run")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "run/capacity.json")
    parser.add_argument("--plan", type=Path, help="print only the planning table, from figures saved by a run")
    parser.add_argument("--memory-only", action="store_true",
                        help="measure memory again, keeping the throughput figures saved in --out")
    args = parser.parse_args()
    if args.plan:
        print("\n".join(plan(json.loads(args.plan.read_text()))))
        return 0

    load = os.getloadavg()
    stack = Stack(Path(tempfile.mkdtemp(prefix="llmrl-capacity-")))
    try:
        _, port = stack.redis()
        client = redis.Redis(port=port)
        sha = client.script_load(SCRIPT)
        version = client.info("server")["redis_version"]
        print(f"Redis {version} on 127.0.0.1:{port}; load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

        print(f"\n1. Memory per tenant ({args.tenants:,} tenants per scenario, fewer for the larger ones)")
        memory = memory_per_tenant(client, sha, args.tenants)
        for row in memory:
            keys = ", ".join(f"{k} {v} B" for k, v in row["memory_usage_of_one_tenant"].items())
            print(f"   {row['scenario']:<46} {row['bytes_per_tenant']:>8.0f} B/tenant   (MEMORY USAGE: {keys})")

        if args.memory_only:
            saved = json.loads(args.out.read_text())
            args.out.write_text(json.dumps({**saved, "memory": memory}, indent=1))
            print(f"memory figures written to {args.out}, throughput kept from its run "
                  f"(load average then {saved['load_before'][0]:.2f})")
            print("\n".join("   " + line for line in plan(json.loads(args.out.read_text()))))
            return 0
        print(f"\n2. One Redis shard running the script (redis-benchmark, {args.connections} connections, "
              f"{args.requests:,} script calls per run, random tenants)")
        two_buckets = [limit("tb", 1000, HOUR, cost=1), limit("tb", 10**6, HOUR, cost=500)]
        one_window = [limit("sw", 1000, HOUR, cost=1)]
        throughput = []
        for label, limits in (("2 token buckets", two_buckets), ("1 sliding window", one_window)):
            for batch in (1, 10, 100):
                requests = max(1000, args.requests // batch)
                row = {"limits": label, **benchmark(port, client, sha, limits, batch, requests, args.connections)}
                throughput.append(row)
                print(f"   {label:<16} batch {batch:>3}: {row['script_calls_per_second']:>9,.0f} script calls/s "
                      f"= {row['charges_per_second']:>8,.0f} charges/s; in Redis {row['redis_usec_per_charge']:>5.1f} us "
                      f"per charge (wall), Redis CPU {row['redis_cpu_usec_per_charge']:>5.1f} us per charge = "
                      f"{row['charges_per_redis_core_second']:>8,.0f} charges per Redis core-second")
        print(f"\n4. Plans (docs/plans.md): the same charges, each reading its tenant's plan, {PLAN_TENANTS:,} "
              "tenants with a plan against none")
        for label, count in (("no plan", 0), ("every tenant a plan", PLAN_TENANTS)):
            requests = max(1000, args.requests // 10)
            row = {"limits": "2 token buckets", "plans": count,
                   **benchmark(port, client, sha, two_buckets, 10, requests, args.connections, plans=count)}
            throughput.append(row)
            print(f"   {label:<20} batch  10: Redis CPU {row['redis_cpu_usec_per_charge']:>5.1f} us per charge, "
                  f"in Redis {row['redis_usec_per_charge']:>5.1f} us per charge (wall)")
        after = os.getloadavg()
        print(f"\nload average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f} ({os.cpu_count()} cores)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"redis": version, "load_before": load, "load_after": after,
                                        "memory": memory, "throughput": throughput}, indent=1))
        print(f"figures written to {args.out}")
        print("\n3. Planning (arithmetic from the figures above; assumptions in scripts/capacity.py)")
        print("\n".join("   " + line for line in plan(json.loads(args.out.read_text()))))
    finally:
        stack.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
