"""Benchmark: the same small non-streaming POST through Envoy without the filter and with
it, measured in one run on this machine so the ratios mean something on a noisy host.

Envoy runs with --concurrency 1 pinned to CPU 0; wrk, the mock upstream, the companion and
Redis share CPU 1 (as in shared/notes/anchors.md). The filter's limit is far above the
offered load, so every request takes the full path (callout, Lua, response headers) and
none is rejected. Requests rotate over 1,000 API keys.

Prints requests/s at 16 connections, p50/p99 latency at 1 connection, the ratios, and
Redis round trips (script calls) per request.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stack import Stack, envoy_config, free_port, http_get

TOKEN = "bench-token"
WRK_SCRIPT = r"""
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}],"max_tokens":8}'
local n = 0
request = function()
  n = n + 1
  wrk.headers["authorization"] = "Bearer sk-bench-" .. (n % 1000)
  return wrk.format()
end
response = function(status)
  if status ~= 200 then error("unexpected status " .. status) end
end
"""


def wrk(url: str, script: Path, connections: int, seconds: int) -> dict:
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout
    if "Non-2xx" in out or "error" in out.lower() and "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    def pct(p):
        value, unit = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    return {"rps": rps, "requests": requests, "p50": pct(50), "p99": pct(99)}


def redis_round_trips(port: int) -> int:
    """Script calls Redis has served (INFO commandstats): one per round trip, where
    total_commands_processed would also count the commands inside each script."""
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "commandstats"], capture_output=True, text=True, check=True).stdout
    return sum(int(n) for n in re.findall(r"^cmdstat_(?:evalsha|eval):calls=(\d+)", out, re.M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10, help="duration of each throughput run")
    args = parser.parse_args()
    for tool in ("wrk", "taskset"):
        if not shutil.which(tool):
            sys.exit(f"bench: {tool} is missing (make setup installs wrk)")

    workdir = Path(tempfile.mkdtemp(prefix="llmrl-bench-"))
    script = workdir / "post.lua"
    script.write_text(WRK_SCRIPT)
    stack = Stack(workdir)
    try:
        _, redis_port = stack.redis()
        companion, companion_port = stack.companion(f"redis://127.0.0.1:{redis_port}", TOKEN)
        mock, mock_port = stack.mock()
        filter_config = {
            "companion": {"upstream": "llm_ratelimit_companion", "token": TOKEN, "timeout": "1s"},
            "failure_mode": "deny",
            "limits": [{"name": "rpm", "requests": 1_000_000_000, "window": "1m"}],
        }
        variants = {}
        for name, with_filter in (("passthrough", False), ("llm-ratelimit", True)):
            port = free_port()
            proc, _ = stack.envoy(
                envoy_config(listen_port=port, admin_port=free_port(), upstream_port=mock_port,
                             companion_port=companion_port, filter_config=filter_config, with_filter=with_filter),
                name=f"envoy-{name}", concurrency=1,
            )
            subprocess.run(["taskset", "-pc", "0", str(proc.pid)], check=True, capture_output=True)
            variants[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
        for proc in (companion, mock):
            subprocess.run(["taskset", "-pc", "1", str(proc.pid)], check=True, capture_output=True)

        results = {}
        for name, url in variants.items():
            wrk(url, script, 4, 2)  # warm up connections, VMs and caches
            before = redis_round_trips(redis_port)
            throughput = wrk(url, script, 16, args.seconds)
            calls = (redis_round_trips(redis_port) - before) / throughput["requests"]
            results[name] = {**throughput, "redis_calls": calls, "latency": wrk(url, script, 1, max(3, args.seconds // 2))}
        base = results["passthrough"]
        print(f"\n{'path':<16}{'req/s (16 conn)':>16}{'ratio':>8}{'p50 1 conn':>13}{'p99 1 conn':>13}{'added p50':>12}{'Redis trips/req':>17}")
        for name, r in results.items():
            lat = r["latency"]
            print(f"{name:<16}{r['rps']:>16,.0f}{r['rps'] / base['rps']:>8.2f}{lat['p50']:>10.3f} ms{lat['p99']:>10.3f} ms"
                  f"{lat['p50'] - base['latency']['p50']:>9.3f} ms{r['redis_calls']:>17.2f}")
        print(f"\n(wrk -t1, {args.seconds}s per throughput run; Envoy --concurrency 1 on CPU 0; everything else on CPU 1)")
    finally:
        stack.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
