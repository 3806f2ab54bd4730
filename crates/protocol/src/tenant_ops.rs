//! What an operator asks the companion about one tenant, outside any request: where it
//! stands on each limit (`USAGE_PATH`, charging nothing) and, to start it afresh, a reset
//! of its counters (`RESET_PATH`). The `llm-ratelimit` CLI sends these; the filter never
//! does. Both take the tenant and the limits the same way (`TenantLimits`), as a charge
//! names them but without a cost.

use crate::{is_token_bucket, LimitKind};
use serde::{Deserialize, Serialize};

/// Endpoint that reports a tenant's state on each limit without charging (a
/// [`TenantLimits`], answered with a [`UsageReply`]).
pub const USAGE_PATH: &str = "/v1/usage";
/// Endpoint that deletes a tenant's counters for the limits named (a [`TenantLimits`],
/// answered with a [`ResetReply`]).
pub const RESET_PATH: &str = "/v1/admin/reset";

/// One tenant and the limits of a policy, as the filter's config compiles them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    pub domain: String,
    /// Hashed tenant id (never a credential).
    pub tenant: String,
    pub limits: Vec<LimitSpec>,
}

/// A limit as a charge names it (its key comes from `name` and `kind`), without a cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    pub name: String,
    pub capacity: u64,
    pub window_ms: u64,
    #[serde(default, skip_serializing_if = "is_token_bucket")]
    pub kind: LimitKind,
    /// As `LimitCharge::period_bounds_ms`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub period_bounds_ms: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageReply {
    /// One per limit asked about, in request order.
    pub limits: Vec<LimitUsage>,
    /// The tenant's reservations awaiting settlement: requests admitted whose real usage
    /// is not known yet (or never will be: a reservation not settled expires after the
    /// filter's `tokens.reservation_ttl`, and its charge stands).
    pub reservations: u64,
    /// False when counting stopped early (a very large keyspace): `reservations` is then
    /// a lower bound.
    pub reservations_complete: bool,
}

/// Where a tenant stands on one limit, now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LimitUsage {
    pub name: String,
    #[serde(default, skip_serializing_if = "is_token_bucket")]
    pub kind: LimitKind,
    /// The capacity.
    pub limit: u64,
    /// Whole units free now (requests, tokens, micro-dollars or slots).
    pub remaining: u64,
    /// What is taken now: `limit` less what is free, in whole units (for a slot limit,
    /// the requests in flight). It counts reservations not yet settled at what they
    /// reserved.
    pub used: u64,
    /// Time until the limit is full again (slots: 0).
    pub reset_after_ms: u64,
    /// Time until one more unit fits (0: it fits now).
    pub retry_after_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResetReply {
    /// How many of the limits' counters existed and were deleted (a full limit has none).
    pub deleted: u64,
}
