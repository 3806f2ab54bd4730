//! What a limit is counted per (`limits[].per`) and whether it is enforced
//! (`limits[].mode`): as written, compiled, and checked against the rest of the config.
//! How a request's limits then find their counters is `crate::plan::pools`.

use super::error::{invalid, ConfigError};
use super::policy::{LeaseConfig, Limit, Mode};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// `limits[].per` as written: `"tenant"` (the default), `"all"`, `"end_user"`,
/// `{"header": "x-team-id", "default": "unassigned"}`, or
/// `{"end_user": {"header": "x-end-user"}, "default": "anonymous"}`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum PerShape {
    Named(String),
    Header(HeaderPer),
    EndUser(EndUserPer),
}

/// `{"end_user": "body" | {"header": ...}, "default": ...}`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EndUserPer {
    pub end_user: EndUserSource,
    /// The user a request without one counts as; unset: such a request is refused (400).
    #[serde(default)]
    pub default: Option<String>,
}

/// Where an end user is read: the request body (`"body"`), or a trusted header.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum EndUserSource {
    Body(String),
    Header { header: String },
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
    /// One counter per end user of each tenant (a shared key's users): read from the body
    /// (OpenAI's `safety_identifier` or `user`, Anthropic's `metadata.user_id`), or from a
    /// trusted header (`header`, lower case). `default`: the user a request without one
    /// counts as; `None`: such a request is refused.
    EndUser { header: Option<String>, default: Option<String> },
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
    per_at(&format!("{at}.per"), written, credentials)
}

/// A `per`-shaped field (`"tenant"`, `"all"` or a trusted header), found at `field`.
pub(super) fn per_at(field: &str, written: Option<&PerShape>, credentials: &[String]) -> Result<Per, ConfigError> {
    let field = field.to_string();
    match written {
        None => Ok(Per::Tenant),
        Some(PerShape::Named(name)) if name == "tenant" => Ok(Per::Tenant),
        Some(PerShape::Named(name)) if name == "all" => Ok(Per::All),
        Some(PerShape::Named(name)) if name == "end_user" => Ok(Per::EndUser { header: None, default: None }),
        Some(PerShape::Named(name)) => Err(invalid(
            field,
            format!(
                "{name:?} is not one of \"tenant\", \"all\", \"end_user\" or {{\"header\": \"<a trusted request \
                 header>\"}}"
            ),
        )),
        Some(PerShape::EndUser(EndUserPer { end_user, default })) => {
            let header = match end_user {
                EndUserSource::Body(source) if source == "body" => None,
                EndUserSource::Body(source) => {
                    return Err(invalid(
                        format!("{field}.end_user"),
                        format!("{source:?} is not \"body\" or {{\"header\": \"<a trusted request header>\"}}"),
                    ))
                }
                EndUserSource::Header { header } => {
                    Some(header_name(&format!("{field}.end_user.header"), header, credentials)?)
                }
            };
            Ok(Per::EndUser { header, default: default_value(&field, default.as_deref())? })
        }
        Some(PerShape::Header(HeaderPer { header, default })) => {
            let name = header_name(&format!("{field}.header"), header, credentials)?;
            Ok(Per::Header { name, default: default_value(&field, default.as_deref())? })
        }
    }
}

/// A trusted header's name, lower case, at `field`: never a credential's.
fn header_name(field: &str, header: &str, credentials: &[String]) -> Result<String, ConfigError> {
    let name = header.trim().to_ascii_lowercase();
    let valid = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !valid {
        return Err(invalid(field, format!("{header:?} is not a header name")));
    }
    if CREDENTIAL_HEADERS.contains(&name.as_str()) || credentials.contains(&name) {
        return Err(invalid(
            field,
            format!(
                "{name:?} carries a credential: a limit per credential is `per: \"tenant\"`; a pool needs \
                 a header naming a team or organisation, set by something trusted"
            ),
        ));
    }
    Ok(name)
}

/// A `per`'s `default` (at `field.default`), trimmed: 1 to MAX_DEFAULT printable characters.
fn default_value(field: &str, default: Option<&str>) -> Result<Option<String>, ConfigError> {
    match default {
        None => Ok(None),
        Some(value) if value.trim().is_empty() || value.len() > MAX_DEFAULT || value.chars().any(char::is_control) => {
            Err(invalid(format!("{field}.default"), format!("must be 1-{MAX_DEFAULT} printable characters")))
        }
        Some(value) => Ok(Some(value.trim().to_string())),
    }
}

/// Whether `limits[].mode` says shadow (checked by its type: `enforce` or `shadow`).
pub(super) fn shadow(written: Option<Mode>) -> bool {
    written == Some(Mode::Shadow)
}

/// What per-limit shadow cannot be combined with: a lease admits from budget taken from
/// Redis, and a shadow limit must never refuse, so a leased limit is enforced. (Pools are
/// leased per proxy from their own entry of the lease table, `effects::lease_table`.)
pub(super) fn combine(limits: &[Limit], lease: &LeaseConfig) -> Result<(), ConfigError> {
    if !lease.enabled {
        return Ok(());
    }
    for (i, limit) in limits.iter().enumerate() {
        if limit.shadow {
            return Err(invalid(format!("limits[{i}].mode"), "a shadow limit cannot be leased (`lease.enabled`)"));
        }
        if limit.fair_share.is_some() {
            // Each tenant's share is judged by the script on every charge, against the
            // pool's other tenants; a proxy's grant would admit past that judgement.
            return Err(invalid(
                format!("limits[{i}].fair_share"),
                "a pool with fair shares is charged in Redis request by request: it cannot be leased (`lease.enabled`)",
            ));
        }
    }
    Ok(())
}

/// A shared pool's fair shares, checked: how the Redis script holds each active tenant to
/// its weighted max-min share (`lua/limits.lua`, "Fair shares").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FairShare {
    /// Who the shares are between: tenants (`Per::Tenant`), or a trusted header's values
    /// (`Per::Header`: teams), never `Per::All`.
    pub between: Per,
    /// By tier between tenants, by the header's value between its values.
    pub weights: BTreeMap<String, u32>,
    pub default_weight: u32,
    pub max_tenants: u32,
    pub idle: Duration,
}

impl FairShare {
    /// The weight of a claimant `weights` knows as `name` (a tenant's tier, a header's
    /// value).
    pub fn weight_of(&self, name: &str) -> u32 {
        self.weights.get(name).copied().unwrap_or(self.default_weight)
    }
}
