"""Benchmark: llm-ratelimit against Envoy without a filter and with an empty wasm filter,
all measured in one run on this machine so the ratios mean something on a noisy host.

1. Start-up: time from starting Envoy (--concurrency 2) to /ready, and the first request
   after it, for no filter, the empty filter, the ABI floor filter and llm-ratelimit
   (o200k + cl100k linked).
2. Requests/s at 16 connections, Envoy's CPU time per request, p50/p99 at 1 connection
   and Redis round trips per request, for request limits and request + token limits, each
   decided by a callout per request (direct), from a leased budget (lease) or in the
   proxy's own shared data (local store: no callout, no renewal); and the
   cost of five limits against one, as token buckets and as sliding windows; and the
   hot tenant (`+ tokens, lease, 1 key`): one API key from all 16 connections, where the
   other rows rotate over 1,000; and a request limit with a shared pool every request
   touches (`per: "all"`), direct and leased, next to the same limit without it; and
   the token rows with plans on (`, plans`: every tenant has a plan in Redis, capacities
   equal to the config's, so the load is the same): what reading a plan in the script
   costs. Three
   bodies: a tiny chat; a realistic one (a system prompt and three exchanges, 2.4 kB);
   and a conversation of 1 to 20 turns, each request resending the turns before it, as a
   chat client does. Envoy --concurrency 1 on CPU 0; wrk, the mock upstream, the
   companion and Redis share CPU 1 (as in shared/notes/anchors.md). Next to the empty
   filter, the ABI floor filter (bench/floor-filter): the host calls a token-aware filter
   deciding from a lease makes per request (headers read and held, the body copied in, one
   shared-data read and compare-and-swap, the rate-limit headers set, the reply copied in)
   with no logic; llm-ratelimit's cost over it is its own work.
3. Prompt size: p50 at 1 connection for 1k- and 32k-token prompts, with and without the
   filter; the difference between the two added latencies gives the filter's prompt
   processing rate (read, JSON parse and tokenize) in MB/s, next to native tiktoken-rs on
   the same text.

Limits are far above the offered load: every request takes the whole path and none is
rejected. Requests rotate over 1,000 API keys (the hot tenant row: one).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from stack import ROOT, Stack, envoy_config, free_port, http_get, redis_key, tenant_of

TOKEN = "bench-companion-token-0123456789"  # at least 16 bytes: the companion refuses shorter
EMPTY_WASM = ROOT / "target/wasm32-unknown-unknown/release/empty_filter.wasm"
FLOOR_WASM = ROOT / "target/wasm32-unknown-unknown/release/floor_filter.wasm"
COMPANION = {"upstream": "llm_ratelimit_companion", "token": TOKEN, "timeout": "1s"}
REQUESTS_ONLY = {"companion": COMPANION, "failure_mode": "deny",
                 "limits": [{"name": "rpm", "requests": 1_000_000_000, "window": "1m"}]}
WITH_TOKENS = {**REQUESTS_ONLY, "limits": REQUESTS_ONLY["limits"] + [{"name": "tpm", "tokens": 10**12, "window": "1m"}]}
FIVE_BUCKETS = {**REQUESTS_ONLY, "limits": [
    {"name": f"r{i}", "requests": 1_000_000_000, "window": w} for i, w in enumerate(["1s", "1m", "1h", "1d", "30d"])]}
SLIDING = {**REQUESTS_ONLY, "limits": [{"name": "rpm", "requests": 1_000_000_000, "window": "1m", "algorithm": "sliding_window"}]}
FIVE_SLIDING = {**REQUESTS_ONLY, "limits": [
    {**limit, "algorithm": "sliding_window"} for limit in FIVE_BUCKETS["limits"]]}
LEASED = {**REQUESTS_ONLY, "lease": {"enabled": True}}
LEASED_TOKENS = {**WITH_TOKENS, "lease": {"enabled": True}}
# The same request limit with a shared pool every request touches (`per: "all"`, the
# upstream's quota): next to the rows above, what the pool adds, directly and leased.
POOLED = {**REQUESTS_ONLY, "limits": REQUESTS_ONLY["limits"] + [
    {"name": "upstream", "requests": 1_000_000_000, "window": "1m", "per": "all"}]}
POOLED_LEASED = {**POOLED, "lease": {"enabled": True}}
# Plans on (issue 44): the token rows in a domain of their own where every tenant has a
# plan (written before the measured runs by `write_plans`), the rows without plans in
# the default domain where none has: the difference is reading a plan in the script.
PLANS_DOMAIN = "bench-plans"
PLANNED_TOKENS = {**WITH_TOKENS, "domain": PLANS_DOMAIN}
PLANNED_LEASED_TOKENS = {**LEASED_TOKENS, "domain": PLANS_DOMAIN}
PLAN_ROWS = ("+ tokens, direct, plans", "+ tokens, lease, plans")
# The local store (`"store": "local"`): every limit in the proxy's shared data, no callout.
LOCAL_STORE = {"store": "local", "limits": REQUESTS_ONLY["limits"]}
LOCAL_STORE_TOKENS = {"store": "local", "limits": WITH_TOKENS["limits"]}
# The queue on, capacity free: what docs/queue.md's "never enters the queue" costs
# (the row `requests, queue on`).
QUEUED = {**REQUESTS_ONLY, "queue": {"max_wait": "5s"}}

# API keys the requests rotate over; the hot tenant rows send one key from every connection.
TENANTS = 1000
HOT_TENANT_ROWS = ("+ tokens, lease, 1 key",)

WRK_SCRIPT = r"""
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
local bodies = {}
for line in io.lines("BODY_FILE") do bodies[#bodies + 1] = line end
local n = 0
request = function()
  n = n + 1
  wrk.headers["authorization"] = "Bearer sk-bench-" .. (n % TENANTS)
  -- "{{n}}" in a body becomes the request's number: a text no request sent before.
  local body = bodies[(n % #bodies) + 1]:gsub("{{n}}", tostring(n))
  return wrk.format(nil, nil, nil, body)
end
response = function(status)
  if status ~= 200 then error("unexpected status " .. status) end
end
"""

WORDS = ("limit token request budget window proxy reserve settle stream usage model tenant quota burst "
         "latency throughput gateway envoy filter redis cluster lease prompt completion the a of to and in "
         "is for on with as by at from that this it be are was were 2026 42 3.14 {json} [list] (note), "
         "naïve café 東京 Zürich").split()


def prompt_text(words: int) -> str:
    """Deterministic, varied text (a linear congruential walk over a word list)."""
    state, out = 12345, []
    for i in range(words):
        state = (state * 1103515245 + 12345) % 2**31
        out.append(WORDS[state % len(WORDS)])
        if i % 17 == 16:
            out[-1] += "."
    return " ".join(out)


def wrk(url: str, script: Path, connections: int, seconds: int) -> dict:
    done = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    out = done.stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    def pct(p):
        value, unit = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "p50": pct(50),
        "p99": pct(99),
    }


def write_plans(port: int, tenants: int) -> int:
    """A plan for each API key the requests rotate over (crates/protocol/src/plans.rs):
    both limits' capacities as the config has them, and a note, as an operator's plan for
    a customer looks. Returns Redis's MEMORY USAGE of one, in bytes."""
    commands = []
    for n in range(tenants):
        key = redis_key("llmrl:", PLANS_DOMAIN, tenant_of(f"sk-bench-{n}"), "plan", "limits")
        commands.append(f"HSET {key} cap:rpm 1000000000 cap:tpm 1000000000000 note bench-plan-{n:06d}")
    subprocess.run(["redis-cli", "-p", str(port)], input="\n".join(commands) + "\n", text=True, check=True,
                   capture_output=True)
    one = redis_key("llmrl:", PLANS_DOMAIN, tenant_of("sk-bench-1"), "plan", "limits")
    return int(subprocess.run(["redis-cli", "-p", str(port), "MEMORY", "USAGE", one], capture_output=True, text=True,
                              check=True).stdout)


def redis_round_trips(port: int) -> int:
    """Script calls Redis served (INFO commandstats): one per round trip, where
    total_commands_processed would also count the commands inside each script."""
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "commandstats"], capture_output=True, text=True, check=True).stdout
    return sum(int(n) for n in re.findall(r"^cmdstat_(?:evalsha|eval):calls=(\d+)", out, re.M))


SYSTEM_PROMPT = ("You are a careful assistant for a logistics company. Answer in plain English, cite the shipment "
                 "id when you refer to one, never invent tracking numbers, and keep answers under two hundred words "
                 "unless the user asks for detail. If a question is about billing, say that billing questions go to "
                 "the accounts team and give the address accounts@example.com.")


def conversation(turns: int) -> dict:
    """A chat body: the system prompt, `turns` exchanges, then a new question."""
    def question(i):
        return f"Where is shipment SH-{i:05d}? It left Rotterdam on the {i % 28 + 1}th and the customer asks daily."
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(turns):
        messages.append({"role": "user", "content": question(i)})
        messages.append({"role": "assistant", "content": f"Shipment SH-{i:05d} cleared customs in Antwerp and is on "
                         f"the truck to Lyon; the carrier expects delivery within {i % 5 + 1} days. I will flag it if "
                         "the estimate moves."})
    messages.append({"role": "user", "content": question(turns)})
    return {"model": "gpt-4o-mini", "messages": messages, "max_tokens": 64}


def script_for(workdir: Path, name: str, body: "dict | list[dict]", tenants: "int | None" = None) -> Path:
    """A wrk script sending `body` (or each of a list of bodies in turn), over `tenants` API
    keys (default `TENANTS`)."""
    body_file = workdir / f"{name}.jsonl"
    body_file.write_text("\n".join(json.dumps(b) for b in (body if isinstance(body, list) else [body])) + "\n")
    script = workdir / f"{name}.lua"
    script.write_text(WRK_SCRIPT.replace("BODY_FILE", str(body_file)).replace("TENANTS", str(tenants or TENANTS)))
    return script


class Bench:
    def __init__(self, workdir: Path, seconds: int):
        self.workdir, self.seconds = workdir, seconds
        self.stack = Stack(workdir)
        _, self.redis_port = self.stack.redis()
        self.companion, self.companion_port = self.stack.companion(f"redis://127.0.0.1:{self.redis_port}", TOKEN)
        self.mock, self.mock_port = self.stack.mock(extra=["--completion-tokens", "8"])
        for proc in (self.companion, self.mock):
            subprocess.run(["taskset", "-apc", "1", str(proc.pid)], check=True, capture_output=True)

    def config(self, filter_config, wasm=None, port=None):
        config = envoy_config(listen_port=port or free_port(), admin_port=free_port(), upstream_port=self.mock_port,
                              companion_port=self.companion_port, filter_config=filter_config or REQUESTS_ONLY,
                              with_filter=filter_config is not None or wasm is not None)
        if wasm is not None:
            config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0][
                "typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(wasm)
        return config

    def envoy(self, name, filter_config, wasm=None, concurrency=1):
        port = free_port()
        proc, _ = self.stack.envoy(self.config(filter_config, wasm, port), name=name, concurrency=concurrency)
        if concurrency == 1:
            subprocess.run(["taskset", "-apc", "0", str(proc.pid)], check=True, capture_output=True)
        return proc, f"http://127.0.0.1:{port}/v1/chat/completions"

    def startup(self, name, filter_config, wasm=None, runs=3):
        """Median seconds to /ready and latency of the first request after it."""
        ready, first = [], []
        for run in range(runs):
            port, admin = free_port(), free_port()
            config = self.config(filter_config, wasm, port)
            config["admin"]["address"]["socket_address"]["port_value"] = admin
            started = time.monotonic()
            proc, _ = self.stack.envoy(config, name=f"start-{name}-{run}", concurrency=2, wait=False)
            while not _ready(proc, admin):
                time.sleep(0.005)
            ready.append(time.monotonic() - started)
            body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
            started = time.monotonic()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"authorization": "Bearer sk-first", "content-type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()
            first.append(time.monotonic() - started)
            proc.stop()
            self.stack.processes.remove(proc)
        return statistics.median(ready), statistics.median(first)

    def run(self, url, script, proc):
        wrk(url, script, 4, 3)  # warm up connections, VMs, caches and V8's optimising tier
        before, cpu_before = redis_round_trips(self.redis_port), cpu_seconds(proc.popen.pid)
        throughput = wrk(url, script, 16, self.seconds)
        cpu_us = (cpu_seconds(proc.popen.pid) - cpu_before) / throughput["requests"] * 1e6
        trips = (redis_round_trips(self.redis_port) - before) / throughput["requests"]
        return {**throughput, "trips": trips, "cpu_us": cpu_us, "latency": wrk(url, script, 1, max(3, self.seconds // 2))}


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over interleaved rounds of one row."""
    def median(key, of=lambda r: r):
        return statistics.median(of(r)[key] for r in runs)
    return {"rps": median("rps"), "cpu_us": median("cpu_us"), "trips": median("trips"),
            "latency": {"p50": median("p50", lambda r: r["latency"]), "p99": median("p99", lambda r: r["latency"])}}


# A reference row not measured (--only) leaves its columns blank.
def ratio(row: dict, ref: "dict | None") -> str:
    return f"{row['rps'] / ref['rps']:.2f}" if ref else "-"


def added_p50(row: dict, ref: "dict | None") -> str:
    return f"{row['latency']['p50'] - ref['latency']['p50']:.3f} ms" if ref else "-"


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used (all its threads): per request, less sensitive than
    throughput to whatever else the machine runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ready(proc, admin_port: int) -> bool:
    if proc.popen.poll() is not None:
        raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
    try:
        return http_get(f"http://127.0.0.1:{admin_port}/ready", timeout=1)[0] == 200
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=10, help="duration of each throughput run")
    parser.add_argument("--parts", default="123", help="which parts to run (default 123)")
    parser.add_argument("--only", action="append", metavar="ROW",
                        help="part 2: measure only this row (repeatable, e.g. --only 'wasm ABI floor')")
    parser.add_argument("--bodies", action="append", metavar="BODY", choices=("tiny chat", "realistic chat", "1-20 turns"),
                        help="part 2: measure only this body (repeatable)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="part 2: interleaved rounds over the rows; each figure is the median of the rounds")
    args = parser.parse_args()
    for tool in ("wrk", "taskset"):
        if not shutil.which(tool):
            sys.exit(f"bench: {tool} is missing (make setup installs wrk)")
    for wasm, target in ((EMPTY_WASM, "empty-filter"), (FLOOR_WASM, "floor-filter")):
        if not wasm.exists():
            sys.exit(f"bench: {wasm} is missing (make {target} builds it)")

    workdir = Path(tempfile.mkdtemp(prefix="llmrl-bench-"))
    bench = Bench(workdir, args.seconds)
    try:
        if "1" in args.parts:
            print("1. Start-up (Envoy --concurrency 2, median of 3)")
            print(f"   {'filter':<28}{'to /ready':>12}{'first request':>16}")
            for name, config, wasm in (("none", None, None), ("empty wasm filter", None, EMPTY_WASM),
                                       ("wasm ABI floor", None, FLOOR_WASM), ("llm-ratelimit, tokens", WITH_TOKENS, None)):
                ready, first = bench.startup(re.sub(r"[^a-z]+", "-", name).strip("-"), config, wasm)
                print(f"   {name:<28}{ready:>10.2f} s{first * 1000:>13.1f} ms")

        body_of = {
            "tiny chat": ("small", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}),
            "realistic chat": ("chat", conversation(3)),
            "1-20 turns": ("turns", [conversation(turns) for turns in range(20)]),
        }
        bodies = {name: script_for(workdir, file, body) for name, (file, body) in body_of.items()}
        hot_bodies = {name: script_for(workdir, f"{file}-hot", body, tenants=1) for name, (file, body) in body_of.items()}
        variants = [("passthrough", None, None), ("empty wasm filter", None, EMPTY_WASM),
                    ("wasm ABI floor", None, FLOOR_WASM),
                    ("requests, direct", REQUESTS_ONLY, None), ("requests, lease", LEASED, None),
                    ("+ pool, direct", POOLED, None), ("+ pool, lease", POOLED_LEASED, None),
                    ("requests, queue on", QUEUED, None),
                    ("+ tokens, direct", WITH_TOKENS, None), (PLAN_ROWS[0], PLANNED_TOKENS, None),
                    ("+ tokens, lease", LEASED_TOKENS, None), (PLAN_ROWS[1], PLANNED_LEASED_TOKENS, None),
                    (HOT_TENANT_ROWS[0], LEASED_TOKENS, None),
                    ("requests, local store", LOCAL_STORE, None), ("+ tokens, local store", LOCAL_STORE_TOKENS, None),
                    ("5 buckets, direct", FIVE_BUCKETS, None), ("1 sliding, direct", SLIDING, None),
                    ("5 sliding, direct", FIVE_SLIDING, None)]
        if args.only:
            unknown = set(args.only) - {name for name, _, _ in variants}
            if unknown:
                sys.exit(f"bench: no row named {', '.join(sorted(unknown))}")
            variants = [v for v in variants if v[0] in args.only]
        if args.bodies:
            bodies = {name: script for name, script in bodies.items() if name in args.bodies}
        # The bodies that matter for a token policy: the filter parses and counts them.
        body_variants = ("passthrough", "empty wasm filter", "wasm ABI floor", "+ tokens, direct", "+ tokens, lease",
                         *HOT_TENANT_ROWS, "+ tokens, local store")
        results, loads = {}, []
        urls, procs = {}, {}
        for name, config, wasm in variants if {"2", "3"} & set(args.parts) else []:
            procs[name], urls[name] = bench.envoy(re.sub(r"[^a-z]+", "-", name).strip("-"), config, wasm)
        plan_bytes = None
        if "2" in args.parts and set(PLAN_ROWS) & urls.keys():
            plan_bytes = write_plans(bench.redis_port, TENANTS)
        for _ in range(args.rounds if "2" in args.parts else 0):
            loads.append(os.getloadavg()[0])
            for name, _, _ in variants:
                for body_name, script in bodies.items():
                    if name in HOT_TENANT_ROWS:
                        script = hot_bodies[body_name]
                    if body_name == "tiny chat" or name in body_variants:
                        results.setdefault((body_name, name), []).append(bench.run(urls[name], script, procs[name]))
        if results:
            print("\n2. Requests (Envoy --concurrency 1 on CPU 0; the rest on CPU 1"
                  + (f"; medians of {args.rounds} interleaved rounds)" if args.rounds > 1 else ")"))
            print(f"   {'path':<24}{'req/s':>9}{'ratio':>7}{'/empty':>8}{'/floor':>8}{'CPU/req':>10}{'p50 1 conn':>12}"
                  f"{'p99 1 conn':>12}{'added p50':>11}{'/empty':>10}{'Redis trips/req':>17}")
        for body_name in bodies:
            rows = {name: median_run(runs) for (b, name), runs in results.items() if b == body_name}
            if not rows:
                continue
            print(f"   {body_name}:")
            base, empty, floor = (rows.get(n) for n in ("passthrough", "empty wasm filter", "wasm ABI floor"))
            for name, r in rows.items():
                lat = r["latency"]
                print(f"   {name:<24}{r['rps']:>9,.0f}{ratio(r, base):>7}{ratio(r, empty):>8}{ratio(r, floor):>8}"
                      f"{r['cpu_us']:>7.1f} us{lat['p50']:>9.3f} ms{lat['p99']:>9.3f} ms"
                      f"{added_p50(r, base):>11}{added_p50(r, empty):>10}{r['trips']:>17.2f}")
                if args.rounds > 1:
                    each = ", ".join(f"{run['rps']:,.0f} {run['cpu_us']:.1f} us" for run in results[(body_name, name)])
                    print(f"   {'':<24}rounds (req/s, CPU/req): {each}")
        if loads:
            print(f"   load average (1 min) at the start of each round: {', '.join(f'{l:.1f}' for l in loads)}")
        if plan_bytes is not None:
            print(f"   plans: every tenant of the rows `, plans` has one ({TENANTS:,}); Redis's MEMORY USAGE of one "
                  f"(2 capacities and a note): {plan_bytes} B")

        if "3" in args.parts and {"passthrough", "+ tokens, direct"} <= urls.keys():
            prompt_size(workdir, urls, args.seconds)
        print(f"\n(wrk -t1, {args.seconds}s per throughput run; {time.strftime('%Y-%m-%d')})")
    finally:
        bench.stack.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def prompt_size(workdir: Path, urls: dict, seconds: int) -> None:
    """Part 3: the filter's prompt processing rate, from the added p50 of two prompt sizes."""
    print("\n3. Prompt size (1 connection; filter with a token limit)")
    sizes = {}
    for label, words in (("1k", 700), ("32k", 22_500)):
        text = prompt_text(words)
        text_file = workdir / f"prompt-{label}.txt"
        text_file.write_text(text)
        native = json.loads(subprocess.run([str(ROOT / "target/release/examples/tokenize_bench"), str(text_file)],
                                           capture_output=True, text=True, check=True).stdout)
        # Each request's prompt is new (a number in front), so none is answered from
        # the filter's table of counts already made.
        script = script_for(workdir, f"prompt-{label}", {"model": "gpt-4o-mini", "max_tokens": 8,
                                                          "messages": [{"role": "user", "content": "{{n}} " + text}]})
        plain = wrk(urls["passthrough"], script, 1, max(3, seconds // 2))
        filtered = wrk(urls["+ tokens, direct"], script, 1, max(3, seconds // 2))
        sizes[label] = {"native": native, "added": filtered["p50"] - plain["p50"], "plain": plain, "filtered": filtered}
        print(f"   {label:>4} prompt ({native['tokens']:>6,} tokens, {native['bytes'] / 1000:>6.1f} kB): p50 "
              f"{plain['p50']:.3f} ms without, {filtered['p50']:.3f} ms with the filter: +{sizes[label]['added']:.3f} ms")
    extra_bytes = sizes["32k"]["native"]["bytes"] - sizes["1k"]["native"]["bytes"]
    extra_ms = sizes["32k"]["added"] - sizes["1k"]["added"]
    in_filter = extra_bytes / (extra_ms / 1000) / 1e6 if extra_ms > 0 else float("nan")
    native_rate = sizes["32k"]["native"]["mb_per_s"]
    print(f"   prompt processing in the filter (read, parse, tokenize): {in_filter:.1f} MB/s; "
          f"native tiktoken-rs on the same text: {native_rate:.1f} MB/s (ratio {in_filter / native_rate:.2f}); "
          f"the filter's counter natively: {sizes['32k']['native']['ours_mb_per_s']:.1f} MB/s")


if __name__ == "__main__":
    main()
