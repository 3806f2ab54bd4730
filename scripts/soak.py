"""Soak: many tenants through one Envoy, and what they cost in memory.

Starts Redis, the companion, the mock upstream and one Envoy (--concurrency 2) with the
filter in lease mode (a requests and a tokens limit, far above the load), then drives wrk
(16 connections) with a chat request that carries a NEW API key on every request
("sk-soak-<phase>-<n>"): every request is a tenant the proxy has never seen. The traffic
runs in phases of an equal number of requests (each phase also bounded in time); after
each, it records Envoy's heap (admin /memory: `allocated`, `heap_size`), the RSS of the
Envoy process (/proc), requests/s and the requests that did not get a 2xx.

Then a repeat pass sends each of a few hundred keys several times, to show that tenants
with repeat traffic are admitted from leases (admin /stats:
`wasmcustom.llm_ratelimit_lease_admissions_total`, `lease_callouts_total`).

The filter keeps per-tenant state in fixed tables (`memory.tenant_slots`,
`memory.average_slots`): past the table size, memory should stay flat however many
tenants come. `--slots` sets both tables (default: the filter's default, 16,384).

    .venv/bin/python scripts/soak.py [--keys 1000000] [--phases 5] [--slots 1024]

Stops by itself: at most --keys requests, each phase at most --phase-seconds; every
process it started is stopped by its PID at the end. Each new tenant's first request is
charged by a callout (no lease yet), so on a 2-core machine shared by Envoy, wrk, the
mock, the companion and Redis this runs at some 400-800 requests/s: a default run ends on
its time bound (5 x 110 s, about 200k keys). The whole million takes
`--phase-seconds 600` and some 30-40 minutes there.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stack import Stack, envoy_config, free_port, http_get

TOKEN = "soak-companion-token-0123456789"  # at least 16 bytes: the companion refuses shorter
LIMITS = [{"name": "rpm", "requests": 1_000_000_000, "window": "1m"},
          {"name": "tpm", "tokens": 10**12, "window": "1m"}]
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}
CONNECTIONS = 16

# One wrk thread; `init` gets the key prefix, how many answers to wait for, a key modulus
# (0: every request a new key; n: key i % n) and a file to create once that many answers
# came. wrk runs for its whole -d even when its thread stops, so the caller watches for
# the file and interrupts wrk (SIGINT: wrk prints its statistics up to then). The count is
# what wrk reports as answered: a request or two in flight at the stop is not counted.
WRK_SCRIPT = r"""
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
local f = io.open("BODY_FILE", "rb")
wrk.body = f:read("*a")
f:close()
local prefix, limit, modulus, marker = "sk-soak-", 0, 0, nil
local sent, answered = 0, 0
statuses = {}  -- non-2xx answers by status, read by `done` through thread:get
local threads = {}
setup = function(thread)
  table.insert(threads, thread)
end
init = function(args)
  prefix = args[1]
  limit = tonumber(args[2])
  modulus = tonumber(args[3])
  marker = args[4]
end
request = function()
  local n = sent
  if modulus > 0 then n = n % modulus end
  sent = sent + 1
  wrk.headers["authorization"] = "Bearer " .. prefix .. n
  return wrk.format()
end
response = function(status)
  answered = answered + 1
  if status < 200 or status > 299 then statuses[status] = (statuses[status] or 0) + 1 end
  if answered == limit then
    local m = io.open(marker, "w")
    m:close()
    wrk.thread:stop()
  end
end
done = function()
  local out = {}
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses") or {}) do table.insert(out, status .. "=" .. count) end
  end
  io.write("statuses: " .. table.concat(out, " ") .. "\n")
end
"""


def wrk(url: str, script: Path, prefix: str, count: int, seconds: float, modulus: int = 0) -> dict:
    """Sends `count` requests (or for `seconds`, whichever ends first) and returns what
    wrk measured."""
    marker = script.with_suffix(".done")
    marker.unlink(missing_ok=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{max(1, int(seconds))}s", "--timeout", "10s", "-s", str(script), url,
         "--", prefix, str(count), str(modulus), str(marker)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        while proc.poll() is None and not marker.exists() and time.monotonic() - started < seconds + 30:
            time.sleep(0.02)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or "requests in" not in out:
        raise RuntimeError(f"wrk failed ({proc.returncode}):\n{out}")
    duration = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m)", out)
    wall = float(duration.group(2)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[duration.group(3)]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "errors": (int(non2xx.group(1)) if non2xx else 0) + (sum(map(int, socket_errors.groups())) if socket_errors else 0),
        "wall": wall,
        "statuses": (re.search(r"^statuses: (.*)$", out, re.M) or [None, ""])[1].strip(),
        "output": out,
    }


def memory(admin_port: int, pid: int) -> dict:
    heap = json.loads(http_get(f"http://127.0.0.1:{admin_port}/memory")[1])
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return {"allocated": int(heap["allocated"]), "heap_size": int(heap["heap_size"]), "rss": rss_kib * 1024}


def counters(admin_port: int) -> dict:
    text = http_get(f"http://127.0.0.1:{admin_port}/stats?filter=wasmcustom", timeout=5)[1].decode()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"wasmcustom\.llm_ratelimit_(\w+): (\d+)", text)}


def redis_used_memory(port: int) -> int:
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "memory"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"^used_memory:(\d+)", out, re.M).group(1))


MIB = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000, help="distinct API keys to send, one request each")
    parser.add_argument("--phases", type=int, default=5, help="phases of keys/phases requests, memory read after each")
    parser.add_argument("--phase-seconds", type=float, default=110,
                        help="the longest one phase may run (5 x 110 s: a default run ends within ~10 minutes)")
    parser.add_argument("--slots", type=int, default=None,
                        help="memory.tenant_slots and memory.average_slots (default: the filter's, 16384)")
    parser.add_argument("--repeat-keys", type=int, default=300, help="keys of the repeat pass")
    parser.add_argument("--repeat-times", type=int, default=4,
                        help="requests per key in the repeat pass (the 1st is charged directly, the 2nd asks for a lease)")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        sys.exit("soak: wrk is missing (make setup installs it)")

    policy = {"companion": {"upstream": "llm_ratelimit_companion", "token": TOKEN, "timeout": "1s"},
              "failure_mode": "deny", "limits": LIMITS, "lease": {"enabled": True}}
    if args.slots:
        policy["memory"] = {"tenant_slots": args.slots, "average_slots": args.slots}

    workdir = Path(tempfile.mkdtemp(prefix="llmrl-soak-"))
    stack = Stack(workdir)
    try:
        _, redis_port = stack.redis()
        _, companion_port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN)
        _, mock_port = stack.mock(extra=["--completion-tokens", "8"])
        port, admin_port = free_port(), free_port()
        envoy, _ = stack.envoy(envoy_config(listen_port=port, admin_port=admin_port, upstream_port=mock_port,
                                            companion_port=companion_port, filter_config=policy), concurrency=2)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body_file = workdir / "body.json"
        body_file.write_text(json.dumps(BODY))
        script = workdir / "soak.lua"
        script.write_text(WRK_SCRIPT.replace("BODY_FILE", str(body_file)))

        # Warm up: connections, both workers' VMs and their vocabularies.
        warm = wrk(url, script, "sk-warm-", 2_000, 20)
        time.sleep(1)
        slots = args.slots or 16384
        print(f"soak: {args.keys:,} distinct keys in {args.phases} phases, one request each; Envoy --concurrency 2, "
              f"lease mode (rpm + tpm), memory.tenant_slots = average_slots = {slots:,}"
              f"{'' if args.slots else ' (default)'}; wrk -t1 -c{CONNECTIONS}")
        rows = []
        before = memory(admin_port, envoy.pid)
        rows.append(("start", warm["requests"], before, None, warm["errors"], warm["statuses"]))
        header = f"{'phase':<8}{'distinct keys':>14}{'allocated MiB':>15}{'heap MiB':>10}{'RSS MiB':>9}{'req/s':>9}{'errors':>8}"
        print(header, flush=True)

        def show(row):
            name, keys, mem, rps, errors, statuses = row
            print(f"{name:<8}{keys:>14,}{mem['allocated'] / MIB:>15.1f}{mem['heap_size'] / MIB:>10.1f}{mem['rss'] / MIB:>9.1f}"
                  f"{'' if rps is None else f'{rps:,.0f}':>9}{errors:>8}{f'  ({statuses})' if statuses else ''}", flush=True)

        show(rows[0])
        distinct = warm["requests"]
        per_phase = args.keys // args.phases
        started = time.monotonic()
        total_errors = 0
        for phase in range(1, args.phases + 1):
            count = per_phase if phase < args.phases else args.keys - per_phase * (args.phases - 1)
            result = wrk(url, script, f"sk-soak-{phase}-", count, args.phase_seconds)
            distinct += result["requests"]
            total_errors += result["errors"]
            rows.append((str(phase), distinct, memory(admin_port, envoy.pid), result["requests"] / result["wall"],
                         result["errors"], result["statuses"]))
            show(rows[-1])
        elapsed = time.monotonic() - started
        after = rows[-1][2]
        grown = after["allocated"] - rows[1][2]["allocated"]
        print(f"distinct keys sent: {distinct - warm['requests']:,} in {elapsed:.0f} s "
              f"({(distinct - warm['requests']) / elapsed:,.0f} req/s overall); non-2xx/socket errors: {total_errors}")
        print(f"allocated: {before['allocated'] / MIB:.1f} MiB at start, {rows[1][2]['allocated'] / MIB:.1f} MiB after phase 1, "
              f"{after['allocated'] / MIB:.1f} MiB at the end: "
              f"{grown / max(1, distinct - rows[1][1]):+.1f} bytes per tenant after phase 1; "
              f"Redis used_memory {redis_used_memory(redis_port) / MIB:.0f} MiB")

        # Repeat traffic: each key several times, within lease.ttl.
        counters_before = counters(admin_port)
        repeat = wrk(url, script, "sk-repeat-", args.repeat_keys * args.repeat_times, 60, modulus=args.repeat_keys)
        time.sleep(0.5)
        counters_after = counters(admin_port)
        delta = {name: counters_after.get(name, 0) - counters_before.get(name, 0)
                 for name in ("requests_allowed_total", "lease_admissions_total", "lease_callouts_total")}
        print(f"repeat pass: {args.repeat_keys} keys x {args.repeat_times} = {repeat['requests']} requests, "
              f"{repeat['errors']} errors {repeat['statuses']}; requests_allowed +{delta['requests_allowed_total']}, "
              f"lease_admissions +{delta['lease_admissions_total']}, lease_callouts +{delta['lease_callouts_total']}")
        final = memory(admin_port, envoy.pid)
        print(f"memory after the repeat pass: allocated {final['allocated'] / MIB:.1f} MiB, RSS {final['rss'] / MIB:.1f} MiB")
    finally:
        stack.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
