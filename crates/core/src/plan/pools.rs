//! Whose counter each of a request's limits is charged on (`limits[].per`): the tenant's
//! own, a pool shared by every request with the same value of a trusted header (a team,
//! an organisation), or one pool for every caller (the upstream's quota). A pool's
//! counter is named by an owner id that takes the tenant's place in its Redis keys
//! (`protocol::keys::ALL_OWNER`, or a hash of the header's name and value, so a value is
//! never in clear in a key, and a client inventing values makes keys that expire with
//! their window, never state in the proxy: nothing here is kept per value).

use crate::config::{Per, Policy};
use crate::plan::charge::ChargePlan;
use crate::protocol::keys::{ALL_OWNER, POOL_OWNER_PREFIX};
use crate::protocol::plans::END_USER_OWNER_PREFIX;
use crate::protocol::FairClaim;
use sha2::{Digest, Sha256};

/// Where one limit of a request is counted.
#[derive(Debug, Clone, PartialEq)]
pub enum Counter {
    /// The tenant's own counter.
    Tenant,
    /// A pool's, by its owner id; with fair shares, who claims this request's share.
    Pool { owner: String, fair: Option<FairClaim> },
    /// The limit's header is missing and it has no default: it does not apply.
    Absent,
}

/// A request that sent a `per` header more than once: which copy counts is for hosts and
/// the component that sets it to disagree on, so the request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepeatedHeader(pub String);

/// The owner id of the pool of `header`'s value `value`: the first 16 bytes of SHA-256
/// over a domain separator, the header's name and the value, as 32 hex digits after
/// `POOL_OWNER_PREFIX` (33 characters, a Redis key part).
pub fn pool_owner(header: &str, value: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"llm-ratelimit/pool/v1\0")
        .chain_update(header.as_bytes())
        .chain_update(b"\0")
        .chain_update(value.as_bytes())
        .finalize();
    owner_id(POOL_OWNER_PREFIX, &digest)
}

/// The owner id of end user `user` of tenant `tenant` (a shared key's user, see
/// `Per::EndUser`): as a pool's, over the tenant id and the user, after
/// `END_USER_OWNER_PREFIX`. The tenant is part of it, so two keys' users of one name are
/// two owners, and a user never reaches another key's counters.
pub fn end_user_owner(tenant: &str, user: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"llm-ratelimit/end-user/v1\0")
        .chain_update(tenant.as_bytes())
        .chain_update(b"\0")
        .chain_update(user.as_bytes())
        .finalize();
    owner_id(END_USER_OWNER_PREFIX, &digest)
}

fn owner_id(prefix: &str, digest: &[u8]) -> String {
    let mut id = String::with_capacity(33);
    id.push_str(prefix);
    for nibble in digest.iter().take(16).flat_map(|b| [b >> 4, b & 0xf]) {
        id.push(char::from_digit(u32::from(nibble), 16).unwrap_or('0'));
    }
    id
}

/// Each limit's counter, in config order, from the request's header values
/// (`header_values(name)`: every copy the request has) and the end user its body names,
/// for `tenant` of `tier`.
pub fn counters(
    config: &Policy,
    tenant: &str,
    tier: &str,
    body_end_user: Option<&str>,
    mut header_values: impl FnMut(&str) -> Vec<String>,
) -> Result<Vec<Counter>, RepeatedHeader> {
    let mut value_of = |name: &str, default: Option<&str>| -> Result<Option<String>, RepeatedHeader> {
        let values = header_values(name);
        let value = match values.as_slice() {
            [] => None,
            [one] => Some(one.trim()).filter(|v| !v.is_empty()),
            _ => return Err(RepeatedHeader(name.to_string())),
        };
        Ok(value.or(default).map(str::to_string))
    };
    let mut counters = Vec::with_capacity(config.limits.len());
    for limit in &config.limits {
        let owner = match &limit.per {
            Per::Tenant => {
                counters.push(Counter::Tenant);
                continue;
            }
            Per::All => ALL_OWNER.to_string(),
            Per::Header { name, default } => match value_of(name, default.as_deref())? {
                Some(value) => pool_owner(name, &value),
                None => {
                    counters.push(Counter::Absent);
                    continue;
                }
            },
            Per::EndUser { header, default } => {
                let user = match header {
                    Some(name) => value_of(name, default.as_deref())?,
                    None => body_end_user.filter(|u| !u.is_empty()).or(default.as_deref()).map(str::to_string),
                };
                match user {
                    Some(user) => end_user_owner(tenant, &user),
                    // Refused if the limit applies to the request (see `unnamed_end_user`).
                    None => {
                        counters.push(Counter::Absent);
                        continue;
                    }
                }
            }
        };
        let fair = match &limit.fair_share {
            None => None,
            Some(fair) => {
                // Between a header's values (teams), the callers without one share one
                // claimant; between tenants, each tenant is one, weighted by its tier.
                let (claimant, weight) = match &fair.between {
                    Per::Header { name, default } => {
                        let value = value_of(name, default.as_deref())?.unwrap_or_default();
                        (pool_owner(name, &value), fair.weight_of(&value))
                    }
                    Per::Tenant | Per::All | Per::EndUser { .. } => (tenant.to_string(), fair.weight_of(tier)),
                };
                Some(FairClaim {
                    claimant,
                    weight,
                    max_claimants: fair.max_tenants,
                    idle_ms: u64::try_from(fair.idle.as_millis()).unwrap_or(u64::MAX),
                })
            }
        };
        counters.push(Counter::Pool { owner, fair });
    }
    Ok(counters)
}

/// Whether a limit counted per end user applies to the request (`plan`) and it names
/// none, with no default user: it is refused (400), never let through uncounted.
pub fn unnamed_end_user(config: &Policy, plan: &ChargePlan, counters: &[Counter]) -> bool {
    config.limits.iter().zip(counters).enumerate().any(|(i, (limit, counter))| {
        matches!(limit.per, Per::EndUser { .. }) && *counter == Counter::Absent && plan.applies(i)
    })
}

/// The distinct pool claimants of a request (limits counted per a header that it was
/// charged on): each owner id with `<header>=<owner id>`, for the spend ledger. At most
/// one per limit.
pub fn claimants(config: &Policy, counters: &[Counter]) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = Vec::new();
    for (limit, counter) in config.limits.iter().zip(counters) {
        let (Per::Header { name, .. }, Counter::Pool { owner, .. }) = (&limit.per, counter) else { continue };
        if found.iter().any(|(known, _)| known == owner) {
            continue;
        }
        // Labelled by the owner's id, never the header's value: a pool's value (a team's
        // name) is never kept in clear in Redis, as its counters' keys are not.
        found.push((owner.clone(), format!("{name}={owner}")));
    }
    found
}

/// Puts each bucket of `plan` on its counter, and marks the shadow limits: a limit whose
/// header is absent is not charged (look-only, as a limit of another model); a shadow
/// limit is charged but never refuses or clamps. A pool with fair shares is claimed as
/// its counter says.
pub fn assign(config: &Policy, plan: &mut ChargePlan, counters: &[Counter]) {
    for (i, (bucket, limit)) in plan.buckets.iter_mut().zip(&config.limits).enumerate() {
        match counters.get(i) {
            Some(Counter::Pool { owner, fair }) => {
                bucket.owner = Some(owner.clone());
                bucket.fair = fair.clone();
            }
            Some(Counter::Absent) => {
                bucket.cost = 0;
                bucket.min_cost = None;
                bucket.provisional = false;
                bucket.look_only = true;
                if let Some(applies) = plan.applicable.get_mut(i) {
                    *applies = false;
                }
                if let Some(eligible) = plan.eligible.get_mut(i) {
                    *eligible = false;
                }
            }
            Some(Counter::Tenant) | None => {}
        }
        if limit.shadow {
            bucket.shadow = true;
            bucket.min_cost = None;
        }
    }
}

/// The owner of each bucket of `plan`, in config order (`None`: the tenant's), for its
/// settlements.
pub fn owners(plan: &ChargePlan) -> Vec<Option<String>> {
    plan.buckets.iter().map(|b| b.owner.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(limits: &str) -> Policy {
        let json =
            format!(r#"{{"companion": {{"upstream": "c", "token": "test-token-0123456789"}}, "limits": {limits}}}"#);
        Policy::from_json(json.as_bytes()).expect("config")
    }

    fn config_with_tiers(limits: &str) -> Policy {
        let json = format!(
            r#"{{"companion": {{"upstream": "c", "token": "test-token-0123456789"}},
                "tier": {{"header": "x-tier", "default": "free"}}, "limits": {limits}}}"#
        );
        Policy::from_json(json.as_bytes()).expect("config")
    }

    #[test]
    fn each_limit_is_counted_per_what_it_says() {
        let config = config(
            r#"[{"name": "key", "requests": 5, "window": "1m"},
                {"name": "team", "requests": 50, "window": "1m", "per": {"header": "X-Team-Id"}},
                {"name": "org", "requests": 80, "window": "1m", "per": {"header": "x-org", "default": "none"}},
                {"name": "upstream", "requests": 500, "window": "1m", "per": "all"}]"#,
        );
        let headers = |name: &str| match name {
            "x-team-id" => vec!["team-a".to_string()],
            _ => vec![],
        };
        let counters = counters(&config, "t1", "", None, headers).expect("no repeated header");
        let pool = |owner: String| Counter::Pool { owner, fair: None };
        assert_eq!(
            counters,
            [
                Counter::Tenant,
                pool(pool_owner("x-team-id", "team-a")),
                pool(pool_owner("x-org", "none")),
                pool("all".into())
            ]
        );
        let absent = super::counters(&config, "t1", "", None, |_| vec![]).expect("nothing repeated");
        assert_eq!(absent[1], Counter::Absent, "no header, no default: the team limit does not apply");
        let twice = super::counters(&config, "t1", "", None, |name| vec![name.to_string(), "b".into()]);
        assert_eq!(twice, Err(RepeatedHeader("x-team-id".into())));
    }

    /// Fair shares between tenants (each weighted by its tier) or between a trusted
    /// header's values (teams, weighted by the value): who claims a request's share.
    #[test]
    fn a_fair_pool_is_claimed_by_the_tenant_or_by_its_team() {
        let config = config_with_tiers(
            r#"[{"name": "by-tenant", "tokens": 5000, "window": "1m", "per": "all",
                 "fair_share": {"weights": {"gold": 3}}},
                {"name": "by-team", "tokens": 5000, "window": "1m", "per": "all",
                 "fair_share": {"between": {"header": "X-Team-Id"}, "weights": {"research": 4}}},
                {"name": "tier-rpm", "requests": 100, "window": "1m", "tiers": ["gold", "free"]}]"#,
        );
        let claim = |team: Option<&str>, tenant: &str, tier: &str| {
            let headers = |name: &str| match (name, team) {
                ("x-team-id", Some(team)) => vec![team.to_string()],
                _ => vec![],
            };
            let counters = counters(&config, tenant, tier, None, headers).expect("one value each");
            counters
                .into_iter()
                .take(2)
                .map(|c| match c {
                    Counter::Pool { fair: Some(fair), .. } => (fair.claimant, fair.weight),
                    other => panic!("a fair pool, not {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        let research = pool_owner("x-team-id", "research");
        assert_eq!(claim(Some("research"), "t1", "gold"), [("t1".into(), 3), (research.clone(), 4)]);
        // Another key of the same team claims the team's share, at the team's weight.
        assert_eq!(claim(Some("research"), "t2", "")[1], (research, 4));
        assert_eq!(claim(Some("ops"), "t2", "")[1], (pool_owner("x-team-id", "ops"), 1));
        // Callers without a team share one claimant, at the default weight.
        assert_eq!(claim(None, "t3", "")[1], claim(None, "t4", "")[1]);
        assert_eq!(claim(None, "t3", "")[1].1, 1);
        // Two values of the team header: refused, as for a `per` header.
        let twice = counters(&config, "t1", "", None, |name| match name {
            "x-team-id" => vec!["a".into(), "b".into()],
            _ => vec![],
        });
        assert_eq!(twice, Err(RepeatedHeader("x-team-id".into())));
    }

    #[test]
    fn owner_ids_hide_the_value_and_fit_a_key() {
        let a = pool_owner("x-team-id", "team-a");
        assert_eq!(a.len(), 33);
        assert!(a.starts_with('p') && !a.contains("team"));
        assert!(crate::protocol::is_key_part(&a));
        assert_ne!(a, pool_owner("x-team-id", "team-b"));
        assert_ne!(a, pool_owner("x-org", "team-a"), "the header is part of the id");
    }
}

#[cfg(test)]
mod readme_tests {
    use super::*;

    /// docs/pools.md's organisation policy loads exactly as written, each limit counted per
    /// what it says.
    #[test]
    fn the_readme_organisation_policy_loads_as_written() {
        let block = crate::testing::docs_json_block("org-policy-example");
        let config = Policy::from_json(block.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        let per = |name: &str| config.limit(name).map(|l| l.per.clone());
        assert_eq!(per("upstream-gpt4o-tpm"), Some(Per::All));
        assert_eq!(per("org-rpm"), Some(Per::Header { name: "x-org-id".into(), default: None }));
        assert_eq!(per("team-tpm"), Some(Per::Header { name: "x-team-id".into(), default: Some("unassigned".into()) }));
        assert_eq!(per("key-rpm"), Some(Per::Tenant));
        assert!(config.limit("team-inflight-trial").is_some_and(|l| l.shadow));
        assert!(
            config.limit("team-monthly-usd").is_some_and(|l| l.kind == crate::protocol::LimitKind::Calendar),
            "a calendar budget"
        );
        let applying = |model: &str| {
            config.limits.iter().filter(|l| l.applies_to(model, "")).map(|l| l.name.as_str()).collect::<Vec<_>>()
        };
        assert!(applying("gpt-4o-mini-2024-07-18").contains(&"upstream-mini-tpm"));
        assert!(!applying("gpt-4o-mini-2024-07-18").contains(&"upstream-gpt4o-tpm"), "mini has its own quota");
        assert!(applying("gpt-4o-2024-08-06").contains(&"upstream-gpt4o-tpm"));
    }
}
