"""Fault suite under sustained load: several minutes of traffic from a few hundred tenants
through two Envoys (each `--concurrency 2`) sharing one companion, while Redis is paused
(CLIENT PAUSE), the companion is killed and restarted, one Envoy is SIGKILLed and started
again, and Redis is restarted (killed and started empty on the same port: its data is
lost, as a cache's would be). Then it checks what the filter promised:

- no 5xx caused by the filter (goal 0): a 5xx is the mock's when it says so (it fails only
  requests that ask it to, with `x-mock-status`); a 503 `rate_limiter_unavailable`, or any
  other 5xx Envoy made itself, counts against the filter. Connection errors to the Envoy
  being killed are expected and counted apart; any other connection error is not.
- admissions within the limits' bounds, for each heavy tenant and each limit (below);
- Envoy's `/memory` (allocated, heap) for the Envoy never killed at start and end;
- after the traffic, every reservation settled (no `:res:` key 3 s after the last
  response) and then every slot and reservation gone (after `slots.ttl` and
  `tokens.reservation_ttl`); the companion healthy.

The bounds checked (token buckets, capacity L per window W, refill r = L/W):

- Central share: what Redis admitted (responses without `x-llm-ratelimit-degraded`) in any
  set of requests whose admissions lie in [a, b] is at most L + r·(b − a): the bucket holds
  at most L at a and refills r·(b − a). Admission times are bounded by the client's send
  and response-header times, the interval taken at its widest. Tokens count what was
  really charged after settlement (the usage the mock reports), plus the credits still to
  come at a for requests admitted before a (a credit returned inside [a, b] for a request
  charged before a is budget that was spent before a). A Redis restart loses every
  counter: the bound starts again at L then, so each Redis lifetime is checked alone.
- Local share (degraded mode, `failure_mode: local`, `fallback.instances: 2`): each
  Envoy process admits locally at most ceil(L/2) + ceil(L/2)/W·(b − a) in [a, b] (its own
  token bucket in shared data, charged the reservation, never credited). A restarted
  Envoy is a new process with a full local bucket.
- Concurrency C: central slots in flight at once (from the response headers to the last
  byte, less 20 ms of client read latency) at most C in each Redis lifetime (a restart
  forgets the slots of requests still in flight); locally at most ceil(C/2) per process.
  Streams are shorter than `slots.ttl`, so no live stream can lose its slot.
- Together, any window of W admits at most (1 + Redis restarts in it)·L + r·W + pending
  credits + 2·ceil(L/2) per Envoy process that decided locally in it (its full local
  bucket and a window's refill): the README's "up to one extra window's budget across
  all proxies while Redis is unreachable". Reported per window; the two checks above
  are stricter (the sum of the two shares) and decide.

Run: .venv/bin/python scripts/faults.py [--minutes 4] [--workdir DIR]
Exit code 0 and `faults: PASS`, or 1 and `faults: FAIL`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402

from stack import Stack, envoy_config, free_port, http_get  # noqa: E402

TOKEN = "faults-token"
DOMAIN = "faults"
PREFIX = "llmrl:"
WINDOW_S = 20.0
REQ_LIMIT = 60  # requests per 20 s: 3/s
TOK_LIMIT = 8000  # tokens per 20 s: 400/s
CONC_LIMIT = 4
INSTANCES = 2
RESERVATION_TTL_S = 5.0
SLOTS_TTL_S = 3.0
CLIENT_TIMEOUT_S = 15.0
READ_LATENCY_MARGIN_S = 0.020
LIGHT_TENANTS = 300
LIGHT_THREADS = 24
LIGHT_RATE = 50.0  # requests/s, all light tenants together
CYCLE_S = 75.0
FIRST_CYCLE_AT = 15.0
QUIET_TAIL_S = 12.0

LIMITS = [
    {"name": "rq", "requests": REQ_LIMIT, "window": f"{WINDOW_S:g}s"},
    {"name": "tk", "tokens": TOK_LIMIT, "window": f"{WINDOW_S:g}s"},
    {"name": "inflight", "concurrency": CONC_LIMIT},
]
FILTER_CONFIG = {
    "companion": {"upstream": "llm_ratelimit_companion", "token": TOKEN, "timeout": "250ms"},
    "domain": DOMAIN,
    "failure_mode": "local",
    "fallback": {"instances": INSTANCES, "breaker_failures": 3, "breaker_cooldown": "300ms"},
    "limits": LIMITS,
    "tokens": {"reservation_ttl": f"{RESERVATION_TTL_S:g}s"},
    "slots": {"ttl": f"{SLOTS_TTL_S:g}s"},
}

# Heavy tenants: each pushes one limit past its bound, from several client threads.
HEAVY = {
    # Small requests at 8/s against 3/s: the request limit binds.
    "heavy-req-1": {"threads": 2, "rate": 4.0, "kind": "small"},
    "heavy-req-2": {"threads": 2, "rate": 4.0, "kind": "small"},
    # ~270 tokens reserved each at 3/s against 400 tokens/s: the token limit binds.
    "heavy-tok": {"threads": 2, "rate": 1.5, "kind": "big"},
    # 2 s streams from 8 threads against 4 slots: the concurrency limit binds.
    "heavy-conc": {"threads": 8, "rate": None, "kind": "slow-stream"},
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def now() -> float:
    return time.monotonic()


class HarnessTimeout(Exception):
    pass


def log(msg: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompt(rng: random.Random, words: int) -> str:
    # Single letters: ~2 characters a token for the filter's tokenizer, 4 for the mock's
    # estimate, so a reservation always covers the prompt the mock reports.
    return " ".join(rng.choice(LETTERS) for _ in range(words))


def api_key(label: str) -> str:
    return f"sk-faults-{label}"


def build_request(kind: str, rng: random.Random) -> tuple[dict, dict]:
    """A chat body and the mock's headers for this kind of request."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": ""}]}
    headers: dict[str, str] = {}
    stream = False
    if kind == "small":
        body["messages"][0]["content"] = prompt(rng, rng.randint(5, 15))
        body["max_tokens"] = 16
        headers["x-mock-completion-tokens"] = "8"
        stream = rng.random() < 0.25
        headers["x-mock-chunk-delay-ms"] = "2"
    elif kind == "big":
        body["messages"][0]["content"] = prompt(rng, rng.randint(30, 60))
        body["max_tokens"] = 200
        # Completions within 1.5x of each other: the running-average estimate (1.5x the
        # average, capped by max_tokens) always covers them.
        headers["x-mock-completion-tokens"] = str(rng.randint(150, 200))
        stream = rng.random() < 0.5
        headers["x-mock-chunk-delay-ms"] = "2"
    elif kind == "slow-stream":
        body["messages"][0]["content"] = prompt(rng, rng.randint(10, 20))
        body["max_tokens"] = 64
        headers["x-mock-completion-tokens"] = "50"
        headers["x-mock-chunk-delay-ms"] = "40"  # ~2 s, below slots.ttl (3 s)
        stream = True
    elif kind == "light":
        body["messages"][0]["content"] = prompt(rng, rng.randint(5, 80))
        body["max_tokens"] = rng.choice([16, 32, 64])
        headers["x-mock-completion-tokens"] = str(rng.randint(4, 40))
        stream = rng.random() < 0.35
        headers["x-mock-chunk-delay-ms"] = str(rng.choice([0, 5, 10]))
        if rng.random() < 0.015:
            headers["x-mock-status"] = rng.choice(["500", "503"])
    else:
        raise ValueError(kind)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body, headers


class Envoys:
    """The two Envoys: ports, which process instance is current, whether up."""

    def __init__(self):
        self.lock = threading.Lock()
        self.state: dict[str, dict] = {}

    def add(self, name: str, port: int, admin: int, proc, config: dict):
        with self.lock:
            gen = self.state.get(name, {}).get("gen", 0) + 1
            self.state[name] = {"port": port, "admin": admin, "proc": proc, "config": config, "gen": gen, "up": True}

    def pick(self, preferred: str | None, rng: random.Random) -> tuple[str, int, str]:
        with self.lock:
            up = [n for n, s in sorted(self.state.items()) if s["up"]]
            if not up:
                up = sorted(self.state)
            name = preferred if preferred in up else rng.choice(up)
            s = self.state[name]
            return name, s["port"], f"{name}{s['gen']}"

    def set_up(self, name: str, up: bool):
        with self.lock:
            self.state[name]["up"] = up


class Traffic:
    def __init__(self, envoys: Envoys, seed: int):
        self.envoys = envoys
        self.stop = threading.Event()
        self.results: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.t0 = now()
        self.seed = seed

    def send(self, label: str, kind: str, rng: random.Random, preferred: str | None) -> dict:
        body, headers = build_request(kind, rng)
        envoy, port, inst = self.envoys.pick(preferred, rng)
        all_headers = {"content-type": "application/json", "authorization": f"Bearer {api_key(label)}", **headers}
        rec = {"tenant": label, "kind": kind, "envoy": envoy, "inst": inst, "asked": headers.get("x-mock-status"),
               "stream": bool(body.get("stream")), "status": None, "err": None, "degraded": None, "ptok": None,
               "ctok": None, "reserved": None, "etype": None, "body": None}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
        rec["ts"] = now() - self.t0
        rec["th"] = None
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=all_headers)
            resp = conn.getresponse()
            rec["th"] = now() - self.t0
            payload = resp.read()
            rec["te"] = now() - self.t0
            rec["status"] = resp.status
            h = {k.lower(): v for k, v in resp.getheaders()}
            rec["degraded"] = h.get("x-llm-ratelimit-degraded")
            for field, name in (("ptok", "x-mock-prompt-tokens"), ("ctok", "x-mock-completion-tokens"),
                                ("reserved", "x-llm-ratelimit-reserved-tokens")):
                if name in h:
                    try:
                        rec[field] = int(h[name])
                    except ValueError:
                        pass
            if resp.status != 200:
                text = payload[:400].decode(errors="replace")
                rec["body"] = text
                try:
                    rec["etype"] = (json.loads(payload).get("error") or {}).get("type")
                except Exception:  # noqa: BLE001 - not JSON: Envoy's own text
                    pass
            elif rec["stream"] and not payload.rstrip().endswith(b"data: [DONE]"):
                rec["err"] = "stream ended without [DONE]"
        except Exception as err:  # noqa: BLE001 - every failure is recorded and classified
            rec["te"] = now() - self.t0
            rec["err"] = f"{type(err).__name__}: {err}"[:200]
        finally:
            conn.close()
        self.results.append(rec)
        return rec

    def heavy_worker(self, label: str, spec: dict, index: int):
        rng = random.Random(f"{self.seed}-{label}-{index}")
        n = index
        period = 1.0 / spec["rate"] if spec["rate"] else None
        next_at = now() + rng.random() * (period or 0.2)
        while not self.stop.is_set():
            if period:
                delay = next_at - now()
                if delay > 0:
                    self.stop.wait(delay)
                    if self.stop.is_set():
                        break
                next_at = max(next_at + period, now() - 1.0)
            n += 1
            rec = self.send(label, spec["kind"], rng, "AB"[n % 2])
            if not period:  # slow streams: back off a little after a refusal
                self.stop.wait(0.25 if rec["status"] != 200 else 0.02)

    def light_worker(self, index: int):
        rng = random.Random(f"{self.seed}-light-{index}")
        period = LIGHT_THREADS / LIGHT_RATE
        next_at = now() + rng.random() * period
        while not self.stop.is_set():
            delay = next_at - now()
            if delay > 0:
                self.stop.wait(delay)
                if self.stop.is_set():
                    break
            next_at = max(next_at + period, now() - 1.0)
            self.send(f"light-{rng.randrange(LIGHT_TENANTS):03d}", "light", rng, None)

    def start(self):
        self.t0 = now()
        for label, spec in HEAVY.items():
            for i in range(spec["threads"]):
                self.threads.append(threading.Thread(target=self.heavy_worker, args=(label, spec, i), daemon=True))
        for i in range(LIGHT_THREADS):
            self.threads.append(threading.Thread(target=self.light_worker, args=(i,), daemon=True))
        for t in self.threads:
            t.start()

    def finish(self, timeout: float):
        self.stop.set()
        deadline = now() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - now()))
        return [t for t in self.threads if t.is_alive()]


# --- the stack and the faults ------------------------------------------------------------

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
            m = re.match(r"^wasmcustom\.llm_ratelimit\.([a-z_.]+): (\d+)$", line.strip())
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


# --- analysis ----------------------------------------------------------------------------

def admitted(rec: dict) -> bool:
    """Went upstream: a 200, or the mock's own error (the filter admitted it)."""
    return rec["status"] == 200 or (rec["status"] is not None and rec["status"] >= 500 and is_mock_error(rec))


def is_mock_error(rec: dict) -> bool:
    return bool(rec["body"]) and "The mock was asked to fail" in rec["body"]


def classify(results: list[dict], events: list[dict]) -> None:
    # An Envoy process that was SIGKILLed: its replies cut short, or refused before the
    # clients knew, are expected (from 0.5 s before the kill on).
    killed = {e["inst"]: e["start"] for e in events if e.get("kill")}
    for rec in results:
        near_kill = rec["inst"] in killed and rec["te"] >= killed[rec["inst"]] - 0.5
        s = rec["status"]
        if rec["err"] and s is None:
            rec["cls"] = "conn error (Envoy being killed)" if near_kill else "conn error (live Envoy)"
        elif rec["err"]:
            rec["cls"] = "truncated stream (Envoy being killed)" if near_kill else "truncated stream (live Envoy)"
        elif s == 200:
            rec["cls"] = "200 degraded" if rec["degraded"] else "200"
        elif s == 429:
            rec["cls"] = "429 degraded" if rec["degraded"] else "429"
        elif s >= 500 and is_mock_error(rec):
            rec["cls"] = f"{s} from the mock (asked)" if rec["asked"] else f"{s} from the mock (NOT asked)"
        elif s >= 500 and rec["body"] and "rate_limiter_unavailable" in rec["body"]:
            rec["cls"] = f"{s} filter rate_limiter_unavailable"
        elif s >= 500:
            rec["cls"] = f"{s} Envoy (Envoy being killed)" if near_kill else f"{s} Envoy/filter"
        else:
            rec["cls"] = f"{s} unexpected"


def pair_check(events: list[tuple], capacity: float, rate: float, pending=None) -> dict:
    """events: (t_lo, t_hi, value) sorted by t_lo. The worst excess of sum(values) over
    capacity + rate·(max t_hi − min t_lo) + pending(min t_lo), over every run of events."""
    worst = {"excess": -math.inf, "sum": 0, "bound": capacity, "span": 0.0, "at": None, "n": 0}
    n = len(events)
    for i in range(n):
        lo = events[i][0]
        extra = pending(lo) if pending else 0.0
        total, hi = 0.0, -math.inf
        for j in range(i, n):
            total += events[j][2]
            hi = max(hi, events[j][1])
            bound = capacity + rate * (hi - lo) + extra
            if total - bound > worst["excess"]:
                worst = {"excess": total - bound, "sum": total, "bound": bound, "span": hi - lo, "at": lo,
                         "n": j - i + 1, "pending": extra}
    return worst


def max_overlap(intervals: list[tuple[float, float]]) -> tuple[int, float | None]:
    points = []
    for a, b in intervals:
        if b > a:
            points.append((a, 1))
            points.append((b, -1))
    points.sort(key=lambda p: (p[0], p[1]))  # ends before starts at the same instant
    cur = best = 0
    at = None
    for t, d in points:
        cur += d
        if cur > best:
            best, at = cur, t
    return best, at


def epochs_of(events: list[dict]) -> list[float]:
    """Start of each Redis lifetime (relative times): the run's start, then each kill."""
    return [-math.inf] + sorted(e["start"] for e in events if e["what"].startswith("redis SIGKILL"))


def epoch_index(t: float, starts: list[float]) -> int:
    return max(i for i, s in enumerate(starts) if t >= s)


def outage_windows(events: list[dict]) -> list[tuple[float, float]]:
    return [(e["start"], e["end"]) for e in events
            if e["what"].startswith(("redis", "companion"))]


def settle_deadline(rec: dict, outages: list[tuple[float, float]]) -> float:
    """Latest time this request's settlement credit may reach Redis: 1 s after its reply
    ended, or 2 s after the outage that held it up."""
    deadline = rec["te"] + 1.0
    for start, end in sorted(outages):
        if start <= deadline and end >= rec["te"]:
            deadline = max(deadline, end + 2.0)
    return deadline


def check_tenant(label: str, recs: list[dict], events: list[dict]) -> list[dict]:
    """The bound checks of one heavy tenant: a list of {name, ok, text}."""
    starts = epochs_of(events)
    outages = outage_windows(events)
    adm = sorted((r for r in recs if admitted(r)), key=lambda r: r["ts"])
    central = [r for r in adm if not r["degraded"]]
    local = [r for r in adm if r["degraded"]]
    checks = []
    r_req, r_tok = REQ_LIMIT / WINDOW_S, TOK_LIMIT / WINDOW_S
    loc_req, loc_tok, loc_conc = math.ceil(REQ_LIMIT / INSTANCES), math.ceil(TOK_LIMIT / INSTANCES), math.ceil(
        CONC_LIMIT / INSTANCES)

    def used(r):  # tokens really charged after settlement (what the mock reports)
        if r["ptok"] is not None and r["ctok"] is not None:
            return r["ptok"] + r["ctok"]
        return r["reserved"] or 0

    credits = [(r["ts"], settle_deadline(r, outages), max(0, (r["reserved"] or 0) - used(r))) for r in adm]

    def pending(a):
        return sum(c for ts, dl, c in credits if ts < a <= dl)

    under = [r for r in adm if r["reserved"] is not None and used(r) > r["reserved"]]
    # Central share, per Redis lifetime.
    for dim, cap, rate, value, pend in (("requests", REQ_LIMIT, r_req, lambda r: 1, None),
                                        ("tokens", TOK_LIMIT, r_tok, used, pending)):
        worst, per_epoch = None, []
        for e in range(len(starts)):
            evs = [(r["ts"], r["th"], value(r)) for r in central if epoch_index(r["ts"], starts) == e]
            if not evs:
                continue
            w = pair_check(evs, cap, rate, pend)
            per_epoch.append((e, len(evs), w))
            if worst is None or w["excess"] > worst["excess"]:
                worst = w
        if worst is None:
            continue
        ok = worst["excess"] <= 1e-6
        checks.append({"name": f"central {dim}", "ok": ok, "text": (
            f"admitted by Redis {sum(n for _, n, _ in per_epoch)} over {len(per_epoch)} Redis lifetime(s); "
            f"worst run: {worst['sum']:.0f} in {worst['span']:.1f}s at t={worst['at']:.1f}s "
            f"vs L + r·Δt{' + pending credits ' + format(worst.get('pending', 0), '.0f') if pend else ''} "
            f"= {worst['bound']:.0f} (excess {worst['excess']:+.0f})")})
    # Local share, per Envoy process.
    by_inst = defaultdict(list)
    for r in local:
        by_inst[r["inst"]].append(r)
    for inst, rs in sorted(by_inst.items()):
        for dim, cap, value in (("requests", loc_req, lambda r: 1), ("tokens", loc_tok, lambda r: r["reserved"] or used(r))):
            evs = [(r["ts"], r["th"], value(r)) for r in rs]
            w = pair_check(evs, cap, cap / WINDOW_S)
            checks.append({"name": f"local {dim} {inst}", "ok": w["excess"] <= 1e-6, "text": (
                f"admitted locally {len(rs)}; worst run: {w['sum']:.0f} in {w['span']:.1f}s "
                f"vs ceil(L/2) + Δt·ceil(L/2)/W = {w['bound']:.0f} (excess {w['excess']:+.0f})")})
    # Concurrency.
    if HEAVY.get(label, {}).get("kind") == "slow-stream":
        worst_c, worst_raw = 0, 0
        for e in range(len(starts)):
            rs = [r for r in central if epoch_index(r["ts"], starts) == e and r["th"] is not None]
            best, _ = max_overlap([(r["th"], r["te"] - READ_LATENCY_MARGIN_S) for r in rs])
            raw, _ = max_overlap([(r["th"], r["te"]) for r in rs])
            worst_c, worst_raw = max(worst_c, best), max(worst_raw, raw)
        checks.append({"name": "central concurrency", "ok": worst_c <= CONC_LIMIT, "text": (
            f"most in flight at once (admitted by Redis, per Redis lifetime): {worst_c} "
            f"({worst_raw} without the {READ_LATENCY_MARGIN_S * 1000:.0f} ms read margin) vs C = {CONC_LIMIT}")})
        for inst, rs in sorted(by_inst.items()):
            best, _ = max_overlap([(r["th"], r["te"] - READ_LATENCY_MARGIN_S) for r in rs if r["th"] is not None])
            checks.append({"name": f"local concurrency {inst}", "ok": best <= loc_conc, "text": (
                f"most in flight at once, admitted locally: {best} vs ceil(C/2) = {loc_conc}")})
        allb, _ = max_overlap([(r["th"], r["te"] - READ_LATENCY_MARGIN_S) for r in adm if r["th"] is not None])
        checks.append({"name": "concurrency, all", "ok": True, "text": (
            f"most in flight at once, central and local together: {allb} "
            f"(bound C + C after a Redis restart + ceil(C/2) per Envoy process = up to "
            f"{2 * CONC_LIMIT + 3 * loc_conc})")})
    # Every window of W, all admissions together (report; implied by the checks above).
    for dim, cap, rate, value, loc in (("requests", REQ_LIMIT, r_req, lambda r: 1, loc_req),
                                       ("tokens", TOK_LIMIT, r_tok, used, loc_tok)):
        worst = None
        for r0 in adm:
            a, b = r0["ts"], r0["ts"] + WINDOW_S
            inwin = [r for r in adm if a <= r["ts"] < b]
            total = sum(value(r) for r in inwin)
            restarts = sum(1 for s in starts[1:] if a < s < b)
            insts = {r["inst"] for r in inwin if r["degraded"]}
            bound = (1 + restarts) * cap + rate * WINDOW_S + (pending(a) if dim == "tokens" else 0) + len(insts) * 2 * loc
            if worst is None or total - bound > worst[0] - worst[1]:
                worst = (total, bound, a, restarts, len(insts))
        if worst:
            checks.append({"name": f"any {WINDOW_S:g}s window, {dim}", "ok": worst[0] <= worst[1] + 1e-6, "text": (
                f"closest to its bound: {worst[0]:.0f} admitted from t={worst[2]:.1f}s (limit {cap}; bound "
                f"{worst[1]:.0f} with {worst[3]} Redis restart(s) and {worst[4]} local decider(s) in it)")})
    if under:
        checks.append({"name": "reservations cover usage", "ok": True, "text": (
            f"{len(under)} admitted request(s) used more than reserved (settled as a debit), e.g. "
            f"reserved {under[0]['reserved']} used {used(under[0])}")})
    return checks


def fmt_bytes(n: int | None) -> str:
    return "n/a" if not n else f"{n / 1048576:.1f} MiB"


# --- main --------------------------------------------------------------------------------

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


def print_report(rep: dict) -> list[str]:
    fails = []
    results, events = rep["results"], rep["events"]
    classify(results, events)
    print("\n================ llm-ratelimit fault suite ================")
    print(f"config: {json.dumps({k: v for k, v in FILTER_CONFIG.items() if k != 'companion'})}")
    print(f"        Redis restarts lose all state (no persistence), as a cache's restart would.")
    print(f"\nfaults ({len(events)}):")
    for e in events:
        if not e.get("kill"):
            print(f"  t={e['start']:6.1f}s .. {e['end']:6.1f}s  {e['what']}")
    for err in rep["errors"]:
        fails.append(f"fault step failed: {err}")

    print(f"\nrequests: {len(results)} in {rep['duration']:.0f}s "
          f"({len(results) / rep['duration']:.0f}/s), tenants: {len({r['tenant'] for r in results})}")
    by_cls = Counter(r["cls"] for r in results)
    for cls, n in sorted(by_cls.items(), key=lambda kv: -kv[1]):
        print(f"  {n:7d}  {cls}")
    per_envoy = Counter((r["inst"], r["cls"].split(" (")[0]) for r in results)
    print("  by Envoy process: " + ", ".join(f"{i} {c}: {n}" for (i, c), n in sorted(per_envoy.items())))

    filter_5xx = [r for r in results if r["cls"].endswith(("rate_limiter_unavailable", "Envoy/filter"))]
    print(f"\n5xx caused by the filter: {len(filter_5xx)} (goal 0)")
    for r in filter_5xx[:5]:
        print(f"    t={r['ts']:.2f}s {r['inst']} {r['tenant']} {r['status']} {r['body']!r}")
    if filter_5xx:
        fails.append(f"{len(filter_5xx)} 5xx caused by the filter")
    mock_unasked = [r for r in results if "NOT asked" in r["cls"]]
    if mock_unasked:
        fails.append(f"{len(mock_unasked)} mock errors nobody asked for")
    live_errors = [r for r in results if r["cls"].endswith("(live Envoy)")]
    print(f"connection errors: {sum(1 for r in results if r['cls'].endswith('(Envoy being killed)'))} "
          f"to the Envoy being killed (expected), {len(live_errors)} to a live Envoy")
    for r in live_errors[:5]:
        print(f"    t={r['ts']:.2f}s..{r['te']:.2f}s {r['inst']} {r['tenant']} {r['err']}")
    if live_errors:
        fails.append(f"{len(live_errors)} connection errors or truncated streams on a live Envoy")
    unexpected = [r for r in results if r["cls"].endswith("unexpected")]
    if unexpected:
        fails.append(f"{len(unexpected)} unexpected statuses, e.g. {unexpected[0]['status']} {unexpected[0]['body']!r}")
    degraded = sum(1 for r in results if r["degraded"])
    print(f"decided locally (x-llm-ratelimit-degraded): {degraded}")
    if not degraded:
        fails.append("no request was decided in the degraded mode: the faults did not bite")

    light = [r for r in results if r["tenant"].startswith("light")]
    light_429 = [r for r in light if r["status"] == 429]
    print(f"light tenants: {len(light)} requests, {len(light_429)} refused (their traffic is far below the limits)")
    for r in light_429[:3]:
        print(f"    t={r['ts']:.2f}s {r['inst']} {r['tenant']} degraded={r['degraded']} {r['body'][:160]!r}")

    print(f"\nbounds (L = {REQ_LIMIT} requests and {TOK_LIMIT} tokens per {WINDOW_S:g}s, C = {CONC_LIMIT} "
          f"in flight; fallback.instances = {INSTANCES}):")
    for label in HEAVY:
        recs = [r for r in results if r["tenant"] == label]
        st = Counter(r["cls"] for r in recs)
        print(f"  {label}: {len(recs)} sent, " + ", ".join(f"{n} {c}" for c, n in sorted(st.items(), key=lambda kv: -kv[1])))
        if not any(r["status"] == 429 for r in recs):
            fails.append(f"{label} was never refused: its bound was not exercised")
        for c in check_tenant(label, recs, events):
            print(f"    {'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['text']}")
            if not c["ok"]:
                fails.append(f"{label}: {c['name']}: {c['text']}")

    start, warm, end, mem_b = rep["mem"]
    print("\nmemory, Envoy A (never killed), admin /memory:")
    for what, m in (("start", start), ("after warm-up", warm), ("end", end)):
        if m:
            print(f"  {what:14s} allocated {fmt_bytes(m['allocated'])}, heap {fmt_bytes(m['heap'])}, RSS {fmt_bytes(m['rss'])}")
    if start and end and start["allocated"]:
        print(f"  growth start→end: {fmt_bytes(end['allocated'] - start['allocated'])} allocated")
    if mem_b:
        print(f"  Envoy {mem_b['inst']} (restarted) at the end: allocated {fmt_bytes(mem_b['allocated'])}, RSS {fmt_bytes(mem_b['rss'])}")

    print("\nfilter counters (Envoy /stats):")
    for name, s in rep["stats"].items():
        keys = ["requests_allowed", "requests_limited", "local_decisions", "companion_failures",
                "settlements_failed", "shared_writes_refused", "tokens_reserved", "tokens_charged"]
        print(f"  {name}: " + ", ".join(f"{k} {s.get(k, '?')}" for k in keys))

    early, late = rep["early"], rep["late"]
    print("\nRedis after the traffic:")
    print(f"  3 s after the last reply: keys by kind {dict(early['kinds'])}; "
          f"unsettled reservations {len(early['res'])}, slot sets with members {len(early['slots'])}")
    for k, ttl in early["res"][:10]:
        print(f"    unsettled {k} (ttl {ttl} ms)")
    for k, n, ttl in early["slots"][:10]:
        print(f"    held slots {k}: {n} (ttl {ttl} ms)")
    print(f"  after reservation_ttl + slots.ttl: keys by kind {dict(late['kinds'])}; "
          f"reservations {len(late['res'])}, slot sets with members {len(late['slots'])}")
    if early["res"]:
        fails.append(f"{len(early['res'])} reservation(s) not settled 3 s after the last reply (companion healthy)")
    if early["slots"]:
        fails.append(f"{len(early['slots'])} slot set(s) still held 3 s after the last reply")
    if late["res"] or late["slots"]:
        fails.append(f"keys left after their TTLs: {len(late['res'])} reservations, {len(late['slots'])} slot sets")
    print(f"  companion /healthz: {rep['health']}; Envoys alive: {rep['alive']}")
    if rep["health"] != 200:
        fails.append(f"companion unhealthy at the end ({rep['health']})")
    if not all(rep["alive"].values()):
        fails.append(f"an Envoy died: {rep['alive']}")
    problems, given_up, timed_out = rep["log_problems"]
    print(f"  Envoy log lines at error/critical level or telling of a wasm failure: {len(problems)}")
    for line in problems[:8]:
        print(f"    {line}")
    if problems:
        fails.append("Envoy logged errors or a wasm failure (see the lines above)")
    print(f"  settlements the filter gave up after retries (Envoy warnings): {given_up}; companion settle calls "
          f"that timed out on Redis: {timed_out}")
    if given_up:
        print("    WARN: a settlement given up leaves its reservation to expire as charged (errs on the side of the")
        print("    limit); a reservation-less one (a local admission's debit or credit) is lost, and one the")
        print("    companion reported failed on a Redis timeout may have been applied and is then sent again.")
    return fails


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
