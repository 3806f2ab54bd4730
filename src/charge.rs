//! What one request is charged: a request against every request limit, and its token
//! estimate against every token limit, decided from the path and body alone.

use crate::config::{model_rule, Config, Dimension};
use crate::protocol::BucketSpec;
use crate::request::{Api, LlmRequest};
use crate::reservation::{estimate_output, OutputAverage, TokenEstimate};
use crate::tokens::Encoding;

#[derive(Debug, Clone, PartialEq)]
pub struct ChargePlan {
    /// One per configured limit, in config order, with this request's cost.
    pub buckets: Vec<BucketSpec>,
    /// The tokens reserved; `None` when no limit counts tokens.
    pub estimate: Option<TokenEstimate>,
    /// How the reply's text is counted if it reports no usage.
    pub encoding: Encoding,
    /// The model, for the running average of completion lengths.
    pub model: String,
    /// The body to send upstream instead of the client's (usage requested in the stream).
    pub rewritten_body: Option<Vec<u8>>,
}

impl ChargePlan {
    /// Buckets charged by the token estimate, for settling.
    pub fn token_buckets<'a>(
        &'a self,
        config: &'a Config,
    ) -> impl Iterator<Item = &'a BucketSpec> + 'a {
        self.buckets.iter().filter(|b| {
            config
                .limit(&b.name)
                .is_some_and(|l| l.dimension() == Dimension::Tokens)
        })
    }
}

/// Shared-data key of a tenant's running average completion length for a model.
pub fn average_key(domain: &str, tenant: &str, model: &str) -> String {
    format!("llmrl.avg.{domain}.{tenant}.{model}")
}

/// Plans the charge. `body` is `None` when token limits are not configured (the body is
/// then never read) and empty for a request without one.
pub fn plan(
    config: &Config,
    path: &str,
    body: Option<&[u8]>,
    average: impl Fn(&str) -> Option<OutputAverage>,
) -> ChargePlan {
    let policy = &config.tokens;
    let request = body
        .and_then(|body| Api::from_path(path).and_then(|api| LlmRequest::parse(api, body).ok()));
    let model = request
        .as_ref()
        .and_then(|r| r.model.clone())
        .unwrap_or_default();
    let rule = model_rule(policy, request.as_ref().and_then(|r| r.model.as_deref()));
    let estimate = match (&request, body) {
        (_, None) => None,
        (Some(request), Some(_)) => {
            let prompt = (request.prompt_tokens(rule.encoding) as f64 * rule.factor).ceil() as u64;
            let output = if request.api.produces_output() {
                let cap = request
                    .max_output
                    .or(rule.max_output)
                    .unwrap_or(policy.default_max_output);
                estimate_output(cap, average(&model), policy.output_estimate_factor)
            } else {
                0
            };
            Some(TokenEstimate { prompt, output })
        }
        (None, Some(_)) => Some(TokenEstimate {
            prompt: policy.unparsed_request_cost,
            output: 0,
        }),
    };
    let buckets = config
        .limits
        .iter()
        .map(|limit| BucketSpec {
            name: limit.name.clone(),
            capacity: limit.capacity(),
            window_ms: limit.window_ms(),
            cost: match limit.dimension() {
                Dimension::Requests => 1,
                Dimension::Tokens => estimate.map_or(0, TokenEstimate::total),
            },
        })
        .collect();
    let rewritten_body = match &request {
        Some(request) if policy.request_stream_usage => request.with_usage_requested(),
        _ => None,
    };
    ChargePlan {
        buckets,
        estimate,
        encoding: rule.encoding,
        model,
        rewritten_body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tokens: &str) -> Config {
        let json = format!(
            r#"{{"companion": {{"upstream": "c", "token": "t"}}, "tokens": {tokens},
               "limits": [{{"name": "rpm", "requests": 20, "window": "1m"}}, {{"name": "tpm", "tokens": 10000, "window": "1m"}}]}}"#
        );
        Config::from_json(json.as_bytes()).expect("config")
    }

    const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

    #[test]
    fn charges_one_request_and_the_token_estimate() {
        let config = config("{}");
        let plan = plan(
            &config,
            "/v1/chat/completions",
            Some(CHAT.as_bytes()),
            |_| None,
        );
        assert_eq!(
            plan.estimate,
            Some(TokenEstimate {
                prompt: 9,
                output: 300
            })
        );
        let costs: Vec<u64> = plan.buckets.iter().map(|b| b.cost).collect();
        assert_eq!(costs, [1, 309]);
        assert_eq!(
            plan.token_buckets(&config)
                .map(|b| b.name.as_str())
                .collect::<Vec<_>>(),
            ["tpm"]
        );
        assert_eq!(
            (plan.model.as_str(), plan.encoding),
            ("gpt-4o", Encoding::O200kBase)
        );
        assert_eq!(plan.rewritten_body, None);
    }

    #[test]
    fn the_running_average_shortens_the_estimate() {
        let config = config("{}");
        let plan = plan(
            &config,
            "/v1/chat/completions",
            Some(CHAT.as_bytes()),
            |model| (model == "gpt-4o").then(|| OutputAverage::first(40)),
        );
        assert_eq!(
            plan.estimate,
            Some(TokenEstimate {
                prompt: 9,
                output: 60
            })
        );
    }

    #[test]
    fn model_rules_set_encoding_factor_and_cap() {
        let config = config(
            r#"{"models": [{"match": "claude-*", "encoding": "cl100k_base", "factor": 2.0, "max_output": 64}]}"#,
        );
        let body =
            r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hello world"}]}"#;
        let plan = plan(&config, "/v1/messages", Some(body.as_bytes()), |_| None);
        assert_eq!(
            plan.estimate,
            Some(TokenEstimate {
                prompt: 18,
                output: 64
            })
        );
        assert_eq!(plan.encoding, Encoding::Cl100kBase);
    }

    #[test]
    fn unknown_paths_and_bad_bodies_cost_the_configured_fallback() {
        let config = config(r#"{"unparsed_request_cost": 250}"#);
        for (path, body) in [
            ("/v1/models", ""),
            ("/v1/chat/completions", "{not json"),
            ("/v1/chat/completions", ""),
        ] {
            let plan = plan(&config, path, Some(body.as_bytes()), |_| None);
            assert_eq!(
                plan.estimate,
                Some(TokenEstimate {
                    prompt: 250,
                    output: 0
                }),
                "{path} {body}"
            );
        }
    }

    #[test]
    fn embeddings_reserve_no_output_and_request_limits_alone_read_nothing() {
        let config = config("{}");
        let body = r#"{"model":"text-embedding-3-small","input":"hello world"}"#;
        let plan = plan(&config, "/v1/embeddings", Some(body.as_bytes()), |_| None);
        assert_eq!(
            plan.estimate,
            Some(TokenEstimate {
                prompt: 2,
                output: 0
            })
        );
        assert_eq!(plan.encoding, Encoding::Cl100kBase);
        let plan = super::plan(&config, "/v1/chat/completions", None, |_| None);
        assert_eq!((plan.estimate, plan.buckets[1].cost), (None, 0));
    }

    #[test]
    fn asks_for_stream_usage_when_configured() {
        let config = config(r#"{"request_stream_usage": true}"#);
        let body = r#"{"model":"gpt-4o","stream":true,"messages":[]}"#;
        let plan = plan(
            &config,
            "/v1/chat/completions",
            Some(body.as_bytes()),
            |_| None,
        );
        let rewritten: serde_json::Value =
            serde_json::from_slice(&plan.rewritten_body.expect("rewritten")).expect("json");
        assert_eq!(rewritten["stream_options"]["include_usage"], true);
    }
}
