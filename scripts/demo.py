"""The demo stack on fixed loopback ports: `up` starts it in the background, `down` stops
exactly the processes `up` started, `burst` sends a short scripted burst through it.

    Envoy listener   127.0.0.1:10000   (admin 127.0.0.1:9901)
    companion        127.0.0.1:8081
    mock LLM         127.0.0.1:8090
    Redis            127.0.0.1:6380
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from stack import ROOT, bucket_key, DEMO_ENVOY_CONFIG, Stack, filter_config_of, http_get, send, wait_until
import yaml

RUN = ROOT / "run/demo"
PIDS = RUN / "pids.json"
ENVOY_PORT, ADMIN_PORT, COMPANION_PORT, MOCK_PORT, REDIS_PORT = 10000, 9901, 8081, 8090, 6380


def running() -> dict:
    """The demo's processes that are still alive, checked against their command lines so a
    reused PID is never mistaken for ours."""
    if not PIDS.exists():
        return {}
    alive = {}
    for name, entry in json.loads(PIDS.read_text()).items():
        try:
            cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if entry["exe"] in cmdline:
            alive[name] = entry
    return alive


def up() -> None:
    if running():
        print("The demo stack is already up (make down stops it).")
        return
    demo_config = yaml.safe_load(DEMO_ENVOY_CONFIG.read_text())
    # The demo's credentials, fresh each time: the filter reads its own from Envoy's
    # environment (vm_config.environment_variables), never from its config.
    token, admin_token = secrets.token_hex(16), secrets.token_hex(16)
    RUN.mkdir(parents=True, exist_ok=True)  # a fresh clone has no run/ yet
    (RUN / "admin-token").write_text(admin_token + "\n")
    stack = Stack(RUN)
    try:
        _, redis_port = stack.redis(REDIS_PORT, name="redis")
        # Below the demo filter's companion.timeout (100ms), as docs/troubleshooting.md asks
        # (above twice --redis-timeout).
        stack.companion(f"redis://127.0.0.1:{redis_port}", token, port=COMPANION_PORT, admin_token=admin_token,
                        redis_timeout="40ms")
        stack.mock(MOCK_PORT, extra=["--completion-tokens", "40", "--chunk-delay-ms", "5"])
        os.chdir(ROOT)  # the committed config names the .wasm relative to the repository root
        stack.envoy(demo_config, name="envoy", concurrency=2, env={"LLMRL_COMPANION_TOKEN": token})
    except Exception:
        stack.stop_all()
        raise
    PIDS.write_text(json.dumps({p.name: {"pid": p.pid, "exe": Path(p.args[0]).name} for p in stack.processes}, indent=1))
    for proc in stack.processes:
        proc.log.close()  # the processes keep running after we exit
    print(f"""The demo stack is up:
  Envoy with the filter  http://127.0.0.1:{ENVOY_PORT}   (admin, /stats: http://127.0.0.1:{ADMIN_PORT})
  companion              http://127.0.0.1:{COMPANION_PORT}/healthz
  mock LLM upstream      http://127.0.0.1:{MOCK_PORT}
  Redis                  127.0.0.1:{REDIS_PORT}
  logs                   {RUN.relative_to(ROOT)}/*.log
  Envoy config           {DEMO_ENVOY_CONFIG.relative_to(ROOT)}
Stop it with: make down""")


def down() -> None:
    alive = running()
    if not alive:
        print("The demo stack is not running.")
    for name, entry in reversed(list(alive.items())):  # Envoy first, Redis last
        try:
            os.killpg(entry["pid"], signal.SIGTERM)
        except ProcessLookupError:
            continue
        for _ in range(100):
            if not Path(f"/proc/{entry['pid']}").exists() or "zombie" in _state(entry["pid"]):
                break
            time.sleep(0.05)
        else:
            os.killpg(entry["pid"], signal.SIGKILL)
        print(f"stopped {name} (pid {entry['pid']})")
    PIDS.unlink(missing_ok=True)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


def post(key: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    return send(ENVOY_PORT, key, body, headers=headers, timeout=60)


def settled_tokens(key: str, capacity: int) -> float:
    """The tenant's token bucket as Redis holds it (the filter hashes the key the same way).
    A bucket that refilled completely has expired: no key means full."""
    out = subprocess.run(["redis-cli", "-p", str(REDIS_PORT), "hget", bucket_key(key, "tpm"), "tokens"],
                         capture_output=True, text=True).stdout.strip()
    return float(out) if out else float(capacity)


def error_message(payload: bytes) -> str:
    return json.loads(payload)["error"]["message"]


def burst() -> None:
    limits = filter_config_of(yaml.safe_load(DEMO_ENVOY_CONFIG.read_text()))["limits"]
    describe = lambda l: f"{l['name']} = {l.get('requests') or l.get('tokens')} {'requests' if 'requests' in l else 'tokens'} per {l['window']}"
    print("Policy:", ", ".join(describe(l) for l in limits))
    request_limit = min(l["requests"] for l in limits if "requests" in l)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Tell me about rate limits."}], "max_tokens": 50}

    key = f"sk-demo-{secrets.token_hex(4)}"  # fresh tenants, so every run starts full
    print(f"\n1. Many small requests from tenant {key[:11]}...: the request limit answers first.")
    for i in range(1, request_limit + 4):
        status, headers, payload = post(key, body)
        line = (f"  #{i:<3} {status}  requests left {headers.get('x-ratelimit-remaining-requests', '?'):>3}"
                f"/{headers.get('x-ratelimit-limit-requests', '?')}  reset in {headers.get('x-ratelimit-reset-requests', '?')}")
        if status == 429:
            line += f"  Retry-After: {headers.get('retry-after')}s  \"{error_message(payload)}\""
        print(line)

    key = f"sk-demo-{secrets.token_hex(4)}"
    print(f"\n2. Long streamed completions from tenant {key[:11]}...: each reserves its prompt (counted in the")
    print("   proxy) plus a completion allowance, then the real usage from the stream is settled and the rest given back.")
    stream_body = {**body, "max_tokens": 2000, "stream": True, "stream_options": {"include_usage": True}}
    for i in range(1, 10):
        status, headers, payload = post(key, stream_body, {"x-mock-completion-tokens": "1500", "x-mock-chunk-delay-ms": "0"})
        if status != 200:
            print(f"  #{i:<3} {status}  \"{error_message(payload)}\"")
            break
        usage = json.loads(payload.decode().split("\n\n")[-3][len("data: "):])["usage"]
        reserved = int(headers["x-llm-ratelimit-reserved-tokens"])
        time.sleep(0.15)  # settlements go out on the filter's next 50 ms tick
        level = settled_tokens(key, int(headers["x-ratelimit-limit-tokens"]))
        print(f"  #{i:<3} {status}  reserved {reserved:>5,}  tokens left {int(headers['x-ratelimit-remaining-tokens']):>6,}"
              f"  | used {usage['total_tokens']:>5,}  settled: {reserved - usage['total_tokens']:>4,} given back,"
              f" {level:>8,.0f} left")

    print(f"""
Send your own requests:
  curl -s http://127.0.0.1:{ENVOY_PORT}/v1/chat/completions -H 'Authorization: Bearer sk-my-key' \\
       -H 'content-type: application/json' -d '{{"model":"gpt-4o-mini","messages":[{{"role":"user","content":"hi"}}]}}' -i
  OpenAI SDK:  OpenAI(base_url="http://127.0.0.1:{ENVOY_PORT}/v1", api_key="sk-my-key")
Stop the stack with: make down""")


if __name__ == "__main__":
    commands = {"up": up, "down": down, "burst": burst}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(commands)}")
    commands[sys.argv[1]]()
