"""How close token limits come to their budget, and how much of it they let clients use,
when the provider counts prompts differently from the proxy (`make accuracy`).

Three Envoys (2 workers each) share one companion, one Redis and one mock upstream; one
tenant has 10,000 tokens a minute. The upstream reports a prompt as `--per-byte` tokens
per byte of its request body (0.25: about 4 bytes a token, as providers whose tokenizer
is not OpenAI's, and OpenAI with tools or images, count more than tiktoken's count of
the text). Each scenario starts its own three Envoys, then sends waves of 40 parallel
requests, spread over the Envoys; each wave comes from a new API key, so it has a full
budget, while what the proxies learned from the waves before (per model, not per
tenant) stays. Per wave it prints what was admitted, the tokens the upstream reported for
them, and how far that is from what the limit allows in the time the wave took (the
limit, plus for a token bucket what it refilled meanwhile). Then the utilisation: 40
clients of a new tenant that keep asking for more than the limit, with and without the
queue, three times each on the same Envoys (the first time they know nothing), and the
tokens used in that time (under a minute) against the limit.

    .venv/bin/python scripts/accuracy.py            # after make build
    LLMRL_WASM=other.wasm .venv/bin/python scripts/accuracy.py   # another build of the filter
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from stack import ROOT, WASM, Backend, Stack, free_port, http_get, send, wait_until

LIMIT = 10_000
WINDOW_S = 60.0
PARALLEL = 40
ENVOYS = 3
PROMPT = "Request {i}: write a long essay about rate limits."
MODEL = "gpt-4o-mini"


@dataclass
class Scenario:
    name: str
    algorithm: str = "sliding_window"
    stream: bool = True
    max_tokens: int | None = 980
    completion: int = 980
    clamp: bool = False
    lease: bool = False
    # Filter settings under `tokens` beyond clamping (a build that predates them refuses
    # the config: the scenario is then reported as refused).
    tokens: dict = field(default_factory=dict)


SCENARIOS = [
    Scenario("sliding window, streams, max_tokens 980"),
    Scenario("token bucket, same", algorithm="token_bucket"),
    Scenario("clamp_max_tokens on, same as the first", clamp=True),
    Scenario("leases on (token bucket), same", algorithm="token_bucket", lease=True),
    Scenario("sliding window, JSON replies", stream=False),
    Scenario("no max_tokens, 4,000-token replies", max_tokens=None, completion=4000),
    Scenario("clamp_max_tokens, no max_tokens, 4,000-token replies", max_tokens=None, completion=4000, clamp=True),
    Scenario("short answers: max_tokens 1,000, 40-token replies", max_tokens=1000, completion=40),
    Scenario("short answers, default_expected_output 100", max_tokens=1000, completion=40,
             tokens={"default_expected_output": 100}),
    Scenario("streams of 980, default_expected_output 100", tokens={"default_expected_output": 100}),
]


@dataclass
class Wave:
    admitted: int = 0
    refused: int = 0
    other: list = field(default_factory=list)
    used: int = 0
    provider_prompt: int = 0
    reserved: int = 0
    started: float = 0.0
    done: float = 0.0


def limits(algorithm: str) -> list[dict]:
    return [{"name": "tpm", "tokens": LIMIT, "window": "1m", "algorithm": algorithm}]


def body(i: int, scenario: Scenario) -> dict:
    request = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT.format(i=i)}]}
    if scenario.max_tokens is not None:
        request["max_tokens"] = scenario.max_tokens
    if scenario.stream:
        request.update(stream=True, stream_options={"include_usage": True})
    return request


def one(port: int, key: str, request: dict, completion: int, start: threading.Barrier | None):
    if start is not None:
        start.wait()
    return send(port, key, request, headers={"x-mock-completion-tokens": str(completion)}, timeout=120)


def wave(ports: list[int], key: str, scenario: Scenario) -> Wave:
    """40 requests at once from one tenant, spread over the proxies."""
    start = threading.Barrier(PARALLEL)
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = [
            pool.submit(one, ports[i % len(ports)], key, body(i, scenario), scenario.completion, start)
            for i in range(PARALLEL)
        ]
        replies = [f.result() for f in futures]
    result = Wave(started=min(r.started for r in replies), done=max(r.done for r in replies))
    for reply in replies:
        if reply.status == 200:
            result.admitted += 1
            prompt = int(reply.headers["x-mock-prompt-tokens"])
            result.used += prompt + int(reply.headers["x-mock-completion-tokens"])
            result.provider_prompt += prompt
            result.reserved += int(reply.headers.get("x-llm-ratelimit-reserved-tokens", 0))
        elif reply.status == 429:
            result.refused += 1
        else:
            result.other.append(reply.status)
    return result


def allowance(scenario: Scenario, w: Wave) -> float:
    """What the limit lets through in the time the wave took: a sliding window its budget
    (the wave is far shorter than its minute), a token bucket its budget plus its refill."""
    refill = LIMIT * (w.done - w.started) / WINDOW_S if scenario.algorithm == "token_bucket" else 0.0
    return LIMIT + refill


class Proxies:
    """Three Envoys with one filter config, on the shared backend."""

    def __init__(self, backend: Backend, config: dict, tag: str):
        self.backend = backend
        started = []
        for n in range(ENVOYS):
            admin = free_port()
            port, proc = backend.envoy(config, name=f"envoy-{tag}-{n}", admin_port=admin, wait=False)
            started.append((port, admin, proc))
        for port, admin, proc in started:
            wait_until(lambda: http_get(f"http://127.0.0.1:{admin}/ready")[0] == 200, 90, "envoy", proc)
        self.ports = [p for p, _, _ in started]
        self.admins = [a for _, a, _ in started]
        self.procs = [proc for _, _, proc in started]
        # Each worker builds its vocabulary on its first tick: let that pass before the waves.
        time.sleep(4)

    def gauges(self, prefix: str) -> list[str]:
        found = []
        for admin in self.admins:
            _, stats = http_get(f"http://127.0.0.1:{admin}/stats?filter={prefix}")
            found += [line for line in stats.decode().splitlines() if line.strip()]
        return found

    def stop(self):
        for proc in self.procs:
            proc.stop()
            if proc in self.backend.stack.processes:
                self.backend.stack.processes.remove(proc)


def scenario_config(backend: Backend, scenario: Scenario, domain: str) -> dict:
    """The scenario's filter config, in a domain of its own: what proxies learn is shared
    through Redis per domain, and each scenario starts from nothing learned."""
    tokens = {"clamp_max_tokens": True, "min_output_tokens": 64} if scenario.clamp else {}
    tokens = {**tokens, **scenario.tokens} or None
    lease = {"enabled": True} if scenario.lease else None
    return backend.filter_config(limits(scenario.algorithm), tokens=tokens, lease=lease, companion_timeout="1s",
                                 domain=domain)


def row(name: str, label: str, scenario: Scenario, w: Wave) -> str:
    allowed = allowance(scenario, w)
    over = (w.used - allowed) / LIMIT
    each = f"{w.reserved / w.admitted:6.0f} {w.provider_prompt / w.admitted:6.1f}" if w.admitted else ""
    errors = f"  other statuses: {w.other}" if w.other else ""
    return (f"{name:54} {label:11} {w.admitted:4} {w.used:8,} {allowed:9,.0f} {over:+8.2%} {w.used / LIMIT:6.1%}"
            f"  {each:>13}{errors}")


def run_scenarios(backend: Backend, scenarios: list[Scenario], waves: int) -> bool:
    print(f"{'scenario':54} {'wave':11} {'adm':>4} {'used':>8} {'allowed':>9} {'vs limit':>8} {'used %':>6}"
          f"  {'reserved':>6} {'prompt':>6}")
    ok = True
    for s_index, scenario in enumerate(scenarios):
        try:
            proxies = Proxies(backend, scenario_config(backend, scenario, f"accuracy{s_index}"), f"s{s_index}")
        except (RuntimeError, TimeoutError):
            print(f"{scenario.name:54} refused by this build of the filter (settings it does not know)")
            continue
        try:
            for n in range(waves):
                w = wave(proxies.ports, f"sk-accuracy-{s_index}-{n}-{time.time_ns()}", scenario)
                label = "1 (cold)" if n == 0 else f"{n + 1} (learned)"
                print(row(scenario.name if n == 0 else "", label, scenario, w), flush=True)
                ok &= not w.other
                time.sleep(0.5)  # the last settlements and what they teach
            if s_index == 0:
                for line in proxies.gauges("model_rule=.=gpt-4o;.;llm_ratelimit_prompt_factor"):
                    print(f"    {line}")
        finally:
            proxies.stop()
    return ok


def clients(proxies: Proxies, key: str, seconds: float) -> tuple[int, int, int]:
    """40 clients of one tenant asking for more than the limit, all at once and then each
    sending its next request as soon as its last one ends (after a 429, once Retry-After
    has passed, if that is within the run), for `seconds`. Returns the tokens the upstream
    reported in that time, the requests admitted and refused."""
    scenario = Scenario("utilisation", max_tokens=1000, completion=40)
    totals = {"used": 0, "admitted": 0, "refused": 0}
    lock = threading.Lock()
    start = threading.Barrier(PARALLEL)
    deadline = time.monotonic() + seconds

    def client(c: int):
        i = c
        start.wait()  # the first requests all at once: a first burst
        while time.monotonic() < deadline:
            reply = send(proxies.ports[c % ENVOYS], key, body(i, scenario),
                         headers={"x-mock-completion-tokens": "40"}, timeout=60)
            i += PARALLEL
            with lock:
                if reply.status == 200:
                    totals["admitted"] += 1
                    totals["used"] += int(reply.headers["x-mock-prompt-tokens"]) + int(reply.headers["x-mock-completion-tokens"])
                else:
                    totals["refused"] += 1
            if reply.status == 429:
                wait = float(reply.headers.get("retry-after", "1"))
                time.sleep(min(wait, max(0.0, deadline - time.monotonic())))

    with ThreadPoolExecutor(PARALLEL) as pool:
        list(pool.map(client, range(PARALLEL)))
    return totals["used"], totals["admitted"], totals["refused"]


def utilisation(backend: Backend, seconds: float, queue: bool, runs: int) -> None:
    """`runs` times, a new tenant's 40 clients against a 10,000/min sliding window on the
    same three Envoys (the first run finds them knowing nothing; later ones, what the
    earlier runs taught): the tokens used in the run (under a minute) against the limit."""
    config = backend.filter_config(limits("sliding_window"), queue={"max_wait": "3s"} if queue else None,
                                   companion_timeout="1s", domain=f"utilisation{int(queue)}")
    proxies = Proxies(backend, config, f"u{int(queue)}")
    mode = "queue on (max_wait 3s)" if queue else "no queue"
    try:
        for run in range(runs):
            used, admitted, refused = clients(proxies, f"sk-utilisation-{int(queue)}-{run}-{time.time_ns()}", seconds)
            label = f"{mode}, run {run + 1}{' (cold)' if run == 0 else ''}"
            print(f"  {label:38} admitted {admitted:4}, refused {refused:4}: used {used:6,} = {used / LIMIT:6.1%} of the limit",
                  flush=True)
    finally:
        proxies.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-byte", type=float, default=0.25, help="prompt tokens the upstream counts per body byte")
    parser.add_argument("--waves", type=int, default=2, help="waves per scenario (the first is cold)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each utilisation run")
    parser.add_argument("--runs", type=int, default=3, help="utilisation runs per mode")
    parser.add_argument("--only", default="", help="run only the scenarios whose name contains this ('utilisation': "
                                                   "only the utilisation runs)")
    args = parser.parse_args()
    print(f"make accuracy: {ENVOYS} Envoys x 2 workers, one companion and Redis, {LIMIT:,} tokens/min for one tenant,\n"
          f"waves of {PARALLEL} parallel requests; the upstream counts {args.per_byte} prompt tokens per body byte\n"
          f"(filter: {WASM.relative_to(ROOT) if WASM.is_relative_to(ROOT) else WASM})\n")
    stack = Stack(ROOT / "run/accuracy")
    ok = True
    try:
        backend = Backend(stack, token="accuracy-token", mock_args=["--prompt-tokens-per-byte", str(args.per_byte)])
        scenarios = [s for s in SCENARIOS if args.only in s.name]
        ok = run_scenarios(backend, scenarios, args.waves)
        if args.only in ("", "utilisation"):
            print(f"\nUtilisation: {PARALLEL} clients of a new tenant keep asking (max_tokens 1,000, 40-token replies; "
                  f"after a 429, Retry-After) for {args.seconds:.0f} s against a {LIMIT:,}/min sliding window")
            for queue in (False, True):
                utilisation(backend, args.seconds, queue, args.runs)
    finally:
        stack.stop_all()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
