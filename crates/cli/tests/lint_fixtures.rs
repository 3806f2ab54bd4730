//! `check-config` as a lint, on the fixture files in `tests/cases/lint/` (one file per
//! finding), through the real binary: its exit status and the words it prints. What each
//! finding must say comes from docs/check-config.md.

use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/cases/lint").join(name)
}

/// Runs `check-config` on a fixture: (exit code, stdout and stderr).
fn check(name: &str, extra: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_llm-ratelimit"))
        .arg("check-config")
        .args(extra)
        .arg(fixture(name))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap(), text)
}

/// Every fixture: its arguments, the exit status, and words its output must contain.
const CASES: &[(&str, &[&str], i32, &[&str])] = &[
    ("clean.json", &[], 0, &[": ok: 2 limit(s)"]),
    ("clean.json", &["--strict"], 0, &[": ok: 2 limit(s)"]),
    ("clean.json", &["--host", "nginx"], 0, &[": ok:"]),
    // Failures: what would hang, what would be silently ignored, per host.
    ("envoy-missing-stop-iteration.yaml", &[], 1, &["error:", "allow_on_headers_stop_iteration: true", "hangs"]),
    ("envoy-missing-stop-iteration-requests-only.yaml", &[], 0, &[": ok: 1 limit(s): rpm"]),
    ("trailing-comma.json", &[], 1, &["not valid JSON: trailing comma at line 2"]),
    ("duplicate-key.yaml", &[], 1, &["line 11 column 3", "`pluginConfig` appears twice"]),
    ("nginx-too-long.json", &["--host", "nginx"], 1, &["error:", "4278 bytes", "too long parameter"]),
    ("nginx-too-long.json", &[], 0, &[": ok: 75 limit(s)"]),
    (
        "request-stream-usage.json",
        &["--host", "nginx"],
        1,
        &["field `tokens.request_stream_usage`", "nginx never holds"],
    ),
    ("request-stream-usage.json", &[], 0, &[": ok:"]),
    ("clamp-max-tokens.json", &["--host", "nginx"], 1, &["field `tokens.clamp_max_tokens`", "silently not apply"]),
    ("clamp-max-tokens.json", &[], 0, &[": ok:"]),
    ("clamp-headers-not-held.json", &[], 1, &["field `tokens.clamp_max_tokens`", "`hold_request_headers` is false"]),
    // Warnings: exit 0, or 1 with --strict.
    ("token-limit-below-default-output.json", &[], 0, &["warning: field `limits[0].tokens`: 2000 is below", "(4096)"]),
    ("token-limit-below-default-output.json", &["--strict"], 1, &["warning: field `limits[0].tokens`"]),
    ("local-one-instance.json", &[], 0, &["warning: `failure_mode` is local and `fallback.instances` is left at 1"]),
    ("local-one-instance.json", &["--strict"], 1, &["warning: `failure_mode` is local"]),
    (
        "timeouts-wrong-order.json",
        &[],
        0,
        &["warning: timeouts in the wrong order: `fallback.breaker_cooldown` (100ms)", "`companion.timeout` (200ms)"],
    ),
    ("timeouts-wrong-order.json", &["--strict"], 1, &["timeouts in the wrong order"]),
];

#[test]
fn every_lint_fixture_says_what_it_must() {
    let mut wrong = Vec::new();
    for (name, extra, status, words) in CASES {
        let (code, text) = check(name, extra);
        let missing: Vec<&&str> = words.iter().filter(|w| !text.contains(**w)).collect();
        if code != *status || !missing.is_empty() {
            wrong.push(format!("{name} {extra:?}: exit {code} (want {status}), missing {missing:?}:\n{text}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_fixture_is_in_the_table() {
    let dir = fixture("");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(CASES.iter().any(|(n, ..)| *n == name), "{name} in {} has no case", dir.display());
    }
}

/// A clean config says nothing but ok: no finding fires where there is nothing to find.
#[test]
fn a_clean_config_has_no_finding() {
    let (_, text) = check("clean.json", &[]);
    assert!(!text.contains("warning") && !text.contains("error"), "{text}");
}
