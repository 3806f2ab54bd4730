//! `check-config --print-effective`, through the real binary: the config as the filter
//! runs it, every default filled in. What the defaults are comes from the configuration
//! reference's tables (docs/configuration.md, the operator's contract), not from the code
//! that prints them; and the reference is checked field by field against the config's own
//! definitions: the fields serde names when it refuses an unknown one, and those printed.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn print_effective(config: &str, extra: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, config).unwrap();
    run(&path, extra)
}

fn run(path: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_llm-ratelimit"))
        .args(["check-config", "--print-effective"])
        .args(extra)
        .arg(path)
        .output()
        .unwrap()
}

fn printed(output: &Output) -> Value {
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)))
}

const SECRET: &str = "print-effective-secret-0123456789";

/// Every section present, so that every field has something to print (the first limit a
/// pool with fair shares, so their defaults print).
fn full_config() -> String {
    format!(
        r#"{{"companion": {{"upstream": "llm_ratelimit_companion", "token": "{SECRET}"}},
            "tier": {{"header": "x-tier", "default": "free"}},
            "tokens": {{"models": [{{"match": "claude-*", "encoding": "cl100k_base"}}]}},
            "prices": [{{"match": "gpt-4o*", "input": 2.5, "output": 10}}],
            "limits": [{{"name": "tpm", "tokens": 100000, "window": "1m", "per": "all", "fair_share": {{}}}}, {{"name": "rpm", "requests": 20, "window": "1m", "tiers": ["free"]}}]}}"#
    )
}

/// The reference's configuration rows: (field, default as written), from every table of
/// docs/configuration.md whose header has `field` and `default` columns.
fn reference_defaults() -> Vec<(String, String)> {
    reference_rows().into_iter().map(|(field, default, _)| (field, default)).collect()
}

/// The reference's rows: (field, default as written, the whole row).
fn reference_rows() -> Vec<(String, String, String)> {
    let readme = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let mut rows = Vec::new();
    let mut columns: Option<(usize, usize)> = None;
    for line in readme.lines() {
        if !line.starts_with('|') {
            columns = None;
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        match columns {
            None => {
                let at = |name: &str| cells.iter().position(|c| *c == name);
                columns = at("field").zip(at("default"));
                if columns.is_none() {
                    columns = Some((usize::MAX, usize::MAX)); // another kind of table
                }
            }
            Some((field, default)) if field != usize::MAX && !line.starts_with("|---") => {
                if let (Some(f), Some(d)) = (cells.get(field), cells.get(default)) {
                    if let Some(name) = f.strip_prefix('`').and_then(|f| f.strip_suffix('`')) {
                        rows.push((name.to_string(), d.to_string(), line.to_string()));
                    }
                }
            }
            Some(_) => {}
        }
    }
    assert!(rows.len() >= 60, "{} rows: the reference's configuration tables were not found", rows.len());
    rows
}

/// The value at a reference field path (`tokens.default_max_output`, `limits[].window`: the
/// first limit's, a tokens limit).
fn at<'a>(config: &'a Value, field: &str) -> Option<&'a Value> {
    field.split('.').try_fold(config, |value, part| match part.strip_suffix("[]") {
        Some(array) => value.get(array)?.get(0),
        None => value.get(part),
    })
}

/// A default as the reference writes it, when it is a literal: `"50ms"`, `4096`, `false`,
/// `[]`, `{}`, `["provider", "ietf"]`, or a bare word in backticks (`charge`).
fn literal(default: &str) -> Option<Value> {
    let code = default.strip_prefix('`')?;
    let (code, rest) = code.split_once('`')?;
    // "`"0s"` (off)" and "`[]` (every tier)": the literal, then words about it.
    if !(rest.is_empty() || rest.starts_with(" (")) {
        return None;
    }
    serde_json::from_str(code)
        .ok()
        .or_else(|| code.chars().all(|c| c.is_ascii_lowercase() || c == '_').then(|| Value::String(code.to_string())))
}

#[test]
fn every_default_the_reference_gives_is_what_is_printed() {
    // The defaults of a config that writes nothing optional; a section it leaves out
    // (`tier`) from the full one, which writes that section's required fields only.
    let minimal = printed(&print_effective(
        r#"{"companion": {"upstream": "c", "token_env": "LLMRL_COMPANION_TOKEN"}, "limits": [{"name": "tpm", "tokens": 9, "window": "1m"}]}"#,
        &[],
    ));
    let full = printed(&print_effective(&full_config(), &[]));
    let mut compared = 0;
    for (field, default) in reference_defaults() {
        let Some(expected) = literal(&default) else { continue };
        let value = at(&minimal, &field)
            .filter(|v| !v.is_null())
            .or_else(|| at(&full, &field))
            .unwrap_or_else(|| panic!("{field} is not printed: {full:#}"));
        assert_eq!(value, &expected, "{field}: docs/configuration.md says {default}");
        compared += 1;
    }
    assert!(compared >= 40, "only {compared} literal defaults compared");
}

#[test]
fn every_field_printed_is_one_the_reference_documents() {
    let effective = printed(&print_effective(&full_config(), &[]));
    let documented: Vec<String> = reference_defaults().into_iter().map(|(field, _)| field).collect();
    let mut fields = Vec::new();
    for (section, value) in effective.as_object().unwrap() {
        match value {
            // A section's own fields; maps (`deployments`) and lists of values are fields.
            Value::Object(fields_of) if !matches!(section.as_str(), "deployments") => {
                fields.extend(fields_of.keys().map(|key| format!("{section}.{key}")))
            }
            Value::Array(items) if items.first().is_some_and(Value::is_object) && section == "limits" => {
                fields.extend(items[0].as_object().unwrap().keys().map(|key| format!("{section}[].{key}")))
            }
            _ => fields.push(section.clone()),
        }
    }
    assert!(fields.len() >= 60, "{fields:?}");
    let undocumented: Vec<&String> = fields.iter().filter(|f| !documented.contains(f)).collect();
    assert!(undocumented.is_empty(), "printed but not in docs/configuration.md's tables: {undocumented:?}");
}

/// A config with every section and every kind of list item present, so that each object
/// of the config can be probed for its fields.
fn probe_config() -> Value {
    let mut config: Value = serde_json::from_str(&full_config()).unwrap();
    config["identity"] = serde_json::json!({"sources": [{"header": "x-api-key"}]});
    for section in ["slots", "bypass", "queue", "fallback", "lease", "memory", "provider_limits", "refusals"] {
        config[section] = serde_json::json!({});
    }
    config
}

/// The fields the config accepts in the object at `pointer` (a JSON pointer into `config`),
/// as the config's own definitions name them: `check-config` refuses an unknown field with
/// serde's "unknown field `…`, expected one of `a`, `b`" ("expected `a` or `b`", "expected
/// `a`"), which lists the struct's fields. A struct that takes a flattened one lists only
/// the inner struct's: the printed config adds the rest.
fn accepted_fields(config: &Value, pointer: &str) -> Vec<String> {
    const PROBE: &str = "zz_not_a_field";
    let mut probed = config.clone();
    let object = match probed.pointer_mut(pointer) {
        Some(Value::Object(object)) => object,
        other => panic!("{pointer} is not an object of the probe config: {other:?}"),
    };
    object.insert(PROBE.into(), Value::from(1));
    let output = print_effective(&probed.to_string(), &[]);
    assert!(!output.status.success(), "{pointer}: a field named {PROBE} was accepted");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let message =
        stderr.split(&format!("unknown field `{PROBE}`")).nth(1).unwrap_or_else(|| panic!("{pointer}: {stderr}"));
    let expected = message.split(" at line ").next().unwrap_or(message);
    expected.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// Each object of the config whose fields are rows of the reference: (the rows' prefix,
/// where it is in `probe_config`).
const SECTIONS: [(&str, &str); 15] = [
    ("", ""),
    ("companion.", "/companion"),
    ("identity.", "/identity"),
    ("limits[].", "/limits/0"),
    ("limits[].fair_share.", "/limits/0/fair_share"),
    ("tokens.", "/tokens"),
    ("slots.", "/slots"),
    ("tier.", "/tier"),
    ("bypass.", "/bypass"),
    ("queue.", "/queue"),
    ("fallback.", "/fallback"),
    ("lease.", "/lease"),
    ("memory.", "/memory"),
    ("provider_limits.", "/provider_limits"),
    ("refusals.", "/refusals"),
];

#[test]
fn every_field_the_config_accepts_has_its_row_and_every_row_names_one() {
    let config = probe_config();
    let mut accepted = std::collections::BTreeSet::new();
    for (prefix, pointer) in SECTIONS {
        let fields = accepted_fields(&config, pointer);
        assert!(!fields.is_empty(), "{pointer}: serde named no fields");
        accepted.extend(fields.into_iter().map(|field| format!("{prefix}{field}")));
    }
    let rows: Vec<String> = reference_rows().into_iter().map(|(field, _, _)| field).collect();
    // A section (`tokens`) is documented by its fields' rows.
    let missing: Vec<&String> = accepted
        .iter()
        .filter(|field| {
            !rows.iter().any(|row| {
                row == *field || row.starts_with(&format!("{field}.")) || row.starts_with(&format!("{field}[]."))
            })
        })
        .collect();
    assert!(missing.is_empty(), "fields the config accepts with no row in docs/configuration.md: {missing:?}");
    let unknown: Vec<&String> = rows.iter().filter(|row| !accepted.contains(*row)).collect();
    assert!(unknown.is_empty(), "rows of docs/configuration.md naming no field the config accepts: {unknown:?}");
}

#[test]
fn every_field_of_a_list_item_is_named_in_its_row() {
    // The items of these lists have no rows of their own: their row names each field.
    let config = probe_config();
    let effective = printed(&print_effective(&config.to_string(), &[]));
    let rows = reference_rows();
    for (row, pointer) in
        [("tokens.models", "/tokens/models/0"), ("prices", "/prices/0"), ("identity.sources", "/identity/sources/0")]
    {
        let mut fields = accepted_fields(&config, pointer);
        let shown =
            effective.pointer(pointer).and_then(Value::as_object).unwrap_or_else(|| panic!("{pointer}: {effective:#}"));
        fields.extend(shown.keys().cloned());
        assert!(fields.len() >= 2, "{row}: {fields:?}");
        let (_, _, text) = rows.iter().find(|(field, _, _)| field == row).unwrap_or_else(|| panic!("no row {row}"));
        let unnamed: Vec<&String> = fields
            .iter()
            .filter(|f| !text.contains(&format!("`{f}`")) && !text.contains(&format!("\"{f}\"")))
            .collect();
        assert!(unnamed.is_empty(), "the row of `{row}` in docs/configuration.md does not name {unnamed:?}");
    }
}

#[test]
fn what_is_written_stands_and_secrets_never_print() {
    let config =
        full_config().replace(r#""upstream": "llm_ratelimit_companion""#, r#""upstream": "c", "timeout": "1.5s""#);
    let output = print_effective(&config, &[]);
    let effective = printed(&output);
    assert_eq!(effective["companion"]["timeout"], "1500ms");
    assert_eq!(effective["companion"]["authority"], "c", "unset: the upstream");
    assert_eq!(
        effective["limits"][1],
        serde_json::json!({"name": "rpm", "requests": 20, "window": "1m",
        "algorithm": "token_bucket", "models": [], "tiers": ["free"], "per": "tenant", "mode": "enforce"}),
        "a requests limit: no token fields"
    );
    assert_eq!(
        effective["limits"][0]["fair_share"],
        serde_json::json!({"between": "tenant", "weights": {}, "default_weight": 1, "max_tenants": 64, "idle": "1m"}),
        "a pool's fair shares: idle defaults to its window, shares are between tenants"
    );
    assert_eq!(effective["tokens"]["models"][0]["match"], "claude-*");
    assert_eq!(effective["tokens"]["models"][0]["factor"], 1.0);
    assert_eq!(effective["companion"]["token"], "(redacted)");
    let all = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!all.contains(SECRET));
    // What is printed is a config the filter takes, and prints the same again.
    let again = printed(&print_effective(&effective.to_string().replace("(redacted)", SECRET), &[]));
    assert_eq!(again, effective);
}

#[test]
fn the_host_decides_whether_headers_are_held() {
    let config = full_config();
    assert_eq!(printed(&print_effective(&config, &[]))["hold_request_headers"], true, "Envoy holds them");
    let nginx = printed(&print_effective(&config, &["--host", "nginx"]));
    assert_eq!(nginx["hold_request_headers"], false, "Nginx cannot deliver a body meanwhile");
}

#[test]
fn a_bad_config_prints_nothing_and_fails_naming_the_field() {
    let output = print_effective(&full_config().replace(r#""1m""#, r#""1x""#), &[]);
    assert!(!output.status.success());
    assert!(output.stdout.is_empty(), "{}", String::from_utf8_lossy(&output.stdout));
    assert!(String::from_utf8_lossy(&output.stderr).contains("field `limits[0].window`"));
}

#[test]
fn a_manifest_prints_the_config_it_carries() {
    let effective = printed(&run(&root().join("envoy/demo.yaml"), &[]));
    assert_eq!(effective["limits"].as_array().map(Vec::len), Some(3), "{effective:#}");
    assert!(effective["tokens"]["default_max_output"].is_u64());
}
