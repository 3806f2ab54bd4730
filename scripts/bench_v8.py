"""The core's instructions per request as V8 runs them: `request_bench`'s loop (the fake
host included) built for wasm32 and run by Node's V8 with TurboFan only, as Envoy runs
the filter, under callgrind. A minute a figure, against several for
`bench_instructions.py`, and closer to Envoy's own work than the native `request_bench`:
V8's compiled code spends about 2.4 times the native instructions on the same path, and
not evenly (allocation weighs more, and so do copies, which V8 makes a call into C). Node's V8
is older than Envoy's: confirm a step in Envoy with `bench_instructions.py` at its end.

The figure is the slope between two runs of N and 3N requests (after 500 to warm up),
so start-up and compilation fall out of it. It is repeatable to the instruction (seeds
fixed, no address randomisation), but it grows with N (the harness's tables fill):
compare figures of one N.

With --profile, V8's sampling profiler (`node --cpu-prof`) over a longer run instead: the
functions by their own time and by time under them (names from the module's name
section, demangled by `c++filt`).

Usage: scripts/bench_v8.py [--mode lease|local|direct] [--body small|chat|turns|stream]
                           [--tenants 10] [--per-tick 4] [-n 1000] [--wasm PATH] [--profile]

The defaults are `bench_instructions.py`'s: 10 tenants, about 4 requests a tick.
"""

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WASM = ROOT / "target/wasm32-unknown-unknown/wasm/examples/request_bench_v8.wasm"
MODES = ["lease", "local", "direct"]
BODIES = ["small", "chat", "turns", "stream"]
WARM_UP = 500

# Instantiates the module (it imports nothing) and serves requests twice: a warm-up, then
# the counted run, each from a fresh fake proxy.
RUNNER = """
const fs = require('fs');
const [wasm, mode, body, n, tenants, perTick, warm] = process.argv.slice(2).map((a, i) => i ? Number(a) : a);
const instance = new WebAssembly.Instance(new WebAssembly.Module(fs.readFileSync(wasm)), {});
if (instance.exports.serve(mode, body, warm, tenants, perTick) !== warm) throw new Error('warm-up failed');
const started = process.hrtime.bigint();
if (instance.exports.serve(mode, body, n, tenants, perTick) !== n) throw new Error('run failed');
console.log(JSON.stringify({requests: n, us_per_request: Number(process.hrtime.bigint() - started) / 1e3 / n}));
"""
# Liftoff off, as the proxy-wasm host has it. For the count: one thread, so callgrind sees
# all of it, and every seed fixed, V8's garbage collection made predictable and the
# address space not randomised (setarch -R), so the same module counts the same to the
# instruction: without them two runs differed by up to 7k a request.
NODE = ["node", "--no-liftoff"]
COUNTED = ["setarch", "-R", "valgrind", "--tool=callgrind", "--smc-check=all-non-file"]
DETERMINISTIC = ["--single-threaded", "--predictable", "--hash-seed=1", "--random-seed=1"]


def build():
    subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "request-bench-v8"], check=True)


def run_args(runner, args, n):
    return [runner, str(args.wasm), str(MODES.index(args.mode)), str(BODIES.index(args.body)), str(n),
            str(args.tenants), str(args.per_tick), str(WARM_UP)]


def instructions(runner, args, n, out):
    """Total instructions of one run of `n` requests under callgrind."""
    run = subprocess.run([*COUNTED, f"--callgrind-out-file={out}", *NODE, *DETERMINISTIC, *run_args(runner, args, n)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the run of {n} requests failed:\n{run.stderr[-2000:]}")
    for line in Path(out).read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"no totals in {out}")


def demangled(names):
    """Rust's mangled names as `c++filt` reads them (binutils knows Rust's v0 scheme), less
    the crate hashes and this crate's own prefix."""
    names = sorted(set(names))
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    if len(out) != len(names):
        out = names
    tidy = [re.sub(r"\[[0-9a-f]+\]", "", text).replace("llm_ratelimit_core::", "") or "(anonymous)" for text in out]
    return dict(zip(names, tidy))


def profile(runner, args, tmp):
    """V8's sampling profile of a run: (own, under) samples by function, and the run's total."""
    n = max(args.n * 200, 200_000)
    # Compiled on other threads, so that compiling does not show as the module's time.
    subprocess.run([*NODE, "--cpu-prof", f"--cpu-prof-dir={tmp}", "--cpu-prof-interval", "50",
                    *run_args(runner, args, n)], check=True, capture_output=True)
    data = json.loads(next(Path(tmp).glob("*.cpuprofile")).read_text())
    nodes = {node["id"]: node for node in data["nodes"]}
    parent = {child: node["id"] for node in data["nodes"] for child in node.get("children", [])}
    name = demangled(node["callFrame"]["functionName"] for node in data["nodes"])
    own, under = collections.Counter(), collections.Counter()
    for node_id, count in collections.Counter(data["samples"]).items():
        own[name[nodes[node_id]["callFrame"]["functionName"]]] += count
        seen, at = set(), node_id
        while at is not None:
            called = name[nodes[at]["callFrame"]["functionName"]]
            if called not in seen:
                seen.add(called)
                under[called] += count
            at = parent.get(at)
    return own, under, under.get("serve", 0) or sum(own.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="lease")
    parser.add_argument("--body", choices=BODIES, default="small")
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--per-tick", type=int, default=4)
    parser.add_argument("-n", type=int, default=1000, help="requests of the shorter run (the longer runs 3n)")
    parser.add_argument("--wasm", type=Path, help="a module built as `make request-bench-v8` builds it")
    parser.add_argument("--profile", action="store_true", help="V8's sampling profile instead of the count")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.wasm is None:
        build()
        args.wasm = WASM
    with tempfile.TemporaryDirectory() as tmp:
        runner = Path(tmp) / "runner.js"
        runner.write_text(RUNNER)
        if args.profile:
            own, under, total = profile(runner, args, tmp)
            for title, counts in (("own time", own), ("time under", under)):
                print(f"{title} (% of serving):")
                for name, count in counts.most_common(args.top):
                    print(f"  {100 * count / total:6.2f}%  {name[:160]}")
            return
        short_run = instructions(runner, args, args.n, Path(tmp) / "short.cg")
        long_run = instructions(runner, args, 3 * args.n, Path(tmp) / "long.cg")
    per_request = (long_run - short_run) / (2 * args.n)
    print(json.dumps({"mode": args.mode, "body": args.body, "tenants": args.tenants, "per_tick": args.per_tick,
                      "instructions_per_request": round(per_request)}))


if __name__ == "__main__":
    sys.exit(main())
