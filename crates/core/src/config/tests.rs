//! The config end to end: JSON in, a policy or an error naming the field out.

use super::*;
use crate::protocol::LimitKind;
use crate::tokens::Encoding;
use std::time::Duration;

const GOOD: &str = r#"{
    "companion": {"upstream": "companion", "token": "s3cret", "timeout": "250ms"},
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
    let json = r#"{"companion": {"upstream": "c", "token": "t"},
                   "limits": [{"name": "rpm", "requests": 1, "window": "1s"}]}"#;
    let config = Policy::from_json(json.as_bytes()).expect("minimal config");
    assert_eq!(config.domain, "llm");
    assert_eq!(config.companion.timeout, Duration::from_millis(50));
    assert_eq!(config.identity.sources, None);
    assert_eq!(config.identity.missing, MissingIdentity::Reject);
    assert_eq!(config.failure_mode, FailureMode::Local);
    assert_eq!(config.mode, Mode::Enforce);
    assert_eq!(config.headers, vec![HeaderStyle::Provider, HeaderStyle::Ietf]);
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
    let json = r#"{"companion": {"upstream": "c", "token": "t"}, "limits": [{"name": "tpm", "tokens": 1, "window": "1s"}],
                   "tokens": {"default_expected_output": 300, "models": [
                     {"match": "claude-*", "encoding": "cl100k_base", "expected_output": 800},
                     {"match": "gpt-4o*", "encoding": "o200k_base"}, {"match": "Other.v2*", "encoding": "o200k_base"}]}}"#;
    let tokens = Policy::from_json(json.as_bytes()).expect("config").tokens;
    let rule = |model| tokens.rule_for(Some(model)).1;
    assert_eq!((rule("claude-3-5").expected_output, rule("claude-3-5").label.as_str()), (Some(800), "claude"));
    assert_eq!((rule("gpt-4o-mini").expected_output, rule("gpt-4o-mini").label.as_str()), (Some(300), "gpt-4o"));
    assert!(rule("gpt-4o-mini").configured);
    assert_eq!(rule("other.v2").label, "other", "case-sensitive: no rule, the catch-all");
    assert_eq!(rule("Other.v2-x").label, "other_v2");
    // The built-in family the operator's gpt-4o* shadows keeps a label of its own.
    let labels: Vec<&str> = tokens.all_rules().map(|(_, r)| r.label.as_str()).collect();
    assert!(labels.contains(&"gpt-4o_2"), "{labels:?}");
    assert_eq!(labels.iter().collect::<std::collections::BTreeSet<_>>().len(), labels.len(), "unique");
    assert_eq!(labels.last(), Some(&"other"), "the catch-all, for every model no rule names");
    assert_eq!(tokens.rule_for(None).0, tokens.rules.len());
}

#[test]
fn bypass_matches_paths_and_tenant_ids() {
    let json = r#"{"companion": {"upstream": "c", "token": "t"}, "limits": [{"name": "rpm", "requests": 1, "window": "1s"}],
                   "bypass": {"paths": ["/v1/models*", "/healthz"], "tenants": ["0123456789abcdef0123456789abcdef"]}}"#;
    let bypass = Policy::from_json(json.as_bytes()).expect("config").bypass;
    let bypassed = |raw: &str| bypass.path(&crate::path::normalised(raw));
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
    let json = r#"{"companion": {"upstream": "c", "token": "t"}, "tier": {"header": "x-tier", "default": "free"},
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

/// The README's complete policy loads exactly as written.
#[test]
fn the_readme_policy_loads_as_written() {
    let readme = include_str!("../../../../README.md");
    let block = readme
        .split("<!-- policy-example -->")
        .nth(1)
        .and_then(|rest| rest.split("```json").nth(1))
        .and_then(|rest| rest.split("```").next())
        .expect("the README's policy example");
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

/// Each bad config, the field its error must name, and a fragment of the message.
#[cfg_attr(not(target_arch = "wasm32"), test)]
#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
fn rejects_bad_configs_naming_the_field() {
    let limits = r#""limits": [{"name": "rpm", "requests": 5, "window": "1m"}]"#;
    let companion = r#""companion": {"upstream": "c", "token": "t"}"#;
    let cases: Vec<(String, &str, &str)> = vec![
        ("not json".into(), "(top level)", "expected ident"),
        (format!("{{{limits}}}"), "(top level)", "missing field `companion`"),
        (format!("{{{companion}}}"), "(top level)", "missing field `limits`"),
        (format!("{{{companion}, {limits}, \"colour\": 1}}"), "colour", "unknown field `colour`"),
        (
            format!(r#"{{"companion": {{"upstream": "c", "token": "t", "tmeout": "1s"}}, {limits}}}"#),
            "companion.tmeout",
            "unknown field `tmeout`",
        ),
        (format!(r#"{{"companion": {{"upstream": "", "token": "t"}}, {limits}}}"#), "companion.upstream", "must name"),
        (
            format!(r#"{{"companion": {{"upstream": "c", "token": ""}}, {limits}}}"#),
            "companion.token",
            "must not be empty",
        ),
        (
            format!(r#"{{"companion": {{"upstream": "c", "token": "t", "timeout": "soon"}}, {limits}}}"#),
            "companion.timeout",
            "invalid duration \"soon\"",
        ),
        (
            format!(r#"{{"companion": {{"upstream": "c", "token": "t", "timeout": "2m"}}, {limits}}}"#),
            "companion.timeout",
            "outside 1ms..60s",
        ),
        (format!(r#"{{{companion}, {limits}, "failure_mode": "maybe"}}"#), "failure_mode", "unknown variant `maybe`"),
        (format!(r#"{{{companion}, {limits}, "domain": "Prod!"}}"#), "domain", "\"Prod!\" is not a valid name"),
        (format!(r#"{{{companion}, {limits}, "unknown_paths": "allow"}}"#), "unknown_paths", "unknown variant `allow`"),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"unreadable_body": "guess"}}}}"#),
            "tokens.unreadable_body",
            "unknown variant `guess`",
        ),
        (
            format!(r#"{{{companion}, {limits}, "identity": {{"missing": "ignore"}}}}"#),
            "identity.missing",
            "unknown variant `ignore`",
        ),
        (
            format!(r#"{{{companion}, {limits}, "identity": {{"sources": []}}}}"#),
            "identity.sources",
            "at least one header",
        ),
        (
            format!(r#"{{{companion}, {limits}, "identity": {{"sources": [{{"header": "a b"}}]}}}}"#),
            "identity.sources[0].header",
            "\"a b\" is not a header name",
        ),
        (format!(r#"{{{companion}, "limits": []}}"#), "limits", "at least one limit"),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 0, "window": "1m"}}]}}"#),
            "limits[0].requests",
            "0 is outside",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "rpm", "requests": -3, "window": "1m"}}]}}"#),
            "limits[0].requests",
            "invalid value: integer `-3`",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 1, "window": "1x"}}]}}"#),
            "limits[0].window",
            "unknown unit \"x\"",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 1, "window": "10ms"}}]}}"#),
            "limits[0].window",
            "outside 100ms..366d",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 1, "window": "1m"}}, {{"name": "rpm", "requests": 2, "window": "1h"}}]}}"#
            ),
            "limits[1].name",
            "used by another limit",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "r{{x}}", "requests": 1, "window": "1m"}}]}}"#),
            "limits[0].name",
            "not a valid name",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "rpm", "window": "1m"}}]}}"#),
            "limits[0]",
            "exactly one of `requests`, `tokens`, `concurrency` and `usd`",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "x", "requests": 1, "tokens": 5, "window": "1m"}}]}}"#),
            "limits[0]",
            "exactly one of",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "tpm", "tokens": 0, "window": "1m"}}]}}"#),
            "limits[0].tokens",
            "0 is outside",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"default_encoding": "p50k_base"}}}}"#),
            "tokens.default_encoding",
            "unknown variant `p50k_base`",
        ),
        (
            format!(
                r#"{{{companion}, {limits}, "tokens": {{"models": [{{"match": "x*", "encoding": "o200k_base", "factor": 0}}]}}}}"#
            ),
            "tokens.models[0].factor",
            "outside (0, 10]",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"models": [{{"match": "x*"}}]}}}}"#),
            "tokens.models[0]",
            "missing field `encoding`",
        ),
        (
            format!(
                r#"{{{companion}, {limits}, "tokens": {{"models": [{{"match": "", "encoding": "o200k_base"}}]}}}}"#
            ),
            "tokens.models[0].match",
            "must not be empty",
        ),
        (
            format!(
                r#"{{{companion}, {limits}, "tokens": {{"models": [{{"match": "x*", "encoding": "o200k_base", "expected_output": 0}}]}}}}"#
            ),
            "tokens.models[0].expected_output",
            "must be positive",
        ),
        (
            format!(
                r#"{{{companion}, {limits}, "tokens": {{"models": [{{"match": "x*", "encoding": "o200k_base", "expected_output": "lots"}}]}}}}"#
            ),
            "tokens.models[0]",
            "expected_output: invalid type: string",
        ),
        (
            format!(
                r#"{{{companion}, {limits}, "tokens": {{"models": [{{"match": "x*", "encoding": "o200k_base", "max_ouptut": 5}}]}}}}"#
            ),
            "tokens.models[0]",
            "unknown field `max_ouptut`",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"default_expected_output": 0}}}}"#),
            "tokens.default_expected_output",
            "must be positive",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"calibrate": "yes"}}}}"#),
            "tokens.calibrate",
            "expected a boolean",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"share_calibration": 1}}}}"#),
            "tokens.share_calibration",
            "expected a boolean",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"output_estimate_factor": 0}}}}"#),
            "tokens.output_estimate_factor",
            "outside 0.1..10",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"max_request_bytes": 10}}}}"#),
            "tokens.max_request_bytes",
            "outside 1024",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"reservation_ttl": "1ms"}}}}"#),
            "tokens.reservation_ttl",
            "outside 1s..1d",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"on_upstream_error": "ignore"}}}}"#),
            "tokens.on_upstream_error",
            "unknown variant `ignore`",
        ),
        (
            format!(r#"{{{companion}, {limits}, "tokens": {{"default_max_output": 0}}}}"#),
            "tokens.default_max_output",
            "must be positive",
        ),
        (format!(r#"{{{companion}, {limits}, "tokens": {{"colour": 1}}}}"#), "tokens.colour", "unknown field `colour`"),
        (format!(r#"{{{companion}, {limits}, "fallback": {{"instances": 0}}}}"#), "fallback.instances", "0 is outside"),
        (format!(r#"{{{companion}, {limits}, "mode": "dry_run"}}"#), "mode", "unknown variant `dry_run`"),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "m", "requests": 1, "window": "1m", "tiers": ["gold"]}}], "tier": {{"header": "x-tier", "default": "gold", "tenants": {{"sk-live-SECRET": "gold"}}}}}}"#
            ),
            "tier.tenants (entry 0)",
            "not credentials",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "b", "usd": 5, "window": "1d"}}]}}"#),
            "prices",
            "needs a price table",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "b", "usd": -5, "window": "1d"}}], "prices": [{{"match": "*", "input": 1, "output": 1}}]}}"#
            ),
            "limits[0].usd",
            "outside (0, 1e9]",
        ),
        (
            format!(r#"{{{companion}, {limits}, "prices": [{{"match": "gpt-4o", "input": 2.5}}]}}"#),
            "prices[0]",
            "missing field `output`",
        ),
        (
            format!(r#"{{{companion}, {limits}, "prices": [{{"match": "gpt-4o", "input": -1, "output": 1}}]}}"#),
            "prices[0]",
            "dollars per million",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "m", "requests": 1, "window": "1m", "algorithm": "leaky"}}]}}"#
            ),
            "limits[0].algorithm",
            "unknown variant `leaky`",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "c", "concurrency": 1, "algorithm": "sliding_window"}}]}}"#),
            "limits[0].algorithm",
            "no window to slide",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "m", "requests": 1, "window": "1m", "algorithm": "sliding_window"}}], "lease": {{"enabled": true}}}}"#
            ),
            "lease.enabled",
            "sliding windows do not combine",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "m", "requests": 1, "window": "1m", "tiers": ["gold"]}}]}}"#
            ),
            "limits[0].tiers",
            "needs `tier`",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "m", "requests": 1, "window": "1m", "tiers": ["Gold!"]}}], "tier": {{"header": "x-tier", "default": "gold"}}}}"#
            ),
            "limits[0].tiers[0]",
            "not a valid tier name",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "m", "requests": 1, "window": "1m", "tiers": ["gold"]}}], "tier": {{"header": "x-tier", "default": "free"}}}}"#
            ),
            "tier.default",
            "not a tier any limit names",
        ),
        (
            format!(
                r#"{{{companion}, "limits": [{{"name": "m", "requests": 1, "window": "1m", "models": ["gpt-4o*", ""]}}]}}"#
            ),
            "limits[0].models[1]",
            "must not be empty",
        ),
        (
            format!(r#"{{{companion}, {limits}, "headers": ["openai", "github"]}}"#),
            "headers[1]",
            "unknown variant `github`",
        ),
        (
            format!(r#"{{{companion}, {limits}, "error_format": "cohere"}}"#),
            "error_format",
            "unknown variant `cohere`, expected one of `auto`, `openai`, `anthropic`, `google`, `bedrock`",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "t", "tokens": 5, "window": "1m", "count": "prompt"}}]}}"#),
            "limits[0].count",
            "unknown variant `prompt`, expected one of `total`, `input`, `output`, `cached_input`",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "r", "requests": 5, "window": "1m", "count": "input"}}]}}"#),
            "limits[0].count",
            "only a `tokens` limit counts",
        ),
        (
            format!(r#"{{{companion}, {limits}, "bypass": {{"tenants": ["sk-live-123"]}}}}"#),
            "bypass.tenants[0]",
            "not a credential",
        ),
        (
            format!(r#"{{{companion}, {limits}, "bypass": {{"paths": ["v1/models"]}}}}"#),
            "bypass.paths[0]",
            "must start with",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "cc", "concurrency": 5, "window": "1m"}}]}}"#),
            "limits[0].window",
            "has no window",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 5}}]}}"#),
            "limits[0].window",
            "required for a requests",
        ),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "cc", "concurrency": 0}}]}}"#),
            "limits[0].concurrency",
            "0 is outside",
        ),
        (format!(r#"{{{companion}, {limits}, "slots": {{"ttl": "100ms"}}}}"#), "slots.ttl", "outside 1s..1h"),
        (
            format!(r#"{{{companion}, "limits": [{{"name": "cc", "concurrency": 2}}], "lease": {{"enabled": true}}}}"#),
            "lease.enabled",
            "concurrency limits do not combine",
        ),
        (format!(r#"{{{companion}, {limits}, "queue": {{"max_wait": "1h"}}}}"#), "queue.max_wait", "outside 0s..10m"),
        (
            format!(r#"{{{companion}, {limits}, "queue": {{"default_priority": 12}}}}"#),
            "queue.default_priority",
            "outside 0..9",
        ),
        (
            format!(r#"{{{companion}, {limits}, "queue": {{"priority_header": "x y"}}}}"#),
            "queue.priority_header",
            "not a header name",
        ),
        (
            format!(r#"{{{companion}, {limits}, "queue": {{"max_wait": "1s"}}, "lease": {{"enabled": true}}}}"#),
            "lease.enabled",
            "queueing do not combine",
        ),
        (
            format!(r#"{{{companion}, {limits}, "fallback": {{"breaker_cooldown": "1ms"}}}}"#),
            "fallback.breaker_cooldown",
            "outside 10ms",
        ),
        (
            format!(r#"{{{companion}, {limits}, "fallback": {{"breaker_failures": 0}}}}"#),
            "fallback.breaker_failures",
            "must be positive",
        ),
        (format!(r#"{{{companion}, {limits}, "lease": {{"ttl": "1ms"}}}}"#), "lease.ttl", "outside 100ms"),
        (format!(r#"{{{companion}, {limits}, "lease": {{"share": 0}}}}"#), "lease.share", "outside (0.01, 1]"),
        (
            format!(r#"{{{companion}, {limits}, "lease": {{"low_water": 0.95}}}}"#),
            "lease.low_water",
            "outside (0, 0.9]",
        ),
        (
            format!(
                r#"{{{companion}, {limits}, "lease": {{"enabled": true}}, "tokens": {{"clamp_max_tokens": true}}}}"#
            ),
            "lease.enabled",
            "do not combine",
        ),
        (format!(r#"{{{companion}, {limits}, "lease": {{"size": 5}}}}"#), "lease.size", "unknown field `size`"),
        (
            format!(r#"{{{companion}, {limits}, "failure_mode": "maybe"}}"#),
            "failure_mode",
            "expected one of `local`, `allow`, `deny`",
        ),
    ];
    for (json, field, fragment) in cases {
        let err = Policy::from_json(json.as_bytes()).expect_err(&json);
        assert_eq!(err.field, field, "{json}: {err}");
        assert!(err.message.contains(fragment), "{json}: {err}");
        assert!(err.to_string().contains(&format!("`{field}`")), "{err}");
        assert!(!err.to_string().contains("SECRET"), "a credential in the config is never echoed: {err}");
    }
}
