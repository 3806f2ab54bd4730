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
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLI = Path(os.environ.get("LLMRL_CLI_BIN", ROOT / "target/release/llm-ratelimit"))
WASM = ROOT / "target/wasm32-unknown-unknown/wasm/llm_ratelimit.wasm"
# Kubernetes manifests; deploy/prometheus/ holds alerting rules (checked with the
# dashboard's queries in tests/test_filter_metrics.py and crates/cli/tests/deploy_queries.rs).
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.parent.name != "prometheus")
# Kinds defined by CRDs: no schema ships with kubernetes-validate, so they are checked
# for what they embed (the filter config) and their apiVersion only.
CRD_KINDS = {
    "WasmPlugin": "extensions.istio.io/v1alpha1",
    "DestinationRule": "networking.istio.io/v1",
    "EnvoyProxy": "gateway.envoyproxy.io/v1alpha1",
    "EnvoyExtensionPolicy": "gateway.envoyproxy.io/v1alpha1",
    "Gateway": "gateway.networking.k8s.io/v1",
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def check_config(*files: Path, extra: tuple = ()) -> subprocess.CompletedProcess:
    assert CLI.exists(), f"{CLI} is missing: run `make native`"
    return subprocess.run([str(CLI), "check-config", *extra, *map(str, files)], capture_output=True, text=True,
                          timeout=60)


def test_every_manifest_parses_and_names_itself():
    assert {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS} >= {
        "companion.yaml", "redis-trial.yaml", "istio/wasmplugin.yaml", "envoy-gateway/extension-policy.yaml"}
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
    assert {"Namespace", "Secret", "Deployment", "Service", "PodDisruptionBudget"} <= set(validated)
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
    env = {e["name"]: e.get("value") for e in container["env"]}
    token_file = Path(env["LLMRL_COMPANION_TOKEN_FILE"])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == token_file.parent)
    volume = next(v for v in companion["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == companion["Secret"]["metadata"]["name"]

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
    assert "change-me" not in result.stdout + result.stderr, "the token is never printed"
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
