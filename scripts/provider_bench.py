"""Requests that reached the provider only to be refused, without and with
`provider_limits` (`make provider-bench`; not part of `make test`).

Two Envoys (2 workers each) share one companion and one mock upstream playing a provider
with limits per credential (mock-llm --provider-requests N --provider-window-ms W). One
client per proxy offers a steady load (--rate requests/s each, paced); the mock allows
half of what is offered. Each shape runs twice, on a fresh credential each time: the
proxies without `provider_limits`, then with it. Reported per shape: requests offered,
served, refused by the provider (the mock's own count), and answered by the proxies for
the provider; the goal is at most one refused per provider retry period per proxy.

Shapes: OpenAI (remaining and reset headers on every reply, no retry-after on its 429)
and Google's Gemini API (nothing on a success; RetryInfo in its 429's body)."""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import Backend, Stack, http_get, send  # noqa: E402

LIMITS = [{"name": "rpm", "requests": 1_000_000, "window": "1m"}]
GEMINI_PATH = "/v1beta/models/gemini-2.5-flash:generateContent"


def openai(port, key):
    return send(port, key).status


def gemini(port, key):
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    return send(port, None, body, path=GEMINI_PATH, headers={"x-goog-api-key": key}).status


def offer(ports, key, call, rate, seconds):
    """One paced client per port: `rate` requests/s for `seconds`; the statuses seen."""
    statuses, lock = [], threading.Lock()

    def client(port):
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            status = call(port, key)
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=client, args=(p,)) for p in ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def throttled(backend):
    return json.loads(http_get(f"http://127.0.0.1:{backend.mock_port}/mock/stats")[1])["throttled"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20, help="requests/s per proxy (default 20)")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--window-ms", type=int, default=2000, help="the mock's window (default 2000)")
    args = parser.parse_args()
    offered_per_window = 2 * args.rate * args.window_ms / 1000
    allowed = max(1, int(offered_per_window / 2))
    stack = Stack(Path(sys.argv[0]).resolve().parent.parent / "run" / "provider-bench")
    try:
        backend = Backend(stack, token="provider-bench-token-0123456789",
                          mock_args=["--provider-requests", str(allowed), "--provider-window-ms", str(args.window_ms)])
        plain = [backend.envoy_for(LIMITS, name=f"plain-{i}")[0] for i in range(2)]
        listening = [backend.envoy_for(LIMITS, name=f"listening-{i}", provider_limits={"enabled": True})[0]
                     for i in range(2)]
        periods = args.seconds * 1000 / args.window_ms
        print(f"offered {2 * args.rate:.0f} requests/s over 2 proxies for {args.seconds:.0f} s; the mock allows "
              f"{allowed} per {args.window_ms} ms per credential (50%): {periods:.0f} retry periods")
        print(f"{'shape':8} {'provider_limits':16} {'offered':>8} {'served':>7} {'refused by provider':>20} "
              f"{'answered by proxy':>18} {'refused per period per proxy':>29}")
        for shape, call in (("openai", openai), ("gemini", gemini)):
            for label, ports in (("off", plain), ("on", listening)):
                before = throttled(backend)
                statuses = offer(ports, f"bench-{shape}-{label}", call, args.rate, args.seconds)
                refused = throttled(backend) - before
                served = statuses.count(200)
                local = statuses.count(429) - refused
                print(f"{shape:8} {label:16} {len(statuses):8} {served:7} {refused:20} {local:18} "
                      f"{refused / periods / 2:29.2f}")
    finally:
        stack.stop_all()


if __name__ == "__main__":
    main()
