"""What one tenant's flood of waiting requests costs the others (issue 26 item 10).

One Envoy, a limit of 60 requests a minute per tenant, `queue.max_wait` 10 s: one tenant
sends N requests at once (they wait in the queue), and meanwhile other tenants send one
request every 50 ms; their latency p50/max is reported, with the companion's Redis
commands for the queue. Run with LLMRL_WASM / LLMRL_COMPANION_BIN pointing at another
build to compare (the figures of docs/benchmark.md, "A queue flood", are from this script).

    .venv/bin/python scripts/queue_flood.py [--waiters 1000] [--tenant-share 0.1]
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import Backend, Stack, http_get, send  # noqa: E402


def queue_commands(port: int) -> float:
    body = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    name = 'llm_ratelimit_companion_redis_call_duration_seconds_count{op="queue"}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--tenant-share", type=float, default=None, help="queue.tenant_share (left out if not given)")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long the other tenants are measured")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        try:
            backend = Backend(stack, token="flood-token")
            queue = {"max_wait": "10s", "max_length": max(1000, args.waiters)}
            if args.tenant_share is not None:
                queue["tenant_share"] = args.tenant_share
            config = backend.filter_config([{"name": "rpm", "requests": 60, "window": "1m"}], queue=queue)
            port, _ = backend.envoy(config)
            for i in range(60):  # the flooding tenant's budget is spent: its requests wait
                send(port, "sk-flood", path="/v1/models", body=None)
            quiet = [send(port, f"sk-quiet-{i}", path="/v1/models", body=None).elapsed for i in range(40)]
            before = queue_commands(backend.companion_port)
            stop = threading.Event()
            with ThreadPoolExecutor(max_workers=args.waiters) as pool:
                flood = [pool.submit(send, port, "sk-flood", None, path="/v1/models", timeout=30)
                         for _ in range(args.waiters)]
                time.sleep(1.0)
                others, started, i = [], time.monotonic(), 0
                while time.monotonic() - started < args.seconds:
                    reply = send(port, f"sk-other-{i}", path="/v1/models", body=None)
                    others.append((reply.status, reply.elapsed))
                    i += 1
                    time.sleep(0.05)
                commands = queue_commands(backend.companion_port) - before
                stop.set()
                replies = [f.result() for f in flood]
            waited = sum(1 for r in replies if "x-llm-ratelimit-queued-ms" in r.headers)
            latencies = [e for _, e in others]
            print(f"waiters sent {args.waiters}, tenant_share {args.tenant_share}: {waited} waited in the queue, "
                  f"{args.waiters - waited} answered at once")
            print(f"other tenants without the flood: p50 {statistics.median(quiet) * 1000:.1f} ms, "
                  f"max {max(quiet) * 1000:.1f} ms")
            print(f"other tenants during the flood ({len(others)} requests, statuses {sorted(set(s for s, _ in others))}): "
                  f"p50 {statistics.median(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
            print(f"queue commands to Redis during the {args.seconds:.0f} s measured: {commands:.0f} "
                  f"({commands / args.seconds:.0f}/s)")
        finally:
            stack.stop_all()


if __name__ == "__main__":
    main()
