//! What one request is charged: a request against every request limit, and its token
//! estimate against every token limit, decided from the path and body alone.

use crate::config::Price;
use crate::config::{model_rule, Dimension, Policy};
use crate::prompt_cache::PromptCache;
use crate::protocol::{LimitCharge, LimitsReply};
use crate::request::{Api, LlmRequest};
use crate::reservation::{estimate_output, OutputAverage, TokenEstimate};
use crate::tokens::Encoding;

#[derive(Debug, Clone, PartialEq)]
pub struct ChargePlan {
    /// One per configured limit, in config order, with this request's cost.
    pub buckets: Vec<LimitCharge>,
    /// The tokens reserved; `None` when no limit counts tokens.
    pub estimate: Option<TokenEstimate>,
    /// How the reply's text is counted if it reports no usage.
    pub encoding: Encoding,
    /// The model, for the running average of completion lengths.
    pub model: String,
    /// The parsed request.
    pub request: Option<LlmRequest>,
    /// The client's body, kept when it may be rewritten once the decision is known.
    pub rewritable_body: Option<Vec<u8>>,
    /// Whether the output cap follows what the charge granted (`tokens.clamp_max_tokens`).
    pub clamped: bool,
    /// The model's price, when a cost limit applies and the price table has it.
    pub price: Option<Price>,
    /// A cost limit applies but the model has no price: the request cannot be charged.
    pub unpriced: bool,
}

impl ChargePlan {
    /// The tokens this request reserved (0 when no limit counts tokens).
    pub fn reserved_tokens(&self) -> u64 {
        self.estimate.map_or(0, TokenEstimate::total)
    }

    /// After the charge: the output allowance granted (`charged` is what the token
    /// buckets were charged) and the body to send upstream instead of the client's, if
    /// it changes. Shrinks the estimate to the grant, so the settlement is against it.
    pub fn apply_grant(&mut self, config: &Policy, charged: Option<u64>) -> Option<Vec<u8>> {
        let granted = match (self.clamped, &mut self.estimate, charged) {
            (true, Some(estimate), Some(charged)) => {
                estimate.output = charged.saturating_sub(estimate.prompt);
                Some(estimate.output)
            }
            _ => None,
        };
        self.request.as_ref()?.rewritten(self.rewritable_body.as_deref()?, config.tokens.request_stream_usage, granted)
    }

    /// Buckets charged by the token estimate, for settling.
    pub fn token_buckets<'a>(&'a self, config: &'a Policy) -> impl Iterator<Item = &'a LimitCharge> + 'a {
        self.buckets
            .iter()
            .filter(|b| b.cost > 0 && config.limit(&b.name).is_some_and(|l| l.dimension() == Dimension::Tokens))
    }

    /// Whether the limit at `index` applies to this request (is charged something).
    pub fn applies(&self, index: usize) -> bool {
        self.buckets.get(index).is_some_and(|b| b.cost > 0)
    }

    /// The reply's outcomes for the limits that apply to this request: what headers and
    /// 429s should speak of.
    pub fn relevant(&self, reply: &LimitsReply) -> LimitsReply {
        let limits =
            reply.limits.iter().zip(&self.buckets).filter(|(_, b)| b.cost > 0).map(|(o, _)| o.clone()).collect();
        LimitsReply { allowed: reply.allowed, waited_ms: reply.waited_ms, limits }
    }
}

/// Plans the charge. `body` is `None` when token limits are not configured (the body is
/// then never read) and empty for a request without one.
pub fn plan(
    config: &Policy,
    path: &str,
    tier: &str,
    body: Option<&[u8]>,
    prompt_cache: &mut PromptCache,
    mut average: impl FnMut(&str) -> Option<OutputAverage>,
) -> ChargePlan {
    let policy = &config.tokens;
    let parsed = body.and_then(|body| Api::from_path(path).and_then(|api| LlmRequest::parse(api, body).ok()));
    let request = parsed.as_ref().map(|parsed| parsed.request.clone());
    let model = request.as_ref().and_then(|r| r.model.clone()).unwrap_or_default();
    let rule = model_rule(policy, request.as_ref().and_then(|r| r.model.as_deref()));
    let clamped = policy.clamp_max_tokens && request.as_ref().is_some_and(|r| r.api.produces_output());
    let price = config.price_of(&model);
    let mut min_output = None;
    let estimate = match (&parsed, body) {
        (_, None) => None,
        _ if !config.counts_tokens() => None,
        (Some(parsed), Some(_)) => {
            let request = &parsed.request;
            let counted = parsed.prompt_tokens_with(&mut |text| prompt_cache.count(rule.encoding, text));
            let prompt = (counted as f64 * rule.factor).ceil() as u64;
            let cap = request.max_output.or(rule.max_output).unwrap_or(policy.default_max_output);
            let output = if !request.api.produces_output() {
                0
            } else if clamped {
                // The true upper bound, elastic down to a useful minimum.
                min_output = Some(policy.min_output_tokens.min(cap));
                cap
            } else {
                estimate_output(cap, average(&model), policy.output_estimate_factor)
            };
            Some(TokenEstimate { prompt, output })
        }
        (None, Some(_)) => Some(TokenEstimate { prompt: policy.unparsed_request_cost, output: 0 }),
    };
    let buckets = config
        .limits
        .iter()
        .map(|limit| LimitCharge {
            name: limit.name.clone(),
            capacity: limit.capacity(),
            window_ms: limit.window_ms(),
            // A limit for other models is still asked about (cost 0 only looks), so every
            // plan has one bucket per configured limit, in config order.
            cost: match (limit.applies_to(&model, tier), limit.dimension()) {
                (false, _) => 0,
                (true, Dimension::Requests | Dimension::Concurrency) => 1,
                (true, Dimension::Tokens) => estimate.map_or(0, TokenEstimate::total),
                (true, Dimension::Cost) => match (price, estimate) {
                    (Some(price), Some(estimate)) => price.micro_usd(estimate),
                    _ => 0,
                },
            },
            min_cost: match (limit.applies_to(&model, tier), limit.dimension(), estimate, min_output) {
                (true, Dimension::Tokens, Some(estimate), Some(min_output)) => Some(estimate.prompt + min_output),
                _ => None,
            },
            kind: limit.kind,
        })
        .collect();
    let unpriced =
        price.is_none() && config.limits.iter().any(|l| l.dimension() == Dimension::Cost && l.applies_to(&model, tier));
    // Only a body that may change is kept past the decision (see `apply_grant`).
    let rewritable =
        request.as_ref().is_some_and(|r| clamped || (policy.request_stream_usage && r.wants_usage_added()));
    let rewritable_body = body.filter(|_| rewritable).map(<[u8]>::to_vec);
    ChargePlan { buckets, estimate, encoding: rule.encoding, model, request, rewritable_body, clamped, price, unpriced }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tokens: &str) -> Policy {
        let json = format!(
            r#"{{"companion": {{"upstream": "c", "token": "t"}}, "tokens": {tokens},
               "limits": [{{"name": "rpm", "requests": 20, "window": "1m"}}, {{"name": "tpm", "tokens": 10000, "window": "1m"}}]}}"#
        );
        Policy::from_json(json.as_bytes()).expect("config")
    }

    const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

    fn json(bytes: Option<Vec<u8>>) -> serde_json::Value {
        serde_json::from_slice(&bytes.expect("rewritten")).expect("json")
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn charges_one_request_and_the_token_estimate() {
        let config = config("{}");
        let plan = plan(&config, "/v1/chat/completions", "", Some(CHAT.as_bytes()), &mut PromptCache::new(0), |_| None);
        assert_eq!(plan.estimate, Some(TokenEstimate { prompt: 9, output: 300 }));
        let costs: Vec<u64> = plan.buckets.iter().map(|b| b.cost).collect();
        assert_eq!(costs, [1, 309]);
        assert_eq!(plan.token_buckets(&config).map(|b| b.name.as_str()).collect::<Vec<_>>(), ["tpm"]);
        assert_eq!((plan.model.as_str(), plan.encoding), ("gpt-4o", Encoding::O200kBase));
        assert!(!plan.clamped && plan.buckets.iter().all(|b| b.min_cost.is_none()));
    }

    #[test]
    fn the_running_average_shortens_the_estimate() {
        let config = config("{}");
        let plan =
            plan(&config, "/v1/chat/completions", "", Some(CHAT.as_bytes()), &mut PromptCache::new(0), |model| {
                (model == "gpt-4o").then(|| OutputAverage::first(40))
            });
        assert_eq!(plan.estimate, Some(TokenEstimate { prompt: 9, output: 60 }));
    }

    #[test]
    fn a_per_model_limit_charges_only_its_models() {
        let json = r#"{"companion": {"upstream": "c", "token": "t"}, "limits": [
            {"name": "rpm", "requests": 20, "window": "1m"},
            {"name": "gpt4o-rpm", "requests": 5, "window": "1m", "models": ["gpt-4o*"]}]}"#;
        let config = Policy::from_json(json.as_bytes()).expect("config");
        assert!(config.reads_body() && !config.counts_tokens());
        let costs = |model: &str| {
            let body = format!(r#"{{"model":"{model}","messages":[]}}"#);
            let plan =
                plan(&config, "/v1/chat/completions", "", Some(body.as_bytes()), &mut PromptCache::new(0), |_| None);
            assert_eq!(plan.estimate, None, "no token limit: nothing to estimate");
            plan.buckets.iter().map(|b| b.cost).collect::<Vec<_>>()
        };
        assert_eq!(costs("gpt-4o"), [1, 1]);
        assert_eq!(costs("gpt-4o-mini"), [1, 1]);
        assert_eq!(costs("o3"), [1, 0]);
    }

    #[test]
    fn a_budget_is_charged_at_the_models_price_and_refuses_unpriced_models() {
        let json = r#"{"companion": {"upstream": "c", "token": "t"}, "limits": [{"name": "day", "usd": 5, "window": "1d"}],
                       "prices": [{"match": "gpt-4o*", "input": 2.5, "output": 10}]}"#;
        let config = Policy::from_json(json.as_bytes()).expect("config");
        let plan = plan(&config, "/v1/chat/completions", "", Some(CHAT.as_bytes()), &mut PromptCache::new(0), |_| None);
        // 9 prompt tokens at $2.50/M and 300 output at $10/M: 3,022.5 micro-dollars, rounded up.
        assert_eq!((plan.buckets[0].cost, plan.unpriced), (3_023, false));
        let other = r#"{"model":"mystery-1","messages":[]}"#;
        let plan =
            super::plan(&config, "/v1/chat/completions", "", Some(other.as_bytes()), &mut PromptCache::new(0), |_| {
                None
            });
        assert!(plan.unpriced);
    }

    #[test]
    fn model_rules_set_encoding_factor_and_cap() {
        let config = config(
            r#"{"models": [{"match": "claude-*", "encoding": "cl100k_base", "factor": 2.0, "max_output": 64}]}"#,
        );
        let body = r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hello world"}]}"#;
        let plan = plan(&config, "/v1/messages", "", Some(body.as_bytes()), &mut PromptCache::new(0), |_| None);
        assert_eq!(plan.estimate, Some(TokenEstimate { prompt: 18, output: 64 }));
        assert_eq!(plan.encoding, Encoding::Cl100kBase);
    }

    #[test]
    fn unknown_paths_and_bad_bodies_cost_the_configured_fallback() {
        let config = config(r#"{"unparsed_request_cost": 250}"#);
        for (path, body) in [("/v1/models", ""), ("/v1/chat/completions", "{not json"), ("/v1/chat/completions", "")] {
            let plan = plan(&config, path, "", Some(body.as_bytes()), &mut PromptCache::new(0), |_| None);
            assert_eq!(plan.estimate, Some(TokenEstimate { prompt: 250, output: 0 }), "{path} {body}");
        }
    }

    #[test]
    fn embeddings_reserve_no_output_and_request_limits_alone_read_nothing() {
        let config = config("{}");
        let body = r#"{"model":"text-embedding-3-small","input":"hello world"}"#;
        let plan = plan(&config, "/v1/embeddings", "", Some(body.as_bytes()), &mut PromptCache::new(0), |_| None);
        assert_eq!(plan.estimate, Some(TokenEstimate { prompt: 2, output: 0 }));
        assert_eq!(plan.encoding, Encoding::Cl100kBase);
        let plan = super::plan(&config, "/v1/chat/completions", "", None, &mut PromptCache::new(0), |_| None);
        assert_eq!((plan.estimate, plan.buckets[1].cost), (None, 0));
    }

    #[test]
    fn asks_for_stream_usage_when_configured() {
        let config = config(r#"{"request_stream_usage": true}"#);
        let body = r#"{"model":"gpt-4o","stream":true,"messages":[]}"#;
        let mut plan =
            plan(&config, "/v1/chat/completions", "", Some(body.as_bytes()), &mut PromptCache::new(0), |_| None);
        let rewritten = json(plan.apply_grant(&config, Some(999)));
        assert_eq!(rewritten["stream_options"]["include_usage"], true);
        assert!(rewritten.get("max_completion_tokens").is_none(), "not clamping: {rewritten}");
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn clamping_reserves_the_upper_bound_elastically_and_caps_the_grant() {
        let config = config(r#"{"clamp_max_tokens": true, "min_output_tokens": 50}"#);
        let mut plan =
            plan(&config, "/v1/chat/completions", "", Some(CHAT.as_bytes()), &mut PromptCache::new(0), |_| {
                Some(OutputAverage::first(10))
            });
        // The average is ignored: the reservation is the true upper bound.
        assert_eq!(plan.estimate, Some(TokenEstimate { prompt: 9, output: 300 }));
        let tpm = &plan.buckets[1];
        assert_eq!((tpm.cost, tpm.min_cost), (309, Some(59)));
        assert_eq!(plan.buckets[0].min_cost, None);
        // Charged 129 of 309: the request may generate 120 tokens, and is told so.
        assert_eq!(json(plan.apply_grant(&config, Some(129)))["max_tokens"], 120);
        assert_eq!(plan.estimate, Some(TokenEstimate { prompt: 9, output: 120 }));
        // Granted in full: the body stays as it was.
        let mut plan =
            super::plan(&config, "/v1/chat/completions", "", Some(CHAT.as_bytes()), &mut PromptCache::new(0), |_| None);
        assert_eq!(plan.apply_grant(&config, Some(309)), None);
    }
}
