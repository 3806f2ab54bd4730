//! The policy the filter runs on: the config compiled once, at load. Every value here has
//! been checked, durations are `Duration`s, header names are lower case, and a limit's
//! measure is one enum, so no code downstream re-checks or re-derives anything. What each
//! setting means for operators is documented on the shape (`super::shape`).

use crate::accounting::calendar::Calendar;
use crate::accounting::lease::LeasePolicy;
use crate::accounting::reservation::{TokenCounts, UpstreamErrorCharge};
use crate::api::dialect::ErrorFormat;
use crate::api::identity::{IdentitySource, MissingIdentity};
use crate::protocol::LimitKind;
use crate::tokens::{builtin_families, glob_match, Encoding, ModelRule};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Policy {
    /// Where the counters live (`Store::Local`: `companion` is never called).
    pub store: Store,
    pub companion: Companion,
    /// Namespace of this policy's counters in Redis.
    pub domain: String,
    pub identity: Identity,
    pub failure_mode: FailureMode,
    /// Every request is charged against each of these, all or nothing, in this order.
    pub limits: Vec<Limit>,
    pub tokens: TokenPolicy,
    pub slots: Slots,
    pub tier: Option<TierConfig>,
    /// Tried in order.
    pub prices: Vec<PriceEntry>,
    pub mode: Mode,
    /// The rate-limit headers responses carry, decided for each limit at load.
    pub headers: super::HeaderPlan,
    /// Whose shape local replies and the `provider` headers take.
    pub error_format: ErrorFormat,
    pub bypass: Bypass,
    pub unknown_paths: UnknownPaths,
    pub queue: QueueConfig,
    pub fallback: Fallback,
    pub lease: LeaseConfig,
    pub memory: Memory,
    pub provider_limits: ProviderLimits,
    pub refusals: Refusals,
    /// As written: unset means "where the host can" (see `Worker::holds_request_headers`).
    pub hold_request_headers: Option<bool>,
    /// Azure OpenAI deployment → model (see `providers`).
    pub deployments: BTreeMap<String, String>,
    pub record: RecordMode,
}

/// How each request's record is published to the host (`lifecycle::record`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordMode {
    /// One property holding the record as a JSON object (one host call per request).
    #[default]
    Json,
    /// One property per field, for access-log formats and CEL that read fields apart.
    Fields,
    /// Both.
    Both,
    /// None.
    Off,
}

/// Where the limits' counters live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Store {
    /// In Redis, through the companion: one budget for every proxy of the domain.
    #[default]
    Redis,
    /// In this proxy's shared data, across its workers (`effects/local_limiter.rs`): no companion, no
    /// Redis; each proxy counts only what passes through it.
    Local,
}

/// What the filter does with the provider's word on its limits (`crate::effects::provider_state`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderLimits {
    pub enabled: bool,
    pub share: bool,
    pub default_retry_ms: u64,
    pub max_retry_ms: u64,
    pub lower_limits: bool,
    pub slots: u32,
    /// The backend a request goes to while the provider refuses, instead of a 429.
    pub overflow: Option<String>,
}

/// How refusals tell a client whether waiting helps (`refusals`, see `super::shape::Refusals`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refusals {
    /// A refusal whose wait is longer than this is answered as a spent budget.
    pub retry_horizon_ms: u64,
    /// The status of a spent budget's refusal: 429 or 403.
    pub spent_status: u32,
    /// Warn while a budget has less than this fraction of its capacity left.
    pub warn_below: Option<f64>,
}

/// Sizes of the shared-data tables (see `crate::effects::tables`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    pub tenant_slots: u32,
    pub average_slots: u32,
    /// The local limiter's bound on a window's entries (and, with the local store, on a
    /// concurrency limit's slots).
    pub local_entries: u32,
    /// The secret key of the tables' slot hash (derived at compile: `config::compile`).
    pub slot_key: [u64; 2],
}

impl Policy {
    /// Whether any limit needs the request's token estimate (token and cost limits), so
    /// the body must be read and counted.
    pub fn counts_tokens(&self) -> bool {
        self.limits.iter().any(|l| matches!(l.dimension(), Dimension::Tokens | Dimension::Cost))
    }

    /// The price of `model`: the first matching entry of `prices`.
    pub fn price_of(&self, model: &str) -> Option<Price> {
        self.prices.iter().find(|p| glob_match(&p.pattern, model)).map(|p| p.price)
    }

    /// What a model the filter cannot name yet (an Azure deployment `deployments` does
    /// not map) is reserved at, under a cost limit: the highest input, cached-input and
    /// output prices of the table, so that whichever priced model it turns out to be, the
    /// reservation covers it. The reply's `model` then prices the settlement
    /// (`ChargePlan::settlement_price`).
    pub fn ceiling_price(&self) -> Option<Price> {
        self.prices.iter().map(|entry| entry.price).reduce(|a, b| Price {
            input: a.input.max(b.input),
            output: a.output.max(b.output),
            cached_input: Some(a.cached_input.unwrap_or(a.input).max(b.cached_input.unwrap_or(b.input))),
        })
    }

    /// Every tier some limit names.
    pub fn tiers(&self) -> impl Iterator<Item = &str> {
        tiers_named(&self.limits)
    }

    /// The tier of `tenant`, whose tier header says `value`: its override, else the
    /// header's tier if a limit names it, else the default.
    pub fn tier_of(&self, tenant: &str, value: Option<&str>) -> &str {
        let Some(tier) = &self.tier else { return "" };
        if let Some(own) = tier.tenants.get(tenant) {
            return own;
        }
        value.map(str::trim).and_then(|v| self.tiers().find(|t| *t == v)).unwrap_or(&tier.default)
    }

    /// Whether the request body must be read before deciding: to count tokens, to learn
    /// the model a per-model limit depends on, or the end user a limit is counted per.
    pub fn reads_body(&self) -> bool {
        self.counts_tokens() || self.reads_body_end_user() || self.limits.iter().any(|l| !l.models.is_empty())
    }

    /// Whether a limit is counted per an end user the body names.
    pub fn reads_body_end_user(&self) -> bool {
        self.limits.iter().any(|l| matches!(l.per, super::Per::EndUser { header: None, .. }))
    }

    /// Whether a refusal may send a request to another backend (a limit's `overflow`, or
    /// `provider_limits.overflow`): the client's own overflow header is then removed.
    pub fn overflows(&self) -> bool {
        self.provider_limits.overflow.is_some() || self.limits.iter().any(|l| l.overflow.is_some())
    }

    pub fn has_concurrency(&self) -> bool {
        self.limits.iter().any(|l| l.dimension() == Dimension::Concurrency)
    }

    pub fn limit(&self, name: &str) -> Option<&Limit> {
        self.limits.iter().find(|l| l.name == name)
    }
}

/// The tiers `limits` name: the only tiers a tenant can be in.
pub(super) fn tiers_named(limits: &[Limit]) -> impl Iterator<Item = &str> {
    limits.iter().flat_map(|l| l.tiers.iter().map(String::as_str))
}

#[derive(Debug, Clone)]
pub struct Companion {
    /// The callout target: an Envoy cluster name, or `host:port`.
    pub upstream: String,
    /// `:authority` of the callout, when it is not `upstream`.
    pub authority: Option<String>,
    /// Shared secret the companion requires in `x-llmrl-token`.
    pub token: Secret,
    /// How long a callout may take before the failure mode decides.
    pub timeout: Duration,
}

impl Companion {
    /// What the local store has in its place: nothing to call (never called, see `Store`).
    pub(crate) fn none() -> Companion {
        Companion {
            upstream: String::new(),
            authority: None,
            token: Secret::new(String::new()),
            timeout: Duration::ZERO,
        }
    }

    pub fn authority(&self) -> &str {
        self.authority.as_deref().unwrap_or(&self.upstream)
    }
}

#[derive(Debug, Clone)]
pub struct Identity {
    /// The operator's own credential headers (names in lower case), all read; `None`:
    /// each API's own places.
    pub sources: Option<Vec<IdentitySource>>,
    pub missing: MissingIdentity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Decide with a strict local limit (each limit divided by `fallback.instances`),
    /// held in shared data; reconcile with Redis when it is back.
    #[default]
    Local,
    /// Let the request through, marked with a response header and a metric.
    Allow,
    /// Answer 503 with `Retry-After`.
    Deny,
}

/// What a body on an LLM path that cannot be read as its API's JSON gets: it cannot be
/// counted, and the upstream may read it anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnreadableBody {
    /// Answer 400 in the API's shape.
    #[default]
    Refuse,
    /// Charge the most it can cost: its bytes as prompt tokens plus
    /// `tokens.default_max_output`, at the highest price of `prices`, under every limit
    /// whatever models it names.
    ChargeMost,
}

/// What a request on a path no API is recognised in gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownPaths {
    /// One request and `tokens.unparsed_request_cost` tokens (the Batch and Realtime
    /// APIs are refused all the same).
    #[default]
    Charge,
    /// Answer 400 in the shape of the path's provider (OpenAI's when none).
    Refuse,
}

/// Whether decisions are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Requests over a limit are refused.
    #[default]
    Enforce,
    /// Everything is computed, charged and settled as if enforced, and headers and metrics
    /// say what would have happened, but no request is refused.
    Shadow,
}

/// Rate-limit header conventions a response may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderStyle {
    /// The caller's API's own (see `crate::api::dialect`): OpenAI's for OpenAI's paths,
    /// Anthropic's for Anthropic's; Google and Bedrock publish none.
    Provider,
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (and `-concurrency`).
    Openai,
    /// `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`.
    Anthropic,
    /// `RateLimit-Policy` and `RateLimit` (IETF draft).
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` for the most
    /// restrictive limit.
    Classic,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    /// Names the counter in Redis and in headers and 429 bodies.
    pub name: String,
    pub measure: Measure,
    /// The time in which a spent budget refills completely; for a concurrency limit,
    /// `slots.ttl`, how long a slot lives unrenewed; for a calendar budget, the longest
    /// its period runs (`Period::longest_ms`).
    pub window: Duration,
    /// A calendar budget's period: full again at each of its boundaries (kind `Calendar`).
    pub calendar: Option<Calendar>,
    /// What this limit is in Redis: `Slots` exactly when the measure is concurrency.
    pub kind: LimitKind,
    /// Model patterns this limit applies to; empty: every model.
    pub models: Vec<String>,
    /// Tiers this limit applies to; empty: every tier.
    pub tiers: Vec<String>,
    /// Whose counter a request is charged on (see `crate::plan::pools`).
    pub per: super::Per,
    /// Charged and reported, never refusing (`limits[].mode: shadow`).
    pub shadow: bool,
    /// A shared pool's fair shares among its tenants (`limits[].fair_share`).
    pub fair_share: Option<super::FairShare>,
    /// The backend a request this limit refuses goes to instead of a 429.
    pub overflow: Option<String>,
    /// The fallback backend this limit belongs to (it applies only to requests sent there).
    pub backend: Option<String>,
}

/// What a limit counts, and how much of it it allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Requests per window.
    Requests(u64),
    /// Tokens per window: all of them, or one part (`count`).
    Tokens { amount: u64, count: TokenCount },
    /// Money per window.
    Usd { micro: u64 },
    /// Requests in flight at once.
    Concurrency(u64),
}

impl Measure {
    pub fn dimension(self) -> Dimension {
        match self {
            Measure::Requests(_) => Dimension::Requests,
            Measure::Tokens { .. } => Dimension::Tokens,
            Measure::Usd { .. } => Dimension::Cost,
            Measure::Concurrency(_) => Dimension::Concurrency,
        }
    }

    /// The amount, in the unit Redis counts: requests, tokens, micro-dollars, slots.
    pub fn capacity(self) -> u64 {
        match self {
            Measure::Requests(n) | Measure::Tokens { amount: n, .. } | Measure::Concurrency(n) => n,
            Measure::Usd { micro } => micro,
        }
    }
}

/// Which of a request's tokens a token limit counts (`limits[].count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenCount {
    /// Input and output.
    #[default]
    Total,
    /// Input (prompt) tokens, those read from a prompt cache included.
    Input,
    /// Output (completion) tokens.
    Output,
    /// Input tokens the provider reports as read from its prompt cache. Unknown until the
    /// reply: reserved as 0, taken at settlement (see `TokenCount::reserved`).
    CachedInput,
}

impl TokenCount {
    /// What a request reserves against a limit of this count, from its estimate. Cached
    /// input is unknown before the reply, and reserving the whole prompt would refuse
    /// requests that never touch the cache, so it reserves nothing: such a limit refuses
    /// while its budget is overdrawn by earlier settlements, and concurrent requests may
    /// overdraw it by what they read from the cache.
    pub fn reserved(self, estimate: TokenCounts) -> u64 {
        match self {
            TokenCount::Total => estimate.total(),
            TokenCount::Input => estimate.prompt,
            TokenCount::Output => estimate.output,
            TokenCount::CachedInput => 0,
        }
    }

    /// What a request used of this count: `used` as settled, `cached` of its input read
    /// from the provider's prompt cache.
    pub fn used(self, used: TokenCounts, cached: u64) -> u64 {
        match self {
            TokenCount::CachedInput => cached.min(used.prompt),
            other => other.reserved(used),
        }
    }

    /// How 429 messages name these tokens.
    pub fn name(self) -> &'static str {
        match self {
            TokenCount::Total => "tokens",
            TokenCount::Input => "input tokens",
            TokenCount::Output => "output tokens",
            TokenCount::CachedInput => "cached input tokens",
        }
    }

    /// OpenAI's `error.type` of a 429 for these tokens (`tokens`, as OpenAI's own, for all).
    pub fn error_type(self) -> &'static str {
        match self {
            TokenCount::Total => "tokens",
            TokenCount::Input => "input_tokens",
            TokenCount::Output => "output_tokens",
            TokenCount::CachedInput => "cached_input_tokens",
        }
    }

    /// What the request's reservation against such a limit is made of, for 429s.
    pub fn reservation(self) -> &'static str {
        match self {
            TokenCount::Total => "prompt and completion allowance",
            TokenCount::Input => "its prompt",
            TokenCount::Output => "its completion allowance",
            TokenCount::CachedInput => "none until the reply says",
        }
    }
}

/// What a limit counts, without the amount: how headers and 429s speak of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dimension {
    Requests,
    Tokens,
    Concurrency,
    /// Money, in micro-dollars.
    Cost,
}

impl Dimension {
    /// As OpenAI names it in headers and error types.
    pub fn name(self) -> &'static str {
        match self {
            Dimension::Requests => "requests",
            Dimension::Tokens => "tokens",
            Dimension::Concurrency => "concurrency",
            Dimension::Cost => "cost",
        }
    }
}

impl Limit {
    pub fn dimension(&self) -> Dimension {
        self.measure.dimension()
    }

    /// The tokens a token limit counts; `None` for every other limit.
    pub fn token_count(&self) -> Option<TokenCount> {
        match self.measure {
            Measure::Tokens { count, .. } => Some(count),
            _ => None,
        }
    }

    /// The budget: requests, tokens or micro-dollars per window, or requests at once.
    pub fn capacity(&self) -> u64 {
        self.measure.capacity()
    }

    /// The refill window; for a concurrency limit, how long a slot lives unrenewed.
    pub fn window_ms(&self) -> u64 {
        duration_ms(self.window)
    }

    /// The window at `now_ms`: a calendar budget's is the length of the period `now_ms`
    /// is in (a day of 23 hours, a February), any other limit's its `window`.
    pub fn window_ms_at(&self, now_ms: u64) -> u64 {
        let bounds = self.period_bounds_ms(now_ms);
        Calendar::period_at(&bounds, now_ms as f64).map_or(self.window_ms(), |(start, end)| end - start)
    }

    /// A calendar budget's period boundaries around `now_ms` (see `Calendar::bounds_ms`),
    /// as a charge, a settlement or a peek of it carries them; empty for other limits.
    pub fn period_bounds_ms(&self, now_ms: u64) -> Vec<u64> {
        self.calendar.as_ref().map_or_else(Vec::new, |calendar| calendar.bounds_ms(now_ms))
    }

    /// How messages say the window: `1m0s`, or `calendar month (Europe/Amsterdam)`.
    pub fn window_name(&self) -> String {
        match &self.calendar {
            Some(calendar) => calendar.describe(),
            None => crate::duration::format_reset(self.window_ms()),
        }
    }

    /// Whether a request for `model` (empty: unknown) from a tenant of `tier` is charged
    /// against this limit.
    /// Whether the limit counts a request bound for `backend` (`None`: the primary route).
    /// The primary's are the limits of no fallback; a fallback's are its own and the ones
    /// shared by every route (neither a fallback's nor overflowing: a tenant's budget), not
    /// the limits that send requests away.
    pub fn counts_on(&self, backend: Option<&str>) -> bool {
        match backend {
            None => self.backend.is_none(),
            Some(backend) => {
                self.backend.as_deref() == Some(backend) || (self.backend.is_none() && self.overflow.is_none())
            }
        }
    }

    pub fn applies_to(&self, model: &str, tier: &str) -> bool {
        (self.models.is_empty() || self.models.iter().any(|pattern| glob_match(pattern, model)))
            && self.applies_to_tier(tier)
    }

    /// Whether the limit applies to `tier`, whatever the model: for a request whose
    /// model cannot be known, charged under every model's limits.
    pub fn applies_to_tier(&self, tier: &str) -> bool {
        self.tiers.is_empty() || self.tiers.iter().any(|t| t == tier)
    }
}

/// Concurrency slots.
#[derive(Debug, Clone)]
pub struct Slots {
    /// How long a slot lives unless renewed.
    pub ttl: Duration,
}

/// How prompts are counted, completions estimated, and reservations settled.
#[derive(Debug, Clone)]
pub struct TokenPolicy {
    pub default_encoding: Encoding,
    /// The rules a model is matched against, in order: the operator's (`tokens.models`),
    /// then the built-in OpenAI families; `catch_all` takes every other model. A model's
    /// rule decides how it is counted and capped, and keys what the proxy learns about
    /// it, so that is bounded by the config, never by the model names clients send.
    pub rules: Vec<ModelPolicy>,
    pub catch_all: ModelPolicy,
    pub default_max_output: u64,
    pub output_estimate_factor: f64,
    pub unparsed_request_cost: u64,
    pub unreadable_body: UnreadableBody,
    pub max_request_bytes: u64,
    pub reservation_ttl: Duration,
    pub on_upstream_error: UpstreamErrorCharge,
    pub request_stream_usage: bool,
    pub on_client_abort: crate::accounting::reply_floor::ClientAbortCharge,
    /// Models whose streams without usage are charged at least their reservation.
    pub hidden_output_models: Vec<String>,
    pub clamp_max_tokens: bool,
    pub min_output_tokens: u64,
    pub warm_up: bool,
    /// Learn prompt factors and completion priors per rule from settled replies.
    pub calibrate: bool,
    /// Exchange what is learned with the other proxies of the domain (only with `calibrate`).
    pub share_calibration: bool,
}

/// One model rule with what the policy adds to it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelPolicy {
    pub rule: ModelRule,
    /// Other patterns the rule's models are named by (a built-in family's other spellings:
    /// Azure's `gpt-35*` for `gpt-3.5*`); an operator's rule has none.
    pub also: &'static [&'static str],
    /// The completion length assumed for a tenant with no history of its own (the rule's
    /// `expected_output`, else `tokens.default_expected_output`), until the proxy has
    /// learned the model's.
    pub expected_output: Option<u64>,
    /// Names the rule in metrics (the `model_rule` label): its pattern without wildcards,
    /// unique among the rules.
    pub label: String,
    /// Written by the operator (not built in).
    pub configured: bool,
}

impl ModelPolicy {
    /// Whether `model` is one of the rule's: its pattern or one of its other spellings.
    pub fn matches(&self, model: &str) -> bool {
        glob_match(&self.rule.pattern, model) || self.also.iter().any(|pattern| glob_match(pattern, model))
    }
}

impl TokenPolicy {
    /// The rule that applies to `model` (none: the catch-all), with its index: the
    /// operator's first match, then the built-in OpenAI families, then the catch-all.
    pub fn rule_for(&self, model: Option<&str>) -> (usize, &ModelPolicy) {
        let model = model.unwrap_or("");
        self.rules
            .iter()
            .enumerate()
            .find(|(_, policy)| policy.matches(model))
            .unwrap_or((self.rules.len(), &self.catch_all))
    }

    /// Every rule with its index, the catch-all last: as many as the config has, so what
    /// is kept per rule is bounded.
    pub fn all_rules(&self) -> impl Iterator<Item = (usize, &ModelPolicy)> {
        self.rules.iter().chain(std::iter::once(&self.catch_all)).enumerate()
    }

    /// The rule at `index` (out of range: the catch-all).
    pub fn rule(&self, index: usize) -> &ModelPolicy {
        self.rules.get(index).unwrap_or(&self.catch_all)
    }
}

/// The rules a policy matches models against: `configured` (with each rule's prior), then
/// the built-in families; and the catch-all for every other model.
pub(super) fn model_policies(
    configured: Vec<(ModelRule, Option<u64>)>,
    default_encoding: Encoding,
    default_expected_output: Option<u64>,
) -> (Vec<ModelPolicy>, ModelPolicy) {
    let mut labels = std::collections::BTreeSet::new();
    let mut policy =
        |rule: ModelRule, also: &'static [&'static str], expected_output: Option<u64>, configured: bool| {
            let base = metric_label(&rule.pattern);
            let label =
                (1..).map(|n| if n == 1 { base.clone() } else { format!("{base}_{n}") }).find(|l| !labels.contains(l));
            let label = label.unwrap_or(base);
            labels.insert(label.clone());
            ModelPolicy { rule, also, expected_output: expected_output.or(default_expected_output), label, configured }
        };
    let mut rules: Vec<ModelPolicy> =
        configured.into_iter().map(|(rule, expected)| policy(rule, &[], expected, true)).collect();
    rules.extend(builtin_families().into_iter().map(|family| policy(family.rule, family.also, None, false)));
    let every_model = ModelRule { pattern: "*".into(), encoding: default_encoding, factor: 1.0, max_output: None };
    let mut catch_all = policy(every_model, &[], None, false);
    catch_all.label = "other".into();
    (rules, catch_all)
}

/// A model pattern as a `model_rule` label value: the pattern without its wildcards
/// (`gpt-4.1*` is `gpt-4.1`, `claude-*` is `claude`), so a label always reads as the rule's
/// `match`. Characters the label encoding (`model_rule=.=<value>;.;`) or Envoy's
/// dot-separated stat names would misread (`;`, `=`, a leading, trailing or repeated `.`)
/// become `_`.
fn metric_label(pattern: &str) -> String {
    let mut label = String::with_capacity(pattern.len());
    for c in pattern.chars().filter(|c| *c != '*') {
        let keeps = c.is_ascii_alphanumeric() || c == '-' || (c == '.' && !label.is_empty() && !label.ends_with('.'));
        label.push(if keeps { c.to_ascii_lowercase() } else { '_' });
    }
    let label = label.trim_matches(['-', '_', '.']);
    if label.is_empty() || label == "other" {
        "rule".to_string()
    } else {
        label.to_string()
    }
}

/// The degraded mode: how the proxy decides alone, and when it stops asking.
#[derive(Debug, Clone)]
pub struct Fallback {
    /// How many proxy instances share the limits: each decides alone with this share.
    pub instances: u32,
    /// Consecutive failed callouts that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker keeps every decision local before one request probes.
    pub breaker_cooldown: Duration,
}

/// Leased budgets.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub enabled: bool,
    /// How long a grant lives.
    pub ttl: Duration,
    pub low_water: f64,
    pub initial_fraction: f64,
    pub max_fraction: f64,
    /// The most of what a tenant has left that one grant may take.
    pub share: f64,
}

impl Policy {
    /// How leases are sized and renewed: a renewal, once asked, is awaited for as long as
    /// its callout may take (the companion's timeout, and a tick for the host's timer to
    /// fire), so a proxy never has two renewals of one lease entry out at once.
    pub fn lease_policy(&self) -> LeasePolicy {
        let lease = &self.lease;
        LeasePolicy {
            ttl_ms: duration_ms(lease.ttl),
            low_water: lease.low_water,
            initial_fraction: lease.initial_fraction,
            max_fraction: lease.max_fraction,
            renewal_wait_ms: duration_ms(self.companion.timeout) + RENEWAL_MARGIN_MS,
        }
    }
}

/// What a renewal's marker outlasts its callout's timeout by: the host fires timeouts
/// on its own timer, up to about a tick late.
const RENEWAL_MARGIN_MS: u64 = 100;

/// Requests never limited.
#[derive(Debug, Clone, Default)]
pub struct Bypass {
    /// Tenant ids, never credentials.
    pub tenants: Vec<String>,
    /// Request path patterns, `*` matching any run of characters.
    pub paths: Vec<String>,
}

impl Bypass {
    /// Whether `path`, normalised (`crate::parse::path::normalised`), is bypassed: the path the
    /// request is routed on, so `/v1/models*` cannot match `/v1/models/../chat/completions`.
    pub fn path(&self, path: &str) -> bool {
        self.paths.iter().any(|pattern| glob_match(pattern, path))
    }

    pub fn tenant(&self, tenant: &str) -> bool {
        self.tenants.iter().any(|t| t == tenant)
    }
}

/// A price-table entry: a model pattern and its price.
#[derive(Debug, Clone)]
pub struct PriceEntry {
    /// Model name, `*` matching any run of characters.
    pub pattern: String,
    pub price: Price,
}

/// A model's price, in US dollars per million tokens: so also micro-dollars per token.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input: f64,
    pub output: f64,
    /// Input read from the provider's prompt cache, where it reports it; `input` if unset.
    #[serde(default)]
    pub cached_input: Option<f64>,
}

impl Price {
    /// What `usage` costs, in micro-dollars, rounded up.
    pub fn micro_usd(&self, usage: TokenCounts) -> u64 {
        self.micro_usd_cached(usage, 0)
    }

    /// What `usage` costs when `cached` of its input came from the prompt cache.
    pub fn micro_usd_cached(&self, usage: TokenCounts, cached: u64) -> u64 {
        let cached = cached.min(usage.prompt);
        let fresh = (usage.prompt - cached) as f64 * self.input;
        let from_cache = cached as f64 * self.cached_input.unwrap_or(self.input);
        (fresh + from_cache + usage.output as f64 * self.output).ceil().max(0.0) as u64
    }
}

/// Where a tenant's tier comes from.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// The request header carrying the tier, in lower case.
    pub header: String,
    /// The tier of a request whose header is missing or names no known tier.
    pub default: String,
    /// Per-tenant overrides: tenant id → tier.
    pub tenants: BTreeMap<String, String>,
}

/// Waiting for capacity instead of an instant 429.
#[derive(Debug, Clone)]
pub struct QueueConfig {
    /// The longest a request waits for capacity; zero: no queueing.
    pub max_wait: Duration,
    /// The most requests one proxy keeps waiting at once.
    pub max_length: u32,
    /// The most of them one tenant's waiters may be (`queue.tenant_share` of
    /// `max_length`, at least 1).
    pub max_per_tenant: u32,
    /// A request header carrying a priority 0 to 9, in lower case.
    pub priority_header: Option<String>,
    pub default_priority: u8,
    /// Priorities by tenant tier, for requests whose header does not say.
    pub tier_priorities: BTreeMap<String, u8>,
    /// How much waiting one priority level is worth.
    pub aging: Duration,
}

impl QueueConfig {
    pub fn enabled(&self) -> bool {
        !self.max_wait.is_zero()
    }
}

/// A secret from config: never printed, not even by `Debug`.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Secret {
        Secret(value)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// Written out (`check-config --print-effective`) as a marker, never the value.
impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

/// What stands for a secret wherever a config is written out.
pub const REDACTED: &str = "(redacted)";

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Whole milliseconds, as the wire protocol and Redis count them. Policy durations are
/// at most 366 days, far inside `u64`.
fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_turn_usage_into_micro_dollars() {
        // gpt-4o-like: $2.50 in, $10 out per million tokens.
        let price = Price { input: 2.5, output: 10.0, cached_input: Some(1.25) };
        assert_eq!(price.micro_usd(TokenCounts { prompt: 1000, output: 500 }), 7_500);
        // 400 of the 1,000 prompt tokens came from the cache, at half price.
        assert_eq!(price.micro_usd_cached(TokenCounts { prompt: 1000, output: 500 }, 400), 7_000);
        assert_eq!(price.micro_usd_cached(TokenCounts { prompt: 10, output: 0 }, 99), 13, "cached never exceeds input");
        assert_eq!(price.micro_usd(TokenCounts { prompt: 1, output: 0 }), 3, "rounded up");
    }

    #[test]
    fn each_measure_has_its_dimension_and_capacity() {
        let cases = [
            (Measure::Requests(20), Dimension::Requests, 20),
            (Measure::Tokens { amount: 10_000, count: TokenCount::Input }, Dimension::Tokens, 10_000),
            (Measure::Usd { micro: 5_000_000 }, Dimension::Cost, 5_000_000),
            (Measure::Concurrency(4), Dimension::Concurrency, 4),
        ];
        for (measure, dimension, capacity) in cases {
            assert_eq!((measure.dimension(), measure.capacity()), (dimension, capacity), "{measure:?}");
        }
    }
}
