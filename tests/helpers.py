"""What tests of several levels share, beyond the process harness (scripts/stack.py, shared
with the demo and the bench): Redis's clock, the companion's metrics, a tenant's queue, a
pool's owner id, an Envoy's Prometheus scrape, the access log's records, and oversized
bodies posted while reading the answer. What the tests of one folder share is in a helper
module of that folder (tests/lua/limits_script.py, tests/e2e/pool_setup.py,
tests/e2e/bedrock_client.py, tests/companion/certificates.py). A test module imports from
these, never from another test module (tests/checks/test_test_imports.py)."""

import hashlib
import json
import re
import socket
import threading

from stack import chat, http_get

COMPANION_PREFIX = "llm_ratelimit_companion_"


def redis_now_ms(client) -> float:
    """Redis's own clock (TIME), ms: the one every proxy shares."""
    time = client.time()
    if isinstance(time, dict):  # a cluster client asks every node: one machine, one clock
        time = next(iter(time.values()))
    seconds, micros = time
    return seconds * 1000 + micros / 1000


def companion_scrape(port: int, path: str = "/metrics") -> dict:
    """The companion's metrics: {'name{labels}': value}, labels as written."""
    status, body = http_get(f"http://127.0.0.1:{port}{path}")
    assert status == 200
    samples = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def companion_metric(samples: dict, name: str, **labels) -> float:
    """One series of the companion's; labels in any order (the exposition sorts none)."""
    wanted = {f'{k}="{v}"' for k, v in labels.items()}
    for series, value in samples.items():
        base, _, rest = series.partition("{")
        if base == COMPANION_PREFIX + name and set(filter(None, rest.rstrip("}").split(","))) == wanted:
            return value
    raise AssertionError(f"no series {name} {labels} in {sorted(samples)}")


def queue_waiters(store, tenant, domain: str = "llm") -> int:
    """How many of a tenant's requests wait in its queue in Redis now."""
    return store.zcard(f"llmrl:{{{domain}:{tenant}}}:queue:waiters")


def pool_owner(header: str, value: str) -> str:
    """The owner id of a `per` header value's pool, as docs/pools.md states it: `p` and the
    first 16 bytes of SHA-256 over the separator, the header's name and the value."""
    digest = hashlib.sha256(b"llm-ratelimit/pool/v1\0" + header.encode() + b"\0" + value.encode()).hexdigest()
    return "p" + digest[:32]


PROMETHEUS_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
PROMETHEUS_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def envoy_scrape(admin_port: int) -> dict:
    """An Envoy's `/stats/prometheus` (the filter's metrics among Envoy's own) as
    {(name, frozenset of label pairs): value}."""
    status, body = http_get(f"http://127.0.0.1:{admin_port}/stats/prometheus", timeout=10)
    assert status == 200
    samples = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        match = PROMETHEUS_SAMPLE.match(line)
        assert match, f"not Prometheus text: {line!r}"
        name, labels, value = match.groups()
        samples[(name, frozenset(PROMETHEUS_LABEL.findall(labels or "")))] = float(value)
    return samples


def access_log_records(envoy, path_part: str = "/v1/") -> list[dict]:
    """An Envoy's access log lines for LLM paths (`path_part` in the path), each with its
    `llm_ratelimit` record parsed into `record` (None when the filter wrote none)."""
    lines = []
    for line in envoy.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"llm_ratelimit"' in line:
            entry = json.loads(line)
            if path_part in (entry.get("path") or ""):
                raw = entry["llm_ratelimit"]
                entry["record"] = json.loads(raw) if raw else None
                lines.append(entry)
    return lines


def too_large_message(limit: int) -> str:
    """The message of the filter's 413 (and the demo's mapped one) for a body over `limit` bytes."""
    return f"The request body is larger than the {limit} bytes this gateway reads to count tokens."


ORDINARY_WORDS = "the quick brown fox jumps over the lazy dog while counting tokens for a rate limit ".split()


def chat_of_size(size: int) -> bytes:
    """A chat request of about `size` bytes of ordinary text (long runs of one character
    are the tokenizer's worst case: not what this is about)."""
    text = " ".join(ORDINARY_WORDS[i % len(ORDINARY_WORDS)] for i in range(size // 5 + 16))
    shell = len(json.dumps(chat("")))
    return json.dumps(chat(text[: size - shell])).encode()


def post_reading_early(port: int, body: bytes, key: str = "sk-oversized", timeout: float = 30.0,
                       path: str = "/v1/chat/completions"):
    """POSTs `body` from a thread while reading the response, the way a client must to see
    an answer that comes before its upload ends. Returns (status, headers, body, upload
    error or None)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    upload_error = []

    def upload():
        try:
            sock.sendall(head + body)
        except OSError as err:  # the server answered and closed before the body ended
            upload_error.append(err)

    sender = threading.Thread(target=upload, daemon=True)
    sender.start()
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            head_part, sep, rest = data.partition(b"\r\n\r\n")
            if sep:
                lines = head_part.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                if len(rest) >= int(headers.get("content-length", "-1")) >= 0:
                    break
    finally:
        sender.join(timeout)
        sock.close()
    head_part, _, rest = data.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, rest[: int(headers["content-length"])], (upload_error or [None])[0]
