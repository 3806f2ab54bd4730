//! What one request is charged: a request against every request limit, and its token
//! estimate against every token limit, decided from the path and body alone.

use crate::accounting::calibration::Calibration;
use crate::accounting::reservation::{estimate_output, OutputAverage, TokenCounts};
use crate::config::{Dimension, Measure, ModelPolicy, Policy, Price, TokenCount, UnreadableBody};
use crate::protocol::{LimitCharge, LimitsReply};
use crate::providers;
use crate::providers::Route;
use crate::readers::request::{parse_on, LlmRequest, ParsedBody};
use crate::tokens::Encoding;

/// What a request is charged, planned before its decision. Changed only before a decision
/// is made on it (dated at the decision's clock, lowered by the provider's word, re-routed
/// by an overflow before its second charge); what a decision adds (a clamped output,
/// [`Grant`]) is kept apart by the lifecycle.
#[derive(Debug, Clone, PartialEq)]
pub struct ChargePlan {
    /// One per configured limit, in config order, with this request's cost.
    pub buckets: Vec<LimitCharge>,
    /// The tokens reserved; `None` when no limit counts tokens.
    pub estimate: Option<TokenCounts>,
    /// How the reply's text is counted if it reports no usage.
    pub encoding: Encoding,
    /// The model, for the running average of completion lengths.
    pub model: String,
    /// The model is an Azure deployment's name with no entry in `deployments`: the
    /// reply's `model` prices the settlement.
    pub model_from_reply: bool,
    /// The index of the model's rule (`TokenPolicy::rule`), which keys what is learned.
    pub rule: usize,
    /// The prompt as the proxy counted it, before any factor (0 when not counted): what
    /// the provider's count is compared with.
    pub counted_prompt: u64,
    /// Whether each configured limit applies to this request (its model and tier), in
    /// config order: it is settled, and shown in headers, even when the request reserves
    /// nothing of it (a `cached_input` limit, an `output` limit for an embedding).
    pub applicable: Vec<bool>,
    /// Whether each configured limit would apply to this request on any route (its model,
    /// tier and pool), in config order: `applicable` is these on the request's route.
    pub eligible: Vec<bool>,
    /// With clamping, the least output allowance worth admitting the request with.
    pub min_output: Option<u64>,
    /// The backend the request overflowed to (`None`: the primary route).
    pub backend: Option<String>,
    /// Whether the body was read as its API's request (its token costs are settled).
    pub parsed: bool,
    /// The parsed request.
    pub request: Option<LlmRequest>,
    /// The end user the body names (for limits counted per end user).
    pub end_user: Option<String>,
    /// The client's body, kept when it may be rewritten once the decision is known.
    pub rewritable_body: Option<Vec<u8>>,
    /// Whether the output cap follows what the charge granted (`tokens.clamp_max_tokens`).
    pub clamped: bool,
    /// The model's price, when a cost limit applies and the price table has it.
    pub price: Option<Price>,
    /// A cost limit applies but the model has no price: the request cannot be charged.
    pub unpriced: bool,
    /// Why the body cannot be read as its API's JSON, when it is to be refused for it
    /// (`tokens.unreadable_body: refuse`).
    /// The body could not be read and is charged at the most it can cost
    /// (`unreadable_body: charge_most`): its charge stands, never settled (nothing the
    /// reply says about a request the filter could not read lowers it).
    pub charged_most: bool,
    pub unreadable: Option<String>,
}

/// The output a charge granted a clamped request: what the decision adds to its plan,
/// kept apart from it (see `ChargePlan::grant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Each choice's output cap.
    pub per_choice: u64,
    /// All choices' together: what the reservation holds of output.
    pub output: u64,
}

/// A limit as charged, with this `cost` and nothing else of a request's: no owner, not
/// shadowed, undated, settled in full. The plan's buckets and the worker's lease asks start
/// from it.
pub(crate) fn limit_charge(limit: &crate::config::Limit, cost: u64) -> LimitCharge {
    LimitCharge {
        owner: None,
        shadow: false,
        name: limit.name.clone(),
        capacity: limit.capacity(),
        window_ms: limit.window_ms(),
        cost,
        min_cost: None,
        kind: limit.kind,
        period_bounds_ms: Vec::new(),
        provisional: false,
        look_only: false,
        fair: None,
    }
}

/// The parts of a bucket that depend on the request (see `ChargePlan::terms`).
struct BucketTerms {
    cost: u64,
    min_cost: Option<u64>,
    provisional: bool,
    look_only: bool,
}

impl ChargePlan {
    /// The bucket of `limit` for this request, charged when it `applies`; the owner,
    /// shadow flag and period are set apart (`pools::assign`, `date`).
    fn bucket(&self, limit: &crate::config::Limit, applies: bool) -> LimitCharge {
        let terms = self.terms(limit, applies);
        LimitCharge {
            cost: terms.cost,
            min_cost: terms.min_cost,
            provisional: terms.provisional,
            look_only: terms.look_only,
            // The rest as any charge starts: the owner, shadow flag and period (dated when
            // the decision's clock is read) are set apart.
            ..limit_charge(limit, 0)
        }
    }

    /// What this request takes of `limit`'s bucket when it `applies` (no name copied: a
    /// re-route reads these for every limit).
    fn terms(&self, limit: &crate::config::Limit, applies: bool) -> BucketTerms {
        let estimate = self.estimate;
        BucketTerms {
            // A limit for other models is still asked about, look-only (it never refuses),
            // so every plan has one bucket per configured limit, in config order.
            cost: match (applies, limit.measure) {
                (false, _) => 0,
                (true, Measure::Requests(_) | Measure::Concurrency(_)) => 1,
                (true, Measure::Tokens { count, .. }) => estimate.map_or(0, |e| count.reserved(e)),
                (true, Measure::Usd { .. }) => match (self.price, estimate) {
                    (Some(price), Some(estimate)) => price.micro_usd(estimate),
                    _ => 0,
                },
            },
            // With clamping, the limits that count the output give up the same share of
            // the output allowance (down to `min_output_tokens`) to fit.
            min_cost: match (applies, limit.token_count(), estimate, self.min_output) {
                (true, Some(TokenCount::Total), Some(estimate), Some(min_output)) => {
                    Some(estimate.prompt.saturating_add(min_output))
                }
                (true, Some(TokenCount::Output), Some(_), Some(min_output)) => Some(min_output),
                _ => None,
            },
            // An unparsed request's flat cost is never settled: nothing comes back.
            provisional: self.parsed && applies && matches!(limit.dimension(), Dimension::Tokens | Dimension::Cost),
            look_only: !applies,
        }
    }

    /// Charges the request on `backend`'s limits (`None`: the primary route's): each
    /// eligible limit that counts there, every other one asked about look-only. What
    /// owns each bucket and when its period runs stay as they were.
    pub fn route_to(&mut self, config: &Policy, backend: Option<&str>) {
        self.backend = backend.map(str::to_string);
        self.applicable = config
            .limits
            .iter()
            .zip(&self.eligible)
            .map(|(limit, &eligible)| eligible && limit.counts_on(backend))
            .collect();
        for (i, limit) in config.limits.iter().enumerate() {
            let applies = self.applies(i);
            let fresh = self.terms(limit, applies);
            if let Some(bucket) = self.buckets.get_mut(i) {
                bucket.cost = fresh.cost;
                bucket.min_cost = fresh.min_cost.filter(|_| !bucket.shadow);
                bucket.provisional = fresh.provisional;
                bucket.look_only = fresh.look_only;
            }
        }
    }

    /// Gives each calendar budget's bucket the period boundaries around `now_ms`, the
    /// decision's clock: what is charged is decided from the request, the period from the
    /// time (and, in Redis, from Redis's clock).
    pub fn date(&mut self, config: &Policy, now_ms: u64) {
        for (bucket, limit) in self.buckets.iter_mut().zip(&config.limits) {
            bucket.period_bounds_ms = limit.period_bounds_ms(now_ms);
        }
    }

    /// What the charge granted (`charged`: what each bucket was charged, in plan order):
    /// the output allowance, all choices together, when clamping shrank it; `None` when the
    /// whole estimate stands. Every elastic bucket (a `total` or `output` token limit, when
    /// clamping) gave up the same reduction of the output allowance, so any one of them
    /// tells the grant. Several choices share it, each an equal part.
    pub fn grant(&self, charged: &[u64]) -> Option<Grant> {
        let estimate = self.estimate.filter(|_| self.clamped)?;
        let reduction = self
            .buckets
            .iter()
            .zip(charged)
            .find(|(bucket, _)| bucket.min_cost.is_some())
            .map_or(0, |(bucket, &charged)| bucket.cost.saturating_sub(charged));
        let choices = self.request.as_ref().map_or(1, |r| r.choices);
        let per_choice = estimate.output.saturating_sub(reduction) / choices;
        Some(Grant { per_choice, output: per_choice.saturating_mul(choices) })
    }

    /// What the request holds reserved once `grant` is known: the estimate, its output cut
    /// to the grant; what it is settled against.
    pub fn reserved(&self, grant: Option<Grant>) -> Option<TokenCounts> {
        let estimate = self.estimate?;
        Some(grant.map_or(estimate, |grant| TokenCounts { output: grant.output, ..estimate }))
    }

    /// The body to send upstream instead of the client's, if it changes: the output cap
    /// at what `grant` allows each choice, stream usage requested (as configured).
    pub fn body_for(&self, config: &Policy, grant: Option<Grant>) -> Option<Vec<u8>> {
        let granted = grant.map(|grant| grant.per_choice);
        self.request.as_ref()?.rewritten(self.rewritable_body.as_deref()?, config.tokens.request_stream_usage, granted)
    }

    /// The price the reply is settled at: the plan's, or for an unmapped Azure deployment
    /// the price of the model the reply named, if the price table has one.
    pub fn settlement_price(&self, config: &Policy, reply_model: Option<&str>) -> Option<Price> {
        match reply_model.filter(|_| self.model_from_reply).and_then(|model| config.price_of(model)) {
            Some(price) => Some(price),
            None => self.price,
        }
    }

    /// Whether the request asks for a completion (not an embedding), so its reply teaches
    /// completion lengths.
    pub fn produces_output(&self) -> bool {
        self.request.as_ref().is_some_and(|r| r.api.produces_output())
    }

    /// Whether the limit at `index` applies to this request.
    pub fn applies(&self, index: usize) -> bool {
        self.applicable.get(index).copied().unwrap_or(false)
    }

    /// The reply's outcomes for the limits that apply to this request: what headers and
    /// 429s should speak of.
    pub fn relevant(&self, reply: &LimitsReply) -> LimitsReply {
        self.keep_relevant(reply.clone())
    }

    /// [`ChargePlan::relevant`] of a reply the caller is done with: its outcomes kept, not
    /// copied (each carries its limit's name; an admission's headers are written from it).
    pub fn keep_relevant(&self, mut reply: LimitsReply) -> LimitsReply {
        let mut applies = self.applicable.iter();
        reply.limits.retain(|_| applies.next().copied().unwrap_or(false));
        reply
    }
}

/// What this proxy has learned that shapes a reservation.
pub trait Learned {
    /// This tenant's running average completion for `model`, if it has one.
    fn average(&mut self, model: &str) -> Option<OutputAverage>;
    /// What settled replies taught about the models of rule `rule`.
    fn calibration(&mut self, rule: usize) -> Calibration;
    /// Tokens in `text`: counted, or remembered from an earlier count (see `PromptCache`).
    fn count(&mut self, encoding: Encoding, text: &str) -> u64 {
        encoding.count(text)
    }
}

/// A proxy that has learned nothing yet.
pub struct Cold;

impl Learned for Cold {
    fn average(&mut self, _: &str) -> Option<OutputAverage> {
        None
    }

    fn calibration(&mut self, _: usize) -> Calibration {
        Calibration::default()
    }
}

/// Plans the charge. `body` is `None` when token limits are not configured (the body is
/// then never read) and empty for a request without one.
pub fn plan(
    config: &Policy,
    route: Option<&Route>,
    tier: &str,
    body: Option<&[u8]>,
    learned: &mut impl Learned,
) -> ChargePlan {
    let policy = &config.tokens;
    let parse = body.and_then(|body| parse_on(route?, body));
    // A body on an LLM path that is not its API's JSON (an empty one is no body: a GET).
    let unreadable = match (&parse, body) {
        (Some(Err(why)), Some(body)) if !body.is_empty() => Some(why.to_string()),
        _ => None,
    };
    // Charged at the most it can cost (`unreadable_body: charge_most`), whatever it names.
    let most = unreadable.is_some() && policy.unreadable_body == UnreadableBody::ChargeMost;
    let parsed = parse.and_then(Result::ok);
    let request = parsed.as_ref().map(|parsed| parsed.request.clone());
    // From the body, or the path (Gemini, Vertex AI, Bedrock), or a deployment (Azure).
    let named = providers::model_name(route, request.as_ref().and_then(|r| r.model.as_deref()), &config.deployments);
    let model = named.name;
    let (rule_index, model_policy) = policy.rule_for(Some(model.as_str()).filter(|m| !m.is_empty()));
    let rule = &model_policy.rule;
    let bounded = policy.clamp_max_tokens && request.as_ref().is_some_and(|r| r.api.produces_output());
    // A signed body (Bedrock) cannot have its cap shrunk: it is reserved at the bound
    // clamping starts from, its whole cap, all or nothing.
    let clamped = bounded && !request.as_ref().is_some_and(|r| r.body_is_signed);
    let price = if most {
        config.ceiling_price()
    } else {
        config.price_of(&model).or_else(|| named.unmapped_deployment.then(|| config.ceiling_price()).flatten())
    };
    let mut min_output = None;
    let mut counted_prompt = 0;
    let estimate = match (&parsed, body) {
        (_, None) => None,
        _ if !config.counts_tokens() => None,
        (Some(parsed), Some(_)) => {
            let request = &parsed.request;
            counted_prompt = parsed.prompt_tokens_with(&mut |text| learned.count(rule.encoding, text));
            let calibration = learned.calibration(rule_index);
            let prompt = (counted_prompt as f64 * calibration.prompt_factor(rule.factor)).ceil() as u64;
            // Each of `choices` completions may run to the cap.
            let per_choice = request.max_output.or(rule.max_output).unwrap_or(policy.default_max_output);
            let cap = per_choice.saturating_mul(request.choices);
            Some(if !request.api.produces_output() {
                TokenCounts { prompt, output: 0 }
            } else if bounded {
                // The true upper bound, elastic down to a useful minimum where it may be clamped.
                min_output = clamped.then(|| policy.min_output_tokens.min(per_choice).saturating_mul(request.choices));
                TokenCounts { prompt: prompt_bound(prompt, parsed), output: cap }
            } else {
                let history = learned.average(&model).or_else(|| prior(model_policy, &calibration));
                let output = estimate_output(per_choice, history, policy.output_estimate_factor);
                TokenCounts { prompt, output: output.saturating_mul(request.choices) }
            })
        }
        // Every byte a token, and the longest completion the config allows for.
        (None, Some(body)) if most => {
            Some(TokenCounts { prompt: body.len() as u64, output: policy.default_max_output })
        }
        (None, Some(_)) => Some(TokenCounts { prompt: policy.unparsed_request_cost, output: 0 }),
    };
    let applies = |limit: &crate::config::Limit| {
        if most {
            limit.applies_to_tier(tier)
        } else {
            limit.applies_to(&model, tier)
        }
    };
    let eligible: Vec<bool> = config.limits.iter().map(applies).collect();
    let mut plan = ChargePlan {
        buckets: Vec::new(),
        estimate,
        encoding: rule.encoding,
        model: model.clone(),
        model_from_reply: named.unmapped_deployment,
        rule: rule_index,
        counted_prompt,
        applicable: Vec::new(),
        eligible,
        min_output,
        backend: None,
        parsed: request.is_some(),
        end_user: parsed.as_ref().filter(|_| config.reads_body_end_user()).and_then(|parsed| parsed.end_user()),
        request: None,
        rewritable_body: None,
        clamped,
        price,
        unpriced: false,
        charged_most: most,
        unreadable: unreadable.filter(|_| !most),
    };
    plan.buckets = config.limits.iter().map(|limit| plan.bucket(limit, false)).collect();
    plan.route_to(config, None);
    plan.unpriced = price.is_none()
        && config.limits.iter().any(|l| l.dimension() == Dimension::Cost && applies(l) && l.counts_on(None));
    // Only a body that may change is kept past the decision (see `body_for`).
    let rewritable =
        request.as_ref().is_some_and(|r| clamped || (policy.request_stream_usage && r.wants_usage_added()));
    plan.rewritable_body = body.filter(|_| rewritable).map(<[u8]>::to_vec);
    plan.request = request;
    plan
}

/// A prompt's size that no provider's count of it exceeds, for the hard cap of clamping:
/// at least `estimate` (the count at the learned factor), and at least the prompt with
/// each of its texts measured in bytes (`ParsedBody::prompt_bytes`). A byte-level BPE
/// tokenizer (tiktoken's encodings and the like) makes at most one token of each byte of
/// text, SentencePiece with byte fallback at most one more per text (its word-boundary
/// mark); what providers add around a message (OpenAI 3 tokens, chat templates a few
/// special tokens) is covered by the 3 a message counts plus its role's bytes (`user`: 4,
/// one token). Not bounded so: an image given by URL (counted at the proxy's 765, at the
/// learned factor) and prompts a provider adds of its own (Anthropic's tool-use system
/// prompt), which only calibration covers.
pub fn prompt_bound(estimate: u64, request: &ParsedBody) -> u64 {
    estimate.max(request.prompt_bytes())
}

/// What stands in for a tenant's own history of a model's completions: the model's, as
/// this proxy learned them from every tenant; else the rule's `expected_output`; else
/// nothing (the request reserves its output cap).
fn prior(model: &ModelPolicy, calibration: &Calibration) -> Option<OutputAverage> {
    let mean = calibration.output_prior().or(model.expected_output.map(|e| e as f64))?;
    Some(OutputAverage { mean, samples: 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan of the test's chat body on OpenAI's path, on a proxy that learned nothing.
    fn cold_chat_plan(config: &Policy) -> ChargePlan {
        plan(config, providers::route("/v1/chat/completions").as_ref(), "", Some(CHAT.as_bytes()), &mut Cold)
    }
    use crate::api::Api;

    fn config(tokens: &str) -> Policy {
        let json = format!(
            r#"{{"companion": {{"upstream": "c", "token": "test-token-0123456789"}}, "tokens": {tokens},
               "limits": [{{"name": "rpm", "requests": 20, "window": "1m"}}, {{"name": "tpm", "tokens": 10000, "window": "1m"}}]}}"#
        );
        Policy::from_json(json.as_bytes()).expect("config")
    }

    const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

    /// What a proxy learned, as a test sets it; records the models asked about.
    #[derive(Default)]
    struct Known {
        average: Option<OutputAverage>,
        calibration: Calibration,
        asked: Vec<String>,
    }

    impl Known {
        fn average(average: OutputAverage) -> Known {
            Known { average: Some(average), ..Known::default() }
        }
    }

    impl Learned for Known {
        fn average(&mut self, model: &str) -> Option<OutputAverage> {
            self.asked.push(model.to_string());
            self.average
        }

        fn calibration(&mut self, _: usize) -> Calibration {
            self.calibration
        }
    }

    fn json(bytes: Option<Vec<u8>>) -> serde_json::Value {
        serde_json::from_slice(&bytes.expect("rewritten")).expect("json")
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn charges_one_request_and_the_token_estimate() {
        let config = config("{}");
        let plan =
            plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(CHAT.as_bytes()), &mut Cold);
        assert_eq!(plan.estimate, Some(TokenCounts { prompt: 9, output: 300 }));
        let costs: Vec<u64> = plan.buckets.iter().map(|b| b.cost).collect();
        assert_eq!(costs, [1, 309]);
        assert_eq!(plan.applicable, [true, true]);
        assert_eq!((plan.model.as_str(), plan.encoding), ("gpt-4o", Encoding::O200kBase));
        assert!(!plan.clamped && plan.buckets.iter().all(|b| b.min_cost.is_none()));
        let provisional: Vec<bool> = plan.buckets.iter().map(|b| b.provisional).collect();
        assert_eq!(provisional, [false, true], "the token reservation is settled; the request count is not");
    }

    #[test]
    fn an_output_cap_past_any_count_reserves_the_most_not_a_wrapped_sum() {
        // Seen on a real nginx: max_tokens 1e20 read as u64::MAX, and prompt + cap wrapped
        // round to a 10-token reservation for a fresh tenant.
        let config = config("{}");
        for cap in ["1e20", "1e308", "18446744073709551615"] {
            let body = CHAT.replace("\"max_tokens\":300", &format!("\"max_tokens\":{cap}"));
            let plan =
                plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(body.as_bytes()), &mut Cold);
            assert_eq!(plan.buckets[1].cost, u64::MAX, "{cap}");
        }
    }

    #[test]
    fn the_running_average_shortens_the_estimate() {
        let config = config("{}");
        let mut known = Known { average: Some(OutputAverage::first(40)), ..Known::default() };
        let plan =
            plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(CHAT.as_bytes()), &mut known);
        assert_eq!(known.asked, ["gpt-4o"]);
        assert_eq!(plan.estimate, Some(TokenCounts { prompt: 9, output: 60 }));
    }

    #[test]
    fn a_per_model_limit_charges_only_its_models() {
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [
            {"name": "rpm", "requests": 20, "window": "1m"},
            {"name": "gpt4o-rpm", "requests": 5, "window": "1m", "models": ["gpt-4o*"]}]}"#;
        let config = Policy::from_json(json.as_bytes()).expect("config");
        assert!(config.reads_body() && !config.counts_tokens());
        let costs = |model: &str| {
            let body = format!(r#"{{"model":"{model}","messages":[]}}"#);
            let plan =
                plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(body.as_bytes()), &mut Cold);
            assert_eq!(plan.estimate, None, "no token limit: nothing to estimate");
            plan.buckets.iter().map(|b| b.cost).collect::<Vec<_>>()
        };
        assert_eq!(costs("gpt-4o"), [1, 1]);
        assert_eq!(costs("gpt-4o-mini"), [1, 1]);
        assert_eq!(costs("o3"), [1, 0]);
    }

    #[test]
    fn a_budget_is_charged_at_the_models_price_and_refuses_unpriced_models() {
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [{"name": "day", "usd": 5, "window": "1d"}],
                       "prices": [{"match": "gpt-4o*", "input": 2.5, "output": 10}]}"#;
        let config = Policy::from_json(json.as_bytes()).expect("config");
        let plan =
            plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(CHAT.as_bytes()), &mut Cold);
        // 9 prompt tokens at $2.50/M and 300 output at $10/M: 3,022.5 micro-dollars, rounded up.
        assert_eq!((plan.buckets[0].cost, plan.unpriced), (3_023, false));
        let other = r#"{"model":"mystery-1","messages":[]}"#;
        let plan = super::plan(
            &config,
            providers::route("/v1/chat/completions").as_ref(),
            "",
            Some(other.as_bytes()),
            &mut Cold,
        );
        assert!(plan.unpriced);
    }

    #[test]
    fn model_rules_set_encoding_factor_and_cap() {
        let config = config(
            r#"{"models": [{"match": "claude-*", "encoding": "cl100k_base", "factor": 2.0, "max_output": 64}]}"#,
        );
        let body = r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hello world"}]}"#;
        let plan = plan(&config, providers::route("/v1/messages").as_ref(), "", Some(body.as_bytes()), &mut Cold);
        assert_eq!(plan.estimate, Some(TokenCounts { prompt: 18, output: 64 }));
        assert_eq!(plan.encoding, Encoding::Cl100kBase);
    }

    #[test]
    fn unknown_paths_and_bad_bodies_cost_the_configured_fallback() {
        let config = config(r#"{"unparsed_request_cost": 250}"#);
        for (path, body) in [("/v1/models", ""), ("/v1/chat/completions", "{not json"), ("/v1/chat/completions", "")] {
            let plan = plan(&config, providers::route(path).as_ref(), "", Some(body.as_bytes()), &mut Cold);
            assert_eq!(plan.estimate, Some(TokenCounts { prompt: 250, output: 0 }), "{path} {body}");
            assert!(plan.buckets.iter().all(|b| !b.provisional), "a flat cost is never settled");
        }
    }

    #[test]
    fn embeddings_reserve_no_output_and_request_limits_alone_read_nothing() {
        let config = config("{}");
        let body = r#"{"model":"text-embedding-3-small","input":"hello world"}"#;
        let plan = plan(&config, providers::route("/v1/embeddings").as_ref(), "", Some(body.as_bytes()), &mut Cold);
        assert_eq!(plan.estimate, Some(TokenCounts { prompt: 2, output: 0 }));
        assert_eq!(plan.encoding, Encoding::Cl100kBase);
        let plan = super::plan(&config, providers::route("/v1/chat/completions").as_ref(), "", None, &mut Cold);
        assert_eq!((plan.estimate, plan.buckets[1].cost), (None, 0));
    }

    #[test]
    fn asks_for_stream_usage_when_configured() {
        let config = config(r#"{"request_stream_usage": true}"#);
        let body = r#"{"model":"gpt-4o","stream":true,"messages":[]}"#;
        let plan =
            plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(body.as_bytes()), &mut Cold);
        assert_eq!(plan.grant(&[1, 999]), None, "not clamping");
        let rewritten = json(plan.body_for(&config, plan.grant(&[1, 999])));
        assert_eq!(rewritten["stream_options"]["include_usage"], true);
        assert!(rewritten.get("max_completion_tokens").is_none(), "not clamping: {rewritten}");
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn clamping_reserves_the_upper_bound_elastically_and_caps_the_grant() {
        let config = config(r#"{"clamp_max_tokens": true, "min_output_tokens": 50}"#);
        let plan = plan(
            &config,
            providers::route("/v1/chat/completions").as_ref(),
            "",
            Some(CHAT.as_bytes()),
            &mut Known::average(OutputAverage::first(10)),
        );
        // The average is ignored: the reservation is the true upper bound, the prompt at
        // its bound (its text in bytes), the output at the request's cap.
        let bound = 21;
        assert_eq!(plan.estimate, Some(TokenCounts { prompt: bound, output: 300 }));
        let tpm = &plan.buckets[1];
        assert_eq!((tpm.cost, tpm.min_cost), (bound + 300, Some(bound + 50)));
        assert_eq!(plan.buckets[0].min_cost, None);
        // Charged the bound and 120: the request may generate 120 tokens, and is told so.
        let grant = plan.grant(&[1, bound + 120]);
        assert_eq!(json(plan.body_for(&config, grant))["max_tokens"], 120);
        assert_eq!(plan.reserved(grant), Some(TokenCounts { prompt: bound, output: 120 }));
        assert_eq!(plan.estimate, Some(TokenCounts { prompt: bound, output: 300 }), "the plan stays as planned");
        // Granted in full: the body stays as it was.
        let plan = cold_chat_plan(&config);
        let grant = plan.grant(&[1, bound + 300]);
        assert_eq!(plan.body_for(&config, grant), None);
        assert_eq!(plan.reserved(grant), plan.estimate);
    }

    #[test]
    fn the_prompt_bound_is_at_least_every_count_of_the_prompt() {
        // OpenAI's tiktoken's counts of prose, code, JSON, CJK, RTL, emoji and special-token
        // text (tests/cases/token_counts.json), each text a message of its own, fifty times
        // over (the most per-message overhead for the bytes).
        let table: serde_json::Value =
            serde_json::from_str(include_str!("../../../../tests/cases/token_counts.json")).unwrap();
        let texts = table["cases"].as_array().unwrap().iter().map(|case| {
            let most = case["o200k_base"].as_u64().max(case["cl100k_base"].as_u64());
            (case["text"].as_str().unwrap(), most.unwrap())
        });
        for (text, tokens) in texts.chain([("a", 1), ("7 3 9 1", 7), ("🦀", 3)]) {
            let messages: Vec<_> = (0..50).map(|_| serde_json::json!({"role": "user", "content": text})).collect();
            let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
            let request = LlmRequest::parse(Api::ChatCompletions, body.as_bytes()).unwrap();
            // OpenAI's own count of the request: 3 a message, its role and text, 3 to prime.
            let billed = 50 * (3 + 1 + tokens) + 3;
            assert!(prompt_bound(0, &request) >= billed, "{text:?}");
            for encoding in [Encoding::O200kBase, Encoding::Cl100kBase] {
                assert!(prompt_bound(0, &request) >= request.prompt_tokens(encoding), "{encoding:?} {text:?}");
            }
        }
        let chat = LlmRequest::parse(Api::ChatCompletions, CHAT.as_bytes()).unwrap();
        assert_eq!(prompt_bound(0, &chat), 3 + 4 + 11 + 3, "priming, the message, `user`, `hello world`");
        assert_eq!(prompt_bound(500, &chat), 500, "never below the estimate");
    }

    #[test]
    fn the_learned_factor_scales_the_prompt_and_the_rule_keys_it() {
        let config = config(r#"{"models": [{"match": "claude-*", "encoding": "cl100k_base", "factor": 1.1}]}"#);
        let lesson = crate::accounting::calibration::Lesson { prompt: Some((9, 21)), output: None };
        let mut known = Known { calibration: Calibration::default().learn(lesson), ..Known::default() };
        let plan =
            plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(CHAT.as_bytes()), &mut known);
        assert_eq!(plan.counted_prompt, 9);
        assert_eq!(plan.estimate.map(|e| e.prompt), Some(21), "9 counted at the learned 21/9");
        assert_eq!(config.tokens.rule(plan.rule).rule.pattern, "gpt-4o*", "the built-in family keys it");
        // Unknown models share one rule, the catch-all, whatever their names.
        let rules: Vec<usize> = ["mystery-1", "mystery-2", ""]
            .iter()
            .map(|m| CHAT.replace("gpt-4o", m))
            .map(|body| {
                super::plan(
                    &config,
                    providers::route("/v1/chat/completions").as_ref(),
                    "",
                    Some(body.as_bytes()),
                    &mut Cold,
                )
                .rule
            })
            .collect();
        assert_eq!(rules, [config.tokens.rules.len(); 3]);
        assert_eq!(config.tokens.rule(rules[0]).label, "other");
    }

    #[test]
    fn a_tenant_without_history_reserves_the_models_prior() {
        let mut config =
            config(r#"{"models": [{"match": "gpt-4o*", "encoding": "o200k_base", "expected_output": 100}]}"#);
        let reserve = |config: &Policy, known: &mut Known| {
            plan(config, providers::route("/v1/chat/completions").as_ref(), "", Some(CHAT.as_bytes()), known)
                .estimate
                .map(|e| e.output)
        };
        // The rule's prior, at the estimate factor (1.5), below the cap of 300.
        assert_eq!(reserve(&config, &mut Known::default()), Some(150));
        // Once the proxy has seen enough of the model's completions, theirs.
        let mut learned = Calibration::default();
        for output in [20, 20, 20] {
            learned = learned.learn(crate::accounting::calibration::Lesson { prompt: None, output: Some(output) });
        }
        assert_eq!(reserve(&config, &mut Known { calibration: learned, ..Known::default() }), Some(30));
        // The tenant's own history, when it has one, wins.
        let mut own = Known { average: Some(OutputAverage::first(180)), calibration: learned, asked: vec![] };
        assert_eq!(reserve(&config, &mut own), Some(270));
        // No prior anywhere: the cap.
        config.tokens.rules[0].expected_output = None;
        assert_eq!(reserve(&config, &mut Known::default()), Some(300));
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn each_token_limit_reserves_the_part_it_counts() {
        let written = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "tokens": {"models": [{"match": "gpt-4o*", "encoding": "o200k_base", "factor": 2.0}]},
            "limits": [{"name": "tpm", "tokens": 10000, "window": "1m"},
                       {"name": "itpm", "tokens": 10000, "window": "1m", "count": "input"},
                       {"name": "otpm", "tokens": 10000, "window": "1m", "count": "output"},
                       {"name": "ctpm", "tokens": 10000, "window": "1m", "count": "cached_input"},
                       {"name": "usd", "usd": 1, "window": "1d"}],
            "prices": [{"match": "*", "input": 2, "output": 10}]}"#;
        let config = Policy::from_json(written.as_bytes()).expect("config");
        let plan =
            plan(&config, providers::route("/v1/chat/completions").as_ref(), "", Some(CHAT.as_bytes()), &mut Cold);
        // 9 counted, at the rule's factor of 2: 18 input; 300 output allowed.
        let costs: Vec<u64> = plan.buckets.iter().map(|b| b.cost).collect();
        assert_eq!(costs, [318, 18, 300, 0, 18 * 2 + 300 * 10], "the budget prices each part");
        assert_eq!(plan.applicable, [true; 5], "a limit reserving nothing still applies (it is settled)");
        let body = r#"{"model":"text-embedding-3-small","input":"hello world"}"#;
        let embedding =
            super::plan(&config, providers::route("/v1/embeddings").as_ref(), "", Some(body.as_bytes()), &mut Cold);
        assert_eq!(embedding.buckets.iter().map(|b| b.cost).collect::<Vec<_>>(), [2, 2, 0, 0, 4]);
        // Clamping: the limits that count output are elastic, down to the least output.
        let clamped = written
            .replace(r#""factor": 2.0}]"#, r#""factor": 2.0}], "clamp_max_tokens": true, "min_output_tokens": 50"#);
        let config = Policy::from_json(clamped.as_bytes()).expect("config");
        let plan = cold_chat_plan(&config);
        let least: Vec<Option<u64>> = plan.buckets.iter().map(|b| b.min_cost).collect();
        assert_eq!(least, [Some(21 + 50), None, Some(50), None, None]);
        // The output limit had 120 left: every elastic limit gave up 180.
        let grant = plan.grant(&[21 + 120, 21, 120, 0, 1]);
        assert_eq!(json(plan.body_for(&config, grant))["max_tokens"], 120);
        assert_eq!(plan.reserved(grant), Some(TokenCounts { prompt: 21, output: 120 }));
    }

    #[test]
    fn each_count_takes_its_part_of_what_was_used() {
        use crate::config::TokenCount::*;
        let used = TokenCounts { prompt: 700, output: 40 };
        let cases = [(Total, 740, 740), (Input, 700, 700), (Output, 40, 40), (CachedInput, 0, 500)];
        for (count, reserved, settled) in cases {
            assert_eq!((count.reserved(used), count.used(used, 500)), (reserved, settled), "{count:?}");
        }
        assert_eq!(CachedInput.used(used, 9_999), 700, "never more than the input");
    }
}
