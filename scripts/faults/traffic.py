"""The clients: heavy tenants pushing each limit past its bound, light ones far below,
and what each request got."""

from __future__ import annotations

import http.client
import json
import random
import threading

from .settings import CLIENT_TIMEOUT_S, HEAVY, LETTERS, LIGHT_RATE, LIGHT_TENANTS, LIGHT_THREADS, now


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
