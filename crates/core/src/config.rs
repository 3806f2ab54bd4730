//! The filter's configuration: the JSON an operator puts in the proxy's plugin
//! configuration. Parsing rejects unknown fields; every error names the field (as a path
//! such as `limits[0].window`) and the bad value, so the proxy refuses a bad config with a
//! message that says what to fix.

use crate::duration::parse_duration;
use crate::identity::{is_tenant_id, IdentitySource, MissingIdentity};
use crate::lease::LeasePolicy;
use crate::protocol::LimitKind;
use crate::reservation::{TokenEstimate, UpstreamErrorCharge};
use crate::tokens::{builtin_rules, glob_match, Encoding, ModelRule};
use serde::{Deserialize, Deserializer};
use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the companion (the service that runs the Lua scripts in Redis) is reached.
    pub companion: Companion,
    /// Namespace of this config's counters in Redis: configs with the same domain and limit
    /// names share budgets (that is how several proxies hold one global limit).
    #[serde(default = "default_domain")]
    pub domain: String,
    #[serde(default)]
    pub identity: Identity,
    /// What to do with a request when the companion fails or does not answer in time.
    #[serde(default)]
    pub failure_mode: FailureMode,
    /// Every request is charged against each of these, all or nothing.
    pub limits: Vec<Limit>,
    #[serde(default)]
    pub tokens: TokenPolicy,
    #[serde(default)]
    pub slots: Slots,
    #[serde(default)]
    pub tier: Option<TierConfig>,
    /// Prices for cost limits, tried in order.
    #[serde(default)]
    pub prices: Vec<PriceEntry>,
    #[serde(default)]
    pub mode: Mode,
    /// Which header conventions responses carry (`Retry-After` is always on a 429).
    #[serde(default = "default_header_styles")]
    pub headers: Vec<HeaderStyle>,
    #[serde(default)]
    pub bypass: Bypass,
    #[serde(default)]
    pub queue: QueueConfig,
    #[serde(default)]
    pub fallback: Fallback,
    #[serde(default)]
    pub lease: LeaseConfig,
    /// Hold the request headers while the body is read and the decision made (needs
    /// Envoy's `allow_on_headers_stop_iteration: true`). Turn off on hosts that cannot
    /// read a body while the headers wait: the headers then go upstream first and the body
    /// waits for the decision.
    #[serde(default = "yes")]
    pub hold_request_headers: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Companion {
    /// The callout target, taken verbatim: an Envoy cluster name, or `host:port` on hosts
    /// such as ngx_wasm_module.
    pub upstream: String,
    /// `:authority` of the callout; defaults to `upstream`.
    #[serde(default)]
    pub authority: Option<String>,
    /// Shared secret the companion requires in `x-llmrl-token`.
    pub token: Secret,
    #[serde(default = "default_companion_timeout")]
    pub timeout: ConfigDuration,
}

impl Companion {
    pub fn authority(&self) -> &str {
        self.authority.as_deref().unwrap_or(&self.upstream)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// Headers tried in order; the first present one identifies the tenant.
    #[serde(default = "default_identity_sources")]
    pub sources: Vec<IdentitySource>,
    #[serde(default)]
    pub missing: MissingIdentity,
}

impl Default for Identity {
    fn default() -> Self {
        Identity { sources: default_identity_sources(), missing: MissingIdentity::default() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
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

/// The degraded mode: how the proxy decides alone, and when it stops asking.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fallback {
    /// How many proxy instances share the limits: each decides alone with this share.
    pub instances: u32,
    /// Consecutive failed callouts that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker keeps every decision local before one request probes.
    pub breaker_cooldown: ConfigDuration,
}

impl Default for Fallback {
    fn default() -> Self {
        Fallback { instances: 1, breaker_failures: 3, breaker_cooldown: ConfigDuration(Duration::from_millis(500)) }
    }
}

/// Leased budgets: most requests are admitted from a block of budget this proxy holds,
/// with no callout.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeaseConfig {
    pub enabled: bool,
    /// How long a grant lives; what is left then goes back to Redis.
    pub ttl: ConfigDuration,
    /// Renew when less than this fraction of the last grant is left.
    pub low_water: f64,
    /// The first grant, as a fraction of the limit.
    pub initial_fraction: f64,
    /// The largest grant, as a fraction of the limit.
    pub max_fraction: f64,
    /// The most of what a tenant has left that one grant may take.
    pub share: f64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            enabled: false,
            ttl: ConfigDuration(Duration::from_secs(10)),
            low_water: 0.2,
            initial_fraction: 0.02,
            max_fraction: 0.1,
            share: 0.5,
        }
    }
}

impl LeaseConfig {
    pub fn policy(&self) -> LeasePolicy {
        LeasePolicy {
            ttl_ms: self.ttl.0.as_millis() as u64,
            low_water: self.low_water,
            initial_fraction: self.initial_fraction,
            max_fraction: self.max_fraction,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Names the counter in Redis and in headers and 429 bodies.
    pub name: String,
    /// Requests admitted per `window` (set this or `tokens`).
    #[serde(default)]
    pub requests: Option<u64>,
    /// Tokens (prompt and completion) admitted per `window` (set this or `requests`).
    #[serde(default)]
    pub tokens: Option<u64>,
    /// Requests in flight at once, across all proxies (no `window`: a slot is held until
    /// the response ends, or for `slots.ttl` if its proxy stops renewing it).
    #[serde(default)]
    pub concurrency: Option<u64>,
    /// US dollars per `window`, priced with `prices` (set this or `requests`, `tokens`,
    /// `concurrency`). Held in micro-dollars.
    #[serde(default)]
    pub usd: Option<f64>,
    /// The time in which a spent budget refills completely (requests and tokens limits).
    /// For a concurrency limit, set by validation to `slots.ttl`.
    #[serde(default)]
    pub window: Option<ConfigDuration>,
    /// Models this limit applies to (`*` matches any run of characters: `gpt-4o*`); empty:
    /// every request.
    #[serde(default)]
    pub models: Vec<String>,
    /// Tenant tiers this limit applies to (see `tier`); empty: every tier.
    #[serde(default)]
    pub tiers: Vec<String>,
    /// How a requests or tokens limit counts its window.
    #[serde(default)]
    pub algorithm: Algorithm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Refills continuously: bursts up to the limit, then the refill rate.
    #[default]
    TokenBucket,
    /// At most the limit in any window, exactly (no double burst at a boundary).
    SlidingWindow,
}

/// What a limit counts.
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
        if self.tokens.is_some() {
            Dimension::Tokens
        } else if self.concurrency.is_some() {
            Dimension::Concurrency
        } else if self.usd.is_some() {
            Dimension::Cost
        } else {
            Dimension::Requests
        }
    }

    /// The budget: requests or tokens per window, or requests at once.
    pub fn capacity(&self) -> u64 {
        let micro_usd = self.usd.map(|usd| (usd * 1e6).round() as u64);
        self.tokens.or(self.requests).or(self.concurrency).or(micro_usd).unwrap_or(0)
    }

    /// The refill window; for a concurrency limit, how long a slot lives unrenewed.
    pub fn window_ms(&self) -> u64 {
        self.window.map_or(0, |w| w.0.as_millis() as u64)
    }

    /// Whether a request for `model` (empty: unknown) from a tenant of `tier` is charged
    /// against this limit.
    pub fn applies_to(&self, model: &str, tier: &str) -> bool {
        (self.models.is_empty() || self.models.iter().any(|pattern| glob_match(pattern, model)))
            && (self.tiers.is_empty() || self.tiers.iter().any(|t| t == tier))
    }

    /// What this limit is in Redis.
    pub fn kind(&self) -> LimitKind {
        match (self.dimension(), self.algorithm) {
            (Dimension::Concurrency, _) => LimitKind::Slots,
            (_, Algorithm::SlidingWindow) => LimitKind::SlidingWindow,
            (_, Algorithm::TokenBucket) => LimitKind::TokenBucket,
        }
    }
}

/// A price-table entry: a model pattern and its price.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceEntry {
    /// Model name, `*` matching any run of characters.
    #[serde(rename = "match")]
    pub pattern: String,
    /// US dollars per million input (prompt) and output (completion) tokens.
    #[serde(flatten)]
    pub price: Price,
}

/// A model's price, in US dollars per million tokens: so also micro-dollars per token.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
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
    pub fn micro_usd(&self, usage: TokenEstimate) -> u64 {
        self.micro_usd_cached(usage, 0)
    }

    /// What `usage` costs when `cached` of its input came from the prompt cache.
    pub fn micro_usd_cached(&self, usage: TokenEstimate, cached: u64) -> u64 {
        let cached = cached.min(usage.prompt);
        let fresh = (usage.prompt - cached) as f64 * self.input;
        let from_cache = cached as f64 * self.cached_input.unwrap_or(self.input);
        (fresh + from_cache + usage.output as f64 * self.output).ceil().max(0.0) as u64
    }
}

/// Where a tenant's tier comes from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConfig {
    /// A request header carrying the tier, set by something the operator trusts (a JWT
    /// filter copying a claim, say); a client must not be able to set it.
    pub header: String,
    /// The tier of a request whose header is missing or names no known tier.
    pub default: String,
    /// Per-tenant overrides: tenant id → tier, before the header (a tier of its own gives
    /// a tenant limits of its own).
    #[serde(default)]
    pub tenants: std::collections::BTreeMap<String, String>,
}

/// Whether decisions are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderStyle {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (and `-concurrency`).
    Openai,
    /// `RateLimit-Policy` and `RateLimit` (IETF draft).
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` for the most
    /// restrictive limit.
    Classic,
}

fn default_header_styles() -> Vec<HeaderStyle> {
    vec![HeaderStyle::Openai, HeaderStyle::Ietf]
}

/// Requests never limited.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Bypass {
    /// Tenant ids (as the filter derives them: the first 32 hex digits of SHA-256 over
    /// "llm-ratelimit/tenant/v1\0" and the credential; `anonymous` for the pooled tenant).
    pub tenants: Vec<String>,
    /// Request paths, `*` matching any run of characters (`/v1/models*`).
    pub paths: Vec<String>,
}

impl Bypass {
    pub fn path(&self, path: &str) -> bool {
        let path = path.split(['?', '#']).next().unwrap_or("");
        self.paths.iter().any(|pattern| glob_match(pattern, path))
    }

    pub fn tenant(&self, tenant: &str) -> bool {
        self.tenants.iter().any(|t| t == tenant)
    }
}

/// Waiting for capacity instead of an instant 429.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// The longest a request waits for capacity; "0s" turns queueing off. A request whose
    /// retry time is already beyond it is refused at once.
    pub max_wait: ConfigDuration,
    /// The most requests one proxy keeps waiting at once; more are refused at once.
    pub max_length: u32,
    /// A request header carrying a priority 0 (lowest) to 9 (highest), if the operator
    /// lets clients choose.
    pub priority_header: Option<String>,
    /// The priority of requests that do not say.
    pub default_priority: u8,
    /// Priorities by tenant tier (see `tier`), for requests whose header does not say.
    pub tier_priorities: std::collections::BTreeMap<String, u8>,
    /// How much waiting one priority level is worth: a lower priority request moves up as
    /// it waits, so it is never starved.
    pub aging: ConfigDuration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_wait: ConfigDuration(Duration::ZERO),
            max_length: 1000,
            priority_header: None,
            default_priority: 5,
            tier_priorities: std::collections::BTreeMap::new(),
            aging: ConfigDuration(Duration::from_secs(1)),
        }
    }
}

impl QueueConfig {
    pub fn enabled(&self) -> bool {
        !self.max_wait.0.is_zero()
    }
}

/// Concurrency slots.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Slots {
    /// How long a slot lives unless renewed: the filter renews the slots of live requests
    /// every third of this, so a slot outlives a crashed proxy by at most this long.
    pub ttl: ConfigDuration,
}

impl Default for Slots {
    fn default() -> Self {
        Slots { ttl: ConfigDuration(Duration::from_secs(30)) }
    }
}

/// How prompts are counted, completions estimated, and reservations settled.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenPolicy {
    /// Encoding for models no rule matches.
    pub default_encoding: Encoding,
    /// Tried in order before the built-in OpenAI families; the first match wins.
    pub models: Vec<ModelRule>,
    /// Output cap assumed when neither the request nor a model rule sets one.
    pub default_max_output: u64,
    /// The completion estimate is `min(max_output, factor x this tenant's running
    /// average completion for the model)`.
    pub output_estimate_factor: f64,
    /// Tokens charged for a request whose body cannot be read (unknown path, not JSON).
    pub unparsed_request_cost: u64,
    /// Largest request body read for counting; a larger one is answered 413.
    pub max_request_bytes: u64,
    /// How long a reservation waits for its settlement before the estimate stands.
    pub reservation_ttl: ConfigDuration,
    /// What an upstream error (status >= 400) is charged.
    pub on_upstream_error: UpstreamErrorCharge,
    /// Add `stream_options.include_usage` to streamed OpenAI chat requests that lack it
    /// (and remove the extra usage chunk from what the client receives).
    pub request_stream_usage: bool,
    /// Reserve each request's true upper bound (prompt + output cap), shrunk to what the
    /// tenant has left if need be, and set the request's output cap to match: the limit
    /// then holds exactly, whatever the completions turn out to be.
    pub clamp_max_tokens: bool,
    /// With clamping, the smallest output allowance worth admitting a request with.
    pub min_output_tokens: u64,
    /// Build the vocabularies on the first timer tick rather than on the first request.
    pub warm_up: bool,
}

impl Default for TokenPolicy {
    fn default() -> Self {
        TokenPolicy {
            default_encoding: Encoding::O200kBase,
            models: Vec::new(),
            default_max_output: 4096,
            output_estimate_factor: 1.5,
            unparsed_request_cost: 1000,
            max_request_bytes: 1 << 20,
            reservation_ttl: ConfigDuration(Duration::from_secs(15 * 60)),
            on_upstream_error: UpstreamErrorCharge::default(),
            request_stream_usage: false,
            clamp_max_tokens: false,
            min_output_tokens: 64,
            warm_up: true,
        }
    }
}

/// The rule that applies to a model: the operator's first match, then the built-in
/// OpenAI families, then the default encoding.
pub fn model_rule(policy: &TokenPolicy, model: Option<&str>) -> ModelRule {
    let model = model.unwrap_or("");
    policy
        .models
        .iter()
        .find(|rule| glob_match(&rule.pattern, model))
        .cloned()
        .or_else(|| builtin_rules().into_iter().find(|rule| glob_match(&rule.pattern, model)))
        .unwrap_or(ModelRule { pattern: "*".into(), encoding: policy.default_encoding, factor: 1.0, max_output: None })
}

/// A duration written as a string (`"250ms"`, `"1m"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigDuration(pub Duration);

impl<'de> Deserialize<'de> for ConfigDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        parse_duration(&text).map(ConfigDuration).map_err(serde::de::Error::custom)
    }
}

/// A secret from config: never printed, not even by `Debug`.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `limits[0].window`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid filter config: field `{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

fn yes() -> bool {
    true
}

fn default_domain() -> String {
    "llm".to_string()
}

fn default_companion_timeout() -> ConfigDuration {
    ConfigDuration(Duration::from_millis(50))
}

fn default_identity_sources() -> Vec<IdentitySource> {
    vec![
        IdentitySource { header: "authorization".into(), prefix: Some("Bearer ".into()) },
        IdentitySource { header: "x-api-key".into(), prefix: None },
    ]
}

/// Names that end up in Redis keys and headers: short, and free of the characters that
/// carry meaning there (`{}` are Redis Cluster hash tags, `:` separates key parts).
fn check_name(field: &str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(field, format!("{name:?} is not a valid name: use 1 to 32 of a-z, 0-9, '_', '-'")))
    }
}

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        let mut config: Config = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." { "(top level)".to_string() } else { path };
            invalid(field, e.into_inner().to_string())
        })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&mut self) -> Result<(), ConfigError> {
        if self.companion.upstream.trim().is_empty() {
            return Err(invalid("companion.upstream", "must name the companion's cluster (Envoy) or host:port"));
        }
        if self.companion.token.expose().is_empty() {
            return Err(invalid("companion.token", "must not be empty"));
        }
        let timeout = self.companion.timeout.0;
        if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(60) {
            return Err(invalid("companion.timeout", format!("{timeout:?} is outside 1ms..60s")));
        }
        check_name("domain", &self.domain)?;
        if self.identity.sources.is_empty() {
            return Err(invalid("identity.sources", "must list at least one header"));
        }
        for (i, source) in self.identity.sources.iter_mut().enumerate() {
            let header = source.header.trim().to_ascii_lowercase();
            let valid =
                !header.is_empty() && header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !valid {
                return Err(invalid(
                    format!("identity.sources[{i}].header"),
                    format!("{:?} is not a header name", source.header),
                ));
            }
            source.header = header;
        }
        if self.limits.is_empty() {
            return Err(invalid("limits", "must list at least one limit"));
        }
        let mut names = HashSet::new();
        for (i, limit) in self.limits.iter().enumerate() {
            check_name(&format!("limits[{i}].name"), &limit.name)?;
            if !names.insert(limit.name.as_str()) {
                return Err(invalid(format!("limits[{i}].name"), format!("{:?} is used by another limit", limit.name)));
            }
            let set =
                [limit.requests.is_some(), limit.tokens.is_some(), limit.concurrency.is_some(), limit.usd.is_some()];
            if set.iter().filter(|s| **s).count() != 1 {
                return Err(invalid(
                    format!("limits[{i}]"),
                    "set exactly one of `requests`, `tokens`, `concurrency` and `usd`",
                ));
            }
            if let Some(usd) = limit.usd {
                if !(usd.is_finite() && usd > 0.0 && usd <= 1e9) {
                    return Err(invalid(format!("limits[{i}].usd"), format!("{usd} is outside (0, 1e9]")));
                }
            }
            let field = limit.dimension().name();
            let field = if field == "cost" { "usd" } else { field };
            let amount = limit.capacity();
            if amount == 0 || amount > 1_000_000_000_000 {
                return Err(invalid(format!("limits[{i}].{field}"), format!("{amount} is outside 1..1000000000000")));
            }
            if let Some(at) = limit.models.iter().position(|m| m.is_empty()) {
                return Err(invalid(format!("limits[{i}].models[{at}]"), "must not be empty"));
            }
            if let Some((at, tier)) = limit.tiers.iter().enumerate().find(|(_, t)| check_name("", t).is_err()) {
                return Err(invalid(format!("limits[{i}].tiers[{at}]"), format!("{tier:?} is not a valid tier name")));
            }
            if limit.algorithm == Algorithm::SlidingWindow && limit.dimension() == Dimension::Concurrency {
                return Err(invalid(format!("limits[{i}].algorithm"), "a concurrency limit has no window to slide"));
            }
            if !limit.tiers.is_empty() && self.tier.is_none() {
                return Err(invalid(format!("limits[{i}].tiers"), "needs `tier` (where a tenant's tier comes from)"));
            }
            match (limit.dimension(), limit.window) {
                (Dimension::Concurrency, Some(_)) => {
                    return Err(invalid(
                        format!("limits[{i}].window"),
                        "a concurrency limit has no window (slots live `slots.ttl`)",
                    ))
                }
                (Dimension::Concurrency, None) => {}
                (_, None) => {
                    return Err(invalid(format!("limits[{i}].window"), "required for a requests or tokens limit"))
                }
                (_, Some(ConfigDuration(window))) => {
                    if window < Duration::from_millis(100) || window > Duration::from_secs(366 * 86_400) {
                        return Err(invalid(
                            format!("limits[{i}].window"),
                            format!("{window:?} is outside 100ms..366d"),
                        ));
                    }
                }
            }
        }
        let ttl = self.slots.ttl.0;
        if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(3600) {
            return Err(invalid("slots.ttl", format!("{ttl:?} is outside 1s..1h")));
        }
        for limit in &mut self.limits {
            if limit.dimension() == Dimension::Concurrency {
                limit.window = Some(self.slots.ttl);
            }
        }
        self.validate_tokens()?;
        self.validate_fallback_and_lease()
    }

    fn validate_fallback_and_lease(&self) -> Result<(), ConfigError> {
        let fallback = &self.fallback;
        if fallback.instances == 0 || fallback.instances > 10_000 {
            return Err(invalid("fallback.instances", format!("{} is outside 1..10000", fallback.instances)));
        }
        if fallback.breaker_failures == 0 {
            return Err(invalid("fallback.breaker_failures", "must be positive"));
        }
        let cooldown = fallback.breaker_cooldown.0;
        if cooldown < Duration::from_millis(10) || cooldown > Duration::from_secs(300) {
            return Err(invalid("fallback.breaker_cooldown", format!("{cooldown:?} is outside 10ms..5m")));
        }
        let lease = &self.lease;
        let ttl = lease.ttl.0;
        if ttl < Duration::from_millis(100) || ttl > Duration::from_secs(3600) {
            return Err(invalid("lease.ttl", format!("{ttl:?} is outside 100ms..1h")));
        }
        for (field, value, low, high) in [
            ("lease.low_water", lease.low_water, 0.0, 0.9),
            ("lease.initial_fraction", lease.initial_fraction, 0.0001, 1.0),
            ("lease.max_fraction", lease.max_fraction, 0.0001, 1.0),
            ("lease.share", lease.share, 0.01, 1.0),
        ] {
            if !(value.is_finite() && value > low && value <= high) {
                return Err(invalid(field, format!("{value} is outside ({low}, {high}]")));
            }
        }
        for (i, tenant) in self.bypass.tenants.iter().enumerate() {
            if !is_tenant_id(tenant) {
                return Err(invalid(
                    format!("bypass.tenants[{i}]"),
                    "must be a tenant id (32 lower-case hex digits), not a credential",
                ));
            }
        }
        for (i, path) in self.bypass.paths.iter().enumerate() {
            if !path.starts_with('/') && !path.starts_with('*') {
                return Err(invalid(format!("bypass.paths[{i}]"), format!("{path:?} must start with '/' or '*'")));
            }
        }
        for (i, entry) in self.prices.iter().enumerate() {
            let ok = |v: f64| v.is_finite() && (0.0..=1e6).contains(&v);
            if entry.pattern.is_empty() {
                return Err(invalid(format!("prices[{i}].match"), "must not be empty"));
            }
            if !ok(entry.price.input) || !ok(entry.price.output) {
                return Err(invalid(
                    format!("prices[{i}]"),
                    "input and output must be dollars per million tokens in 0..1e6",
                ));
            }
        }
        if self.limits.iter().any(|l| l.dimension() == Dimension::Cost) && self.prices.is_empty() {
            return Err(invalid(
                "prices",
                "a `usd` limit needs a price table (requests for models it does not list are refused)",
            ));
        }
        if let Some(tier) = &self.tier {
            let header_ok = !tier.header.is_empty()
                && tier.header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !header_ok {
                return Err(invalid("tier.header", format!("{:?} is not a header name", tier.header)));
            }
            if !self.tiers().any(|t| t == tier.default) {
                return Err(invalid("tier.default", format!("{:?} is not a tier any limit names", tier.default)));
            }
            // Entries are named by position: a key may be a credential pasted by mistake,
            // and this message goes to the proxy's log.
            for (at, (tenant, own)) in tier.tenants.iter().enumerate() {
                if !is_tenant_id(tenant) {
                    return Err(invalid(
                        format!("tier.tenants (entry {at})"),
                        "keys must be tenant ids (32 lower-case hex digits), not credentials",
                    ));
                }
                if !self.tiers().any(|t| t == own) {
                    return Err(invalid(
                        format!("tier.tenants (entry {at})"),
                        format!("{own:?} is not a tier any limit names"),
                    ));
                }
            }
        }
        let queue = &self.queue;
        if queue.max_wait.0 > Duration::from_secs(600) {
            return Err(invalid("queue.max_wait", format!("{:?} is outside 0s..10m", queue.max_wait.0)));
        }
        if queue.default_priority > 9 {
            return Err(invalid("queue.default_priority", format!("{} is outside 0..9", queue.default_priority)));
        }
        for (at, (tier, priority)) in queue.tier_priorities.iter().enumerate() {
            if *priority > 9 || !self.tiers().any(|t| t == tier) {
                return Err(invalid(
                    format!("queue.tier_priorities.{tier}"),
                    format!("entry {at}: priority {priority} must be 0..9, for a tier some limit names"),
                ));
            }
        }
        if queue.aging.0 < Duration::from_millis(1) {
            return Err(invalid("queue.aging", "must be positive"));
        }
        if let Some(header) = &queue.priority_header {
            if header.is_empty() || !header.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
                return Err(invalid("queue.priority_header", format!("{header:?} is not a header name")));
            }
        }
        if lease.enabled && queue.enabled() {
            return Err(invalid(
                "lease.enabled",
                "leases and queueing do not combine: a queued request waits in Redis",
            ));
        }
        if lease.enabled && self.limits.iter().any(|l| l.dimension() == Dimension::Concurrency) {
            return Err(invalid(
                "lease.enabled",
                "leases and concurrency limits do not combine: slots are held in Redis",
            ));
        }
        if lease.enabled && self.limits.iter().any(|l| l.algorithm == Algorithm::SlidingWindow) {
            return Err(invalid(
                "lease.enabled",
                "leases and sliding windows do not combine: leases are token buckets",
            ));
        }
        if lease.enabled && self.tokens.clamp_max_tokens {
            return Err(invalid(
                "lease.enabled",
                "leases and tokens.clamp_max_tokens do not combine: clamping needs the exact remainder in Redis",
            ));
        }
        Ok(())
    }

    fn validate_tokens(&self) -> Result<(), ConfigError> {
        let policy = &self.tokens;
        let encodings = std::iter::once(("tokens.default_encoding".to_string(), policy.default_encoding))
            .chain(policy.models.iter().enumerate().map(|(i, r)| (format!("tokens.models[{i}].encoding"), r.encoding)));
        for (field, encoding) in encodings {
            if !encoding.available() {
                return Err(invalid(field, format!("{} is not compiled into this build", encoding.name())));
            }
        }
        for (i, rule) in policy.models.iter().enumerate() {
            if rule.pattern.is_empty() {
                return Err(invalid(format!("tokens.models[{i}].match"), "must not be empty"));
            }
            if !(rule.factor.is_finite() && rule.factor > 0.0 && rule.factor <= 10.0) {
                return Err(invalid(
                    format!("tokens.models[{i}].factor"),
                    format!("{} is outside (0, 10]", rule.factor),
                ));
            }
            if rule.max_output == Some(0) {
                return Err(invalid(format!("tokens.models[{i}].max_output"), "must be positive"));
            }
        }
        if policy.min_output_tokens == 0 {
            return Err(invalid("tokens.min_output_tokens", "must be positive"));
        }
        if policy.default_max_output == 0 {
            return Err(invalid("tokens.default_max_output", "must be positive"));
        }
        let factor = policy.output_estimate_factor;
        if !(factor.is_finite() && (0.1..=10.0).contains(&factor)) {
            return Err(invalid("tokens.output_estimate_factor", format!("{factor} is outside 0.1..10")));
        }
        if policy.max_request_bytes < 1024 || policy.max_request_bytes > 64 << 20 {
            return Err(invalid(
                "tokens.max_request_bytes",
                format!("{} is outside 1024..67108864", policy.max_request_bytes),
            ));
        }
        let ttl = policy.reservation_ttl.0;
        if ttl < Duration::from_secs(1) || ttl > Duration::from_secs(86_400) {
            return Err(invalid("tokens.reservation_ttl", format!("{ttl:?} is outside 1s..1d")));
        }
        Ok(())
    }

    /// Whether any limit needs the request's token estimate (token and cost limits), so
    /// the body must be read and counted.
    pub fn counts_tokens(&self) -> bool {
        self.limits.iter().any(|l| matches!(l.dimension(), Dimension::Tokens | Dimension::Cost))
    }

    /// The price of `model`: the first matching entry of `prices`.
    pub fn price_of(&self, model: &str) -> Option<Price> {
        self.prices.iter().find(|p| glob_match(&p.pattern, model)).map(|p| p.price)
    }

    /// Every tier some limit names.
    pub fn tiers(&self) -> impl Iterator<Item = &str> {
        self.limits.iter().flat_map(|l| l.tiers.iter().map(String::as_str))
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

    /// Whether the request body must be read before deciding: to count tokens, or to
    /// learn the model a per-model limit depends on.
    pub fn reads_body(&self) -> bool {
        self.counts_tokens() || self.limits.iter().any(|l| !l.models.is_empty())
    }

    pub fn has_concurrency(&self) -> bool {
        self.limits.iter().any(|l| l.dimension() == Dimension::Concurrency)
    }

    pub fn limit(&self, name: &str) -> Option<&Limit> {
        self.limits.iter().find(|l| l.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let config = Config::from_json(GOOD.as_bytes()).expect("good config");
        assert_eq!(config.companion.upstream, "companion");
        assert_eq!(config.companion.authority(), "companion");
        assert_eq!(config.companion.timeout.0, Duration::from_millis(250));
        assert_eq!(config.domain, "prod");
        assert_eq!(config.identity.sources, vec![IdentitySource { header: "x-tenant".into(), prefix: None }]);
        assert_eq!(config.identity.missing, MissingIdentity::Anonymous);
        assert_eq!(config.failure_mode, FailureMode::Deny);
        assert_eq!(config.limits.len(), 4);
        let inflight = &config.limits[3];
        assert_eq!(
            (inflight.dimension(), inflight.capacity(), inflight.window_ms()),
            (Dimension::Concurrency, 4, 20_000)
        );
        assert_eq!(inflight.kind(), LimitKind::Slots);
        assert_eq!(config.limits[1].window_ms(), 86_400_000);
        assert_eq!((config.limits[2].dimension(), config.limits[2].capacity()), (Dimension::Tokens, 10_000));
        assert!(config.counts_tokens());
        assert_eq!(config.tokens.models[0].encoding, Encoding::Cl100kBase);
        assert_eq!(config.tokens.reservation_ttl.0, Duration::from_secs(600));
        assert_eq!(model_rule(&config.tokens, Some("claude-3-haiku")).factor, 1.1);
        assert_eq!(model_rule(&config.tokens, Some("gpt-4-turbo")).encoding, Encoding::Cl100kBase);
        assert_eq!(model_rule(&config.tokens, Some("mystery")).encoding, Encoding::O200kBase);
    }

    #[test]
    fn fills_defaults() {
        let json = r#"{"companion": {"upstream": "c", "token": "t"},
                       "limits": [{"name": "rpm", "requests": 1, "window": "1s"}]}"#;
        let config = Config::from_json(json.as_bytes()).expect("minimal config");
        assert_eq!(config.domain, "llm");
        assert_eq!(config.companion.timeout.0, Duration::from_millis(50));
        assert_eq!(config.identity.sources, default_identity_sources());
        assert_eq!(config.identity.missing, MissingIdentity::Reject);
        assert_eq!(config.failure_mode, FailureMode::Local);
        assert_eq!(config.mode, Mode::Enforce);
        assert_eq!(config.headers, vec![HeaderStyle::Openai, HeaderStyle::Ietf]);
        assert!(!config.bypass.path("/v1/chat/completions"));
        assert_eq!(config.fallback.instances, 1);
        assert!(!config.lease.enabled);
        assert!(!config.counts_tokens());
        assert!(config.hold_request_headers);
        assert_eq!(config.tokens.default_encoding, Encoding::O200kBase);
        assert_eq!(config.tokens.on_upstream_error, UpstreamErrorCharge::PromptOnly);
    }

    #[test]
    fn bypass_matches_paths_and_tenant_ids() {
        let json = r#"{"companion": {"upstream": "c", "token": "t"}, "limits": [{"name": "rpm", "requests": 1, "window": "1s"}],
                       "bypass": {"paths": ["/v1/models*", "/healthz"], "tenants": ["0123456789abcdef0123456789abcdef"]}}"#;
        let bypass = Config::from_json(json.as_bytes()).expect("config").bypass;
        assert!(bypass.path("/v1/models") && bypass.path("/v1/models/gpt-4o?x=1") && bypass.path("/healthz"));
        assert!(!bypass.path("/v1/chat/completions") && !bypass.path("/healthz/deep"));
        assert!(bypass.tenant("0123456789abcdef0123456789abcdef") && !bypass.tenant("anonymous"));
    }

    #[test]
    fn tiers_come_from_a_header_with_a_default() {
        let json = r#"{"companion": {"upstream": "c", "token": "t"}, "tier": {"header": "x-tier", "default": "free"},
            "limits": [{"name": "rpm-free", "requests": 2, "window": "1h", "tiers": ["free"]},
                       {"name": "rpm-gold", "requests": 5, "window": "1h", "tiers": ["gold"]},
                       {"name": "tpd", "tokens": 100000, "window": "1d"}]}"#;
        let config = Config::from_json(json.as_bytes()).expect("config");
        assert_eq!(config.tier_of("t", Some("gold")), "gold");
        assert_eq!(config.tier_of("t", Some(" gold ")), "gold");
        assert_eq!(config.tier_of("t", Some("platinum")), "free");
        assert_eq!(config.tier_of("t", None), "free");
        let applying = |tier| {
            config.limits.iter().filter(|l| l.applies_to("m", tier)).map(|l| l.name.as_str()).collect::<Vec<_>>()
        };
        assert_eq!(applying("gold"), ["rpm-gold", "tpd"]);
        assert_eq!(applying("free"), ["rpm-free", "tpd"]);
    }

    /// The README's complete policy loads exactly as written.
    #[test]
    fn the_readme_policy_loads_as_written() {
        let readme = include_str!("../../../README.md");
        let block = readme
            .split("<!-- policy-example -->")
            .nth(1)
            .and_then(|rest| rest.split("```json").nth(1))
            .and_then(|rest| rest.split("```").next())
            .expect("the README's policy example");
        let config = Config::from_json(block.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.domain, "prod");
        assert_eq!(config.tier_of("0f1e2d3c4b5a69788796a5b4c3d2e1f0", Some("free")), "partner");
        assert_eq!(config.tier_of("some-other-tenant-id", Some("pro")), "pro");
        assert_eq!(config.price_of("gpt-4o-mini-2024").map(|p| p.input), Some(0.15));
        assert!(config.limits.iter().any(|l| l.algorithm == Algorithm::SlidingWindow));
        assert!(config.has_concurrency() && config.queue.enabled() && config.counts_tokens());
    }

    #[test]
    fn token_never_shows_in_debug_output() {
        let config = Config::from_json(GOOD.as_bytes()).expect("good config");
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
            (
                format!(r#"{{"companion": {{"upstream": "", "token": "t"}}, {limits}}}"#),
                "companion.upstream",
                "must name",
            ),
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
            (
                format!(r#"{{{companion}, {limits}, "failure_mode": "maybe"}}"#),
                "failure_mode",
                "unknown variant `maybe`",
            ),
            (format!(r#"{{{companion}, {limits}, "domain": "Prod!"}}"#), "domain", "\"Prod!\" is not a valid name"),
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
            (
                format!(r#"{{{companion}, {limits}, "tokens": {{"colour": 1}}}}"#),
                "tokens.colour",
                "unknown field `colour`",
            ),
            (
                format!(r#"{{{companion}, {limits}, "fallback": {{"instances": 0}}}}"#),
                "fallback.instances",
                "0 is outside",
            ),
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
                format!(
                    r#"{{{companion}, "limits": [{{"name": "c", "concurrency": 1, "algorithm": "sliding_window"}}]}}"#
                ),
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
                format!(
                    r#"{{{companion}, "limits": [{{"name": "cc", "concurrency": 2}}], "lease": {{"enabled": true}}}}"#
                ),
                "lease.enabled",
                "concurrency limits do not combine",
            ),
            (
                format!(r#"{{{companion}, {limits}, "queue": {{"max_wait": "1h"}}}}"#),
                "queue.max_wait",
                "outside 0s..10m",
            ),
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
            let err = Config::from_json(json.as_bytes()).expect_err(&json);
            assert_eq!(err.field, field, "{json}: {err}");
            assert!(err.message.contains(fragment), "{json}: {err}");
            assert!(err.to_string().contains(&format!("`{field}`")), "{err}");
            assert!(!err.to_string().contains("SECRET"), "a credential in the config is never echoed: {err}");
        }
    }
}
