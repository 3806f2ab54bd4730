//! The config as operators write it: the JSON in the proxy's plugin configuration, with
//! its defaults. Every struct rejects unknown fields, so a misspelt key is an error rather
//! than a silently ignored setting. Nothing here is checked beyond its JSON type: `compile`
//! turns a `Document` into a `Policy` or says which field is wrong.
//!
//! Values that are used exactly as written (modes, header styles, prices, encodings,
//! identity sources) are the policy's own types, deserialized in place.

use super::error::{invalid, ConfigError};
use super::policy::{FailureMode, HeaderStyle, Mode, Price, Secret, Store, TokenCount, UnknownPaths, UnreadableBody};
use crate::accounting::reservation::UpstreamErrorCharge;
use crate::api::dialect::ErrorFormat;
use crate::api::identity::{IdentitySource, MissingIdentity};
use crate::duration::parse_duration;
use crate::tokens::{self, Encoding};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::time::Duration;

/// The whole plugin configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Document {
    /// Where the limits' counters live: `redis` (the default: through the companion, one
    /// budget for every proxy of the domain) or `local` (this proxy's shared data, across
    /// its workers: no companion, no Redis).
    #[serde(default)]
    pub store: Store,
    /// Where the companion (the service that runs the Lua scripts in Redis) is reached;
    /// required with the `redis` store, refused with `local`.
    #[serde(default)]
    pub companion: Option<Companion>,
    /// Namespace of this config's counters in Redis: configs with the same domain and limit
    /// names share budgets (that is how several proxies hold one global limit).
    #[serde(default = "default_domain")]
    pub domain: String,
    #[serde(default)]
    pub identity: Identity,
    /// What to do with a request when the companion fails or does not answer in time
    /// (unset: `local`; refused with the `local` store, which has no companion to fail).
    #[serde(default)]
    pub failure_mode: Option<FailureMode>,
    /// Every request is charged against each of these, all or nothing.
    pub limits: Vec<Limit>,
    #[serde(default)]
    pub tokens: Tokens,
    #[serde(default)]
    pub slots: Slots,
    #[serde(default)]
    pub tier: Option<Tier>,
    /// Prices for cost limits, tried in order.
    #[serde(default)]
    pub prices: Vec<PriceEntry>,
    #[serde(default)]
    pub mode: Mode,
    /// Which header conventions responses carry (`Retry-After` is always on a 429).
    #[serde(default = "default_header_styles")]
    pub headers: Vec<HeaderStyle>,
    /// Whose shape the filter's own replies (429, 413, 503...) and the `provider` headers
    /// take: `auto`, the caller's API by the request's path, or one fixed.
    #[serde(default)]
    pub error_format: ErrorFormat,
    #[serde(default)]
    pub bypass: Bypass,
    /// What a request on a path no API is recognised in gets.
    #[serde(default)]
    pub unknown_paths: UnknownPaths,
    #[serde(default)]
    pub queue: Queue,
    /// Unset: the defaults; refused with the `local` store.
    #[serde(default)]
    pub fallback: Option<Fallback>,
    #[serde(default)]
    pub lease: Lease,
    #[serde(default)]
    pub memory: Memory,
    /// Reading the provider's own word on its limits (its rate-limit headers and 429s).
    #[serde(default)]
    pub provider_limits: ProviderLimits,
    /// How a refusal tells a client whether waiting helps, and the warning of a budget
    /// running low.
    #[serde(default)]
    pub refusals: Refusals,
    /// Hold the request headers while the body is read and the decision made (Envoy, with
    /// `allow_on_headers_stop_iteration: true`). Unset: held where the host can deliver
    /// the body meanwhile (Envoy), not elsewhere (Nginx), where the body alone waits for
    /// the decision. `true` on a host that cannot is refused at load.
    #[serde(default)]
    pub hold_request_headers: Option<bool>,
    /// Azure OpenAI: deployment name → the model it serves, for paths that name a
    /// deployment rather than a model (`/openai/deployments/{deployment}/...`) and for the
    /// v1 paths' `model`, so per-model limits, prices and model rules apply.
    #[serde(default)]
    pub deployments: BTreeMap<String, String>,
    /// What each request's record (who, what it used and cost, how it was decided) is
    /// published as, for the host's access log: see `lifecycle::record`.
    #[serde(default)]
    pub record: super::policy::RecordMode,
}

impl Document {
    /// Reads the JSON; an error names the field as a path (`limits[0].window`).
    pub fn parse(bytes: &[u8]) -> Result<Document, ConfigError> {
        super::read::from_slice(bytes).map_err(|e| {
            let field = if e.path == "." { "(top level)".to_string() } else { e.path };
            invalid(field, e.message)
        })
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Companion {
    /// The callout target, taken verbatim: an Envoy cluster name, or `host:port` on hosts
    /// such as ngx_wasm_module.
    pub upstream: String,
    /// `:authority` of the callout; defaults to `upstream`.
    #[serde(default)]
    pub authority: Option<String>,
    /// Shared secret the companion requires in `x-llmrl-token`, written in the config.
    /// Exactly one of `token` and `token_env`.
    #[serde(default)]
    pub token: Option<Secret>,
    /// The name of the VM's environment variable holding the secret (on Envoy,
    /// `vm_config.environment_variables`; on Nginx, the `env` directive), read at load:
    /// the secret stays out of the proxy's config dump.
    #[serde(default)]
    pub token_env: Option<String>,
    #[serde(default = "default_companion_timeout")]
    pub timeout: ConfigDuration,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// The operator's own credential headers, all read (two that disagree refuse the
    /// request); when absent, each API's own (see `Provider::credentials`). Header names
    /// are matched case-insensitively.
    #[serde(default)]
    pub sources: Option<Vec<IdentitySource>>,
    #[serde(default)]
    pub missing: MissingIdentity,
}

/// A limit as written: one of `requests`, `tokens`, `concurrency` and `usd` says what it
/// counts and how much.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Names the counter in Redis and in headers and 429 bodies.
    pub name: String,
    /// Requests admitted per `window`.
    #[serde(default)]
    pub requests: Option<u64>,
    /// Tokens (prompt and completion) admitted per `window`.
    #[serde(default)]
    pub tokens: Option<u64>,
    /// Which of a request's tokens a `tokens` limit counts: all (`total`), `input`,
    /// `output` or `cached_input`.
    #[serde(default)]
    pub count: Option<TokenCount>,
    /// Requests in flight at once, across all proxies (no `window`: a slot is held until
    /// the response ends, or for `slots.ttl` if its proxy stops renewing it).
    #[serde(default)]
    pub concurrency: Option<u64>,
    /// US dollars per `window`, priced with `prices`.
    #[serde(default)]
    pub usd: Option<f64>,
    /// The time in which a spent budget refills completely (every limit but concurrency):
    /// a duration (`"1m"`); or a calendar period, a budget full again at each of its
    /// boundaries: `"day"`, `"week"` (from Monday), `"month"` in UTC, or
    /// `{"calendar": "month", "time_zone": "Europe/Amsterdam"}` in an IANA time zone.
    #[serde(default)]
    pub window: Option<Window>,
    /// Models this limit applies to (`*` matches any run of characters: `gpt-4o*`); empty:
    /// every request.
    #[serde(default)]
    pub models: Vec<String>,
    /// Tenant tiers this limit applies to (see `tier`); empty: every tier.
    #[serde(default)]
    pub tiers: Vec<String>,
    /// How a windowed limit counts its window.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// What the limit is counted per: `"tenant"` (default: each API key its own), `"all"`
    /// (one counter for every caller; with `models`, the upstream's quota), or
    /// `{"header": "x-team-id"}` (one per value of a trusted header; `"default"`: the
    /// value of a request without it, else the limit does not apply to that request).
    #[serde(default)]
    pub per: Option<super::per::PerShape>,
    /// `enforce` (default) or `shadow`: charged and reported, never refusing, whatever
    /// the global `mode`.
    #[serde(default)]
    pub mode: Option<super::policy::Mode>,
    /// A shared pool's fair shares among the tenants charging it: when it is scarce, each
    /// active tenant is held to its weighted max-min share (see `crate::config::per`).
    #[serde(default)]
    pub fair_share: Option<FairShareShape>,
    /// Opt-in: a request this limit refuses goes to this backend instead of a 429, by the
    /// request header `x-llm-ratelimit-overflow` the route table (Envoy) or a `map`
    /// (Nginx) matches; it is charged against that backend's limits instead.
    #[serde(default)]
    pub overflow: Option<String>,
    /// The fallback backend this limit belongs to: it applies only to requests overflowed
    /// there (and to no request of the primary route).
    #[serde(default)]
    pub backend: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Refills continuously: bursts up to the limit, then the refill rate.
    #[default]
    TokenBucket,
    /// At most the limit in any window, exactly (no double burst at a boundary).
    SlidingWindow,
}

/// A limit's `window` as written: a duration, or a calendar period (see `Limit::window`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Window {
    Duration(ConfigDuration),
    Calendar(CalendarWindow),
}

/// A calendar period, in a time zone (none: UTC).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CalendarWindow {
    pub calendar: crate::accounting::calendar::Period,
    #[serde(default)]
    pub time_zone: Option<String>,
}

/// As written: a duration or a period in UTC as a string, a zoned period as an object.
impl Serialize for Window {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Window::Duration(duration) => duration.serialize(serializer),
            Window::Calendar(CalendarWindow { calendar, time_zone: None }) => calendar.serialize(serializer),
            Window::Calendar(zoned) => zoned.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Window {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let value = serde_json::Value::deserialize(deserializer)?;
        if let serde_json::Value::String(text) = &value {
            if let Ok(calendar) = crate::accounting::calendar::Period::deserialize(&value) {
                return Ok(Window::Calendar(CalendarWindow { calendar, time_zone: None }));
            }
            return parse_duration(text)
                .map(|d| Window::Duration(ConfigDuration(d)))
                .map_err(|e| D::Error::custom(format!("{e}; or a calendar period: \"day\", \"week\", \"month\"")));
        }
        CalendarWindow::deserialize(value).map(Window::Calendar).map_err(|e| {
            D::Error::custom(format!(
                "a duration (\"1m\"), a calendar period (\"month\") or {{\"calendar\": ..., \"time_zone\": ...}}: {e}"
            ))
        })
    }
}

/// Concurrency slots.
#[derive(Debug, Clone, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tokens {
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
    /// What a body on an LLM path that is not its API's JSON gets.
    pub unreadable_body: UnreadableBody,
    /// Largest request body read for counting; a larger one is answered 413.
    pub max_request_bytes: u64,
    /// How long a reservation waits for its settlement before the estimate stands.
    pub reservation_ttl: ConfigDuration,
    /// What an upstream error (status >= 400) is charged.
    pub on_upstream_error: UpstreamErrorCharge,
    /// Add `stream_options.include_usage` to streamed OpenAI chat requests that lack it
    /// (and remove the extra usage chunk from what the client receives).
    pub request_stream_usage: bool,
    /// What a client that leaves before the reply starts is charged.
    pub on_client_abort: crate::accounting::reply_floor::ClientAbortCharge,
    /// Models that can spend output the client does not see (`*` wildcards): a stream of
    /// theirs without usage is charged at least its reservation.
    pub hidden_output_models: Vec<String>,
    /// Reserve each request's true upper bound (prompt + output cap), shrunk to what the
    /// tenant has left if need be, and set the request's output cap to match: the limit
    /// then holds exactly, whatever the completions turn out to be.
    pub clamp_max_tokens: bool,
    /// With clamping, the smallest output allowance worth admitting a request with.
    pub min_output_tokens: u64,
    /// Build the vocabularies on the first timer tick rather than on the first request.
    pub warm_up: bool,
    /// The completion length assumed for a tenant with no history of its own for a model
    /// whose rule sets no `expected_output`, until this proxy has seen enough of the
    /// model's completions to know better. Unset: the output cap (nothing can overshoot).
    pub default_expected_output: Option<u64>,
    /// Learn from settled replies, per model rule, how the provider's prompt count relates
    /// to the proxy's and how long the model's completions run, and reserve by that.
    pub calibrate: bool,
    /// Share what is learned with every proxy of the domain, through the companion (unset:
    /// on with the `redis` store; the `local` store learns per proxy and refuses it).
    pub share_calibration: Option<bool>,
}

/// A model rule as written in `tokens.models`: the counting rule's own fields (`match`,
/// `encoding`, `factor`, `max_output`, as `tokens::ModelRule` reads them, refusing any
/// other) and the completion prior.
#[derive(Debug, Clone)]
pub struct ModelRule {
    pub rule: tokens::ModelRule,
    /// The completion length assumed for a tenant with no history of its own for these
    /// models, until this proxy has seen enough of their completions.
    pub expected_output: Option<u64>,
}

impl<'de> Deserialize<'de> for ModelRule {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut fields = serde_json::Map::deserialize(deserializer)?;
        let expected_output = fields
            .remove("expected_output")
            .map(serde_json::from_value::<Option<u64>>)
            .transpose()
            .map_err(|e| D::Error::custom(format!("expected_output: {e}")))?
            .flatten();
        let rule = tokens::ModelRule::deserialize(serde_json::Value::Object(fields)).map_err(D::Error::custom)?;
        Ok(ModelRule { rule, expected_output })
    }
}

impl Serialize for ModelRule {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeMap};
        let rule = serde_json::to_value(&self.rule).map_err(S::Error::custom)?;
        let fields = rule.as_object().into_iter().flatten();
        let mut map = serializer.serialize_map(None)?;
        for (key, value) in fields {
            map.serialize_entry(key, value)?;
        }
        map.serialize_entry("expected_output", &self.expected_output)?;
        map.end()
    }
}

impl Default for Tokens {
    fn default() -> Self {
        Tokens {
            default_encoding: Encoding::O200kBase,
            models: Vec::new(),
            default_max_output: 4096,
            output_estimate_factor: 1.5,
            unparsed_request_cost: 1000,
            unreadable_body: UnreadableBody::default(),
            max_request_bytes: 1 << 20,
            reservation_ttl: ConfigDuration(Duration::from_secs(15 * 60)),
            on_upstream_error: UpstreamErrorCharge::default(),
            request_stream_usage: true,
            on_client_abort: crate::accounting::reply_floor::ClientAbortCharge::default(),
            hidden_output_models: crate::accounting::reply_floor::DEFAULT_HIDDEN_OUTPUT_MODELS
                .map(String::from)
                .to_vec(),
            clamp_max_tokens: false,
            min_output_tokens: 64,
            warm_up: true,
            default_expected_output: None,
            calibrate: true,
            share_calibration: None,
        }
    }
}

/// The degraded mode: how the proxy decides alone, and when it stops asking.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fallback {
    /// How many proxy instances share the limits: each decides alone with this share.
    pub instances: u32,
    /// Consecutive failed callouts that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker keeps every decision local before one request probes.
    pub breaker_cooldown: ConfigDuration,
}

/// How much per-tenant state one proxy keeps: fixed tables in shared data, so memory is
/// bounded whatever the number of tenants or model names clients send.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Memory {
    /// Entries of the tenant tables (leases, and the local limiter's entries); a
    /// tenant's entry is at a slot chosen by a hash of its id.
    pub tenant_slots: u32,
    /// Entries of the table of running completion averages, by tenant and model.
    pub average_slots: u32,
    /// With the `local` store: the most entries a tenant's sliding window keeps (older
    /// ones are folded into the next, which only ever holds an amount longer) and the
    /// most slots a concurrency limit may have.
    pub local_entries: u32,
}

/// What the filter does with what the provider says about its own limits (see the core's
/// `provider_word` and `provider_state`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProviderLimits {
    /// Read the provider's rate-limit headers and throttling errors, and answer locally
    /// while it has said it refuses.
    pub enabled: bool,
    /// Share what providers said across the fleet, through the companion (and give the
    /// one probe after a retry time to one proxy of the fleet).
    pub share: bool,
    /// The wait after a throttling error that names none (Bedrock's).
    pub default_retry: ConfigDuration,
    /// The longest wait taken from a provider, whatever it says.
    pub max_retry: ConfigDuration,
    /// Lower the configured limits to what the provider says is left, when less.
    pub lower_limits: bool,
    /// Entries of the shared-data table of provider words (by upstream credential and model).
    pub slots: u32,
    /// Opt-in: while the provider refuses, a request goes to this backend instead of a
    /// 429 (as a limit's `overflow`).
    pub overflow: Option<String>,
}

impl Default for ProviderLimits {
    fn default() -> Self {
        ProviderLimits {
            enabled: false,
            share: true,
            default_retry: ConfigDuration(Duration::from_secs(1)),
            max_retry: ConfigDuration(Duration::from_secs(300)),
            lower_limits: true,
            slots: 1024,
            overflow: None,
        }
    }
}

/// Refusals a program can act on: a 429 that a short wait fixes stays retryable, with
/// `Retry-After`; one that it cannot (a request larger than a limit, a budget spent until
/// its period ends) says so with `x-should-retry: false` and the API's code for a spent
/// quota.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Refusals {
    /// A limit that frees a request only after longer than this is answered as spent, not
    /// rate-limited: `x-should-retry: false`, OpenAI's `insufficient_quota` (each API's
    /// counterpart in its shape), and `spent_status`. Default 60s: every per-minute limit
    /// frees within it, so each stays a retryable 429, as the providers' own are; and the
    /// official SDKs are no fit for longer waits (openai-python 1.x followed a
    /// `Retry-After` only up to 60 s and then retried on its own backoff of at most 8 s,
    /// into the same refusal; 2.x and later, up to 120 s; the Anthropic SDK sleeps however
    /// long `Retry-After` says, an hour or a month, holding the caller that long).
    pub retry_horizon: ConfigDuration,
    /// The status of a spent budget's refusal: 429 (the default, as OpenAI answers a
    /// spent quota) or 403 (Azure API Management's convention for a spent quota).
    pub spent_status: u16,
    /// Warn a client whose budget runs low: on an admitted response,
    /// `x-llm-ratelimit-budget-low` names each budget (a cost limit, a calendar budget, a
    /// limit whose window is longer than `retry_horizon`) with less than this fraction of
    /// its capacity left. Unset (the default): no warning.
    pub warn_below: Option<f64>,
}

impl Default for Refusals {
    fn default() -> Self {
        Refusals { retry_horizon: ConfigDuration(Duration::from_secs(60)), spent_status: 429, warn_below: None }
    }
}

impl Default for Memory {
    fn default() -> Self {
        Memory { tenant_slots: 16_384, average_slots: 16_384, local_entries: 64 }
    }
}

impl Default for Fallback {
    fn default() -> Self {
        Fallback { instances: 1, breaker_failures: 3, breaker_cooldown: ConfigDuration(Duration::from_millis(500)) }
    }
}

/// Leased budgets: most requests are admitted from a block of budget this proxy holds,
/// with no callout.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Lease {
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

impl Default for Lease {
    fn default() -> Self {
        Lease {
            enabled: false,
            ttl: ConfigDuration(Duration::from_secs(10)),
            low_water: 0.2,
            initial_fraction: 0.02,
            max_fraction: 0.1,
            share: 0.5,
        }
    }
}

/// Requests never limited.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Bypass {
    /// Tenant ids (as the filter derives them: the first 32 hex digits of SHA-256 over
    /// "llm-ratelimit/tenant/v1\0" and the credential; `anonymous` for the pooled tenant).
    pub tenants: Vec<String>,
    /// Request paths, `*` matching any run of characters (`/v1/models*`).
    pub paths: Vec<String>,
}

/// A price-table entry: a model pattern and its price.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PriceEntry {
    /// Model name, `*` matching any run of characters.
    #[serde(rename = "match")]
    pub pattern: String,
    /// US dollars per million input (prompt) and output (completion) tokens.
    #[serde(flatten)]
    pub price: Price,
}

/// Where a tenant's tier comes from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Tier {
    /// A request header carrying the tier, set by something the operator trusts (a JWT
    /// filter copying a claim, say); a client must not be able to set it.
    pub header: String,
    /// The tier of a request whose header is missing or names no known tier.
    pub default: String,
    /// Per-tenant overrides: tenant id → tier, before the header (a tier of its own gives
    /// a tenant limits of its own).
    #[serde(default)]
    pub tenants: BTreeMap<String, String>,
}

/// Waiting for capacity instead of an instant 429.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Queue {
    /// The longest a request waits for capacity; "0s" turns queueing off. A request whose
    /// retry time is already beyond it is refused at once.
    pub max_wait: ConfigDuration,
    /// The most requests one proxy keeps waiting at once; more are refused at once.
    pub max_length: u32,
    /// The share of `max_length` one tenant's waiters may hold (0 < share <= 1).
    pub tenant_share: f64,
    /// A request header carrying a priority 0 (lowest) to 9 (highest), if the operator
    /// lets clients choose.
    pub priority_header: Option<String>,
    /// The priority of requests that do not say.
    pub default_priority: u8,
    /// Priorities by tenant tier (see `tier`), for requests whose header does not say.
    pub tier_priorities: BTreeMap<String, u8>,
    /// How much waiting one priority level is worth: a lower priority request moves up as
    /// it waits, so it is never starved.
    pub aging: ConfigDuration,
}

impl Default for Queue {
    fn default() -> Self {
        Queue {
            max_wait: ConfigDuration(Duration::ZERO),
            max_length: 1000,
            tenant_share: 0.1,
            priority_header: None,
            default_priority: 5,
            tier_priorities: BTreeMap::new(),
            aging: ConfigDuration(Duration::from_secs(1)),
        }
    }
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

/// In the largest unit that writes it whole (`"15m"`, `"500ms"`), as an operator would.
impl Serialize for ConfigDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        const UNITS: [(u128, &str); 5] =
            [(86_400_000_000, "d"), (3_600_000_000, "h"), (60_000_000, "m"), (1_000_000, "s"), (1_000, "ms")];
        let micros = self.0.as_micros();
        let text = match UNITS.iter().find(|(unit, _)| micros % unit == 0) {
            _ if micros == 0 => "0s".to_string(),
            Some((unit, name)) => format!("{}{name}", micros / unit),
            None => format!("{}ms", micros as f64 / 1000.0),
        };
        serializer.serialize_str(&text)
    }
}

fn default_domain() -> String {
    "llm".to_string()
}

fn default_companion_timeout() -> ConfigDuration {
    ConfigDuration(Duration::from_millis(50))
}

fn default_header_styles() -> Vec<HeaderStyle> {
    vec![HeaderStyle::Provider, HeaderStyle::Ietf]
}

/// `limits[].fair_share` as written.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FairShareShape {
    /// Who the shares are between: `"tenant"` (default), or the values of a trusted
    /// request header (`{"header": "x-team-id", "default": ...}`: teams).
    #[serde(default)]
    pub between: Option<super::per::PerShape>,
    /// Tier → weight (1 to 1000): a tenant of that tier has that many shares; with
    /// `between` a header, the header's value → weight.
    #[serde(default)]
    pub weights: BTreeMap<String, u32>,
    /// The weight of a claimant `weights` does not name (default 1).
    #[serde(default)]
    pub default_weight: Option<u32>,
    /// The most tenants the pool keeps shares for (default 64, 2 to 256).
    #[serde(default)]
    pub max_tenants: Option<u32>,
    /// How long a tenant counts as active after its last request (default the limit's
    /// window, 1s to 1d).
    #[serde(default)]
    pub idle: Option<ConfigDuration>,
}
