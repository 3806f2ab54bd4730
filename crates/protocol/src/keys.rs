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

/// The owner of a limit counted for every caller (`limits[].per: "all"`), in the tenant's
/// place in its keys: `<prefix>{<domain>:all}:<kind>:<name>`. A limit counted per a header
/// has an owner hashed from the value ([`POOL_OWNER_PREFIX`] and 32 hex digits). Tenant
/// ids are 32 hex digits or `anonymous`, so no owner is ever a tenant's id.
pub const ALL_OWNER: &str = "all";
/// The first letter of a `per` header value's owner id (not a hex digit).
pub const POOL_OWNER_PREFIX: &str = "p";

/// Kind of a reservation record's key (`name`: the reservation id).
pub const RESERVATION_KIND: &str = "res";
/// Kind of a queued request's cancel marker (`name`: the reservation id).
pub const CANCEL_KIND: &str = "cancel";
/// Kind of the marker of a stand-alone adjustment applied (`name`: its once id).
pub const ONCE_KIND: &str = "once";
/// Kind and name of a tenant's queue of waiting charges.
pub const QUEUE_KIND: &str = "queue";
pub const QUEUE_NAME: &str = "waiters";
/// Tenant, kind and name of a domain's model calibrations, shared by every proxy: one
/// hash, a field per model rule (fingerprint). No tenant id is five letters long.
pub const CALIBRATION_TENANT: &str = "models";
pub const CALIBRATION_KIND: &str = "cal";
pub const CALIBRATION_NAME: &str = "rules";
/// Tenant, kind and name of a domain's provider words (what the providers said about
/// their own limits), shared by every proxy: one hash, a field per provider key. No
/// tenant id is eight letters long.
pub const PROVIDER_TENANT: &str = "provider";
pub const PROVIDER_KIND: &str = "prov";
pub const PROVIDER_NAME: &str = "words";

/// Kind of an owner's ledger hash for a day (`name`: the day, `YYYYMMDD`): fields
/// `<model>|<part>` (see `ledger::Spent::parts`), `~label` and `~models`.
pub const LEDGER_KIND: &str = "ledger";
/// Kind of the marker of the last ledger batch added for an owner from one proxy worker
/// (`name`: the worker's id).
pub const LEDGER_SEQ_KIND: &str = "ledger-seq";
/// Tenant and kind of a day's index of the owners in the ledger (`name`: the day). No
/// tenant id is six letters long, and a pool's owner id starts with `p`.
pub const LEDGER_INDEX_TENANT: &str = "ledger";
pub const LEDGER_INDEX_KIND: &str = "owners";

/// Shared data: `llmrl.<table>.<domain>.<slot>`. Built without `format!`: a request names
/// two or three of these, and formatting costs several times the copying.
fn table_key(table: &str, domain: &str, slot: u32) -> String {
    let mut digits = itoa::Buffer::new();
    let slot = digits.format(slot);
    let mut key = String::with_capacity(8 + table.len() + domain.len() + slot.len());
    for part in ["llmrl.", table, ".", domain, ".", slot] {
        key.push_str(part);
    }
    key
}

/// Shared data: slot `slot` of the table of leases (the tenant is stored in the value;
/// tables are bounded, see the filter's `memory` config).
pub fn lease_key(domain: &str, slot: u32) -> String {
    table_key("lease", domain, slot)
}

/// Shared data: slot `slot` of the local limiter's table (the degraded mode's counters, or
/// the local store's).
pub fn local_key(domain: &str, slot: u32) -> String {
    table_key("local", domain, slot)
}

/// Shared data: how many requests this proxy has waiting in the queue.
pub fn queued_key(domain: &str) -> String {
    format!("llmrl.queued.{domain}")
}

/// Shared data: how many requests of the tenants at `slot` (a fixed table, see the
/// core's `tables::queued_slot`) wait in this proxy's queue.
pub fn queued_tenant_key(domain: &str, slot: u32) -> String {
    table_key("queued", domain, slot)
}

/// Shared data: the local store's secret for the tables' slot hash (see the filter's
/// `local_limiter::slot_key`).
pub fn local_secret_key(domain: &str) -> String {
    format!("llmrl.local-secret.{domain}")
}

/// Shared data: the circuit breaker in front of the companion.
pub fn breaker_key(domain: &str) -> String {
    format!("llmrl.breaker.{domain}")
}

/// Shared data: how many VMs of this proxy have taken a number (each takes the next at
/// configure; the number keeps their reservation ids apart).
pub fn vm_numbers_key(domain: &str) -> String {
    format!("llmrl.vms.{domain}")
}

/// Shared data: slot `slot` of the table of running completion averages (by tenant and
/// model; model names are hashed, never part of a key).
pub fn average_key(domain: &str, slot: u32) -> String {
    table_key("avg", domain, slot)
}

/// Shared data: what the filter learned from settled replies about the models of rule
/// `rule` (its index among the configured and built-in model rules; bounded by the config).
pub fn calibration_key(domain: &str, rule: u32) -> String {
    table_key("cal", domain, rule)
}

/// Shared data: slot `slot` of the table of provider words (by upstream credential and
/// model, hashed; the owner's hash is stored in the value).
pub fn provider_key(domain: &str, slot: u32) -> String {
    table_key("prov", domain, slot)
}

/// Shared data: this proxy's id in the fleet's exchange of provider words (written once
/// by the first VM, read by the others).
pub fn proxy_id_key(domain: &str) -> String {
    format!("llmrl.proxy.{domain}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared-data keys as operators see them in Envoy's stats and docs/metrics.md.
    #[test]
    fn table_keys_name_their_table_domain_and_slot() {
        assert_eq!(lease_key("llm", 0), "llmrl.lease.llm.0");
        assert_eq!(average_key("my-domain", 16_383), "llmrl.avg.my-domain.16383");
        assert_eq!(queued_tenant_key("llm", 1023), "llmrl.queued.llm.1023");
        assert_eq!(calibration_key("llm", 4_294_967_295), "llmrl.cal.llm.4294967295");
        assert_eq!(local_key("x", 7), "llmrl.local.x.7");
        assert_eq!(provider_key("llm", 12), "llmrl.prov.llm.12");
    }
}
