//! Every key name the two sides write: Redis keys (written by the companion's scripts) and
//! proxy-wasm shared-data keys (written by the filter's workers). One place, pinned by
//! golden tests: a renamed key silently forgets every tenant's state on upgrade.

/// `<prefix>{<domain>:<tenant>}:<kind>:<name>`: the braces are a Redis Cluster hash tag,
/// so all keys of a tenant share a slot and one script call can touch them together.
/// `kind` is the limit's kind ([`crate::LimitKind::script_name`]) or one of the
/// per-request kinds below.
pub fn redis_key(prefix: &str, domain: &str, tenant: &str, kind: &str, name: &str) -> String {
    format!("{prefix}{{{domain}:{tenant}}}:{kind}:{name}")
}

/// Kind of a reservation record's key (`name`: the reservation id).
pub const RESERVATION_KIND: &str = "res";
/// Kind of a queued request's cancel marker (`name`: the reservation id).
pub const CANCEL_KIND: &str = "cancel";
/// Kind and name of a tenant's queue of waiting charges.
pub const QUEUE_KIND: &str = "queue";
pub const QUEUE_NAME: &str = "waiters";

/// Shared data: a tenant's leases (all limits in one value).
pub fn lease_key(domain: &str, tenant: &str) -> String {
    format!("llmrl.lease.{domain}.{tenant}")
}

/// Shared data: a tenant's local buckets in the degraded mode.
pub fn local_key(domain: &str, tenant: &str) -> String {
    format!("llmrl.local.{domain}.{tenant}")
}

/// Shared data: how many requests this proxy has waiting in the queue.
pub fn queued_key(domain: &str) -> String {
    format!("llmrl.queued.{domain}")
}

/// Shared data: the circuit breaker in front of the companion.
pub fn breaker_key(domain: &str) -> String {
    format!("llmrl.breaker.{domain}")
}

/// Shared data: a tenant's running average completion length for a model.
pub fn average_key(domain: &str, tenant: &str, model: &str) -> String {
    format!("llmrl.avg.{domain}.{tenant}.{model}")
}
