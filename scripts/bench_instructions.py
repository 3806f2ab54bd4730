"""Envoy's instructions per request under callgrind: the benchmark's rows as counts that
stay put on a loaded machine, where req/s and CPU time move with whatever else runs.

For each row (no filter, the empty filter, the ABI floor filter, llm-ratelimit with RPM +
TPM in lease mode or in the local store, optionally from another .wasm) Envoy
(--concurrency 1) runs under `valgrind --tool=callgrind`; the script reads the
instructions Envoy ran up to /ready (start-up: mostly V8 compiling the module), its
instructions per second while idle (the filter's tick, Envoy's timers), then per body the
instructions of a run of requests at one connection, less the idle rate over the run's
time, per request. Counts are user space only: the kernel's share of a request (sockets,
epoll) is the same for every filter and is not in them. The companion's Redis round trips
per request are printed alongside: a callout costs instructions too.

Each VM's tick (every 50 ms) does the work of the requests since the last (renewals,
averages and calibrations written): at the hundred or so requests a second Envoy serves
under callgrind, a tick's work falls on a handful of requests, where at thousands a second
it falls on hundreds. So each row also prints its figures without the ticks, and what the
ticks cost a second while serving. A tick is told apart in the dump as an entry into the
module called as often as ticks come (about 20 a second for each VM) and not once or a few
times a request; where that cannot be told (a request rate near the tick rate) the line
is left out.

Requests rotate over 10 API keys, not bench.py's 1,000: each tenant comes back within its
lease, as each of the 1,000 does at bench.py's rates. Start-up takes minutes under
valgrind.

Usage: scripts/bench_instructions.py [--rows passthrough,empty,floor,lease,local] [--wasm PATH]
                                     [--bodies tiny,realistic,turns,stream] [--rounds 2] [--keep]
                                     [--startup-only] [--first N]

`--bodies stream` adds the tiny chat streamed (an event a token; the filter asks for the
usage chunk and takes it out of what the client gets).

With --first N, the first N requests after /ready are counted one by one (one tenant's tiny
chat, one at a time, before any other traffic): the first request should cost no more than
the tenth (nothing built lazily on it). In the lease row the first asks the companion for
the tenant's lease; the local row has no callout.

With --keep the dumps stay, for `callgrind_annotate --inclusive=yes` on a body's window. The
module's code, compiled by V8, shows as addresses without names (so do Envoy's own
functions in a stripped build, such as PyPI's); the host calls still tell apart by their
callee's count per request against the floor filter's known calls.
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
import urllib.error
import urllib.request
from pathlib import Path

import bench
import stack

# Under callgrind Envoy runs some fifty times slower, and a tenant's first callouts (before
# its lease) can take longer than bench.py's 1 s companion timeout, which fails the run
# with 503s; a callout's instructions do not depend on its timeout.
SLOW_COMPANION = {**bench.COMPANION, "timeout": "30s"}
ROWS = {"passthrough": (None, None), "empty": (None, bench.EMPTY_WASM), "floor": (None, bench.FLOOR_WASM),
        "lease": ({**bench.LEASED_TOKENS, "companion": SLOW_COMPANION}, None),
        # RPM + TPM in the proxy's own shared data: no companion, no callout.
        "local": (bench.LOCAL_STORE_TOKENS, None)}
BODIES = {
    "tiny": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8},
    "realistic": bench.conversation(3),
    "turns": [bench.conversation(turns) for turns in range(20)],
    # The tiny chat streamed, without asking for usage (as most clients): the mock answers
    # with an event a token (8) and [DONE]; the filter asks for the usage chunk and hides it.
    "stream": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8,
               "stream": True},
}
DEFAULT_BODIES = "tiny,realistic,turns"
TENANTS = 10


# The filter's tick (`effects::host::TICK`): each VM's root is called this often.
TICKS_PER_SECOND = 20


def _is_compiled_wasm(name: str) -> bool:
    """V8's compiled code has no symbols: callgrind names it by address, and it lives above
    4 GiB, where this Envoy's own code (mapped low, named or not) is not."""
    address = name.split("'", 1)[0]  # callgrind marks recursion levels with 'N
    return address.startswith("0x") and int(address, 16) > 1 << 32


def module_entries(dump: Path) -> dict:
    """Calls from Envoy into the module's compiled code, by callee: (calls, inclusive
    instructions). Callgrind's format: `fn=` and `cfn=` name the caller and the callee (as
    `(id) name` the first time, `(id)` after), `calls=` counts the call whose cost is on the
    next line."""
    names, caller, callee, pending, found = {}, None, None, None, {}

    def name(value: str) -> str:
        m = re.match(r"\((\d+)\)(?: (.*))?", value)
        if not m:
            return value
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), m.group(1))

    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("fn="):
            caller = name(line[3:])
        elif line.startswith("cfn="):
            callee = name(line[4:])
        elif line.startswith("calls="):
            pending = int(line[6:].split()[0])
        elif pending is not None and (line[:1].isdigit() or line[:1] in "+-*"):
            parts = line.split()
            if caller and callee and not _is_compiled_wasm(caller) and _is_compiled_wasm(callee):
                calls, total = found.get(callee, (0, 0))
                found[callee] = (calls + pending, total + (int(parts[1]) if len(parts) > 1 else 0))
            pending = None
    return found


def tick_instructions(dump: Path, seconds: float, requests: int) -> "int | None":
    """The instructions of the VMs' ticks in a window (the worker's and the main thread's),
    or None when they cannot be told from the request callbacks. A tick is an entry into the
    module called about as often as ticks came (every 50 ms per VM; a slow Envoy fires
    fewer), and not as often as a request callback is (once or a few times a request)."""
    expected = TICKS_PER_SECOND * seconds
    if requests and 0.4 * expected <= requests <= 1.2 * expected:
        return None
    ticks = [total for calls, total in module_entries(dump).values()
             if 0.5 * expected <= calls <= 1.1 * expected
             and all(abs(calls - k * requests) > 0.05 * max(requests, 1) for k in (1, 2, 3, 4))]
    return sum(ticks) if 1 <= len(ticks) <= 2 else None


def total_instructions(dump: Path) -> int:
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


class Callgrind:
    """One Envoy under callgrind; `window` counts the instructions run while an action runs."""

    def __init__(self, workdir: Path, name: str, pid: int):
        self.workdir, self.name, self.pid = workdir, name, pid

    def control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.pid)], check=True, capture_output=True, timeout=300)

    def dump(self) -> int:
        self.control("-d")
        dumps = self.workdir.glob(f"callgrind.{self.name}.{self.pid}.out.*")
        self.last = max(dumps, key=lambda p: int(p.name.rsplit(".", 1)[1]))
        return total_instructions(self.last)

    def window(self, action):
        self.control("-z")
        started = time.monotonic()
        result = action()
        return self.dump(), time.monotonic() - started, result


def one_request(url: str) -> None:
    """One tiny chat from one tenant, answered (a 429 counts too)."""
    body = json.dumps(BODIES["tiny"]).encode()
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"authorization": "Bearer sk-first", "content-type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=600).read()
    except urllib.error.HTTPError as e:
        e.read()


def measure(bench_: bench.Bench, workdir: Path, name: str, config, wasm, scripts: dict, seconds: int, rounds: int,
            first: int = 0) -> dict:
    wrapper = workdir / "envoy-callgrind.sh"
    wrapper.write_text("#!/bin/sh\nexec valgrind --tool=callgrind --smc-check=all-non-file --separate-threads=no "
                       f"--callgrind-out-file={workdir}/callgrind.$CALLGRIND_ROW.%p.out {stack.envoy_bin()} \"$@\"\n")
    wrapper.chmod(0o755)
    port, admin = stack.free_port(), stack.free_port()
    envoy_config = bench_.config(config, wasm, port)
    envoy_config["admin"]["address"]["socket_address"]["port_value"] = admin
    os.environ.update(ENVOY_BIN=str(wrapper), CALLGRIND_ROW=name)
    try:
        proc, _ = bench_.stack.envoy(envoy_config, name=name, concurrency=1, wait=False)
    finally:
        for variable in ("ENVOY_BIN", "CALLGRIND_ROW"):
            del os.environ[variable]
    stack.wait_until(lambda: stack.http_get(f"http://127.0.0.1:{admin}/ready")[0] == 200, 1800, name, proc)
    grind = Callgrind(workdir, name, proc.popen.pid)
    result = {"startup": grind.dump()}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    # The first requests after start-up, one at a time, one tenant: what is built lazily
    # (on the first request of a VM) shows as the first costing more than the tenth.
    result["first"] = [grind.window(lambda: one_request(url))[0] for _ in range(first)]
    for script in scripts.values():
        bench.wrk(url, script, 2, 5)  # every tenant leased, V8's code warm
    idle, idle_seconds, _ = grind.window(lambda: time.sleep(5))
    result["idle_per_s"] = idle / idle_seconds
    idle_ticks = tick_instructions(grind.last, idle_seconds, 0)
    # What Envoy does at rest besides the filter's ticks (its own timers, the main thread).
    untick_idle_per_s = None if idle_ticks is None else (idle - idle_ticks) / idle_seconds
    for _ in range(rounds):
        for body, script in scripts.items():
            trips = bench.redis_round_trips(bench_.redis_port)
            counted, run_seconds, run = grind.window(lambda: bench.wrk(url, script, 1, seconds))
            trips = (bench.redis_round_trips(bench_.redis_port) - trips) / run["requests"]
            per_request = (counted - result["idle_per_s"] * run_seconds) / run["requests"]
            result.setdefault(body, []).append((per_request, trips))
            result.setdefault("rates", []).append(f"{body} {run['requests'] / run_seconds:.0f}/s")
            ticks = tick_instructions(grind.last, run_seconds, run["requests"])
            if ticks is not None and untick_idle_per_s is not None:
                without = (counted - ticks - untick_idle_per_s * run_seconds) / run["requests"]
                result.setdefault("untick:" + body, []).append((without, ticks / run_seconds))
    proc.stop()
    bench_.stack.processes.remove(proc)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="empty,floor,lease", help="comma-separated: passthrough, empty, floor, lease, local")
    parser.add_argument("--wasm", type=Path, help="llm-ratelimit .wasm for the lease and local rows (default: make wasm's)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per body; each figure is their median")
    parser.add_argument("--seconds", type=int, default=8, help="duration of each run")
    parser.add_argument("--bodies", default=DEFAULT_BODIES, help=f"comma-separated: {', '.join(BODIES)}")
    parser.add_argument("--startup-only", action="store_true", help="only the instructions to /ready")
    parser.add_argument("--first", type=int, default=0, metavar="N",
                        help="also the instructions of each of the first N requests after /ready (one tenant, "
                             "one at a time; the local row has no callout in them)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the callgrind dumps (one per window, by row) for callgrind_annotate; prints where")
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("bench_instructions: valgrind is missing")
    bench.TENANTS = TENANTS
    workdir = Path(tempfile.mkdtemp(prefix="llmrl-instructions-"))
    bench_ = bench.Bench(workdir, args.seconds)
    bodies = args.bodies.split(",")
    if unknown := [body for body in bodies if body not in BODIES]:
        sys.exit(f"bench_instructions: no body {', '.join(unknown)} (the bodies: {', '.join(BODIES)})")
    scripts = {} if args.startup_only else {body: bench.script_for(workdir, body, BODIES[body]) for body in bodies}
    print(f"{'row':<8}{'start-up':>14}{'idle/s':>12}" + "".join(f"{body + ' /req':>22}" for body in scripts)
          + "   (instructions; Redis trips/req)", flush=True)
    try:
        for row in args.rows.split(","):
            config, wasm = ROWS[row]
            if row in ("lease", "local") and args.wasm:
                wasm = args.wasm
            r = measure(bench_, workdir, row, config, wasm, scripts, args.seconds, args.rounds, args.first)
            cells = "".join(f"{statistics.median(c for c, _ in r[b]):>14,.0f} {statistics.median(t for _, t in r[b]):>6.2f}"
                            for b in scripts)
            print(f"{row:<8}{r['startup']:>14,}{r.get('idle_per_s', 0):>12,.0f}{cells}", flush=True)
            if r["first"]:
                print(f"{'':<8}the first {len(r['first'])} requests: {', '.join(f'{c:,}' for c in r['first'])}", flush=True)
            # The filter's tick (every 50 ms) does work for the tenants it served since the
            # last: the slower Envoy runs under callgrind (a loaded machine), the fewer
            # requests share a tick's work, and the more of it each request's figure holds.
            if r.get("rates"):
                print(f"{'':<8}requests a second under callgrind: {', '.join(r['rates'])}", flush=True)
            split = [(b, r["untick:" + b]) for b in scripts if r.get("untick:" + b)]
            if split:
                cells = ", ".join(f"{b} {statistics.median(w for w, _ in v):,.0f}/req" for b, v in split)
                rates = ", ".join(f"{b} {statistics.median(t for _, t in v):,.0f}/s" for b, v in split)
                print(f"{'':<8}without the ticks: {cells}; the ticks while serving: {rates}", flush=True)
    finally:
        bench_.stack.stop_all()
        if args.keep:
            print(f"callgrind dumps kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
