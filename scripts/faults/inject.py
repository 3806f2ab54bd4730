"""The stack (Redis, companion, mock, two Envoys) and the faults injected into it."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import redis

from stack import Stack, envoy_config, free_port, http_get

from .settings import CYCLE_S, FILTER_CONFIG, FIRST_CYCLE_AT, PREFIX, QUIET_TAIL_S, TOKEN, log, now
from .traffic import Envoys, Traffic


class HarnessTimeout(Exception):
    pass


class Faults:
    def __init__(self, workdir: Path, seed: int):
        self.stack = Stack(workdir)
        self.envoys = Envoys()
        self.events: list[dict] = []  # {"what", "start", "end"} relative to traffic t0
        self.errors: list[str] = []
        self.redis_gen = 1
        self.companion_gen = 1
        self.seed = seed
        self.traffic: Traffic | None = None

    def rel(self) -> float:
        return now() - self.traffic.t0 if self.traffic else 0.0

    def start(self):
        self.redis_proc, self.redis_port = self.stack.redis(name="redis-1")
        self.companion_port = free_port()
        self.companion_proc, _ = self.stack.companion(self.redis_url, TOKEN, port=self.companion_port,
                                                      name="companion-1", redis_timeout="40ms")
        self.mock_proc, self.mock_port = self.stack.mock()
        for name in ("A", "B"):
            config = envoy_config(listen_port=free_port(), admin_port=free_port(), upstream_port=self.mock_port,
                                  companion_port=self.companion_port, filter_config=FILTER_CONFIG)
            self.start_envoy(name, config)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}"

    def start_envoy(self, name: str, config: dict):
        port = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        admin = config["admin"]["address"]["socket_address"]["port_value"]
        gen = self.envoys.state.get(name, {}).get("gen", 0) + 1
        last = None
        for _ in range(3):  # the ports of a killed Envoy may take a moment to be free
            try:
                proc, _ = self.stack.envoy(config, name=f"envoy-{name.lower()}-{gen}", concurrency=2)
                self.envoys.add(name, port, admin, proc, config)
                return
            except Exception as err:  # noqa: BLE001
                last = err
                for p in self.stack.processes:
                    if p.name == f"envoy-{name.lower()}-{gen}" and p.alive():
                        p.kill()
                time.sleep(1.0)
        raise RuntimeError(f"Envoy {name} did not start: {last}")

    def redis_client(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port, socket_timeout=5, socket_connect_timeout=2)

    # Each fault records when it began and when the component was back (relative times).
    def _event(self, what: str, action):
        start = self.rel()
        log(f"t={start:6.1f}s fault: {what}")
        try:
            action()
        except Exception as err:  # noqa: BLE001
            self.errors.append(f"{what}: {err}")
            log(f"  FAILED: {err}")
        end = self.rel()
        self.events.append({"what": what, "start": start, "end": end})
        log(f"  back at t={end:6.1f}s ({end - start:.1f}s)")

    def pause_redis(self, seconds: float):
        def act():
            self.redis_client().execute_command("CLIENT", "PAUSE", str(int(seconds * 1000)), "ALL")
            time.sleep(seconds)
        self._event(f"redis paused {seconds:g}s (CLIENT PAUSE ALL)", act)

    def restart_companion(self, down: float):
        def act():
            self.companion_proc.kill()
            time.sleep(down)
            self.companion_gen += 1
            self.companion_proc, _ = self.stack.companion(self.redis_url, TOKEN, port=self.companion_port,
                                                          name=f"companion-{self.companion_gen}", redis_timeout="40ms")
        self._event(f"companion SIGKILL, restarted after {down:g}s", act)

    def restart_redis(self, down: float):
        def act():
            self.redis_proc.kill()
            time.sleep(down)
            self.redis_gen += 1
            self.redis_proc, _ = self.stack.redis(self.redis_port, name=f"redis-{self.redis_gen}")
        self._event(f"redis SIGKILL, restarted empty after {down:g}s (state lost)", act)

    def restart_envoy_b(self, down: float):
        state = self.envoys.state["B"]

        def act():
            inst, killed_at = f"B{state['gen']}", self.rel()
            state["proc"].kill()
            self.envoys.set_up("B", False)  # clients learn of it at once and go to A
            self.events.append({"what": "envoy-B killed", "start": killed_at, "end": killed_at, "kill": "B",
                                "inst": inst})
            time.sleep(down)
            self.start_envoy("B", state["config"])
        self._event(f"envoy B SIGKILL, restarted on the same ports after {down:g}s", act)

    def schedule(self, duration: float) -> list[tuple[float, str, object]]:
        cycle = [(0.0, "pause", lambda: self.pause_redis(4)),
                 (14.0, "companion", lambda: self.restart_companion(6)),
                 (32.0, "envoy", lambda: self.restart_envoy_b(12)),
                 (52.0, "redis", lambda: self.restart_redis(2))]
        # each fault's own length, to keep QUIET_TAIL_S after the last one
        lengths = {"pause": 4, "companion": 8, "envoy": 16, "redis": 4}
        plan, start = [], FIRST_CYCLE_AT
        while start < duration:
            for offset, kind, action in cycle:
                at = start + offset
                if at + lengths[kind] + QUIET_TAIL_S <= duration:
                    plan.append((at, kind, action))
            start += CYCLE_S
        return plan

    # --- observations ---
    def memory(self, name: str) -> dict | None:
        s = self.envoys.state[name]
        try:
            status, body = http_get(f"http://127.0.0.1:{s['admin']}/memory", timeout=3)
            data = json.loads(body) if status == 200 else {}
        except Exception:  # noqa: BLE001
            data = {}
        rss = None
        try:
            for line in Path(f"/proc/{s['proc'].pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        except OSError:
            pass
        return {"inst": f"{name}{s['gen']}", "allocated": int(data.get("allocated", 0) or 0),
                "heap": int(data.get("heap_size", 0) or 0), "rss": rss or 0}

    def filter_stats(self, name: str) -> dict:
        s = self.envoys.state[name]
        try:
            _, body = http_get(f"http://127.0.0.1:{s['admin']}/stats?filter=llm_ratelimit", timeout=3)
        except Exception:  # noqa: BLE001
            return {}
        stats = {}
        for line in body.decode(errors="replace").splitlines():
            m = re.match(r"^wasmcustom\.llm_ratelimit_([a-z_]+): (\d+)$", line.strip())
            if m:
                stats[m.group(1)] = int(m.group(2))
        return stats

    def scan_keys(self) -> dict:
        r = self.redis_client()
        out = {"res": [], "slots": [], "kinds": Counter()}
        for key in r.scan_iter(match=f"{PREFIX}*", count=1000):
            k = key.decode()
            kind = k.split("}:", 1)[1].split(":", 1)[0] if "}:" in k else "?"
            out["kinds"][kind] += 1
            if kind == "res":
                out["res"].append((k, r.pttl(key)))
            elif kind == "slots":
                members = r.zrange(key, 0, -1, withscores=True)
                if members:
                    out["slots"].append((k, len(members), r.pttl(key)))
        return out

    def envoy_log_problems(self) -> tuple[list[str], int, int]:
        """Envoy log lines at error or critical level or telling of a wasm failure; the
        settlements the filter gave up (its own warnings); and the companion's settle
        calls that timed out on Redis."""
        lines, given_up, timed_out = [], 0, 0
        for p in self.stack.processes:
            try:
                text = p.log_path.read_text(errors="replace")
            except OSError:
                continue
            if p.name.startswith("envoy"):
                for line in text.splitlines():
                    if re.search(r"\]\[(error|critical)\]\[|panicked|wasm trap|Uncaught|Plugin.*fail", line):
                        lines.append(f"{p.name}: {line.strip()[:220]}")
                given_up += sum(int(n) for n in re.findall(r"gave up (\d+) settlement", text))
            elif p.name.startswith("companion"):
                timed_out += sum(int(n) for n in re.findall(
                    r"settle failed for (\d+) of \d+ entries: (?:.*timed out|Redis did not answer)", text))
        return lines, given_up, timed_out
