"""What can be checked of deploy/ without a cluster or a registry: every manifest parses,
the Kubernetes kinds validate against their schemas (kubernetes-validate), every filter
config they embed passes `llm-ratelimit check-config`, and `llm-ratelimit package-wasm`
writes an OCI image layout that an independent reader (Python's hashlib, gzip, tarfile)
finds consistent with the Wasm image spec Istio and Envoy Gateway pull."""

import gzip
import hashlib
import io
import json
import os
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest
import redis
import yaml
from stack import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CLI = Path(os.environ.get("LLMRL_CLI_BIN", ROOT / "target/release/llm-ratelimit"))
WASM = ROOT / "target/wasm32-unknown-unknown/wasm/llm_ratelimit.wasm"
# Kubernetes manifests; deploy/prometheus/ holds alerting rules (checked with the
# dashboard's queries in tests/e2e/test_filter_metrics.py and crates/cli/tests/deploy_queries.rs).
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.parent.name != "prometheus")
# Kinds defined by CRDs: no schema ships with kubernetes-validate, so they are checked
# for what they embed (the filter config) and their apiVersion only.
CRD_KINDS = {
    "WasmPlugin": "extensions.istio.io/v1alpha1",
    "DestinationRule": "networking.istio.io/v1",
    "EnvoyProxy": "gateway.envoyproxy.io/v1alpha1",
    "EnvoyExtensionPolicy": "gateway.envoyproxy.io/v1alpha1",
    "Gateway": "gateway.networking.k8s.io/v1",
    "PeerAuthentication": "security.istio.io/v1",
    "AuthorizationPolicy": "security.istio.io/v1",
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def check_config(*files: Path, extra: tuple = ()) -> subprocess.CompletedProcess:
    assert CLI.exists(), f"{CLI} is missing: run `make native`"
    return subprocess.run([str(CLI), "check-config", *extra, *map(str, files)], capture_output=True, text=True,
                          timeout=60)


def test_every_manifest_parses_and_names_itself():
    assert {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS} >= {
        "companion.yaml", "redis-trial.yaml", "network-policies.yaml", "istio/wasmplugin.yaml", "istio/mtls.yaml",
        "envoy-gateway/extension-policy.yaml"}
    for path in MANIFESTS:
        for document in documents(path):
            assert document.get("apiVersion") and document.get("kind"), path
            assert document["metadata"]["name"], path


def test_kubernetes_kinds_validate_against_their_schemas():
    # requirements-dev.txt installs it: missing, the setup is broken, which is a failure,
    # not a reason to skip the schemas.
    try:
        import kubernetes_validate
    except ImportError as missing:
        pytest.fail(f"kubernetes_validate is not installed ({missing}): run `make setup` (requirements-dev.txt)")
    version = kubernetes_validate.latest_version()
    validated = []
    for path in MANIFESTS:
        for document in documents(path):
            if document["kind"] in CRD_KINDS:
                assert document["apiVersion"] == CRD_KINDS[document["kind"]], path
                continue
            kubernetes_validate.validate(document, version, strict=True)
            validated.append(document["kind"])
    assert {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"} <= set(validated)
    # The validator does refuse what is wrong (a field of the wrong type, an unknown one).
    deployment = next(d for d in documents(DEPLOY / "companion.yaml") if d["kind"] == "Deployment")
    for broken in ({"replicas": "two"}, {"replicaz": 2}):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate({**deployment, "spec": {**deployment["spec"], **broken}}, version, strict=True)


def test_the_companion_is_wired_as_the_filter_configs_say():
    companion = {d["kind"]: d for d in documents(DEPLOY / "companion.yaml")}
    service = companion["Service"]
    host = f'{service["metadata"]["name"]}.{service["metadata"]["namespace"]}.svc.cluster.local'
    port = service["spec"]["ports"][0]["port"]
    container = companion["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"]
    # Every credential from a Secret: the two lists as files of one mounted Secret, the
    # Redis password as an environment variable from another; none in the manifest.
    env = {e["name"]: e for e in container["env"]}
    volumes = {v["name"]: v for v in companion["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    for variable, key in (("LLMRL_COMPANION_TOKEN_FILE", "data-plane"), ("LLMRL_ADMIN_TOKEN_FILE", "admin")):
        path = Path(env[variable]["value"])
        mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent)
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == "llm-ratelimit-companion"
        assert {"key": key, "path": path.name} in secret["items"]
    assert env["LLMRL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "llm-ratelimit-redis", "key": "password"}
    assert "@" not in env["LLMRL_REDIS_URL"]["value"], "no password in the URL"
    for name, variable in env.items():
        if any(word in name for word in ("TOKEN", "PASSWORD")) and not name.endswith("_FILE"):
            assert "value" not in variable, f"{name} is a literal in the manifest"
    # /metrics on its own port, the one the scrape annotation names.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert env["LLMRL_METRICS_LISTEN"]["value"].endswith(f':{ports["metrics"]}')
    annotations = companion["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])

    istio = next(d for d in documents(DEPLOY / "istio/wasmplugin.yaml") if d["kind"] == "WasmPlugin")
    assert istio["spec"]["pluginConfig"]["companion"]["upstream"] == f"outbound|{port}||{host}"
    gateway = {d["kind"]: d for d in documents(DEPLOY / "envoy-gateway/extension-policy.yaml")}
    bootstrap = yaml.safe_load(gateway["EnvoyProxy"]["spec"]["bootstrap"]["value"])
    (cluster,) = bootstrap["static_resources"]["clusters"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (address["address"], address["port_value"]) == (host, port)
    assert gateway["EnvoyExtensionPolicy"]["spec"]["wasm"][0]["config"]["companion"]["upstream"] == cluster["name"]
    # The labelled metrics: the same tag extractors as the demo's bootstrap.
    demo = yaml.safe_load((ROOT / "envoy/demo.yaml").read_text())
    assert bootstrap["stats_config"] == demo["stats_config"]


def test_every_embedded_filter_config_passes_check_config():
    with_configs = [DEPLOY / "istio/wasmplugin.yaml", DEPLOY / "envoy-gateway/extension-policy.yaml",
                    ROOT / "envoy/demo.yaml"]
    result = check_config(*with_configs)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok: ") == 3, result.stdout
    assert "warning" not in result.stderr, result.stderr


def test_check_config_reads_what_kubectl_prints_on_its_standard_input():
    """`kubectl get … -o yaml` prints a List holding the resources."""
    resources = [d for d in documents(DEPLOY / "istio/wasmplugin.yaml") if d["kind"] == "WasmPlugin"]
    listing = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": resources})
    result = subprocess.run([str(CLI), "check-config", "-"], input=listing, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok: ") == 1, result.stdout


def test_check_config_fails_on_a_bad_embedded_config(tmp_path):
    bad = (DEPLOY / "istio/wasmplugin.yaml").read_text().replace("window: 1m}", "window: 1 minute}", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    result = check_config(path)
    assert result.returncode == 1
    assert "WasmPlugin istio-ingress/llm-ratelimit, spec.pluginConfig: invalid filter config: field `limits[0].window`" \
        in result.stderr, result.stderr
    # A file without any filter config fails too: a CI step pointed at the wrong file.
    assert check_config(DEPLOY / "companion.yaml").returncode == 1


def test_package_wasm_writes_the_image_istio_and_envoy_gateway_pull(tmp_path):
    assert WASM.exists(), "run `make wasm`"
    out = tmp_path / "image"
    result = subprocess.run([str(CLI), "package-wasm", "--wasm", str(WASM), "--out", str(out), "--tag", "0.1.0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    def blob(descriptor: dict) -> bytes:
        algorithm, hex_digest = descriptor["digest"].split(":")
        data = (out / "blobs" / algorithm / hex_digest).read_bytes()
        assert algorithm == "sha256" and hashlib.sha256(data).hexdigest() == hex_digest
        assert descriptor["size"] == len(data)
        return data

    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((out / "index.json").read_text())
    assert index["schemaVersion"] == 2 and index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    (entry,) = index["manifests"]
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == "0.1.0"
    assert entry["digest"] in result.stdout
    manifest = json.loads(blob(entry))
    assert manifest["mediaType"] == entry["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["annotations"] == {"module.wasm.image/variant": "compat"}
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    tar_bytes = gzip.decompress(blob(layer))
    config = json.loads(blob(manifest["config"]))
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as archive:
        assert archive.getnames() == ["plugin.wasm"]
        assert archive.extractfile("plugin.wasm").read() == WASM.read_bytes()
    # Every blob the layout holds is one the manifest names: nothing stray, nothing missing.
    stored = {p.name for p in (out / "blobs/sha256").iterdir()}
    named = {d["digest"].split(":")[1] for d in (entry, manifest["config"], layer)}
    assert stored == named


def test_no_credential_ships_in_deploy():
    """The companion and the filter refuse placeholders; deploy/ holds no credential at all
    (no Secret with data: they are created with `kubectl create secret`, as the manifests say)."""
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".json", ".Dockerfile", ""}:
            assert "change-me" not in path.read_text(), path
    for path in MANIFESTS:
        for document in documents(path):
            assert document["kind"] != "Secret", f"{path}: a Secret with a value in the tree"
    for path, kind, field in ((DEPLOY / "istio/wasmplugin.yaml", "WasmPlugin", "pluginConfig"),
                              (DEPLOY / "envoy-gateway/extension-policy.yaml", "EnvoyExtensionPolicy", None)):
        resource = next(d for d in documents(path) if d["kind"] == kind)
        config = resource["spec"][field] if field else resource["spec"]["wasm"][0]["config"]
        assert "token" not in config["companion"] and config["companion"]["token_env"] == "LLMRL_COMPANION_TOKEN"


# NetworkPolicy as the Kubernetes API documents it (concepts/services-networking/network-policies):
# a pod selected by a policy of its namespace for a direction is isolated in that direction,
# and a connection then needs one rule of one such policy to match; a connection needs both
# the source's egress and the destination's ingress to allow it.

def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"this reader knows matchLabels only: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def peer_matches(peer: dict, policy_namespace: str, pod: dict) -> bool:
    assert "ipBlock" not in peer
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod["namespace"]})
    else:
        in_namespace = pod["namespace"] == policy_namespace
    return in_namespace and selects(peer.get("podSelector", {}), pod["labels"])


def rule_matches(rule: dict, peers_key: str, policy_namespace: str, other: dict | None, port: int, protocol: str):
    if not any(p.get("protocol", "TCP") == protocol and p["port"] == port for p in rule.get("ports", [])) \
            and rule.get("ports"):
        return False
    peers = rule.get(peers_key, [])
    if not peers:
        return True
    return other is not None and any(peer_matches(peer, policy_namespace, other) for peer in peers)


def direction_allows(policies, pod, direction, other, port, protocol):
    """`other` is None for an address outside the cluster."""
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    isolating = [p for p in policies if p["metadata"]["namespace"] == pod["namespace"]
                 and selects(p["spec"]["podSelector"], pod["labels"]) and direction in p["spec"]["policyTypes"]]
    if not isolating:
        return True
    return any(rule_matches(rule, peers_key, p["metadata"]["namespace"], other, port, protocol)
               for p in isolating for rule in p["spec"].get(key, []))


def connects(policies, source, destination, port, protocol="TCP") -> bool:
    egress = direction_allows(policies, source, "Egress", destination, port, protocol)
    ingress = destination is None or direction_allows(policies, destination, "Ingress", source, port, protocol)
    return egress and ingress


def pod_of(path: Path, kind: str, name: str | None = None) -> dict:
    resource = next(d for d in documents(path) if d["kind"] == kind and name in (None, d["metadata"]["name"]))
    return {"namespace": resource["metadata"]["namespace"], "labels": resource["spec"]["template"]["metadata"]["labels"],
            "ports": {p["name"]: p["containerPort"] for p in resource["spec"]["template"]["spec"]["containers"][0]["ports"]}}


def test_network_policies_let_only_the_proxies_reach_the_companion_and_only_the_companion_redis():
    policies = [d for d in documents(DEPLOY / "network-policies.yaml") if d["kind"] == "NetworkPolicy"]
    companion = pod_of(DEPLOY / "companion.yaml", "Deployment")
    store = pod_of(DEPLOY / "redis-trial.yaml", "Deployment")
    wasmplugin = next(d for d in documents(DEPLOY / "istio/wasmplugin.yaml") if d["kind"] == "WasmPlugin")
    istio_gateway = {"namespace": wasmplugin["metadata"]["namespace"],
                     "labels": {**wasmplugin["spec"]["selector"]["matchLabels"], "app": "istio-ingressgateway"}}
    gateway = next(d for d in documents(DEPLOY / "envoy-gateway/extension-policy.yaml") if d["kind"] == "Gateway")
    # Envoy Gateway runs a Gateway's proxies in its own namespace, labelled with the
    # Gateway's name (gateway.envoyproxy.io: "Gateway API Support", owning-gateway-name).
    eg_proxy = {"namespace": "envoy-gateway-system",
                "labels": {"gateway.envoyproxy.io/owning-gateway-name": gateway["metadata"]["name"]}}
    tenant_app = {"namespace": "apps", "labels": {"app": "chatbot"}}
    neighbour = {"namespace": "llm-ratelimit", "labels": {"app": "debug-shell"}}
    other_gateway_pod = {"namespace": "istio-ingress", "labels": {"app": "something-else"}}
    scraper = {"namespace": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}}
    dns = {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}}
    http, metrics, redis_port = companion["ports"]["http"], companion["ports"]["metrics"], store["ports"]["redis"]

    def table(given):
        return {
            "istio gateway -> companion": connects(given, istio_gateway, companion, http),
            "envoy gateway proxy -> companion": connects(given, eg_proxy, companion, http),
            "scraper -> companion metrics": connects(given, scraper, companion, metrics),
            "companion -> redis": connects(given, companion, store, redis_port),
            "companion -> dns (udp)": connects(given, companion, dns, 53, "UDP"),
            "companion -> dns (tcp)": connects(given, companion, dns, 53, "TCP"),
            "tenant app -> companion": connects(given, tenant_app, companion, http),
            "neighbour pod -> companion": connects(given, neighbour, companion, http),
            "other pod of the gateway's namespace -> companion": connects(given, other_gateway_pod, companion, http),
            "scraper -> companion data port": connects(given, scraper, companion, http),
            "istio gateway -> redis": connects(given, istio_gateway, store, redis_port),
            "tenant app -> redis": connects(given, tenant_app, store, redis_port),
            "neighbour pod -> redis": connects(given, neighbour, store, redis_port),
            "companion -> the internet": connects(given, companion, None, 443),
            "companion -> tenant app": connects(given, companion, tenant_app, 8080),
            "redis -> the internet": connects(given, store, None, 443),
            "companion -> redis on another port": connects(given, companion, store, 16379),
        }

    allowed = {"istio gateway -> companion", "envoy gateway proxy -> companion", "scraper -> companion metrics",
               "companion -> redis", "companion -> dns (udp)", "companion -> dns (tcp)"}
    assert {name for name, ok in table(policies).items() if ok} == allowed
    # Without the policies every one of those connections is open: the table can fail.
    assert all(table([]).values())


def test_the_trial_redis_requires_the_secrets_password_and_keeps_it_off_its_command_line(stack, tmp_path):
    """The manifest's own command and readiness probe, run with the real redis-server."""
    resource = next(d for d in documents(DEPLOY / "redis-trial.yaml") if d["kind"] == "Deployment")
    (container,) = resource["spec"]["template"]["spec"]["containers"]
    variable = next(e for e in container["env"] if e["name"] == "REDISCLI_AUTH")
    assert variable["valueFrom"]["secretKeyRef"] == {"name": "llm-ratelimit-redis", "key": "password"}
    config_dir = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in resource["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert volume["emptyDir"]["medium"] == "Memory"
    port = free_port()
    password = "f" * 64  # what `openssl rand -hex 32` gives: hex
    shell, flag, script = container["command"]
    script = script.replace(config_dir, str(tmp_path)) + f" --port {port} --bind 127.0.0.1"
    proc = stack.spawn("redis-trial", [shell, flag, script], env={"REDISCLI_AUTH": password})
    wait_until(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, 10, "redis", proc)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    assert redis.Redis(port=port, password=password).ping()
    assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
    probe = container["readinessProbe"]["exec"]["command"]
    probe = [*probe[:-1], probe[-1].replace("redis-cli", f"redis-cli -p {port}")]
    environment = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    assert subprocess.run(probe, env={**environment, "REDISCLI_AUTH": password}, timeout=10).returncode == 0
    assert subprocess.run(probe, env={**environment, "REDISCLI_AUTH": "e" * 64}, timeout=10).returncode != 0
    assert subprocess.run(probe, env=environment, timeout=10).returncode != 0


def test_istio_mtls_is_strict_and_opens_the_companion_to_the_gateway_only():
    resources = {d["kind"]: d for d in documents(DEPLOY / "istio/mtls.yaml")}
    companion = pod_of(DEPLOY / "companion.yaml", "Deployment")
    peer = resources["PeerAuthentication"]
    assert peer["metadata"]["namespace"] == companion["namespace"] and "selector" not in peer["spec"]
    assert peer["spec"]["mtls"]["mode"] == "STRICT"
    authorization = resources["AuthorizationPolicy"]["spec"]
    assert selects(authorization["selector"], companion["labels"]) and authorization["action"] == "ALLOW"
    wasmplugin = next(d for d in documents(DEPLOY / "istio/wasmplugin.yaml") if d["kind"] == "WasmPlugin")
    by_port = {rule["to"][0]["operation"]["ports"][0]: rule["from"][0]["source"] for rule in authorization["rules"]}
    assert by_port == {
        str(companion["ports"]["http"]): {
            "principals": [f'cluster.local/ns/{wasmplugin["metadata"]["namespace"]}/sa/istio-ingressgateway']},
        str(companion["ports"]["metrics"]): {"namespaces": ["monitoring"]},
    }
