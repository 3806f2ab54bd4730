//! What a limit is counted per (`limits[].per`) and whether it is enforced
//! (`limits[].mode`): as written, compiled, and checked against the rest of the config.
//! How a request's limits then find their counters is `crate::plan::pools`.

use super::error::{invalid, ConfigError};
use super::policy::{tiers_named, LeaseConfig, Limit, Mode};
use super::shape::ConfigDuration;
use crate::protocol::LimitKind;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// `limits[].per` as written: `"tenant"` (the default), `"all"`, or
/// `{"header": "x-team-id", "default": "unassigned"}`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum PerShape {
    Named(String),
    Header(HeaderPer),
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderPer {
    /// A request header set by something the operator trusts (a JWT filter copying a
    /// team or org claim); a client must not be able to set it.
    pub header: String,
    /// The value a request without the header counts under; unset: the limit does not
    /// apply to such a request.
    #[serde(default)]
    pub default: Option<String>,
}

/// What a limit is counted per, checked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Per {
    /// Each tenant (API key) its own counter.
    #[default]
    Tenant,
    /// One counter per value of a trusted request header (name in lower case): a team's
    /// or an organisation's pool.
    Header { name: String, default: Option<String> },
    /// One counter for every caller: with `models`, the upstream's own quota.
    All,
}

/// The credential headers the providers' APIs use: a pool keyed on one would count per
/// credential (a tenant, done better by `per: tenant`) and take the credential's value
/// into a key's hash input for no purpose.
const CREDENTIAL_HEADERS: [&str; 4] = ["authorization", "x-api-key", "api-key", "x-goog-api-key"];

/// The longest `default` value (a value is hashed, never stored; this bounds the config).
const MAX_DEFAULT: usize = 256;

/// `limits[i].per`, at `at` (`limits[2]`); `credentials`: the operator's own credential
/// headers (`identity.sources`), lower case.
pub(super) fn per(at: &str, written: Option<&PerShape>, credentials: &[String]) -> Result<Per, ConfigError> {
    let field = format!("{at}.per");
    match written {
        None => Ok(Per::Tenant),
        Some(PerShape::Named(name)) if name == "tenant" => Ok(Per::Tenant),
        Some(PerShape::Named(name)) if name == "all" => Ok(Per::All),
        Some(PerShape::Named(name)) => Err(invalid(
            field,
            format!("{name:?} is not one of \"tenant\", \"all\" or {{\"header\": \"<a trusted request header>\"}}"),
        )),
        Some(PerShape::Header(HeaderPer { header, default })) => {
            let name = header.trim().to_ascii_lowercase();
            let valid = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !valid {
                return Err(invalid(format!("{field}.header"), format!("{header:?} is not a header name")));
            }
            if CREDENTIAL_HEADERS.contains(&name.as_str()) || credentials.contains(&name) {
                return Err(invalid(
                    format!("{field}.header"),
                    format!(
                        "{name:?} carries a credential: a limit per credential is `per: \"tenant\"`; a pool needs \
                         a header naming a team or organisation, set by something trusted"
                    ),
                ));
            }
            if let Some(value) = default {
                if value.trim().is_empty() || value.len() > MAX_DEFAULT || value.chars().any(char::is_control) {
                    return Err(invalid(
                        format!("{field}.default"),
                        format!("must be 1-{MAX_DEFAULT} printable characters"),
                    ));
                }
            }
            Ok(Per::Header { name, default: default.as_ref().map(|d| d.trim().to_string()) })
        }
    }
}

/// Whether `limits[].mode` says shadow (checked by its type: `enforce` or `shadow`).
pub(super) fn shadow(written: Option<Mode>) -> bool {
    written == Some(Mode::Shadow)
}

/// What pools and per-limit shadow cannot be combined with yet: leases are a tenant's
/// own (one entry per tenant in the proxy's lease table), so a leased limit must be
/// counted per tenant and enforced.
pub(super) fn combine(limits: &[Limit], lease: &LeaseConfig) -> Result<(), ConfigError> {
    if !lease.enabled {
        return Ok(());
    }
    for (i, limit) in limits.iter().enumerate() {
        if limit.per != Per::Tenant {
            return Err(invalid(
                format!("limits[{i}].per"),
                "with `lease.enabled` every limit is counted per tenant: shared pools are charged directly \
                 (through the companion's batches), not leased",
            ));
        }
        if limit.shadow {
            return Err(invalid(format!("limits[{i}].mode"), "a shadow limit cannot be leased (`lease.enabled`)"));
        }
    }
    Ok(())
}

/// `limits[].fair_share` as written.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FairShareShape {
    /// Tier → weight (1 to 1000): a tenant of that tier has that many shares.
    #[serde(default)]
    pub weights: BTreeMap<String, u32>,
    /// The weight of a tenant whose tier `weights` does not name (default 1).
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

/// A shared pool's fair shares, checked: how the Redis script holds each active tenant to
/// its weighted max-min share (`lua/limits.lua`, "Fair shares").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FairShare {
    pub weights: BTreeMap<String, u32>,
    pub default_weight: u32,
    pub max_tenants: u32,
    pub idle: Duration,
}

impl FairShare {
    /// The weight of a tenant of `tier`.
    pub fn weight_of(&self, tier: &str) -> u32 {
        self.weights.get(tier).copied().unwrap_or(self.default_weight)
    }
}

const WEIGHTS: std::ops::RangeInclusive<u32> = 1..=1000;
const MAX_TENANTS: std::ops::RangeInclusive<u32> = 2..=256;
const IDLE: std::ops::RangeInclusive<Duration> = Duration::from_secs(1)..=Duration::from_secs(86_400);

/// `limits[i].fair_share`, at `at`, of the limit `limit` (compiled but for it).
pub(super) fn fair_share(
    at: &str,
    written: Option<&FairShareShape>,
    limit: &Limit,
) -> Result<Option<FairShare>, ConfigError> {
    let Some(written) = written else { return Ok(None) };
    let field = format!("{at}.fair_share");
    if limit.per == Per::Tenant {
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
        Some(ConfigDuration(idle)) => super::compile::within(format!("{field}.idle"), *idle, IDLE, "1s..1d")?,
        None => limit.window.clamp(*IDLE.start(), *IDLE.end()),
    };
    Ok(Some(FairShare { weights: written.weights.clone(), default_weight, max_tenants, idle }))
}

/// Every tier a `fair_share.weights` names is one some limit names: the only tiers a
/// tenant can be in (a misspelt tier would weigh nobody).
pub(super) fn fair_weights_name_tiers(limits: &[Limit]) -> Result<(), ConfigError> {
    for (i, limit) in limits.iter().enumerate() {
        let Some(fair) = &limit.fair_share else { continue };
        if let Some(tier) = fair.weights.keys().find(|tier| !tiers_named(limits).any(|t| t == tier.as_str())) {
            return Err(invalid(
                format!("limits[{i}].fair_share.weights.{tier}"),
                format!("{tier:?} is not a tier any limit names"),
            ));
        }
    }
    Ok(())
}
