//! The filter's labelled counters: decisions per limit, tokens by kind. Each series is a
//! plain host counter whose name carries its labels in Istio's encoding
//! (`<label>=.=<value>;.;` before the metric name), so Envoy's stats tag extraction
//! (`stats_config.stats_tags`, one regex per label, `(<label>=\.=(.*?);\.;)`) turns them
//! into Prometheus labels, and Istio's `extraStatTags` generates exactly those regexes.
//!
//! Label values come from the config only (limit names, model rule labels), never from a
//! request: the number of series is fixed when the config loads.

use crate::config::Policy;

/// The Prometheus name of the per-limit decision counter.
pub const DECISIONS: &str = "llm_ratelimit_decisions_total";
/// The Prometheus name of the token counter.
pub const TOKENS: &str = "llm_ratelimit_tokens_total";

/// The Prometheus names of the gauges: one per learned figure, labelled.
pub const LEASE_BOUND: &str = "llm_ratelimit_lease_bound";
pub const PROMPT_FACTOR: &str = "llm_ratelimit_prompt_factor_thousandths";
pub const OUTPUT_PRIOR: &str = "llm_ratelimit_output_prior_tokens";

/// The label names, as Envoy's `stats_tags` `tag_name`s. `gen_ai_token_type` is
/// OpenTelemetry's `gen_ai.token.type` as Prometheus spells it.
pub const LABELS: [&str; 5] = ["limit", "decision", "model_rule", "gen_ai_token_type", "token_stage"];

/// What became of a request under one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Admitted with Redis's agreement (a charge, or a lease taken from Redis).
    Allowed,
    /// Refused by this limit (by Redis, a lease, or the degraded mode's local limiter).
    Limited,
    /// Admitted without Redis: the degraded mode (`failure_mode` `local` or `allow`).
    Degraded,
    /// Refused by this limit, and let through by shadow mode.
    Shadow,
    /// Refused by this limit, and sent to its `overflow` backend instead.
    Overflowed,
}

impl Decision {
    const ALL: [Decision; 5] =
        [Decision::Allowed, Decision::Limited, Decision::Degraded, Decision::Shadow, Decision::Overflowed];

    fn label(self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::Limited => "limited",
            Decision::Degraded => "degraded",
            Decision::Shadow => "shadow",
            Decision::Overflowed => "overflowed",
        }
    }
}

/// `gen_ai.token.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Input,
    Output,
}

impl TokenType {
    const ALL: [TokenType; 2] = [TokenType::Input, TokenType::Output];

    fn label(self) -> &'static str {
        match self {
            TokenType::Input => "input",
            TokenType::Output => "output",
        }
    }
}

/// Whether tokens were reserved before the request went upstream, or charged once its
/// reply said what it used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenStage {
    Reserved,
    Charged,
}

impl TokenStage {
    const ALL: [TokenStage; 2] = [TokenStage::Reserved, TokenStage::Charged];

    fn label(self) -> &'static str {
        match self {
            TokenStage::Reserved => "reserved",
            TokenStage::Charged => "charged",
        }
    }
}

/// The index of a decision series (into [`names`]).
pub fn decision(limit: usize, decision: Decision) -> usize {
    limit * Decision::ALL.len() + decision as usize
}

/// The index of a token series. `rule` is a `TokenPolicy` rule index; out of range, the
/// catch-all's, as `TokenPolicy::rule` has it.
pub fn tokens(config: &Policy, rule: usize, kind: TokenType, stage: TokenStage) -> usize {
    let rule = rule.min(config.tokens.rules.len());
    let per_rule = TokenType::ALL.len() * TokenStage::ALL.len();
    config.limits.len() * Decision::ALL.len() + rule * per_rule + kind as usize * TokenStage::ALL.len() + stage as usize
}

/// Every series of this config, by index, as the host's counter names.
pub fn names(config: &Policy) -> Vec<String> {
    let mut names = Vec::new();
    for limit in &config.limits {
        for decision in Decision::ALL {
            names.push(format!("limit=.={};.;decision=.={};.;{DECISIONS}", limit.name, decision.label()));
        }
    }
    for (_, rule) in config.tokens.all_rules() {
        for kind in TokenType::ALL {
            for stage in TokenStage::ALL {
                names.push(format!(
                    "model_rule=.={};.;gen_ai_token_type=.={};.;token_stage=.={};.;{TOKENS}",
                    rule.label,
                    kind.label(),
                    stage.label()
                ));
            }
        }
    }
    names
}

/// A gauge of one limit (`lease_bound`), labelled by the limit's name.
pub fn limit_gauge(metric: &str, limit: &str) -> String {
    format!("limit=.={limit};.;{metric}")
}

/// A gauge of one model rule (`prompt_factor`, `output_prior`), labelled by its label.
pub fn rule_gauge(metric: &str, rule_label: &str) -> String {
    format!("model_rule=.={rule_label};.;{metric}")
}

/// The limit index of each outcome a reply names (the config's order).
pub fn limit_indices<'a>(
    config: &'a Policy,
    names: impl Iterator<Item = &'a str> + 'a,
) -> impl Iterator<Item = usize> + 'a {
    names.filter_map(|name| config.limits.iter().position(|l| l.name == name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"},
            "tokens": {"models": [{"match": "claude-*", "encoding": "cl100k_base"}]},
            "limits": [{"name": "rpm", "requests": 5, "window": "1m"}, {"name": "tpm", "tokens": 9, "window": "1m"}]}"#;
        Policy::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn every_index_names_its_own_series() {
        let config = policy();
        let names = names(&config);
        let unique: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "no two series share a name");
        assert_eq!(
            names[decision(1, Decision::Shadow)],
            "limit=.=tpm;.;decision=.=shadow;.;llm_ratelimit_decisions_total"
        );
        assert_eq!(
            names[tokens(&config, 0, TokenType::Output, TokenStage::Charged)],
            "model_rule=.=claude;.;gen_ai_token_type=.=output;.;token_stage=.=charged;.;llm_ratelimit_tokens_total"
        );
        let catch_all = tokens(&config, usize::MAX, TokenType::Output, TokenStage::Charged);
        assert_eq!(catch_all, names.len() - 1, "the catch-all is the last rule");
        assert!(names[catch_all].starts_with("model_rule=.=other;"));
    }

    /// On the fake host: what one admitted, one refused, one shadowed and one degraded
    /// request count, and under which limit.
    #[test]
    fn requests_count_under_the_limits_that_decided_them() {
        use crate::testing::{FakeCompanion, Proxy, Request, World};
        const CHAT: &str =
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;
        let usage = r#"{"id":"c","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":41,"total_tokens":50}}"#;
        let limits =
            r#"[{"name": "rpm", "requests": 1, "window": "1m"}, {"name": "tpm", "tokens": 10000, "window": "1m"}]"#;
        let json = |extra: &str| {
            format!(
                r#"{{"companion": {{"upstream": "c", "token": "test-token-0123456789"}}, "limits": {limits}{extra}}}"#
            )
        };
        let world = World::new(crate::effects::host::HostKind::Envoy);
        let mut proxy = Proxy::new(&world, &json(r#", "failure_mode": "deny""#));
        let config = proxy.worker.config().unwrap().clone();
        let rule = config.tokens.rule_for(Some("gpt-4o")).0;
        let mut companion = FakeCompanion::default();
        let mut admitted = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        proxy.reply(&mut admitted, 200, "application/json", &[usage]);
        let counted = |host: &crate::testing::FakeHost, series: usize| host.series_value(series);
        assert_eq!(counted(&admitted.host, decision(0, Decision::Allowed)), 1);
        assert_eq!(counted(&admitted.host, decision(1, Decision::Allowed)), 1);
        let reserved = |kind| counted(&admitted.host, tokens(&config, rule, kind, TokenStage::Reserved));
        let charged = |kind| counted(&admitted.host, tokens(&config, rule, kind, TokenStage::Charged));
        assert_eq!((reserved(TokenType::Input), reserved(TokenType::Output)), (9, 300));
        assert_eq!((charged(TokenType::Input), charged(TokenType::Output)), (9, 41));

        let refused = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        assert_eq!(refused.replied().map(|r| r.status), Some(429));
        assert_eq!(counted(&refused.host, decision(0, Decision::Limited)), 1, "rpm refused it");
        assert_eq!(counted(&refused.host, decision(1, Decision::Limited)), 0, "tpm had room");
        assert_eq!(refused.host.series.values().sum::<u64>(), 1, "nothing reserved, nothing charged");

        let mut shadow = Proxy::new(&world, &json(r#", "mode": "shadow""#));
        shadow.send(Request::get("sk-s", "/v1/models"), &mut companion);
        let shadowed = shadow.send(Request::get("sk-s", "/v1/models"), &mut companion);
        assert!(shadowed.forwarded());
        assert_eq!(counted(&shadowed.host, decision(0, Decision::Shadow)), 1);
        assert_eq!(counted(&shadowed.host, decision(0, Decision::Limited)), 0);

        let mut local = Proxy::new(&world, &json(r#", "failure_mode": "local""#));
        let degraded = local.send(Request::get("sk-d", "/v1/models"), &mut FakeCompanion::failing(500));
        assert!(degraded.forwarded());
        assert_eq!(counted(&degraded.host, decision(0, Decision::Degraded)), 1);
        assert_eq!(counted(&degraded.host, decision(0, Decision::Allowed)), 0);
        // The degraded mode's own refusal is the limit's: rpm (1 a minute) has no room left.
        let refused_locally = local.send(Request::get("sk-d", "/v1/models"), &mut FakeCompanion::failing(500));
        assert_eq!(refused_locally.replied().map(|r| r.status), Some(429));
        assert_eq!(counted(&refused_locally.host, decision(0, Decision::Limited)), 1);
        assert_eq!(counted(&refused_locally.host, decision(1, Decision::Limited)), 0);
    }

    /// Leases: admissions from a lease and refusals remembered from Redis count per limit.
    #[test]
    fn lease_decisions_count_under_their_limit() {
        use crate::testing::{FakeCompanion, Proxy, Request, World};
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "lease": {"enabled": true},
            "limits": [{"name": "rpm", "requests": 2, "window": "1m"}]}"#;
        let world = World::new(crate::effects::host::HostKind::Envoy);
        let mut proxy = Proxy::new(&world, json);
        let mut companion = FakeCompanion::default();
        let flights: Vec<_> = (0..4).map(|_| proxy.send(Request::get("sk-a", "/v1/models"), &mut companion)).collect();
        let total = |d| flights.iter().map(|f| f.host.series_value(decision(0, d))).sum::<u64>();
        assert_eq!(flights.iter().filter(|f| f.forwarded()).count(), 2);
        assert_eq!((total(Decision::Allowed), total(Decision::Limited)), (2, 2));
        let remembered = flights.last().unwrap();
        assert_eq!(remembered.host.series_value(decision(0, Decision::Limited)), 1, "refused from the lease entry");
    }

    #[test]
    fn each_learned_figure_is_one_labelled_gauge() {
        use crate::testing::{Proxy, World};
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "lease": {"enabled": true},
            "tokens": {"models": [{"match": "claude-*", "encoding": "cl100k_base", "factor": 1.2}]},
            "limits": [{"name": "rph", "requests": 300, "window": "1h"}, {"name": "tpm", "tokens": 1000, "window": "1m"}]}"#;
        let world = World::new(crate::effects::host::HostKind::Envoy);
        let proxy = Proxy::new(&world, json);
        let gauge = |name: &str| proxy.root.gauges.get(name).copied();
        assert_eq!(gauge("limit=.=rph;.;llm_ratelimit_lease_bound"), Some(30));
        assert_eq!(gauge("model_rule=.=claude;.;llm_ratelimit_prompt_factor_thousandths"), Some(1200));
        assert_eq!(gauge("model_rule=.=other;.;llm_ratelimit_output_prior_tokens"), Some(0));
        // One gauge per figure: 1 lease bound per limit, 2 per model rule, nothing else.
        let rules = proxy.root.gauges.keys().filter(|g| g.starts_with("model_rule=.=")).count();
        assert_eq!(proxy.root.gauges.len(), 2 + rules, "{:?}", proxy.root.gauges.keys());
        assert_eq!(
            rules,
            2 * (crate::tokens::builtin_families().len() + 2),
            "claude-*, the built-in rules, the catch-all"
        );
    }

    #[test]
    fn the_count_follows_the_config_alone() {
        let config = policy();
        let rules = config.tokens.rules.len() + 1;
        assert_eq!(names(&config).len(), 2 * 5 + rules * 4);
    }
}
