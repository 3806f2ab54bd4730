//! From the config as written (`shape::Document`) to the policy the filter runs on: one
//! function per section, then the checks that span sections. Each check names the field
//! as the operator wrote it and quotes the bad value, except where the value may be a
//! credential pasted by mistake (bypass tenants, tier tenant keys): those messages go to
//! the proxy's log, so they say where the value is, never what it is.
//!
//! Only the first error is reported, so the order of the checks decides which one a config
//! with several gets: companion, domain, identity, limits, slots, tokens, fallback, lease,
//! bypass, prices, tier, queue, then what may not be combined.

use super::error::{invalid, ConfigError};
use super::headers::HeaderPlan;
use super::policy::Secret;
use super::policy::{
    model_policies, tiers_named, Bypass, Companion, Dimension, Fallback, Identity, LeaseConfig, Limit, Measure, Memory,
    Policy, PriceEntry, ProviderLimits, QueueConfig, Refusals, Slots, Store, TierConfig, TokenPolicy,
};
use super::shape::{self, Algorithm, ConfigDuration, Document};
use crate::accounting::calendar::Calendar;
use crate::api::identity::{is_tenant_id, IdentitySource};
use crate::protocol::credential::weakness;
use crate::protocol::LimitKind;
use std::collections::{BTreeMap, HashSet};
use std::ops::Bound::{Excluded, Included};
use std::ops::RangeBounds;
use std::time::Duration;

/// Checks every section of `written` and builds the policy from it.
/// `environment` reads the VM's environment variables; `in_vm` false (a check outside the
/// proxy) accepts a `companion.token_env` without reading it.
pub(super) fn compile(
    written: &Document,
    environment: &dyn Fn(&str) -> Option<String>,
    in_vm: bool,
) -> Result<Policy, ConfigError> {
    let companion = match (written.store, &written.companion) {
        (Store::Redis, Some(written)) => companion(written, environment, in_vm)?,
        (Store::Redis, None) => {
            return Err(invalid(
                "companion",
                "required with the default store (`redis`); or set `\"store\": \"local\"` to keep every \
                 limit in this proxy, without a companion",
            ))
        }
        (Store::Local, Some(_)) => {
            return Err(invalid(
                "companion",
                "`\"store\": \"local\"` keeps every limit in this proxy's shared data and calls no \
                 companion: remove `companion`, or drop `store` to keep the limits in Redis",
            ))
        }
        (Store::Local, None) => Companion::none(),
    };
    name("domain", &written.domain)?;
    let identity = identity(&written.identity)?;
    // A concurrency limit's window is the slot ttl. Limits are checked first, and a ttl
    // out of range is refused right after, so no limit built with one is ever used.
    let limits = limits(&written.limits, written.tier.is_some(), written.slots.ttl.0, &identity)?;
    let slots = slots(&written.slots)?;
    let tokens = tokens(&written.tokens, written.store)?;
    let fallback = fallback(&written.fallback.clone().unwrap_or_default())?;
    let lease = lease(&written.lease)?;
    let memory = memory(&written.memory, companion.token.expose(), &written.domain)?;
    let provider_limits = provider_limits(&written.provider_limits)?;
    let refusals = refusals(&written.refusals)?;
    let bypass = bypass(&written.bypass)?;
    let prices = prices(&written.prices)?;
    budgets_are_priced(&limits, &prices)?;
    let tier = written.tier.as_ref().map(|t| tier(t, &limits)).transpose()?;
    let queue = queue(&written.queue, &limits)?;
    lease_combines(&lease, &queue, &limits, &tokens)?;
    if written.store == Store::Local {
        local_store_combines(written, &lease, &queue, &limits, &memory)?;
    }
    super::per::combine(&limits, &lease)?;
    overflows(&limits, &provider_limits, &lease, written.store)?;
    deployments(&written.deployments)?;
    let headers = HeaderPlan::new(&written.headers, &limits);
    Ok(Policy {
        store: written.store,
        companion,
        domain: written.domain.clone(),
        identity,
        failure_mode: written.failure_mode.unwrap_or_default(),
        limits,
        tokens,
        slots,
        tier,
        prices,
        mode: written.mode,
        headers,
        error_format: written.error_format,
        bypass,
        queue,
        fallback,
        lease,
        memory,
        provider_limits,
        refusals,
        hold_request_headers: written.hold_request_headers,
        unknown_paths: written.unknown_paths,
        deployments: written.deployments.clone(),
        record: written.record,
    })
}

fn companion(
    written: &shape::Companion,
    environment: &dyn Fn(&str) -> Option<String>,
    in_vm: bool,
) -> Result<Companion, ConfigError> {
    if written.upstream.trim().is_empty() {
        return Err(invalid("companion.upstream", "must name the companion's cluster (Envoy) or host:port"));
    }
    let token = companion_token(written, environment, in_vm)?;
    let timeout =
        within("companion.timeout", written.timeout.0, Duration::from_millis(1)..=Duration::from_secs(60), "1ms..60s")?;
    Ok(Companion { upstream: written.upstream.clone(), authority: written.authority.clone(), token, timeout })
}

/// The companion credential, written in the config or read from the VM's environment; a
/// short or placeholder one refused, naming the field (never quoting the value).
fn companion_token(
    written: &shape::Companion,
    environment: &dyn Fn(&str) -> Option<String>,
    in_vm: bool,
) -> Result<Secret, ConfigError> {
    let (field, value) = match (&written.token, &written.token_env) {
        (Some(token), None) => ("companion.token", token.expose().to_string()),
        (None, Some(name)) => {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(invalid("companion.token_env", format!("must name an environment variable, got {name:?}")));
            }
            if !in_vm {
                return Ok(Secret::new(String::new()));
            }
            let value = environment(name).ok_or_else(|| {
                invalid(
                    "companion.token_env",
                    format!(
                        "the VM's environment has no variable {name:?} (Envoy: list it in vm_config.environment_variables; \
                         Nginx: an `env {name};` directive in the main context)"
                    ),
                )
            })?;
            ("companion.token_env", value)
        }
        (Some(_), Some(_)) => return Err(invalid("companion.token", "set `token` or `token_env`, not both")),
        (None, None) => {
            return Err(invalid(
                "companion.token",
                "required (or `token_env`, the VM's environment variable holding it)",
            ))
        }
    };
    match weakness(&value) {
        Some(reason) => Err(invalid(field, reason)),
        None => Ok(Secret::new(value)),
    }
}

fn identity(written: &shape::Identity) -> Result<Identity, ConfigError> {
    let Some(written_sources) = &written.sources else {
        return Ok(Identity { sources: None, missing: written.missing });
    };
    if written_sources.is_empty() {
        return Err(invalid("identity.sources", "must list at least one header"));
    }
    let sources = written_sources
        .iter()
        .enumerate()
        .map(|(i, source)| {
            let header = header_name(format!("identity.sources[{i}].header"), &source.header, source.header.trim())?;
            Ok(IdentitySource { header, prefix: source.prefix.clone() })
        })
        .collect::<Result<_, ConfigError>>()?;
    Ok(Identity { sources: Some(sources), missing: written.missing })
}

/// The list: at least one limit, each named once.
fn limits(
    written: &[shape::Limit],
    has_tier: bool,
    slot_ttl: Duration,
    identity: &Identity,
) -> Result<Vec<Limit>, ConfigError> {
    if written.is_empty() {
        return Err(invalid("limits", "must list at least one limit"));
    }
    let mut names = HashSet::new();
    let mut limits = Vec::with_capacity(written.len());
    for (i, entry) in written.iter().enumerate() {
        name(&format!("limits[{i}].name"), &entry.name)?;
        if !names.insert(entry.name.as_str()) {
            return Err(invalid(format!("limits[{i}].name"), format!("{:?} is used by another limit", entry.name)));
        }
        let at = format!("limits[{i}]");
        let mut compiled = limit(&at, entry, has_tier, slot_ttl)?;
        let credentials: Vec<String> = identity.sources.iter().flatten().map(|source| source.header.clone()).collect();
        compiled.per = super::per::per(&at, entry.per.as_ref(), &credentials)?;
        compiled.shadow = super::per::shadow(entry.mode);
        compiled.fair_share = fair_share(&at, entry.fair_share.as_ref(), &compiled, &credentials)?;
        limits.push(compiled);
    }
    fair_weights_name_tiers(&limits)?;
    Ok(limits)
}

const WEIGHTS: std::ops::RangeInclusive<u32> = 1..=1000;
const MAX_TENANTS: std::ops::RangeInclusive<u32> = 2..=256;
const IDLE: std::ops::RangeInclusive<Duration> = Duration::from_secs(1)..=Duration::from_secs(86_400);

/// `limits[i].fair_share`, at `at`, of the limit `limit` (compiled but for it).
fn fair_share(
    at: &str,
    written: Option<&shape::FairShareShape>,
    limit: &Limit,
    credentials: &[String],
) -> Result<Option<super::FairShare>, ConfigError> {
    let Some(written) = written else { return Ok(None) };
    let field = format!("{at}.fair_share");
    if limit.per == super::Per::Tenant {
        return Err(invalid(
            field,
            "shares a pool among the tenants charging it: it needs `per` (\"all\" or a header); a per-tenant \
             limit has one tenant",
        ));
    }
    if !matches!(limit.kind, LimitKind::TokenBucket | LimitKind::SlidingWindow) {
        return Err(invalid(
            field,
            "needs a limit that refills (a token bucket or a sliding window): shares are of a rate, and a \
             concurrency limit or a calendar budget has none",
        ));
    }
    for (tier, weight) in &written.weights {
        if !WEIGHTS.contains(weight) {
            return Err(invalid(format!("{field}.weights.{tier}"), format!("{weight} is outside 1..1000")));
        }
    }
    let default_weight = written.default_weight.unwrap_or(1);
    if !WEIGHTS.contains(&default_weight) {
        return Err(invalid(format!("{field}.default_weight"), format!("{default_weight} is outside 1..1000")));
    }
    let max_tenants = written.max_tenants.unwrap_or(64);
    if !MAX_TENANTS.contains(&max_tenants) {
        return Err(invalid(
            format!("{field}.max_tenants"),
            format!("{max_tenants} is outside 2..256: each charge reads every tenant's share"),
        ));
    }
    let idle = match &written.idle {
        Some(ConfigDuration(idle)) => within(format!("{field}.idle"), *idle, IDLE, "1s..1d")?,
        None => limit.window.clamp(*IDLE.start(), *IDLE.end()),
    };
    let between = super::per::per_at(&format!("{field}.between"), written.between.as_ref(), credentials)?;
    match &between {
        super::Per::EndUser { .. } => {
            return Err(invalid(
                format!("{field}.between"),
                "shares are between tenants or a trusted header's values; an end user's own share is its limit \
                 (`per: \"end_user\"`) or its plan",
            ))
        }
        super::Per::All => {
            return Err(invalid(
                format!("{field}.between"),
                "shares are between tenants (\"tenant\") or a trusted header's values ({\"header\": ...}); \
                 \"all\" would be one claimant",
            ))
        }
        super::Per::Header { name, .. } if matches!(&limit.per, super::Per::Header { name: own, .. } if own == name) => {
            return Err(invalid(
                format!("{field}.between.header"),
                format!("the pool is counted per {name:?}: each of its pools has one value of it to share among"),
            ))
        }
        _ => {}
    }
    Ok(Some(super::FairShare { between, weights: written.weights.clone(), default_weight, max_tenants, idle }))
}

/// Every tier a `fair_share.weights` names is one some limit names: the only tiers a
/// tenant can be in (a misspelt tier would weigh nobody).
fn fair_weights_name_tiers(limits: &[Limit]) -> Result<(), ConfigError> {
    for (i, limit) in limits.iter().enumerate() {
        let Some(fair) = limit.fair_share.as_ref().filter(|fair| fair.between == super::Per::Tenant) else { continue };
        if let Some(tier) = fair.weights.keys().find(|tier| !tiers_named(limits).any(|t| t == tier.as_str())) {
            return Err(invalid(
                format!("limits[{i}].fair_share.weights.{tier}"),
                format!("{tier:?} is not a tier any limit names"),
            ));
        }
    }
    Ok(())
}

/// One limit, found at `at` (`limits[2]`).
fn limit(at: &str, written: &shape::Limit, has_tier: bool, slot_ttl: Duration) -> Result<Limit, ConfigError> {
    let measure = measure(at, written)?;
    if let Some(i) = written.models.iter().position(|m| m.is_empty()) {
        return Err(invalid(format!("{at}.models[{i}]"), "must not be empty"));
    }
    if let Some((i, tier)) = written.tiers.iter().enumerate().find(|(_, t)| !is_name(t)) {
        return Err(invalid(format!("{at}.tiers[{i}]"), format!("{tier:?} is not a valid tier name")));
    }
    let calendar = match &written.window {
        Some(shape::Window::Calendar(window)) => Some(
            Calendar::new(window.calendar, window.time_zone.as_deref())
                .map_err(|message| invalid(format!("{at}.window.time_zone"), message))?,
        ),
        _ => None,
    };
    let kind = match (measure, written.algorithm, &calendar) {
        (Measure::Concurrency(_), Algorithm::SlidingWindow, _) => {
            return Err(invalid(format!("{at}.algorithm"), "a concurrency limit has no window to slide"))
        }
        (Measure::Concurrency(_), Algorithm::TokenBucket, _) => LimitKind::Slots,
        (_, Algorithm::SlidingWindow, Some(_)) => {
            return Err(invalid(
                format!("{at}.algorithm"),
                "a calendar budget is full again at each boundary of its period; it does not slide",
            ))
        }
        (_, _, Some(_)) => LimitKind::Calendar,
        (_, Algorithm::SlidingWindow, None) => LimitKind::SlidingWindow,
        (_, Algorithm::TokenBucket, None) => LimitKind::TokenBucket,
    };
    if !written.tiers.is_empty() && !has_tier {
        return Err(invalid(format!("{at}.tiers"), "needs `tier` (where a tenant's tier comes from)"));
    }
    let window = match (measure, &written.window) {
        (Measure::Concurrency(_), Some(_)) => {
            return Err(invalid(format!("{at}.window"), "a concurrency limit has no window (slots live `slots.ttl`)"))
        }
        (Measure::Concurrency(_), None) => slot_ttl,
        (_, None) => return Err(invalid(format!("{at}.window"), "required for a requests or tokens limit")),
        (_, Some(shape::Window::Calendar(window))) => Duration::from_millis(window.calendar.longest_ms()),
        (_, Some(shape::Window::Duration(ConfigDuration(window)))) => within(
            format!("{at}.window"),
            *window,
            Duration::from_millis(100)..=Duration::from_secs(366 * 86_400),
            "100ms..366d",
        )?,
    };
    Ok(Limit {
        name: written.name.clone(),
        measure,
        window,
        calendar,
        kind,
        models: written.models.clone(),
        tiers: written.tiers.clone(),
        per: super::Per::Tenant,
        shadow: false,
        fair_share: None,
        overflow: written.overflow.clone(),
        backend: written.backend.clone(),
    })
}

/// What a limit counts: exactly one of the four amounts, each in 1..10^12 of its unit.
fn measure(at: &str, written: &shape::Limit) -> Result<Measure, ConfigError> {
    let (measure, key) = match (written.requests, written.tokens, written.concurrency, written.usd) {
        (Some(n), None, None, None) => (Measure::Requests(n), "requests"),
        (None, Some(n), None, None) => {
            (Measure::Tokens { amount: n, count: written.count.unwrap_or_default() }, "tokens")
        }
        (None, None, Some(n), None) => (Measure::Concurrency(n), "concurrency"),
        (None, None, None, Some(usd)) => {
            let usd = within(format!("{at}.usd"), usd, (Excluded(0.0), Included(1e9)), "(0, 1e9]")?;
            (Measure::Usd { micro: (usd * 1e6).round() as u64 }, "usd")
        }
        _ => return Err(invalid(at, "set exactly one of `requests`, `tokens`, `concurrency` and `usd`")),
    };
    if written.count.is_some() && written.tokens.is_none() {
        return Err(invalid(format!("{at}.count"), "only a `tokens` limit counts a part of a request's tokens"));
    }
    // A usd amount is checked in micro-dollars: too small a fraction of a cent rounds to 0.
    within(format!("{at}.{key}"), measure.capacity(), 1..=1_000_000_000_000, "1..1000000000000")?;
    Ok(measure)
}

fn slots(written: &shape::Slots) -> Result<Slots, ConfigError> {
    let ttl = within("slots.ttl", written.ttl.0, Duration::from_secs(1)..=Duration::from_secs(3600), "1s..1h")?;
    Ok(Slots { ttl })
}

fn tokens(written: &shape::Tokens, store: Store) -> Result<TokenPolicy, ConfigError> {
    let encodings = std::iter::once(("tokens.default_encoding".to_string(), written.default_encoding)).chain(
        written.models.iter().enumerate().map(|(i, m)| (format!("tokens.models[{i}].encoding"), m.rule.encoding)),
    );
    for (field, encoding) in encodings {
        if !encoding.available() {
            return Err(invalid(field, format!("{} is not compiled into this build", encoding.name())));
        }
    }
    let mut configured = Vec::with_capacity(written.models.len());
    for (i, shape::ModelRule { rule, expected_output }) in written.models.iter().enumerate() {
        not_empty(format!("tokens.models[{i}].match"), &rule.pattern)?;
        within(format!("tokens.models[{i}].factor"), rule.factor, (Excluded(0.0), Included(10.0)), "(0, 10]")?;
        if let Some(max_output) = rule.max_output {
            positive(format!("tokens.models[{i}].max_output"), max_output)?;
        }
        if let Some(expected) = *expected_output {
            positive(format!("tokens.models[{i}].expected_output"), expected)?;
        }
        configured.push((rule.clone(), *expected_output));
    }
    if let Some(expected) = written.default_expected_output {
        positive("tokens.default_expected_output", expected)?;
    }
    let min_output_tokens = positive("tokens.min_output_tokens", written.min_output_tokens)?;
    let default_max_output = positive("tokens.default_max_output", written.default_max_output)?;
    let output_estimate_factor =
        within("tokens.output_estimate_factor", written.output_estimate_factor, 0.1..=10.0, "0.1..10")?;
    let max_request_bytes =
        within("tokens.max_request_bytes", written.max_request_bytes, 1024..=64 << 20, "1024..67108864")?;
    let reservation_ttl = within(
        "tokens.reservation_ttl",
        written.reservation_ttl.0,
        Duration::from_secs(1)..=Duration::from_secs(86_400),
        "1s..1d",
    )?;
    let hidden_output_models = hidden_output_models(&written.hidden_output_models)?;
    let (rules, catch_all) = model_policies(configured, written.default_encoding, written.default_expected_output);
    Ok(TokenPolicy {
        default_encoding: written.default_encoding,
        rules,
        catch_all,
        default_max_output,
        output_estimate_factor,
        unparsed_request_cost: written.unparsed_request_cost,
        unreadable_body: written.unreadable_body,
        max_request_bytes,
        reservation_ttl,
        on_upstream_error: written.on_upstream_error,
        request_stream_usage: written.request_stream_usage,
        on_client_abort: written.on_client_abort,
        hidden_output_models,
        clamp_max_tokens: written.clamp_max_tokens,
        min_output_tokens,
        warm_up: written.warm_up,
        calibrate: written.calibrate,
        share_calibration: written.calibrate && written.share_calibration.unwrap_or(store == Store::Redis),
    })
}

/// `tokens.hidden_output_models`: bounded, so matching a request stays cheap.
fn hidden_output_models(patterns: &[String]) -> Result<Vec<String>, ConfigError> {
    use crate::accounting::reply_floor::{MAX_HIDDEN_OUTPUT_MODELS, MAX_MODEL_PATTERN_LEN};
    if patterns.len() > MAX_HIDDEN_OUTPUT_MODELS {
        return Err(invalid(
            "tokens.hidden_output_models",
            format!("{} patterns; at most {MAX_HIDDEN_OUTPUT_MODELS}", patterns.len()),
        ));
    }
    for (i, pattern) in patterns.iter().enumerate() {
        if pattern.is_empty() || pattern.len() > MAX_MODEL_PATTERN_LEN {
            return Err(invalid(
                format!("tokens.hidden_output_models[{i}]"),
                format!("a pattern of 1 to {MAX_MODEL_PATTERN_LEN} characters, not {} characters", pattern.len()),
            ));
        }
    }
    Ok(patterns.to_vec())
}

fn fallback(written: &shape::Fallback) -> Result<Fallback, ConfigError> {
    let instances = within("fallback.instances", written.instances, 1..=10_000, "1..10000")?;
    let breaker_failures = positive("fallback.breaker_failures", written.breaker_failures)?;
    let breaker_cooldown = within(
        "fallback.breaker_cooldown",
        written.breaker_cooldown.0,
        Duration::from_millis(10)..=Duration::from_secs(300),
        "10ms..5m",
    )?;
    Ok(Fallback { instances, breaker_failures, breaker_cooldown })
}

fn provider_limits(written: &shape::ProviderLimits) -> Result<ProviderLimits, ConfigError> {
    let ms = |d: Duration| d.as_millis().min(u128::from(u64::MAX)) as u64;
    let default_retry = within(
        "provider_limits.default_retry",
        written.default_retry.0,
        Duration::from_millis(10)..=Duration::from_secs(3600),
        "10ms..1h",
    )?;
    let max_retry = within(
        "provider_limits.max_retry",
        written.max_retry.0,
        Duration::from_secs(1)..=Duration::from_secs(86_400),
        "1s..1d",
    )?;
    if default_retry > max_retry {
        return Err(invalid("provider_limits.default_retry", "must not be longer than provider_limits.max_retry"));
    }
    Ok(ProviderLimits {
        enabled: written.enabled,
        share: written.share,
        default_retry_ms: ms(default_retry),
        max_retry_ms: ms(max_retry),
        lower_limits: written.lower_limits,
        slots: within("provider_limits.slots", written.slots, 16..=1 << 16, "16..65536")?,
        overflow: written.overflow.clone(),
    })
}

fn refusals(written: &shape::Refusals) -> Result<Refusals, ConfigError> {
    let horizon = within(
        "refusals.retry_horizon",
        written.retry_horizon.0,
        Duration::from_secs(1)..=Duration::from_secs(86_400),
        "1s..1d",
    )?;
    let spent_status = match written.spent_status {
        status @ (429 | 403) => u32::from(status),
        other => return Err(invalid("refusals.spent_status", format!("{other} is neither 429 nor 403"))),
    };
    let warn_below = written
        .warn_below
        .map(|fraction| within("refusals.warn_below", fraction, (Excluded(0.0), Excluded(1.0)), "(0, 1)"))
        .transpose()?;
    Ok(Refusals { retry_horizon_ms: horizon.as_millis().min(u128::from(u64::MAX)) as u64, spent_status, warn_below })
}

/// Overflow's backends: valid names, each fallback named by some overflow, no fallback
/// overflowing again, and only where a refusal can be re-charged (a charge in Redis).
fn overflows(
    limits: &[Limit],
    provider: &ProviderLimits,
    lease: &LeaseConfig,
    store: Store,
) -> Result<(), ConfigError> {
    let provider_overflow = provider.overflow.iter().map(|b| ("provider_limits.overflow".to_string(), b));
    let limit_overflows =
        limits.iter().enumerate().filter_map(|(i, l)| Some((format!("limits[{i}].overflow"), l.overflow.as_ref()?)));
    let targets: Vec<(String, &String)> = provider_overflow.chain(limit_overflows).collect();
    for (field, backend) in &targets {
        name(field, backend)?;
        if lease.enabled {
            return Err(invalid(field, "not with leases: a request admitted or refused from a lease is decided in the proxy, with no charge to redo for the fallback"));
        }
        if store == Store::Local {
            return Err(invalid(
                field,
                "not with the local store (overflow re-charges the fallback's limits in Redis)",
            ));
        }
    }
    if provider.overflow.is_some() && !provider.enabled {
        return Err(invalid(
            "provider_limits.overflow",
            "needs provider_limits.enabled (the provider's word is what refuses)",
        ));
    }
    for (i, limit) in limits.iter().enumerate() {
        let Some(backend) = &limit.backend else { continue };
        name(&format!("limits[{i}].backend"), backend)?;
        if limit.overflow.is_some() {
            return Err(invalid(
                format!("limits[{i}].overflow"),
                format!(
                    "limit {:?} belongs to the fallback {backend:?}; a fallback does not overflow again",
                    limit.name
                ),
            ));
        }
        if !targets.iter().any(|(_, target)| *target == backend) {
            return Err(invalid(
                format!("limits[{i}].backend"),
                format!("no `overflow` names {backend:?}: the limit would never apply"),
            ));
        }
    }
    Ok(())
}

fn memory(written: &shape::Memory, token: &str, domain: &str) -> Result<Memory, ConfigError> {
    const RANGE: std::ops::RangeInclusive<u32> = 16..=1 << 20;
    Ok(Memory {
        tenant_slots: within("memory.tenant_slots", written.tenant_slots, RANGE, "16..1048576")?,
        average_slots: within("memory.average_slots", written.average_slots, RANGE, "16..1048576")?,
        local_entries: within("memory.local_entries", written.local_entries, 1..=4096, "1..4096")?,
        slot_key: slot_key(token, domain),
    })
}

fn lease(written: &shape::Lease) -> Result<LeaseConfig, ConfigError> {
    let ttl = within("lease.ttl", written.ttl.0, Duration::from_millis(100)..=Duration::from_secs(3600), "100ms..1h")?;
    let low_water = within("lease.low_water", written.low_water, (Excluded(0.0), Included(0.9)), "(0, 0.9]")?;
    let initial_fraction =
        within("lease.initial_fraction", written.initial_fraction, (Excluded(0.0001), Included(1.0)), "(0.0001, 1]")?;
    let max_fraction =
        within("lease.max_fraction", written.max_fraction, (Excluded(0.0001), Included(1.0)), "(0.0001, 1]")?;
    let share = within("lease.share", written.share, (Excluded(0.01), Included(1.0)), "(0.01, 1]")?;
    Ok(LeaseConfig { enabled: written.enabled, ttl, low_water, initial_fraction, max_fraction, share })
}

fn bypass(written: &shape::Bypass) -> Result<Bypass, ConfigError> {
    if let Some(i) = written.tenants.iter().position(|t| !is_tenant_id(t)) {
        return Err(invalid(
            format!("bypass.tenants[{i}]"),
            "must be a tenant id (32 lower-case hex digits), not a credential",
        ));
    }
    for (i, path) in written.paths.iter().enumerate() {
        if !path.starts_with('/') && !path.starts_with('*') {
            return Err(invalid(format!("bypass.paths[{i}]"), format!("{path:?} must start with '/' or '*'")));
        }
    }
    Ok(Bypass { tenants: written.tenants.clone(), paths: written.paths.clone() })
}

fn prices(written: &[shape::PriceEntry]) -> Result<Vec<PriceEntry>, ConfigError> {
    let dollars_per_million = |v: f64| (0.0..=1e6).contains(&v);
    written
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            not_empty(format!("prices[{i}].match"), &entry.pattern)?;
            if !dollars_per_million(entry.price.input) || !dollars_per_million(entry.price.output) {
                return Err(invalid(
                    format!("prices[{i}]"),
                    "input and output must be dollars per million tokens in 0..1e6",
                ));
            }
            Ok(PriceEntry { pattern: entry.pattern.clone(), price: entry.price })
        })
        .collect()
}

/// A `usd` limit charges by the price table, so it needs one.
fn budgets_are_priced(limits: &[Limit], prices: &[PriceEntry]) -> Result<(), ConfigError> {
    if limits.iter().any(|l| l.dimension() == Dimension::Cost) && prices.is_empty() {
        return Err(invalid(
            "prices",
            "a `usd` limit needs a price table (requests for models it does not list are refused)",
        ));
    }
    Ok(())
}

/// The tier section; every tier it names must be one some limit names.
fn tier(written: &shape::Tier, limits: &[Limit]) -> Result<TierConfig, ConfigError> {
    let header = header_name("tier.header", &written.header, &written.header)?;
    let named = |tier: &str| tiers_named(limits).any(|t| t == tier);
    if !named(&written.default) {
        return Err(invalid("tier.default", format!("{:?} is not a tier any limit names", written.default)));
    }
    // Entries are named by position: a key may be a credential pasted by mistake.
    for (at, (tenant, own)) in written.tenants.iter().enumerate() {
        if !is_tenant_id(tenant) {
            return Err(invalid(
                format!("tier.tenants (entry {at})"),
                "keys must be tenant ids (32 lower-case hex digits), not credentials",
            ));
        }
        if !named(own) {
            return Err(invalid(
                format!("tier.tenants (entry {at})"),
                format!("{own:?} is not a tier any limit names"),
            ));
        }
    }
    Ok(TierConfig { header, default: written.default.clone(), tenants: written.tenants.clone() })
}

fn queue(written: &shape::Queue, limits: &[Limit]) -> Result<QueueConfig, ConfigError> {
    let max_wait = within("queue.max_wait", written.max_wait.0, ..=Duration::from_secs(600), "0s..10m")?;
    let default_priority = within("queue.default_priority", written.default_priority, ..=9, "0..9")?;
    for (at, (tier, priority)) in written.tier_priorities.iter().enumerate() {
        if *priority > 9 || !tiers_named(limits).any(|t| t == tier) {
            return Err(invalid(
                format!("queue.tier_priorities.{tier}"),
                format!("entry {at}: priority {priority} must be 0..9, for a tier some limit names"),
            ));
        }
    }
    if written.aging.0 < Duration::from_millis(1) {
        return Err(invalid("queue.aging", "must be positive"));
    }
    let priority_header =
        written.priority_header.as_deref().map(|h| header_name("queue.priority_header", h, h)).transpose()?;
    let share = written.tenant_share;
    if !(share > 0.0 && share <= 1.0) {
        return Err(invalid("queue.tenant_share", format!("must be in (0, 1], got {share}")));
    }
    Ok(QueueConfig {
        max_wait,
        max_length: written.max_length,
        max_per_tenant: ((f64::from(written.max_length) * share).ceil() as u32).max(1),
        priority_header,
        default_priority,
        tier_priorities: written.tier_priorities.clone(),
        aging: written.aging.0,
    })
}

/// A lease is a token bucket this proxy holds: it cannot stand in for what must be
/// decided in Redis.
fn lease_combines(
    lease: &LeaseConfig,
    queue: &QueueConfig,
    limits: &[Limit],
    tokens: &TokenPolicy,
) -> Result<(), ConfigError> {
    if !lease.enabled {
        return Ok(());
    }
    let clash = if queue.enabled() {
        Some("leases and queueing do not combine: a queued request waits in Redis")
    } else if limits.iter().any(|l| l.kind == LimitKind::Slots) {
        Some("leases and concurrency limits do not combine: slots are held in Redis")
    } else if limits.iter().any(|l| l.kind == LimitKind::SlidingWindow) {
        Some("leases and sliding windows do not combine: leases are token buckets")
    } else if limits.iter().any(|l| l.kind == LimitKind::Calendar) {
        Some("leases and calendar budgets do not combine: a grant held over a period's end would be spent in the next")
    } else if tokens.clamp_max_tokens {
        Some("leases and tokens.clamp_max_tokens do not combine: clamping needs the exact remainder in Redis")
    } else {
        None
    };
    clash.map_or(Ok(()), |message| Err(invalid("lease.enabled", message)))
}

/// What only Redis can hold, refused with the local store, each in the words of why: a
/// proxy's shared data is its own, so nothing in it is seen by another proxy.
fn local_store_combines(
    written: &Document,
    lease: &LeaseConfig,
    queue: &QueueConfig,
    limits: &[Limit],
    memory: &Memory,
) -> Result<(), ConfigError> {
    const LOCAL: &str = "with `\"store\": \"local\"`";
    if queue.enabled() {
        return Err(invalid(
            "queue.max_wait",
            format!("the queue is one line across every proxy, kept in Redis: {LOCAL} there is none; remove `queue`"),
        ));
    }
    if lease.enabled {
        return Err(invalid(
            "lease.enabled",
            format!("a lease is a block of a budget kept in Redis: {LOCAL} every decision is made in the proxy already; remove `lease`"),
        ));
    }
    if written.tokens.share_calibration == Some(true) {
        return Err(invalid(
            "tokens.share_calibration",
            format!("calibrations are shared with the other proxies through the companion: {LOCAL} each proxy learns its own; leave it unset"),
        ));
    }
    if written.failure_mode.is_some() {
        return Err(invalid(
            "failure_mode",
            format!("says what to do when the companion fails: {LOCAL} there is no companion to fail; remove it"),
        ));
    }
    if written.fallback.is_some() {
        return Err(invalid(
            "fallback",
            format!("the degraded mode stands in for an absent companion: {LOCAL} there is none; remove it"),
        ));
    }
    for (i, limit) in limits.iter().enumerate() {
        if limit.per != super::Per::Tenant {
            return Err(invalid(
                format!("limits[{i}].per"),
                format!("a shared pool is counted for callers of every proxy, kept in Redis: {LOCAL} only per-tenant limits are kept; remove `per`"),
            ));
        }
        if limit.kind == LimitKind::Slots && limit.capacity() > u64::from(memory.local_entries) {
            return Err(invalid(
                format!("limits[{i}].concurrency"),
                format!(
                    "{} slots: {LOCAL} a tenant's slots are kept in its entry, at most `memory.local_entries` ({}); raise that",
                    limit.capacity(),
                    memory.local_entries
                ),
            ));
        }
    }
    Ok(())
}

/// Names that end up in Redis keys and headers: short, and free of the characters that
/// carry meaning there (`{}` are Redis Cluster hash tags, `:` separates key parts).
fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn name(field: &str, name: &str) -> Result<(), ConfigError> {
    if is_name(name) {
        Ok(())
    } else {
        Err(invalid(field, format!("{name:?} is not a valid name: use 1 to 32 of a-z, 0-9, '_', '-'")))
    }
}

/// A request header name, lower-cased as the filter looks headers up. `name` is what the
/// operator wrote, perhaps trimmed; an error quotes `written` exactly as written.
fn header_name(field: impl Into<String>, written: &str, name: &str) -> Result<String, ConfigError> {
    let valid = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if valid {
        Ok(name.to_ascii_lowercase())
    } else {
        Err(invalid(field, format!("{written:?} is not a header name")))
    }
}

/// `value`, if it lies in `range`; else an error quoting it and `range` as written for
/// operators (`1ms..60s`, `(0, 10]`). NaN lies in no range.
fn within<T: PartialOrd + Quoted>(
    field: impl Into<String>,
    value: T,
    range: impl RangeBounds<T>,
    written: &str,
) -> Result<T, ConfigError> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(invalid(field, format!("{} is outside {written}", value.quoted())))
    }
}

fn positive<T: PartialOrd + Default>(field: impl Into<String>, value: T) -> Result<T, ConfigError> {
    if value > T::default() {
        Ok(value)
    } else {
        Err(invalid(field, "must be positive"))
    }
}

/// Each entry maps a name Azure accepts for a deployment to a model name.
fn deployments(deployments: &BTreeMap<String, String>) -> Result<(), ConfigError> {
    for (deployment, model) in deployments {
        let at = format!("deployments.{deployment}");
        if !crate::providers::azure::is_deployment_name(deployment) {
            return Err(invalid(at, "not an Azure deployment name (1 to 64 letters, digits, `-`, `_` or `.`)"));
        }
        not_empty(&at, model)?;
        if model.len() > crate::providers::MAX_MODEL_NAME || model.chars().any(char::is_control) {
            return Err(invalid(at, "not a model name"));
        }
    }
    Ok(())
}

fn not_empty(field: impl Into<String>, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() {
        Err(invalid(field, "must not be empty"))
    } else {
        Ok(())
    }
}

/// How a value out of range is quoted: durations as `Debug` shows them (`250ms`),
/// numbers as written (`0.5`, not `0.5f64`; `1`, not `1.0`).
trait Quoted {
    fn quoted(&self) -> String;
}

impl Quoted for Duration {
    fn quoted(&self) -> String {
        format!("{self:?}")
    }
}

macro_rules! quoted_as_displayed {
    ($($number:ty),*) => {
        $(impl Quoted for $number {
            fn quoted(&self) -> String {
                self.to_string()
            }
        })*
    };
}

quoted_as_displayed!(u8, u32, u64, f64);

/// The key of the tables' slot hash: from the companion token (a secret between the
/// proxies and the companion) and the domain, so every worker of a proxy agrees on it
/// without shared state (there is no OS randomness on the filter's target, and a seed
/// written to shared data races at its creation on Envoy), and no client can compute it.
pub(crate) fn slot_key(token: &str, domain: &str) -> [u64; 2] {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(b"llm-ratelimit/slots/v1\0")
        .chain_update(token.as_bytes())
        .chain_update(b"\0")
        .chain_update(domain.as_bytes())
        .finalize();
    let word = |at: usize| digest.get(at..at + 8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
    [word(0), word(8)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TokenCount;
    use serde::de::DeserializeOwned;

    /// A section of the shape, from its JSON.
    fn written<T: DeserializeOwned>(json: &str) -> T {
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"))
    }

    fn document(json: &str) -> Document {
        Document::parse(json.as_bytes()).unwrap_or_else(|e| panic!("{e}"))
    }

    fn limit_of(json: &str) -> Result<Limit, ConfigError> {
        limit("limits[0]", &written(json), false, Duration::from_secs(30))
    }

    fn error(field: &str, message: &str) -> ConfigError {
        invalid(field, message)
    }

    fn token_measure(amount: u64, count: TokenCount) -> Measure {
        Measure::Tokens { amount, count }
    }

    #[test]
    fn each_measure_compiles_to_its_capacity_dimension_and_kind() {
        let cases = [
            (r#"{"name": "r", "requests": 20, "window": "1m"}"#, Measure::Requests(20), LimitKind::TokenBucket),
            (
                r#"{"name": "t", "tokens": 9000, "window": "1m"}"#,
                token_measure(9000, TokenCount::Total),
                LimitKind::TokenBucket,
            ),
            (
                r#"{"name": "t", "tokens": 9000, "window": "1m", "algorithm": "sliding_window", "count": "output"}"#,
                token_measure(9000, TokenCount::Output),
                LimitKind::SlidingWindow,
            ),
            (
                r#"{"name": "t", "tokens": 400, "window": "1m", "count": "input"}"#,
                token_measure(400, TokenCount::Input),
                LimitKind::TokenBucket,
            ),
            (
                r#"{"name": "t", "tokens": 400, "window": "1m", "count": "cached_input"}"#,
                token_measure(400, TokenCount::CachedInput),
                LimitKind::TokenBucket,
            ),
            (r#"{"name": "u", "usd": 2.5, "window": "1d"}"#, Measure::Usd { micro: 2_500_000 }, LimitKind::TokenBucket),
            (r#"{"name": "c", "concurrency": 4}"#, Measure::Concurrency(4), LimitKind::Slots),
        ];
        for (json, measure, kind) in cases {
            let limit = limit_of(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!((limit.measure, limit.kind), (measure, kind), "{json}");
            assert_eq!((limit.capacity(), limit.dimension()), (measure.capacity(), measure.dimension()), "{json}");
        }
    }

    #[test]
    fn a_concurrency_limit_lives_as_long_as_a_slot() {
        let policy = compile(
            &document(
                r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "slots": {"ttl": "12s"},
                "limits": [{"name": "c", "concurrency": 2}, {"name": "r", "requests": 2, "window": "1h"}]}"#,
            ),
            &|_| None,
            true,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let windows: Vec<u64> = policy.limits.iter().map(Limit::window_ms).collect();
        assert_eq!(windows, [12_000, 3_600_000]);
        assert_eq!(policy.slots.ttl, Duration::from_secs(12));
    }

    #[test]
    fn compiling_leaves_the_written_config_as_it_was() {
        let written = document(
            r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "identity": {"sources": [{"header": " X-Tenant "}]},
                "tier": {"header": "X-Tier", "default": "gold"}, "queue": {"priority_header": "X-Priority"},
                "limits": [{"name": "c", "concurrency": 2, "tiers": ["gold"]}]}"#,
        );
        let policy = compile(&written, &|_| None, true).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(policy.identity.sources.as_ref().map(|s| s[0].header.as_str()), Some("x-tenant"));
        assert_eq!(policy.tier.as_ref().map(|t| t.header.as_str()), Some("x-tier"));
        assert_eq!(policy.queue.priority_header.as_deref(), Some("x-priority"));
        assert_eq!(written.identity.sources.as_ref().map(|s| s[0].header.as_str()), Some(" X-Tenant "));
        assert_eq!(written.tier.as_ref().map(|t| t.header.as_str()), Some("X-Tier"));
        assert_eq!(written.limits[0].window, None, "the slot ttl is the policy's, not written back");
    }

    /// One representative refusal per section function, field and message in full.
    #[test]
    fn each_section_refuses_what_it_owns() {
        let gold = written(r#"{"name": "r", "requests": 1, "window": "1m", "tiers": ["gold"]}"#);
        let limits = [limit("limits[0]", &gold, true, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e}"))];
        let cases: Vec<(Result<(), ConfigError>, ConfigError)> = vec![
            (
                companion(
                    &written(r#"{"upstream": "c", "token": "test-token-0123456789", "timeout": "0s"}"#),
                    &|_| None,
                    true,
                )
                .map(drop),
                error("companion.timeout", "0ns is outside 1ms..60s"),
            ),
            (
                identity(&written(r#"{"sources": [{"header": "x:y"}]}"#)).map(drop),
                error("identity.sources[0].header", "\"x:y\" is not a header name"),
            ),
            (
                self::limits(
                    &[written(r#"{"name": "a", "requests": 1, "window": "1m"}"#), written(r#"{"name": "a"}"#)],
                    false,
                    Duration::from_secs(30),
                    &Identity { sources: None, missing: Default::default() },
                )
                .map(drop),
                error("limits[1].name", "\"a\" is used by another limit"),
            ),
            (
                limit_of(r#"{"name": "r", "requests": 1, "window": "1m", "models": ["", "x"]}"#).map(drop),
                error("limits[0].models[0]", "must not be empty"),
            ),
            (
                limit_of(r#"{"name": "u", "usd": 0.0000001, "window": "1d"}"#).map(drop),
                error("limits[0].usd", "0 is outside 1..1000000000000"),
            ),
            (slots(&written(r#"{"ttl": "2h"}"#)).map(drop), error("slots.ttl", "7200s is outside 1s..1h")),
            (
                tokens(
                    &written(r#"{"models": [{"match": "m", "encoding": "o200k_base", "factor": 0.0}]}"#),
                    Store::Redis,
                )
                .map(drop),
                error("tokens.models[0].factor", "0 is outside (0, 10]"),
            ),
            (
                fallback(&written(r#"{"breaker_failures": 0}"#)).map(drop),
                error("fallback.breaker_failures", "must be positive"),
            ),
            (
                lease(&written(r#"{"initial_fraction": 1.5}"#)).map(drop),
                error("lease.initial_fraction", "1.5 is outside (0.0001, 1]"),
            ),
            (
                bypass(&written(r#"{"tenants": ["sk-SECRET"]}"#)).map(drop),
                error("bypass.tenants[0]", "must be a tenant id (32 lower-case hex digits), not a credential"),
            ),
            (
                prices(&[written(r#"{"match": "m", "input": 1, "output": 1e7}"#)]).map(drop),
                error("prices[0]", "input and output must be dollars per million tokens in 0..1e6"),
            ),
            (
                budgets_are_priced(
                    &[limit_of(r#"{"name": "u", "usd": 1, "window": "1d"}"#).unwrap_or_else(|e| panic!("{e}"))],
                    &[],
                ),
                error("prices", "a `usd` limit needs a price table (requests for models it does not list are refused)"),
            ),
            (
                tier(&written(r#"{"header": "x-tier", "default": "gold", "tenants": {"sk-SECRET": "gold"}}"#), &limits)
                    .map(drop),
                error("tier.tenants (entry 0)", "keys must be tenant ids (32 lower-case hex digits), not credentials"),
            ),
            (
                queue(&written(r#"{"tier_priorities": {"silver": 1}}"#), &limits).map(drop),
                error("queue.tier_priorities.silver", "entry 0: priority 1 must be 0..9, for a tier some limit names"),
            ),
        ];
        for (result, expected) in cases {
            assert_eq!(result, Err(expected.clone()), "{expected}");
            assert!(!expected.to_string().contains("SECRET"));
        }
    }

    #[test]
    fn a_lease_refuses_what_must_be_decided_in_redis() {
        let written_lease: shape::Lease = written(r#"{"enabled": true}"#);
        let lease = lease(&written_lease).unwrap_or_else(|e| panic!("{e}"));
        let tokens = tokens(&written("{}"), Store::Redis).unwrap_or_else(|e| panic!("{e}"));
        let idle = queue(&written("{}"), &[]).unwrap_or_else(|e| panic!("{e}"));
        let waiting = queue(&written(r#"{"max_wait": "1s"}"#), &[]).unwrap_or_else(|e| panic!("{e}"));
        let bucket = [limit_of(r#"{"name": "r", "requests": 1, "window": "1m"}"#).unwrap_or_else(|e| panic!("{e}"))];
        let slots = [limit_of(r#"{"name": "c", "concurrency": 1}"#).unwrap_or_else(|e| panic!("{e}"))];
        assert_eq!(lease_combines(&lease, &idle, &bucket, &tokens), Ok(()));
        let refused = |queue, limits: &[Limit]| lease_combines(&lease, queue, limits, &tokens).map_err(|e| e.message);
        assert!(refused(&waiting, &bucket).is_err_and(|m| m.contains("queueing")));
        assert!(refused(&idle, &slots).is_err_and(|m| m.contains("concurrency limits")));
        let off = LeaseConfig { enabled: false, ..lease.clone() };
        assert_eq!(lease_combines(&off, &waiting, &slots, &tokens), Ok(()), "no lease, nothing to clash");
    }

    #[test]
    fn the_shared_checks_quote_what_was_written() {
        assert_eq!(header_name("f", " X-A ", " X-A ".trim()), Ok("x-a".to_string()));
        assert_eq!(header_name("f", " ", ""), Err(error("f", "\" \" is not a header name")));
        assert_eq!(
            within("f", Duration::from_millis(1500), ..=Duration::from_secs(1), "0s..1s").map_err(|e| e.message),
            Err("1.5s is outside 0s..1s".to_string())
        );
        assert_eq!(
            within("f", 0.5, (Excluded(0.5), Included(1.0)), "(0.5, 1]").map_err(|e| e.message),
            Err("0.5 is outside (0.5, 1]".to_string())
        );
        assert!(within("f", f64::NAN, 0.0..=1.0, "0..1").is_err(), "NaN lies in no range");
        assert!(is_name("gold-1_a") && !is_name("Gold") && !is_name("a:b") && !is_name(&"a".repeat(33)));
        assert_eq!(positive("f", 0u32), Err(error("f", "must be positive")));
    }
}
