"""The README's first command, end to end: `make up` (scripts/demo.py up) starts Redis, the
companion, the mock upstream and Envoy on the demo's fixed ports, `burst` shows the
request limit answering 429 and streamed reservations settled, and `make down` stops
exactly the processes `up` started (docs/getting-started.md: "stops exactly the processes `make up`
started"), leaving another process of the same program running."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stack import ROOT, _redis_ping

DEMO = [sys.executable, str(ROOT / "scripts/demo.py")]
PIDS = ROOT / "run/demo/pids.json"
PORTS = (10000, 9901, 8081, 8090, 6380)


def port_free(port: int) -> bool:
    """No listener holds `port` (connections of the burst may linger in TIME_WAIT: a
    server binds past them, as Envoy and Redis do with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "zombie" not in status.lower()


def demo(command: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DEMO, command], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_make_up_serves_the_burst_and_make_down_stops_exactly_what_it_started(stack):
    if PIDS.exists() or not all(port_free(p) for p in PORTS):
        pytest.skip("the demo's fixed ports are in use (a demo of your own is up?): not touching it")
    # Another Redis, not the demo's: `down` must leave it running.
    decoy, decoy_port = stack.redis()
    try:
        started = demo("up")
        assert started.returncode == 0, started.stdout + started.stderr
        pids = {name: entry["pid"] for name, entry in json.loads(PIDS.read_text()).items()}
        assert set(pids) == {"redis", "companion", "mock-llm", "envoy"}, pids
        assert all(alive(pid) for pid in pids.values()), pids
        shown = demo("burst")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        part_one, _, part_two = shown.stdout.partition("\n2. ")
        assert " 200 " in part_one and " 429 " in part_one and "Retry-After" in part_one, shown.stdout
        assert part_two.count(" 200  reserved") >= 2 and "given back" in part_two, shown.stdout
        again = demo("up")
        assert "already up" in again.stdout, again.stdout
        stopped = demo("down")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not any(alive(pid) for pid in pids.values()), pids
        assert sorted(line.split()[1] for line in stopped.stdout.splitlines() if line.startswith("stopped")) == sorted(
            pids), stopped.stdout
        assert not PIDS.exists()
        assert all(port_free(p) for p in PORTS)
        assert alive(decoy.popen.pid) and _redis_ping(decoy_port), "the other Redis is still running"
        assert "not running" in demo("down").stdout
    finally:
        if PIDS.exists():
            demo("down")
