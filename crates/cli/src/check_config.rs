//! `llm-ratelimit check-config FILE...`: the filter's own config validation, natively, on
//! a bare filter config or on the manifests that carry one (Envoy bootstrap or listener
//! YAML/JSON, Istio `WasmPlugin`, Envoy Gateway `EnvoyExtensionPolicy`, several YAML
//! documents per file). A config the filter would refuse fails with the message the filter
//! logs at load, naming the field; the exit status is non-zero on any error. Beyond that it
//! lints (`crate::lint`): combinations that would hang or be silently ignored on the host
//! fail too, and likely mistakes are warned about (failures with `--strict`).

use crate::lint::{self, Plugin};
use llm_ratelimit_core::config::{Policy, RecordMode, Store};
use llm_ratelimit_core::effects::host::HostKind;
use llm_ratelimit_core::lifecycle::record::{FIELD_PROPERTIES, RECORD_PROPERTY};
use llm_ratelimit_core::worker::{check_for_host, holds_request_headers};
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitCode;

/// Check filter configs as the filter checks them at load.
#[derive(clap::Args)]
pub struct Args {
    /// Files: a filter config (JSON), or YAML/JSON manifests embedding one or more (Envoy
    /// bootstrap or listener, Istio WasmPlugin, Envoy Gateway EnvoyExtensionPolicy);
    /// `-` reads standard input (e.g. `kubectl get wasmplugin -A -o yaml | … check-config -`).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Check every Wasm filter found, not only those whose name, root id, VM id or code
    /// mentions llm_ratelimit or llm-ratelimit.
    #[arg(long)]
    all_wasm: bool,
    /// The proxy the filter will run in, for the checks that depend on it.
    #[arg(long, value_enum, default_value_t = Proxy::Envoy)]
    host: Proxy,
    /// Fail on warnings too (likely mistakes: a token limit below the default completion
    /// allowance, a degraded mode sized for one proxy, timeouts in the wrong order).
    #[arg(long)]
    strict: bool,
    /// Print each config as the filter runs it, every default filled in (JSON, on standard
    /// output; the checks' report goes to standard error). Secrets print as "(redacted)".
    #[arg(long)]
    print_effective: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Proxy {
    Envoy,
    Nginx,
}

/// One filter config found in a file: where, and its bytes as the filter would get them.
#[derive(Debug)]
struct Embedded {
    place: String,
    config: Vec<u8>,
    /// The config sits in an Istio WasmPlugin: the companion's cluster is Istio's.
    istio: bool,
    /// The plugin options around it, where the file shows them.
    plugin: Plugin,
}

pub fn run(args: &Args) -> ExitCode {
    let host = match args.host {
        Proxy::Envoy => HostKind::Envoy,
        Proxy::Nginx => HostKind::Nginx,
    };
    let mut failed = false;
    let mut effective = serde_json::Map::new();
    for file in &args.files {
        let name = file.display();
        let text = match read(file) {
            Ok(text) => text,
            Err(err) => {
                eprintln!("{name}: cannot read: {err}");
                failed = true;
                continue;
            }
        };
        let strict_json = file.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
        match check_text(&text, strict_json, args.all_wasm, host) {
            Ok(reports) => {
                for report in reports {
                    match &report.outcome {
                        Ok(summary) if args.print_effective => eprintln!("{name}: {}: ok: {summary}", report.place),
                        Ok(summary) => println!("{name}: {}: ok: {summary}", report.place),
                        Err(error) => {
                            eprintln!("{name}: {}: {error}", report.place);
                            failed = true;
                        }
                    }
                    for failure in &report.failures {
                        eprintln!("{name}: {}: error: {failure}", report.place);
                        failed = true;
                    }
                    for warning in &report.warnings {
                        eprintln!("{name}: {}: warning: {warning}", report.place);
                        failed |= args.strict;
                    }
                    if let Some(config) = report.effective {
                        effective.insert(format!("{name}: {}", report.place), config);
                    }
                }
            }
            Err(error) => {
                eprintln!("{name}: {error}");
                failed = true;
            }
        }
    }
    if args.print_effective && !effective.is_empty() {
        // One config: itself; several: each under the file and place it was found at.
        let printed = match effective.len() {
            1 => effective.into_iter().next().map(|(_, config)| config).unwrap_or_default(),
            _ => Value::Object(effective),
        };
        match serde_json::to_string_pretty(&printed) {
            Ok(text) => println!("{text}"),
            Err(error) => {
                eprintln!("cannot print the effective config: {error}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn read(file: &std::path::Path) -> std::io::Result<String> {
    if file.as_os_str() == "-" {
        return std::io::read_to_string(std::io::stdin());
    }
    std::fs::read_to_string(file)
}

/// What checking one embedded config said.
#[derive(Debug)]
struct Report {
    place: String,
    /// A summary of the policy, or the error the filter would log.
    outcome: Result<String, String>,
    /// What the filter accepts but would hang or ignore on this host (`lint::failures`).
    failures: Vec<String>,
    warnings: Vec<String>,
    /// The config with every default filled in, for this host (when it loads).
    effective: Option<Value>,
    /// The request record's properties the config publishes (when it loads).
    record: Option<Vec<String>>,
    record_mode: RecordMode,
}

/// Finds every filter config in `text` and checks each; an error when there is none.
fn check_text(text: &str, strict_json: bool, all_wasm: bool, host: HostKind) -> Result<Vec<Report>, String> {
    if strict_json {
        // A `.json` file is JSON, as Envoy reads it: no falling back to YAML's leniency
        // (which would accept a trailing comma Envoy refuses).
        serde_json::from_str::<Value>(text).map_err(|e| format!("not valid JSON: {e}"))?;
    }
    let found = embedded_configs(text, all_wasm)?;
    if found.is_empty() {
        return Err("no llm-ratelimit filter config found (use --all-wasm to check every Wasm filter)".into());
    }
    let mut reports: Vec<Report> = found.into_iter().map(|embedded| check(embedded, host)).collect();
    let referenced = record_names_referenced(text);
    for report in &mut reports {
        if let Some(published) = &report.record {
            for name in referenced.iter().filter(|name| !published.contains(name)) {
                report.warnings.push(format!(
                    "the access log reads the record property {name}, which this config does not publish \
                     (record: {:?} publishes {})",
                    report.record_mode,
                    if published.is_empty() { "none".to_string() } else { published.join(", ") }
                ));
            }
        }
    }
    Ok(reports)
}

/// The request record's property names an access-log format in `text` reads: Envoy's
/// `%FILTER_STATE(wasm.llm_ratelimit…)%` and Nginx's `$llm_ratelimit…`.
fn record_names_referenced(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for marker in ["wasm.llm_ratelimit", "$llm_ratelimit"] {
        let prefix_len = marker.len() - RECORD_PROPERTY.len();
        for (at, _) in text.match_indices(marker) {
            let rest = &text[at + prefix_len..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            let name = rest[..end].to_string();
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// The record properties `mode` publishes.
fn record_names_published(mode: RecordMode) -> Vec<String> {
    let json = matches!(mode, RecordMode::Json | RecordMode::Both).then(|| RECORD_PROPERTY.to_string());
    let fields = FIELD_PROPERTIES.iter().filter(|_| matches!(mode, RecordMode::Fields | RecordMode::Both));
    json.into_iter().chain(fields.map(|name| name.to_string())).collect()
}

fn check(embedded: Embedded, host: HostKind) -> Report {
    let policy = Policy::from_json(&embedded.config).map_err(|e| e.to_string());
    let outcome = policy.and_then(|policy| {
        check_for_host(&policy, host)?;
        Ok(policy)
    });
    let effective = outcome.is_ok().then(|| effective_for(&embedded.config, host)).flatten();
    let mut warnings = Vec::new();
    let mut failures = Vec::new();
    let literal_token = llm_ratelimit_core::config::shape::Document::parse(&embedded.config)
        .is_ok_and(|written| written.companion.is_some_and(|companion| companion.token.is_some()));
    if outcome.is_ok() && literal_token {
        // Every host can pass it through the VM's environment; written here, it is in the
        // proxy's config dump and in whatever stores the manifest.
        warnings.push(
            "companion.token is a literal credential: use companion.token_env, the VM's environment variable \
             (Envoy: vm_config.environment_variables; Istio: vmConfig.env; Envoy Gateway: env.hostKeys; \
             Nginx: an `env` directive), set from a Secret"
                .to_string(),
        );
    }
    if let Ok(policy) = &outcome {
        failures = lint::failures(policy, &embedded.config, host, embedded.plugin);
        let written = serde_json::from_slice::<Value>(&embedded.config).unwrap_or(Value::Null);
        warnings.extend(lint::warnings(policy, &written));
        if embedded.istio && policy.store == Store::Redis && !policy.companion.upstream.starts_with("outbound|") {
            warnings.push(format!(
                "companion.upstream {:?} is not an Istio cluster name; Istio names a Service's cluster \
                 `outbound|<port>||<service>.<namespace>.svc.cluster.local`",
                policy.companion.upstream
            ));
        }
    }
    let record_mode = outcome.as_ref().map_or(RecordMode::default(), |policy| policy.record);
    let record = outcome.is_ok().then(|| record_names_published(record_mode));
    let outcome = outcome.map(|policy| {
        let names: Vec<&str> = policy.limits.iter().map(|l| l.name.as_str()).collect();
        let store = match policy.store {
            Store::Redis => format!("companion {:?}", policy.companion.upstream),
            Store::Local => "local store (no companion)".to_string(),
        };
        let published = record_names_published(policy.record);
        let record = match host {
            _ if published.is_empty() => "no request record".to_string(),
            HostKind::Envoy => format!(
                "request record as filter state {}",
                published.iter().map(|n| format!("wasm.{n}")).collect::<Vec<_>>().join(", ")
            ),
            HostKind::Nginx => format!(
                "request record as variables {} (declare each with `set $name \"\";`)",
                published.iter().map(|n| format!("${n}")).collect::<Vec<_>>().join(", ")
            ),
        };
        format!("{} limit(s): {}; {store}; {record}", names.len(), names.join(", "))
    });
    Report { place: embedded.place, outcome, failures, warnings, effective, record, record_mode }
}

/// The config as the filter runs it on `host`: `config::effective`, with the one default
/// that depends on the host resolved as the filter resolves it.
fn effective_for(config: &[u8], host: HostKind) -> Option<Value> {
    let (policy, mut effective) = llm_ratelimit_core::config::effective(config).ok()?;
    effective.as_object_mut()?.insert("hold_request_headers".into(), Value::Bool(holds_request_headers(&policy, host)));
    Some(effective)
}

/// Every filter config in `text`: the text itself when it is a bare config, else those
/// each YAML (or JSON) document embeds.
fn embedded_configs(text: &str, all_wasm: bool) -> Result<Vec<Embedded>, String> {
    // A JSON file is checked from its own bytes, so that what the filter reads is what
    // is checked (number formats, duplicate keys).
    if let Ok(document) = serde_json::from_str::<Value>(text) {
        if is_bare_config(&document) {
            return Ok(vec![Embedded {
                place: "filter config".into(),
                config: text.as_bytes().to_vec(),
                istio: false,
                plugin: Plugin::Unknown,
            }]);
        }
        let mut found = Vec::new();
        find_in_document(&document, "", all_wasm, &mut found);
        return Ok(found);
    }
    let documents: Vec<Value> = match serde_saphyr::from_multiple(text) {
        Ok(documents) => documents,
        // Broken JSON where a bare config was meant: the filter's own message, which says
        // where (a YAML parser's would describe its own grammar).
        Err(_) if text.trim_start().starts_with('{') => {
            return Ok(vec![Embedded {
                place: "filter config".into(),
                config: text.as_bytes().to_vec(),
                istio: false,
                plugin: Plugin::Unknown,
            }])
        }
        Err(e) => return Err(yaml_error(e)),
    };
    let several = documents.len() > 1;
    let mut found = Vec::new();
    for (index, document) in documents.iter().enumerate() {
        let prefix = if several { format!("document {}", index + 1) } else { String::new() };
        find_in_document(document, &prefix, all_wasm, &mut found);
    }
    Ok(found)
}

/// The one filter config in `text` (a bare JSON config, or a manifest that embeds one),
/// for the commands that act on a policy.
pub fn the_config(text: &str) -> Result<Vec<u8>, String> {
    let mut found = embedded_configs(text, false)?;
    match found.len() {
        0 => Err("no llm-ratelimit filter config found".into()),
        1 => Ok(found.remove(0).config),
        n => {
            let places: Vec<String> = found.iter().map(|e| e.place.clone()).collect();
            Err(format!("{n} filter configs found ({}): give a file holding one", places.join(", ")))
        }
    }
}

/// A filter config on its own: the keys only it has at its top.
fn is_bare_config(document: &Value) -> bool {
    document.as_object().is_some_and(|o| o.contains_key("limits") || o.contains_key("companion"))
}

fn find_in_document(document: &Value, prefix: &str, all_wasm: bool, found: &mut Vec<Embedded>) {
    let join = |place: String| if prefix.is_empty() { place } else { format!("{prefix}, {place}") };
    if is_bare_config(document) {
        let config = json_bytes(document);
        found.push(Embedded { place: join("filter config".into()), config, istio: false, plugin: Plugin::Unknown });
        return;
    }
    let kind = document.get("kind").and_then(Value::as_str).unwrap_or("");
    let name = object_name(document);
    match kind {
        // What `kubectl get … -o yaml` prints: the resources, in `items`.
        "List" => {
            for (index, item) in document.get("items").and_then(Value::as_array).into_iter().flatten().enumerate() {
                find_in_document(item, &join(format!("items[{index}]")), all_wasm, found);
            }
        }
        "WasmPlugin" => {
            if all_wasm || mentions_us(document, "pluginConfig") {
                // Istio hands `pluginConfig` (a protobuf Struct) to the filter as JSON; no
                // config: an empty one.
                let config =
                    document.pointer("/spec/pluginConfig").map(as_struct).map_or_else(Vec::new, |c| json_bytes(&c));
                found.push(Embedded {
                    place: join(format!("WasmPlugin {name}, spec.pluginConfig")),
                    config,
                    istio: true,
                    plugin: Plugin::Unknown,
                });
            }
        }
        "EnvoyExtensionPolicy" => {
            let plugins = document.pointer("/spec/wasm").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
            for (index, plugin) in plugins.iter().enumerate() {
                if all_wasm || mentions_us(plugin, "config") {
                    let config = plugin.get("config").map_or_else(Vec::new, json_bytes);
                    let place = join(format!("EnvoyExtensionPolicy {name}, spec.wasm[{index}].config"));
                    found.push(Embedded { place, config, istio: false, plugin: Plugin::Unknown });
                }
            }
        }
        _ => find_envoy_plugins(document, String::new(), &join, all_wasm, found),
    }
}

/// Envoy's Wasm `PluginConfig`s anywhere in a bootstrap, listener or filter: objects with
/// a `vm_config`, whose `configuration` (a `StringValue`) is the filter's config.
fn find_envoy_plugins(
    value: &Value,
    path: String,
    join: &dyn Fn(String) -> String,
    all_wasm: bool,
    found: &mut Vec<Embedded>,
) {
    match value {
        Value::Object(object) => {
            if object.contains_key("vm_config") {
                if all_wasm || mentions_us(value, "configuration") {
                    let config = object.get("configuration").map_or_else(Vec::new, string_value);
                    let named = object.get("name").or_else(|| object.get("root_id")).and_then(Value::as_str);
                    let label = named.map(|n| format!(" ({n})")).unwrap_or_default();
                    let allow_on_headers_stop_iteration =
                        object.get("allow_on_headers_stop_iteration").is_some_and(|v| v == &Value::Bool(true));
                    found.push(Embedded {
                        place: join(format!("{path}.configuration{label}")),
                        config,
                        istio: false,
                        plugin: Plugin::Envoy { allow_on_headers_stop_iteration },
                    });
                }
                return;
            }
            for (key, child) in object {
                let path = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
                find_envoy_plugins(child, path, join, all_wasm, found);
            }
        }
        Value::Array(items) => {
            for (index, child) in items.iter().enumerate() {
                find_envoy_plugins(child, format!("{path}[{index}]"), join, all_wasm, found);
            }
        }
        _ => {}
    }
}

/// A YAML parse error in our words: a duplicate key is the usual slip, and the parser's own
/// message suggests one of its options rather than the fix.
fn yaml_error(error: serde_saphyr::Error) -> String {
    let text = error.to_string();
    if text.contains("duplicate mapping key") {
        let at = error.location().map(|l| format!("line {} column {}: ", l.line(), l.column())).unwrap_or_default();
        // The error may come wrapped (with a snippet); its message carries the key.
        let key = match &error {
            serde_saphyr::Error::DuplicateMappingKey { key: Some(key), .. } => format!("`{key}` "),
            _ => text
                .split("duplicate mapping key: ")
                .nth(1)
                .and_then(|rest| rest.split(", set ").next())
                .map(|key| format!("`{key}` "))
                .unwrap_or_default(),
        };
        return format!(
            "not valid YAML: {at}the key {key}appears twice in the same mapping; YAML allows each key once \
             (Envoy and Kubernetes refuse the file too): remove or merge one of them"
        );
    }
    format!("not JSON or YAML: {text}")
}

/// The bytes Envoy hands the filter for a `configuration`: a `StringValue`'s `value`
/// (`@type` google.protobuf.StringValue), or a bare string.
fn string_value(configuration: &Value) -> Vec<u8> {
    match configuration {
        Value::String(text) => text.as_bytes().to_vec(),
        other => other.get("value").and_then(Value::as_str).unwrap_or("").as_bytes().to_vec(),
    }
}

/// Whether a plugin's own fields (all but its config) name this filter.
fn mentions_us(plugin: &Value, config_key: &str) -> bool {
    let mut plugin = plugin.clone();
    strip_key(&mut plugin, config_key);
    let text = plugin.to_string().to_ascii_lowercase();
    text.contains("llm_ratelimit") || text.contains("llm-ratelimit")
}

fn strip_key(value: &mut Value, key: &str) {
    match value {
        Value::Object(object) => {
            object.remove(key);
            object.values_mut().for_each(|child| strip_key(child, key));
        }
        Value::Array(items) => items.iter_mut().for_each(|child| strip_key(child, key)),
        _ => {}
    }
}

fn object_name(document: &Value) -> String {
    let field = |key: &str| document.get("metadata").and_then(|m| m.get(key)).and_then(Value::as_str);
    match (field("namespace"), field("name")) {
        (Some(namespace), Some(name)) => format!("{namespace}/{name}"),
        (None, Some(name)) => name.to_string(),
        _ => "(unnamed)".to_string(),
    }
}

/// A value as a protobuf `Struct` carries it: every number is a double, which Istio
/// writes back as JSON without a fraction when it is whole (`1e6` becomes `1000000`).
fn as_struct(value: &Value) -> Value {
    match value {
        Value::Number(n) => match n.as_f64() {
            Some(f) if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 => Value::from(f as i64),
            _ => value.clone(),
        },
        Value::Array(items) => Value::Array(items.iter().map(as_struct).collect()),
        Value::Object(object) => Value::Object(object.iter().map(|(k, v)| (k.clone(), as_struct(v))).collect()),
        other => other.clone(),
    }
}

fn json_bytes(value: &Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"companion": {"upstream": "llm_ratelimit_companion", "token": "test-token-0123456789"},
        "limits": [{"name": "rpm", "requests": 20, "window": "1m"}]}"#;

    fn check_envoy(text: &str) -> Result<Vec<Report>, String> {
        check_text(text, false, false, HostKind::Envoy)
    }

    fn outcomes(text: &str) -> Vec<Result<String, String>> {
        check_envoy(text).unwrap().into_iter().map(|r| r.outcome).collect()
    }

    #[test]
    fn a_bare_config_is_checked_with_the_filters_own_message() {
        assert!(outcomes(GOOD)[0].as_ref().unwrap().starts_with("1 limit(s): rpm"));
        let bad = GOOD.replace("\"1m\"", "\"1x\"");
        let expected = Policy::from_json(bad.as_bytes()).unwrap_err().to_string();
        assert!(expected.contains("field `limits[0].window`"), "{expected}");
        assert_eq!(outcomes(&bad), [Err(expected)]);
    }

    /// Every bad-config fixture fails the check with the message beside it, the one the
    /// filter logs: the field named, no credential echoed.
    #[test]
    fn every_bad_config_fixture_is_refused_with_its_message() {
        let fixtures = llm_ratelimit_core::testing::bad_configs();
        assert!(fixtures.len() >= 70, "{} fixtures", fixtures.len());
        for fixture in fixtures {
            let name = &fixture.name;
            let expected = fixture.expected.unwrap_or_else(|| panic!("{name}.json has no {name}.expect beside it"));
            assert!(expected.contains("field `") && !expected.contains("SECRET"), "{name}.expect: {expected}");
            let text = String::from_utf8(fixture.config).unwrap();
            assert_eq!(outcomes(&text), [Err(expected)], "{name}");
        }
    }

    #[test]
    fn host_dependent_checks_follow_the_host() {
        let holding = GOOD.replace("\"limits\"", "\"hold_request_headers\": true, \"limits\"");
        assert!(check_text(&holding, false, false, HostKind::Envoy).unwrap()[0].outcome.is_ok());
        let nginx = check_text(&holding, false, false, HostKind::Nginx).unwrap();
        assert!(nginx[0].outcome.as_ref().unwrap_err().contains("field `hold_request_headers`"));
    }

    fn envoy_filter(name: &str, config: &str) -> String {
        let value = serde_json::to_string(config).unwrap();
        format!(
            "- name: {name}\n  typed_config:\n    config:\n      root_id: {name}\n      vm_config: {{code: {{local: {{filename: /x.wasm}}}}}}\n      configuration:\n        \"@type\": type.googleapis.com/google.protobuf.StringValue\n        value: {value}\n"
        )
    }

    #[test]
    fn envoy_yaml_every_filter_of_ours_and_only_ours() {
        let bad = GOOD.replace("\"rpm\"", "\"RPM!\"");
        let yaml = format!(
            "static_resources:\n  listeners:\n  - filter_chains:\n    - filters:\n      - typed_config:\n          http_filters:\n{}{}{}",
            indent(&envoy_filter("llm_ratelimit", GOOD), 10),
            indent(&envoy_filter("other_wasm", "not json"), 10),
            indent(&envoy_filter("llm_ratelimit_2", &bad), 10),
        );
        let reports = check_envoy(&yaml).unwrap();
        assert_eq!(reports.len(), 2, "the other Wasm filter is not ours: {reports:?}");
        assert!(reports[0].outcome.is_ok());
        assert!(reports[0].place.contains("http_filters[0]") && reports[0].place.ends_with("(llm_ratelimit)"));
        assert!(reports[1].place.contains("http_filters[2]"));
        assert!(reports[1].outcome.as_ref().unwrap_err().contains("field `limits[0].name`"));
        assert_eq!(check_text(&yaml, false, true, HostKind::Envoy).unwrap().len(), 3, "--all-wasm");
    }

    fn indent(text: &str, by: usize) -> String {
        text.lines().map(|line| format!("{}{line}\n", " ".repeat(by))).collect()
    }

    #[test]
    fn istio_and_envoy_gateway_documents() {
        let yaml = r#"
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata: {name: llm-ratelimit, namespace: istio-system}
spec:
  url: oci://registry.example/llm-ratelimit:1
  pluginConfig:
    companion: {upstream: "outbound|8080||c.ns.svc.cluster.local", token: test-token-0123456789}
    fallback: {instances: 3}
    limits: [{name: rpm, requests: 20, window: 1m}]
---
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata: {name: llm-ratelimit}
spec:
  wasm:
  - name: llm-ratelimit
    code: {type: Image, image: {url: registry.example/llm-ratelimit:1}}
    config:
      companion: {upstream: llm_ratelimit_companion, token: test-token-0123456789}
      limits: [{name: rpm, requests: 20, window: 1q}]
"#;
        let reports = check_envoy(yaml).unwrap();
        assert_eq!(reports.len(), 2);
        assert_eq!(reports[0].place, "document 1, WasmPlugin istio-system/llm-ratelimit, spec.pluginConfig");
        assert!(reports[0].outcome.is_ok(), "{:?}", reports[0]);
        assert_eq!(reports[0].warnings.len(), 1, "{:?}", reports[0]);
        assert!(reports[0].warnings[0].contains("companion.token is a literal credential"), "{:?}", reports[0]);
        assert!(!reports[0].warnings[0].contains("test-token-0123456789"), "the value is never printed");
        let by_reference = yaml.replace("token: test-token-0123456789}", "token_env: LLMRL_COMPANION_TOKEN}");
        assert!(check_envoy(&by_reference).unwrap()[0].warnings.is_empty(), "{by_reference}");
        assert_eq!(reports[1].place, "document 2, EnvoyExtensionPolicy llm-ratelimit, spec.wasm[0].config");
        assert!(reports[1].outcome.as_ref().unwrap_err().contains("field `limits[0].window`"));

        // YAML's 1e6 is a float; through Istio's Struct it reaches the filter as 1000000.
        let float = yaml.replace("requests: 20, window: 1m}]\n---", "requests: 1e6, window: 1m}]\n---");
        assert_ne!(float, yaml);
        assert!(check_envoy(&float).unwrap()[0].outcome.is_ok(), "{:?}", check_envoy(&float));

        let not_istio = yaml.replace("outbound|8080||c.ns.svc.cluster.local", "llm_ratelimit_companion");
        assert!(check_envoy(&not_istio).unwrap()[0].warnings[1].contains("not an Istio cluster name"));
    }

    #[test]
    fn a_kubectl_list_is_searched_item_by_item() {
        let list = "apiVersion: v1\nkind: List\nitems:\n- kind: EnvoyExtensionPolicy\n  metadata: {name: p, namespace: ns}\n  spec:\n    wasm:\n    - name: llm-ratelimit\n      config: {companion: {upstream: c, token: test-token-0123456789}, limits: [{name: rpm, requests: 1, window: 1m}]}\n";
        let reports = check_envoy(list).unwrap();
        assert_eq!(reports.len(), 1);
        assert_eq!(reports[0].place, "items[0], EnvoyExtensionPolicy ns/p, spec.wasm[0].config");
        assert!(reports[0].outcome.is_ok());
    }

    #[test]
    fn nothing_found_or_unreadable_is_an_error_never_a_panic() {
        assert!(check_envoy("kind: Service\nmetadata: {name: x}\n").unwrap_err().contains("no llm-ratelimit"));
        for junk in [
            "{",
            "a: [",
            "\u{0}\u{1}",
            "- - - ]",
            "",
            "kind: WasmPlugin\nspec: 3\n",
            "kind: EnvoyExtensionPolicy\nspec: {wasm: 1}",
        ] {
            let _ = check_envoy(junk);
        }
        // Deep nesting and an alias bomb are refused by the parsers' limits, not by a crash.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(check_envoy(&deep).unwrap_err().contains("not JSON or YAML"));
        let mut bomb = String::from("a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]\n");
        for i in 1..30 {
            let p = i - 1;
            bomb += &format!("a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n");
        }
        assert!(check_envoy(&bomb).unwrap_err().contains("not JSON or YAML"));
        // A WasmPlugin of ours without a config is refused, as the filter refuses an empty one.
        let empty = check_envoy("kind: WasmPlugin\nmetadata: {name: llm-ratelimit}\nspec: {url: x}\n").unwrap();
        assert!(empty[0].outcome.is_err());
    }

    #[test]
    fn the_demo_envoy_config_passes() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../envoy/demo.yaml");
        let reports = check_envoy(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(reports.len(), 1);
        assert!(reports[0].outcome.as_ref().unwrap().starts_with("3 limit(s): rpm, rpd, tpm"), "{reports:?}");
        assert!(reports[0].outcome.as_ref().unwrap().ends_with("request record as filter state wasm.llm_ratelimit"));
        assert!(reports[0].warnings.is_empty(), "the demo's access log reads what it publishes: {reports:?}");
    }

    #[test]
    fn an_access_log_reading_a_record_property_not_published_is_warned_about() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../envoy/demo.yaml");
        let demo = std::fs::read_to_string(path).unwrap();
        let off = demo.replace(r#""failure_mode": "local","#, r#""failure_mode": "local", "record": "off","#);
        let reports = check_envoy(&off).unwrap();
        assert!(reports[0].outcome.as_ref().unwrap().ends_with("no request record"), "{reports:?}");
        assert_eq!(reports[0].warnings.len(), 1, "{reports:?}");
        assert!(reports[0].warnings[0].contains("llm_ratelimit, which this config does not publish"));
        let fields = demo.replace(r#""failure_mode": "local","#, r#""failure_mode": "local", "record": "fields","#)
            + "\n# %FILTER_STATE(wasm.llm_ratelimit_output_tokens:PLAIN)% %FILTER_STATE(wasm.llm_ratelimit_tokens:PLAIN)%\n";
        let reports = check_envoy(&fields).unwrap();
        let warned: Vec<&String> = reports[0].warnings.iter().collect();
        assert_eq!(warned.len(), 2, "the JSON record and a misspelt field, not the real field: {warned:?}");
        assert!(warned.iter().any(|w| w.contains("llm_ratelimit_tokens,")), "{warned:?}");
    }
}
