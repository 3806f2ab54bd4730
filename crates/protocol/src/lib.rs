//! The JSON the filter and the companion exchange. One type per message, shared by both
//! sides (the companion depends on this crate), so the wire format lives in one place.

use serde::{Deserialize, Serialize};

pub mod credential;
pub mod duration;
pub mod keys;
pub mod ledger;
pub mod plan_admin;
pub mod plans;
pub mod provider;
mod tenant_ops;

pub use provider::{
    is_provider_key, ProbeBy, ProviderEntry, ProviderExchange, ProviderReply, ProviderReport, MAX_PROVIDER_ENTRIES,
    MAX_PROVIDER_REPORTS, PROBE_HOLD_MS, PROBE_OFFER_MS, PROVIDER_PATH, QUOTAS,
};
pub use tenant_ops::{LimitSpec, LimitUsage, ResetReply, TenantLimits, UsageReply, RESET_PATH, USAGE_PATH};

/// Header carrying the shared secret on every callout to the companion.
pub const TOKEN_HEADER: &str = "x-llmrl-token";
/// Endpoint that charges a request against every limit at once (a [`ChargeRequest`]). Its
/// name predates sliding windows and slots; it stays, as the wire does.
pub const CHARGE_PATH: &str = "/v1/token_bucket";
/// The companion's health check (`GET`, no body, no token): 200 when Redis answers.
pub const HEALTH_PATH: &str = "/healthz";
/// Endpoint that settles reservations, many per call (a [`SettlementBatch`]).
pub const SETTLE_PATH: &str = "/v1/settle";
/// Endpoint that grants leases (a [`LeaseRequest`]).
pub const LEASE_PATH: &str = "/v1/lease";
/// Endpoint that keeps concurrency slots alive (a `SettlementBatch` whose settlements name
/// the slots), many per call.
pub const TOUCH_PATH: &str = "/v1/touch";
/// Endpoint that releases concurrency slots at once (a `SettlementBatch` naming them); the
/// slots' settlement, which releases them too, may follow.
pub const RELEASE_PATH: &str = "/v1/release";
/// Endpoint where a proxy worker hands in what settled replies taught it about the models'
/// token counts and gets the figures every proxy taught (a [`CalibrationExchange`]).
pub const CALIBRATION_PATH: &str = "/v1/calibration";

/// What a limit is in Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitKind {
    /// A token bucket: a budget that refills over `window_ms`.
    #[default]
    TokenBucket,
    /// A sliding window: at most `capacity` in any `window_ms`, exactly.
    SlidingWindow,
    /// Concurrency slots: at most `capacity` requests at once, each slot living
    /// `window_ms` unless touched.
    Slots,
    /// A budget for a calendar period (a day, a week, a month in some time zone) that is
    /// full again at the period's end: the period is the one of `period_bounds_ms` that
    /// Redis's clock is in; `window_ms` is the nominal length of a period.
    Calendar,
}

impl LimitKind {
    /// As the Lua script names it.
    pub fn script_name(self) -> &'static str {
        match self {
            LimitKind::TokenBucket => "tb",
            LimitKind::SlidingWindow => "sw",
            LimitKind::Slots => "slots",
            LimitKind::Calendar => "cal",
        }
    }
}

/// Grant a proxy instance a block of each limit, all or none. The reply's `charged` is
/// what each limit granted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    pub domain: String,
    pub tenant: String,
    pub limits: Vec<LeaseAsk>,
    /// The most of what is left that one grant may take (0 < share <= 1).
    pub share: f64,
}

/// One limit of a lease request. On the wire the grant wanted is `cost` and the grant
/// needed `min_cost`, as in a charge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseAsk {
    pub name: String,
    pub capacity: u64,
    pub window_ms: u64,
    /// The grant wanted (0: this limit is not leased).
    #[serde(rename = "cost")]
    pub wanted: u64,
    /// The least grant that is of use (<= `wanted`): what the request that asks needs.
    #[serde(rename = "min_cost", default, skip_serializing_if = "Option::is_none")]
    pub needed: Option<u64>,
    #[serde(default, skip_serializing_if = "is_token_bucket")]
    pub kind: LimitKind,
    /// As `LimitCharge::look_only`: the limit does not apply to the request that asks,
    /// so it never refuses the grant (and grants nothing it does not want).
    #[serde(default, skip_serializing_if = "is_false")]
    pub look_only: bool,
    /// Whose counter this is when it is not the request's tenant's: a shared pool's id
    /// ([`keys::ALL_OWNER`], or a hashed `per` header value), which takes the tenant's
    /// place in the key. `None`: the tenant's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// Check several buckets of one tenant and charge them all, or none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChargeRequest {
    /// Namespace of the counters (the filter config's `domain`).
    pub domain: String,
    /// Hashed tenant id; never a raw credential.
    pub tenant: String,
    pub limits: Vec<LimitCharge>,
    /// Record this charge so that a later settlement can adjust it, once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<Reservation>,
    /// Instead of refusing at once, wait for capacity (needs a reservation: its id names
    /// the waiter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<Wait>,
}

/// How a charge may wait in the tenant's queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Wait {
    /// The longest wait; a request whose retry time is already beyond it is refused at once.
    pub max_ms: u64,
    /// 0 (lowest) to 9 (highest): higher priorities take capacity first.
    pub priority: u8,
    /// Each priority level counts as this much time already waited, so a low priority
    /// request moves up as it waits and is not starved.
    pub aging_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reservation {
    /// Unique per request.
    pub id: String,
    /// How long the record waits for its settlement; after that the charge stands.
    pub ttl_ms: u64,
}

/// Many settlements (of any tenants) in one call: to settle them (`SETTLE_PATH`), or,
/// for the slots they name, to renew (`TOUCH_PATH`) or release them (`RELEASE_PATH`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettlementBatch {
    pub settlements: Vec<Settlement>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settlement {
    pub domain: String,
    pub tenant: String,
    /// The reservation this settles (applied at most once); `None` for adjustments that
    /// stand alone: a returned lease, or what was admitted locally while Redis was away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<String>,
    /// For an adjustment that stands alone: an id under which it is applied at most once,
    /// so a batch sent again after its answer was lost does not apply it twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub once: Option<String>,
    pub limits: Vec<Adjustment>,
    /// The request was given up while its charge was on its way (its client left while
    /// the charge waited in the queue, or the proxy stopped waiting for the answer): stop
    /// that charge (atomically with this refund) if it has not happened yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cancel: bool,
    /// The debits of a request the proxy admitted on its own (the companion away) stand
    /// in for its charge under `reservation` (sent but never answered, or never sent):
    /// applied only if that charge did not happen (and it then never will), at most once,
    /// leaving a record of what they took that the request's settlement is made against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stand_in: Option<StandIn>,
}

/// How a stand-in's record is kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandIn {
    /// How long the record of what the debits took lives (ms, > 0), as a charge's.
    pub record_ttl_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Adjustment {
    pub name: String,
    pub capacity: u64,
    pub window_ms: u64,
    /// Tokens given back (> 0) or taken as well (< 0); slots: ignored (released).
    pub credit: i64,
    #[serde(default, skip_serializing_if = "is_token_bucket")]
    pub kind: LimitKind,
    /// As `LimitCharge::period_bounds_ms`: the settlement applies to the period Redis's
    /// clock is in, and a credit for a charge made in an earlier period is dropped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub period_bounds_ms: Vec<u64>,
    /// Whose counter this is when it is not the request's tenant's: a shared pool's id
    /// ([`keys::ALL_OWNER`], or a hashed `per` header value), which takes the tenant's
    /// place in the key. `None`: the tenant's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SettleReply {
    /// One per settlement, in request order.
    pub results: Vec<SettleOutcome>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SettleOutcome {
    Applied,
    /// Settled before, or the reservation expired: nothing changed.
    AlreadySettled,
    /// Redis failed; safe to send again.
    Failed,
}

/// Most settlements in one call.
pub const MAX_SETTLEMENTS_PER_CALL: usize = 1000;

/// One limit of a charge, with this request's cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitCharge {
    pub name: String,
    /// Tokens the bucket holds when full.
    pub capacity: u64,
    /// Time in which an empty bucket refills to `capacity`.
    pub window_ms: u64,
    /// Tokens this request takes (0 only looks).
    pub cost: u64,
    /// When set (below `cost`), the bucket is elastic: it may be charged less, down to
    /// this, by the same reduction as every other elastic bucket of the call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_cost: Option<u64>,
    #[serde(default, skip_serializing_if = "is_token_bucket")]
    pub kind: LimitKind,
    /// A calendar limit's period boundaries (ms since the epoch, ascending) around the
    /// sender's clock: the start of the period before, of this one, of the next and of the
    /// one after. Redis's clock picks the period, so the budget is full again exactly at a
    /// boundary whatever the proxies' clocks say (within a period). Empty for other kinds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub period_bounds_ms: Vec<u64>,
    /// The cost is an estimate the request's settlement will correct (a token or cost
    /// reservation): capacity may come back sooner than a refusal's `retry_after_ms` says,
    /// as requests in flight settle below their estimates. The queue waits for that.
    #[serde(default, skip_serializing_if = "is_false")]
    pub provisional: bool,
    /// The limit does not apply to this request (another model or tier): it is reported
    /// but never refuses, whatever its level. A limit that applies and reserves nothing
    /// (`cost` 0, such as a `cached_input` limit) still refuses while overdrawn.
    #[serde(default, skip_serializing_if = "is_false")]
    pub look_only: bool,
    /// The limit is tried, not enforced (`limits[].mode: shadow`): it is charged its cost
    /// and its outcome says whether it had room, but it never refuses the charge.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shadow: bool,
    /// Whose counter this is when it is not the request's tenant's: a shared pool's id
    /// ([`keys::ALL_OWNER`], or a hashed `per` header value), which takes the tenant's
    /// place in the key. `None`: the tenant's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// A shared pool held to fair shares among its tenants (`limits[].fair_share`): who
    /// charges it and with what weight. `None`: the pool is first come, first served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair: Option<FairClaim>,
}

/// A tenant's claim on a pool with fair shares (see `lua/limits.lua`, "Fair shares"):
/// the pool's state keeps, per active claimant, its decayed use, so each is held to its
/// max-min fair share whichever proxy sends the charge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FairClaim {
    /// The tenant charging the pool (its id, never a credential).
    pub claimant: String,
    /// Its weight (its tier's, `fair_share.weights`), 1 to 1000.
    pub weight: u32,
    /// The most claimants the pool tracks (`fair_share.max_tenants`).
    pub max_claimants: u32,
    /// How long a claimant stays active after its last charge (`fair_share.idle`).
    pub idle_ms: u64,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

pub(crate) fn is_token_bucket(kind: &LimitKind) -> bool {
    *kind == LimitKind::TokenBucket
}

impl LimitCharge {
    /// The least this bucket may be charged.
    pub fn min(&self) -> u64 {
        self.min_cost.map_or(self.cost, |min| min.min(self.cost))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LimitsReply {
    /// True when every bucket had room and all were charged; false means none was.
    pub allowed: bool,
    /// Time spent waiting in the queue before this answer.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub waited_ms: u64,
    /// One outcome per requested bucket, in request order (none when `suspended`).
    pub limits: Vec<LimitOutcome>,
    /// The owner of limit `limit` is suspended by its plan (see [`plans`]): nothing was
    /// charged or granted, and no wait will change that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<Suspension>,
}

/// Why a charge or a lease was refused without looking at a limit: a plan's suspension.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Suspension {
    /// The limit (by name) whose owner's plan suspends it: the filter knows the owner.
    pub limit: String,
    /// The plan's reason, as the operator wrote it (quoted in the refusal).
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LimitOutcome {
    pub name: String,
    pub status: LimitStatus,
    /// The bucket's capacity.
    pub limit: u64,
    /// Whole tokens left (after the charge, if there was one).
    pub remaining: u64,
    /// Time until the bucket is full again.
    pub reset_after_ms: u64,
    /// Time until this bucket has room for the cost (0 when it has now, or never can).
    pub retry_after_ms: u64,
    /// What the bucket was charged (0 when the call was not allowed).
    #[serde(default)]
    pub charged: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitStatus {
    Allowed,
    Limited,
    /// The cost is larger than the capacity: no wait will make room.
    Never,
}

/// Longest id or name accepted in a key part; the filter's ids are far shorter.
const MAX_KEY_PART: usize = 64;
/// More buckets than this in one call is a bug in the caller, not a policy.
pub const MAX_LIMITS_PER_CALL: usize = 32;

/// Characters allowed in the parts of a Redis key: no `{}` (hash tags), no `:`
/// (separator), nothing that needs escaping.
pub fn is_key_part(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= MAX_KEY_PART
        && text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Checks what the script cannot: names safe for keys, positive sizes, bounded counts.
/// Each bucket is (name, capacity, window_ms, owner).
fn validate_buckets<'a>(
    domain: &str,
    tenant: &str,
    buckets: impl ExactSizeIterator<Item = (&'a str, u64, u64, Option<&'a str>)> + Clone,
) -> Result<(), String> {
    if !is_key_part(domain) {
        return Err(format!("domain {domain:?} must be 1-{MAX_KEY_PART} of [A-Za-z0-9_.-]"));
    }
    if !is_key_part(tenant) {
        return Err(format!("tenant must be 1-{MAX_KEY_PART} of [A-Za-z0-9_.-]"));
    }
    if buckets.len() == 0 || buckets.len() > MAX_LIMITS_PER_CALL {
        return Err(format!("limits must have 1 to {MAX_LIMITS_PER_CALL} entries, got {}", buckets.len()));
    }
    for (i, (name, capacity, window_ms, owner)) in buckets.clone().enumerate() {
        if owner.is_some_and(|owner| !is_key_part(owner)) {
            return Err(format!("limits[{i}].owner must be 1-{MAX_KEY_PART} of [A-Za-z0-9_.-]"));
        }
        if !is_key_part(name) {
            return Err(format!("limits[{i}].name {name:?} must be 1-{MAX_KEY_PART} of [A-Za-z0-9_.-]"));
        }
        if capacity == 0 {
            return Err(format!("limits[{i}].capacity must be positive"));
        }
        if window_ms == 0 {
            return Err(format!("limits[{i}].window_ms must be positive"));
        }
        if buckets.clone().take(i).any(|(other, _, _, _)| other == name) {
            return Err(format!("limits[{i}].name {name:?} appears twice"));
        }
    }
    Ok(())
}

fn validate_reservation_id(id: &str) -> Result<(), String> {
    if is_key_part(id) {
        Ok(())
    } else {
        Err(format!("reservation id must be 1-{MAX_KEY_PART} of [A-Za-z0-9_.-]"))
    }
}

/// Samples count as a plain mean over the first this many, then as an exponential average
/// over about this many (each new sample weighs 1/20): the filter's running figures and
/// `lua/calibration.lua`'s alike.
pub const CALIBRATION_WINDOW: u32 = 20;
/// Most model rules in one exchange; a config has its own rules plus a few built-in ones.
pub const MAX_RULES_PER_EXCHANGE: usize = 64;
/// Most samples of each kind per rule in one exchange; a worker that saw more sends the
/// first ones (the running figures forget old samples within a few dozen anyway).
pub const MAX_SAMPLES_PER_EXCHANGE: usize = 64;

/// What one proxy worker learned from settled replies since its last exchange, per model
/// rule; the answer is every rule's figures as all proxies taught them
/// ([`CalibrationReply`]). A rule with no samples only asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationExchange {
    pub domain: String,
    pub rules: Vec<RuleSamples>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSamples {
    /// The rule's fingerprint (its model pattern and encoding, 16 hex digits): proxies
    /// whose configs have the same rule share its figures.
    pub rule: String,
    /// The provider's prompt tokens per token the proxy counted, one per reply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_ratios: Vec<f64>,
    /// Completion lengths, in tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationReply {
    /// One per rule asked about, in the order asked.
    pub rules: Vec<RuleFigures>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleFigures {
    pub rule: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_ratio: Option<RunningFigure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<RunningFigure>,
}

/// A running mean of samples and their mean absolute deviation from it, over `samples`
/// samples (the filter's `calibration::Running`; `lua/calibration.lua` keeps it in Redis).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RunningFigure {
    pub mean: f64,
    pub deviation: f64,
    pub samples: u32,
}

/// The largest sample taken: a ratio or a completion length beyond it is a bug, not a reply.
const MAX_SAMPLE: f64 = 1e9;

impl CalibrationExchange {
    pub fn validate(&self) -> Result<(), String> {
        if !is_key_part(&self.domain) {
            return Err(format!("domain must be 1-{MAX_KEY_PART} of [A-Za-z0-9_.-]"));
        }
        if self.rules.len() > MAX_RULES_PER_EXCHANGE {
            return Err(format!("at most {MAX_RULES_PER_EXCHANGE} rules per exchange, got {}", self.rules.len()));
        }
        for (i, rule) in self.rules.iter().enumerate() {
            if rule.rule.len() != 16 || !rule.rule.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!("rules[{i}].rule must be 16 hex digits"));
            }
            for (field, samples) in [("prompt_ratios", &rule.prompt_ratios), ("outputs", &rule.outputs)] {
                if samples.len() > MAX_SAMPLES_PER_EXCHANGE {
                    return Err(format!("rules[{i}].{field}: at most {MAX_SAMPLES_PER_EXCHANGE} samples"));
                }
                if !samples.iter().all(|&x| (0.0..=MAX_SAMPLE).contains(&x)) {
                    return Err(format!("rules[{i}].{field}: samples must be numbers in 0..={MAX_SAMPLE}"));
                }
            }
        }
        Ok(())
    }
}

impl TenantLimits {
    pub fn validate(&self) -> Result<(), String> {
        validate_buckets(
            &self.domain,
            &self.tenant,
            self.limits.iter().map(|l| (l.name.as_str(), l.capacity, l.window_ms, None)),
        )
    }
}

impl ChargeRequest {
    pub fn validate(&self) -> Result<(), String> {
        let buckets = self.limits.iter().map(|l| (l.name.as_str(), l.capacity, l.window_ms, l.owner.as_deref()));
        validate_buckets(&self.domain, &self.tenant, buckets)?;
        if let Some(wait) = &self.wait {
            if self.reservation.is_none() {
                return Err("a charge that waits needs a reservation".into());
            }
            if wait.max_ms == 0 || wait.max_ms > 600_000 || wait.priority > 9 || wait.aging_ms == 0 {
                return Err("wait needs max_ms in 1..600000, priority 0..9 and a positive aging_ms".into());
            }
        }
        match &self.reservation {
            Some(reservation) => validate_reservation_id(&reservation.id),
            None => Ok(()),
        }
    }
}

impl LeaseRequest {
    pub fn validate(&self) -> Result<(), String> {
        let buckets = self.limits.iter().map(|l| (l.name.as_str(), l.capacity, l.window_ms, l.owner.as_deref()));
        validate_buckets(&self.domain, &self.tenant, buckets)?;
        if !(self.share > 0.0 && self.share <= 1.0) {
            return Err(format!("share {} is outside (0, 1]", self.share));
        }
        Ok(())
    }
}

impl SettlementBatch {
    pub fn validate(&self) -> Result<(), String> {
        if self.settlements.len() > MAX_SETTLEMENTS_PER_CALL {
            return Err(format!(
                "at most {MAX_SETTLEMENTS_PER_CALL} settlements per call, got {}",
                self.settlements.len()
            ));
        }
        for (i, s) in self.settlements.iter().enumerate() {
            let buckets = s.limits.iter().map(|l| (l.name.as_str(), l.capacity, l.window_ms, l.owner.as_deref()));
            validate_buckets(&s.domain, &s.tenant, buckets)
                .and_then(|()| s.reservation.as_deref().map_or(Ok(()), validate_reservation_id))
                .and_then(|()| s.once.as_deref().map_or(Ok(()), validate_reservation_id))
                .and_then(|()| match (&s.reservation, &s.once) {
                    (Some(_), Some(_)) => Err("a settlement has a reservation or a once id, not both".into()),
                    _ => Ok(()),
                })
                .map_err(|e| format!("settlements[{i}]: {e}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> ChargeRequest {
        ChargeRequest {
            domain: "llm".into(),
            tenant: "0123abcd".into(),
            limits: vec![LimitCharge {
                owner: None,
                shadow: false,
                name: "rpm".into(),
                capacity: 5,
                window_ms: 60_000,
                cost: 1,
                min_cost: None,
                kind: LimitKind::TokenBucket,
                period_bounds_ms: Vec::new(),
                provisional: false,
                look_only: false,
                fair: None,
            }],
            reservation: None,
            wait: None,
        }
    }

    #[test]
    fn accepts_a_well_formed_request() {
        assert_eq!(request().validate(), Ok(()));
    }

    #[test]
    fn rejects_what_would_break_keys_or_the_script() {
        type Mutation = fn(&mut ChargeRequest);
        let cases: Vec<(Mutation, &str)> = vec![
            (|r| r.tenant = "{x}".into(), "tenant"),
            (|r| r.tenant = String::new(), "tenant"),
            (|r| r.domain = "a:b".into(), "domain"),
            (|r| r.limits.clear(), "limits must have"),
            (|r| r.limits[0].name = "r pm".into(), "limits[0].name"),
            (|r| r.limits[0].capacity = 0, "limits[0].capacity"),
            (|r| r.limits[0].window_ms = 0, "limits[0].window_ms"),
            (
                |r| {
                    let again = r.limits[0].clone();
                    r.limits.push(again)
                },
                "appears twice",
            ),
            (|r| r.reservation = Some(Reservation { id: "a:b".into(), ttl_ms: 1 }), "reservation id"),
        ];
        for (mutate, fragment) in cases {
            let mut r = request();
            mutate(&mut r);
            let err = r.validate().expect_err(fragment);
            assert!(err.contains(fragment), "{err}");
        }
    }

    #[test]
    fn settlements_are_validated_one_by_one() {
        let settlement = |tenant: &str| Settlement {
            domain: "llm".into(),
            tenant: tenant.into(),
            reservation: Some("r1".into()),
            once: None,
            cancel: false,
            stand_in: None,
            limits: vec![Adjustment {
                owner: None,
                name: "tpm".into(),
                capacity: 100,
                window_ms: 60_000,
                credit: -5,
                kind: LimitKind::TokenBucket,
                period_bounds_ms: Vec::new(),
            }],
        };
        assert_eq!(SettlementBatch { settlements: vec![settlement("a")] }.validate(), Ok(()));
        let err = SettlementBatch { settlements: vec![settlement("a"), settlement("{b}")] }
            .validate()
            .expect_err("bad tenant");
        assert!(err.starts_with("settlements[1]: tenant"), "{err}");
    }

    #[test]
    fn the_reply_round_trips_through_json() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![LimitOutcome {
                name: "rpm".into(),
                status: LimitStatus::Limited,
                limit: 5,
                remaining: 0,
                reset_after_ms: 60_000,
                retry_after_ms: 12_000,
                charged: 0,
            }],
            suspended: None,
        };
        let json = serde_json::to_string(&reply).expect("serialise");
        assert!(json.contains(r#""status":"limited""#), "{json}");
        assert_eq!(serde_json::from_str::<LimitsReply>(&json).expect("parse"), reply);
    }
}
