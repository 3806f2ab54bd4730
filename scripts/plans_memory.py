"""What plans cost in Redis (issue 44): imports N plans (default 100,000) through the
companion with `llm-ratelimit plan import`, then reports MEMORY USAGE of typical plan
hashes, the owner index per entry, the audit log per entry, and used_memory per plan.
Run: .venv/bin/python scripts/plans_memory.py [N] (after `make native`)."""

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from stack import ROOT, Stack

CLI = ROOT / "target/release/llm-ratelimit"
TOKEN, ADMIN, DOMAIN = "memory-data-plane-token-0123456789", "memory-admin-credential-0123456789", "llm"
CONFIG = {"companion": {"upstream": "c", "token": TOKEN}, "domain": DOMAIN,
          "prices": [{"match": "*", "input": 1, "output": 1}],
          "limits": [{"name": "rpm", "requests": 20, "window": "1m"}, {"name": "tpm", "tokens": 100_000, "window": "1m"},
                     {"name": "monthly-usd", "usd": 100, "window": "30d"}]}
SHAPES = {
    "one capacity": lambda n: {"capacities": {"tpm": 2_000_000}},
    "two capacities, an expiry, a note": lambda n: {
        "capacities": {"tpm": 2_000_000, "monthly-usd": 500_000_000},
        "expires_ms": int(time.time() * 1000) + 365 * 86_400_000, "at_expiry": "suspend",
        "note": f"enterprise trial {n}"},
    "suspended": lambda n: {"suspended": "leaked key"},
}


def main(count: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="plans-memory-"))
    stack = Stack(work)
    try:
        _, redis_port = stack.redis()
        _, port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN, admin_token=ADMIN)
        client = redis.Redis(port=redis_port, decode_responses=True)
        (work / "filter.json").write_text(json.dumps(CONFIG))
        rng = random.Random(1)
        shapes = list(SHAPES.items())
        owners = {}
        with open(work / "plans.jsonl", "w") as out:
            for n in range(count):
                owner = f"{rng.getrandbits(128):032x}"
                name, shape = shapes[n % len(shapes)]
                owners.setdefault(name, owner)
                out.write(json.dumps({"owner": owner, **shape(n)}) + "\n")
        before = client.info("memory")["used_memory"]
        started = time.monotonic()
        subprocess.run([str(CLI), "plan", "import", str(work / "plans.jsonl"), "--config", str(work / "filter.json"),
                        "--companion", f"http://127.0.0.1:{port}"], check=True, env={"LLMRL_ADMIN_TOKEN": ADMIN})
        took = time.monotonic() - started
        used = client.info("memory")["used_memory"] - before
        index = f"llmrl:{{{DOMAIN}:plans}}:plan-index:owners"
        audit = f"llmrl:{{{DOMAIN}:plans}}:plan-audit:log"
        print(f"{count} plans imported in {took:.1f} s")
        for name, owner in owners.items():
            key = f"llmrl:{{{DOMAIN}:{owner}}}:plan:limits"
            print(f"MEMORY USAGE of a plan ({name}): {client.memory_usage(key, samples=0)} bytes")
        index_bytes = client.memory_usage(index, samples=0)
        audit_bytes = client.memory_usage(audit, samples=0)
        print(f"index: {index_bytes} bytes, {index_bytes / client.zcard(index):.0f} per owner")
        print(f"audit log: {audit_bytes} bytes for {client.xlen(audit)} entries, "
              f"{audit_bytes / client.xlen(audit):.0f} per entry (kept: about 100,000 at most)")
        print(f"used_memory grew {used} bytes: {used / count:.0f} per plan, index and log included")
        client.delete(audit)
        used = client.info("memory")["used_memory"] - before
        print(f"without the log: {used / count:.0f} per plan (plan and index entry)")
    finally:
        stack.stop_all()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
