"""`python scripts/faults [--minutes 4] [--workdir DIR]`: the run (see the package's doc)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

# scripts/ (for the package and stack.py) on the path, not this folder.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import faults  # noqa: E402
from faults.inject import Faults, HarnessTimeout  # noqa: E402
from faults.report import print_report  # noqa: E402
from faults.settings import CLIENT_TIMEOUT_S, HEAVY, LIGHT_TENANTS, RESERVATION_TTL_S, SLOTS_TTL_S, log  # noqa: E402
from faults.traffic import Traffic  # noqa: E402
from stack import http_get  # noqa: E402


def run(args) -> bool:
    duration = args.minutes * 60.0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="llmrl-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"work directory (logs): {workdir}")
    f = Faults(workdir, args.seed)
    report: dict = {}
    failures: list[str] = []
    try:
        f.start()
        log(f"stack up: redis :{f.redis_port}, companion :{f.companion_port}, mock :{f.mock_port}, "
            f"envoy A :{f.envoys.state['A']['port']} (admin :{f.envoys.state['A']['admin']}), "
            f"envoy B :{f.envoys.state['B']['port']} (admin :{f.envoys.state['B']['admin']})")
        mem_start = f.memory("A")
        traffic = Traffic(f.envoys, args.seed)
        f.traffic = traffic
        plan = f.schedule(duration)
        log(f"traffic for {duration:.0f}s: {len(HEAVY)} heavy tenants, {LIGHT_TENANTS} light ones; "
            f"{len(plan)} faults scheduled")
        traffic.start()
        mem_warm = None
        for at, _kind, action in plan:
            while f.rel() < at:
                if mem_warm is None and f.rel() >= min(10.0, at - 1):
                    mem_warm = f.memory("A")
                time.sleep(min(0.2, max(0.0, at - f.rel())))
            action()
        while f.rel() < duration:
            time.sleep(min(0.5, duration - f.rel()))
        stuck = traffic.finish(CLIENT_TIMEOUT_S + 5)
        t_stop = f.rel()
        if stuck:
            failures.append(f"{len(stuck)} client thread(s) did not finish")
        log(f"traffic stopped at t={t_stop:.1f}s: {len(traffic.results)} requests")
        # Settlement: every reply has ended; give the 50 ms settlement tick and its
        # retries 3 s, then every reservation must have been settled (its key deleted).
        time.sleep(3.0)
        early = f.scan_keys()
        time.sleep(max(0.0, RESERVATION_TTL_S + SLOTS_TTL_S + 2.0 - 3.0))
        late = f.scan_keys()
        health = http_get(f"http://127.0.0.1:{f.companion_port}/healthz", timeout=3)[0]
        mem_end = f.memory("A")
        mem_b = f.memory("B")
        stats = {n: f.filter_stats(n) for n in ("A", "B")}
        alive = {n: f.envoys.state[n]["proc"].alive() for n in ("A", "B")}
        log_problems = f.envoy_log_problems()
        report = {"results": traffic.results, "events": f.events, "errors": f.errors, "early": early, "late": late,
                  "health": health, "mem": (mem_start, mem_warm, mem_end, mem_b), "stats": stats, "alive": alive,
                  "log_problems": log_problems, "duration": duration}
    except HarnessTimeout:
        failures.append("hard time cap reached")
        traceback.print_exc()
    except Exception:  # noqa: BLE001
        failures.append("harness error: " + traceback.format_exc().strip().splitlines()[-1])
        traceback.print_exc()
    finally:
        signal.alarm(0)  # nothing may interrupt the cleanup
        if f.traffic:
            f.traffic.stop.set()
        f.stack.stop_all()
        log("every process stopped")
    if report:
        (workdir / "results.json").write_text(json.dumps(
            {k: v for k, v in report.items() if k not in ("early", "late")}, default=str))
        failures += print_report(report)
    print()
    for fail in failures:
        print(f"  FAIL: {fail}")
    ok = not failures
    print(f"faults: {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=faults.__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="length of the traffic (default 4)")
    parser.add_argument("--workdir", help="where logs go (default: a new temporary directory)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.minutes <= 0 or args.minutes > 60:
        parser.error("--minutes must be in (0, 60]")
    hard_cap = int(args.minutes * 60 + 240)

    def on_alarm(*_):
        raise HarnessTimeout(f"hard time cap of {hard_cap}s reached")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(hard_cap)

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return 0 if run(args) else 1
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
