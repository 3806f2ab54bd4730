//! The config end to end: JSON in, a policy or an error naming the field out.

use super::*;
use crate::accounting::reservation::UpstreamErrorCharge;
use crate::api::dialect::ErrorFormat;
use crate::api::identity::{IdentitySource, MissingIdentity};
use crate::protocol::LimitKind;
use crate::tokens::Encoding;
use std::time::Duration;

const GOOD: &str = r#"{
    "companion": {"upstream": "companion", "token": "s3cret-0123456789ab", "timeout": "250ms"},
    "domain": "prod",
    "identity": {"sources": [{"header": "X-Tenant"}], "missing": "anonymous"},
    "failure_mode": "deny",
    "limits": [
        {"name": "rpm", "requests": 20, "window": "1m"},
        {"name": "rpd", "requests": 1000, "window": "1d"},
        {"name": "tpm", "tokens": 10000, "window": "1m"},
        {"name": "inflight", "concurrency": 4}
    ],
    "slots": {"ttl": "20s"},
    "tokens": {
        "models": [{"match": "claude-*", "encoding": "cl100k_base", "factor": 1.1, "max_output": 8192}],
        "reservation_ttl": "10m",
        "on_upstream_error": "estimate"
    }
}"#;

#[cfg_attr(not(target_arch = "wasm32"), test)]
#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
fn parses_a_full_config() {
    let config = Policy::from_json(GOOD.as_bytes()).expect("good config");
    assert_eq!(config.companion.upstream, "companion");
    assert_eq!(config.companion.authority(), "companion");
    assert_eq!(config.companion.timeout, Duration::from_millis(250));
    assert_eq!(config.domain, "prod");
    assert_eq!(config.identity.sources, Some(vec![IdentitySource { header: "x-tenant".into(), prefix: None }]));
    assert_eq!(config.identity.missing, MissingIdentity::Anonymous);
    assert_eq!(config.failure_mode, FailureMode::Deny);
    assert_eq!(config.limits.len(), 4);
    let inflight = &config.limits[3];
    assert_eq!((inflight.dimension(), inflight.capacity(), inflight.window_ms()), (Dimension::Concurrency, 4, 20_000));
    assert_eq!(inflight.kind, LimitKind::Slots);
    assert_eq!(config.limits[1].window_ms(), 86_400_000);
    assert_eq!((config.limits[2].dimension(), config.limits[2].capacity()), (Dimension::Tokens, 10_000));
    assert!(config.counts_tokens());
    assert_eq!(config.tokens.rules[0].rule.encoding, Encoding::Cl100kBase);
    assert_eq!(config.tokens.reservation_ttl, Duration::from_secs(600));
    let rule = |model| &config.tokens.rule_for(Some(model)).1.rule;
    assert_eq!(rule("claude-3-haiku").factor, 1.1);
    assert_eq!(rule("gpt-4-turbo").encoding, Encoding::Cl100kBase);
    assert_eq!(rule("mystery").encoding, Encoding::O200kBase);
}

#[test]
fn fills_defaults() {
    let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"},
                   "limits": [{"name": "rpm", "requests": 1, "window": "1s"}]}"#;
    let config = Policy::from_json(json.as_bytes()).expect("minimal config");
    assert_eq!(config.domain, "llm");
    assert_eq!(config.companion.timeout, Duration::from_millis(50));
    assert_eq!(config.identity.sources, None);
    assert_eq!(config.identity.missing, MissingIdentity::Reject);
    assert_eq!(config.failure_mode, FailureMode::Local);
    assert_eq!(config.mode, Mode::Enforce);
    assert_eq!(config.headers.styles, vec![HeaderStyle::Provider, HeaderStyle::Ietf]);
    assert_eq!(config.error_format, ErrorFormat::Auto, "answered in the caller's shape");
    assert!(!config.bypass.path("/v1/chat/completions"));
    assert_eq!(config.fallback.instances, 1);
    assert!(!config.lease.enabled);
    assert!(!config.counts_tokens());
    assert_eq!(config.hold_request_headers, None, "held where the host can");
    assert_eq!(config.tokens.default_encoding, Encoding::O200kBase);
    assert_eq!(config.tokens.on_upstream_error, UpstreamErrorCharge::PromptOnly);
    assert!(config.tokens.calibrate, "learning is on");
    assert!(config.tokens.all_rules().all(|(_, rule)| rule.expected_output.is_none()), "no prior: the cap");
}

#[test]
fn model_rules_get_their_prior_and_a_metric_label_of_their_own() {
    let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [{"name": "tpm", "tokens": 1, "window": "1s"}],
                   "tokens": {"default_expected_output": 300, "models": [
                     {"match": "claude-*", "encoding": "cl100k_base", "expected_output": 800},
                     {"match": "gpt-4o*", "encoding": "o200k_base"}, {"match": "Other.v2*", "encoding": "o200k_base"}]}}"#;
    let tokens = Policy::from_json(json.as_bytes()).expect("config").tokens;
    let rule = |model| tokens.rule_for(Some(model)).1;
    assert_eq!((rule("claude-3-5").expected_output, rule("claude-3-5").label.as_str()), (Some(800), "claude"));
    assert_eq!((rule("gpt-4o-mini").expected_output, rule("gpt-4o-mini").label.as_str()), (Some(300), "gpt-4o"));
    assert!(rule("gpt-4o-mini").configured);
    assert_eq!(rule("other.v2").label, "other", "case-sensitive: no rule, the catch-all");
    assert_eq!(rule("Other.v2-x").label, "other.v2", "the pattern without its wildcard, lowercased");
    // The built-in family the operator's gpt-4o* shadows keeps a label of its own.
    let labels: Vec<&str> = tokens.all_rules().map(|(_, r)| r.label.as_str()).collect();
    assert!(labels.contains(&"gpt-4o_2"), "{labels:?}");
    // Built-in families read as their patterns.
    for family in ["gpt-4.1", "gpt-4.5", "gpt-3.5", "text-embedding-ada-002"] {
        assert!(labels.contains(&family), "{family}: {labels:?}");
    }
    // OpenAI's `gpt-3.5*` and Azure's `gpt-35*` are one family: one rule, one label.
    assert!(!labels.iter().any(|l| l.starts_with("gpt-35")), "{labels:?}");
    assert_eq!(rule("gpt-35-turbo").label, "gpt-3.5");
    assert_eq!(tokens.rule_for(Some("gpt-35-turbo")).0, tokens.rule_for(Some("gpt-3.5-turbo")).0);
    assert_eq!(labels.iter().collect::<std::collections::BTreeSet<_>>().len(), labels.len(), "unique");
    assert_eq!(labels.last(), Some(&"other"), "the catch-all, for every model no rule names");
    assert_eq!(tokens.rule_for(None).0, tokens.rules.len());
}

#[test]
fn a_model_rule_label_never_breaks_the_label_encoding() {
    let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [{"name": "tpm", "tokens": 1, "window": "1s"}],
                   "tokens": {"models": [{"match": ".a..b;.;c=.=d.*", "encoding": "o200k_base"}, {"match": "*", "encoding": "o200k_base"}]}}"#;
    let tokens = Policy::from_json(json.as_bytes()).expect("config").tokens;
    assert_eq!(tokens.rules[0].label, "a._b_._c_._d");
    assert_eq!(tokens.rules[1].label, "rule", "a pattern of wildcards alone");
}

#[test]
fn bypass_matches_paths_and_tenant_ids() {
    let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [{"name": "rpm", "requests": 1, "window": "1s"}],
                   "bypass": {"paths": ["/v1/models*", "/healthz"], "tenants": ["0123456789abcdef0123456789abcdef"]}}"#;
    let bypass = Policy::from_json(json.as_bytes()).expect("config").bypass;
    let bypassed = |raw: &str| bypass.path(&crate::parse::path::normalised(raw));
    assert!(
        bypassed("/v1/models") && bypassed("/v1/models/gpt-4o?x=1") && bypassed("/healthz") && bypassed("//healthz/")
    );
    assert!(!bypassed("/v1/chat/completions") && !bypassed("/healthz/deep"));
    // The path the request is routed on, not the one a pattern could match by its spelling.
    assert!(!bypassed("/v1/models/../chat/completions") && !bypassed("/v1/models/%2e%2e/chat/completions"));
    assert!(bypass.tenant("0123456789abcdef0123456789abcdef") && !bypass.tenant("anonymous"));
}

#[test]
fn tiers_come_from_a_header_with_a_default() {
    let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "tier": {"header": "x-tier", "default": "free"},
        "limits": [{"name": "rpm-free", "requests": 2, "window": "1h", "tiers": ["free"]},
                   {"name": "rpm-gold", "requests": 5, "window": "1h", "tiers": ["gold"]},
                   {"name": "tpd", "tokens": 100000, "window": "1d"}]}"#;
    let config = Policy::from_json(json.as_bytes()).expect("config");
    assert_eq!(config.tier_of("t", Some("gold")), "gold");
    assert_eq!(config.tier_of("t", Some(" gold ")), "gold");
    assert_eq!(config.tier_of("t", Some("platinum")), "free");
    assert_eq!(config.tier_of("t", None), "free");
    let applying =
        |tier| config.limits.iter().filter(|l| l.applies_to("m", tier)).map(|l| l.name.as_str()).collect::<Vec<_>>();
    assert_eq!(applying("gold"), ["rpm-gold", "tpd"]);
    assert_eq!(applying("free"), ["rpm-free", "tpd"]);
}

/// docs/configuration.md's complete policy loads exactly as written.
#[test]
fn the_readme_policy_loads_as_written() {
    let block = crate::testing::docs_json_block("policy-example");
    let config = Policy::from_json(block.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.domain, "prod");
    assert_eq!(config.tier_of("0f1e2d3c4b5a69788796a5b4c3d2e1f0", Some("free")), "partner");
    assert_eq!(config.tier_of("some-other-tenant-id", Some("pro")), "pro");
    assert_eq!(config.price_of("gpt-4o-mini-2024").map(|p| p.input), Some(0.15));
    assert!(config.limits.iter().any(|l| l.kind == LimitKind::SlidingWindow));
    assert!(config.has_concurrency() && config.queue.enabled() && config.counts_tokens());
}

#[test]
fn token_never_shows_in_debug_output() {
    let config = Policy::from_json(GOOD.as_bytes()).expect("good config");
    assert!(!format!("{config:?}").contains("s3cret"));
}

/// Each bad config of tests/cases/bad_configs is refused with the message beside it, which
/// names the field and never echoes a credential (every fixture's credentials say SECRET).
#[test]
fn rejects_bad_configs_naming_the_field() {
    let fixtures = crate::testing::bad_configs();
    assert!(fixtures.len() >= 70, "{} fixtures in {}", fixtures.len(), crate::testing::BAD_CONFIGS);
    for fixture in fixtures {
        let name = &fixture.name;
        let expected = fixture.expected.unwrap_or_else(|| panic!("{name}.json has no {name}.expect beside it"));
        assert!(!expected.contains("SECRET"), "{name}.expect: a credential in the config is never echoed");
        let err = Policy::from_json(&fixture.config).expect_err(name);
        assert_eq!(err.to_string(), expected, "{name}");
    }
}

/// `companion.token_env` is read from the VM's environment at load, and what it holds
/// meets the same rules as a written token; outside a VM it is not read.
#[cfg_attr(not(target_arch = "wasm32"), test)]
#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
fn the_token_comes_from_the_vm_environment() {
    let json = r#"{"companion": {"upstream": "c", "token_env": "LLMRL_COMPANION_TOKEN"},
        "limits": [{"name": "rpm", "requests": 5, "window": "1m"}]}"#;
    let strong = "0123456789abcdef0123456789abcdef".to_string();
    let with = |value: &'static str| move |name: &str| (name == "LLMRL_COMPANION_TOKEN").then(|| value.to_string());
    let read =
        Policy::from_json_in(json.as_bytes(), &|name: &str| (name == "LLMRL_COMPANION_TOKEN").then(|| strong.clone()))
            .expect("the variable holds a credential");
    assert_eq!(read.companion.token.expose(), strong);
    let missing = Policy::from_json_in(json.as_bytes(), &|_: &str| None).unwrap_err();
    assert_eq!(missing.field, "companion.token_env");
    assert!(missing.to_string().contains("vm_config.environment_variables"), "{missing}");
    let placeholder = Policy::from_json_in(json.as_bytes(), &with("change-me")).unwrap_err();
    assert_eq!(placeholder.field, "companion.token_env");
    assert_eq!(Policy::from_json_in(json.as_bytes(), &with("short")).unwrap_err().field, "companion.token_env");
    // `check-config` and the CLI read the config outside any VM: the reference is enough.
    assert!(Policy::from_json(json.as_bytes()).is_ok());
}
