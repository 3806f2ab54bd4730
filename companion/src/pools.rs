//! Charges and settlements whose limits have several owners: a tenant's own limits, a
//! team's pool (`limits[].per` a header) and the upstream's quota (`per: "all"`), each
//! counter keyed under its owner's hash tag (`{domain:owner}`).
//!
//! On one Redis server every key is in reach of one script call: the request's limits,
//! whoever owns them, are charged all or nothing in that call (`lua/limits.lua`), and
//! settled in one call against the one reservation record, under the tenant's tag.
//!
//! On Redis Cluster the owners' keys live in different hash slots, and a script call may
//! touch one slot only. A charge is then split by owner, the tenant's own limits first and
//! the pools in the order the request names them, and the parts are charged one after
//! another, each all or nothing in its slot, each leaving its own reservation record (the
//! request's id, under its owner's tag). When a part is refused, the parts already charged
//! are given back at once through their records, and the request is refused. So no counter
//! is ever charged past its capacity by an admitted request: a cluster never admits more
//! than one server would. What differs is that a request later refused holds what it took
//! from the earlier parts for one round trip to Redis (about a millisecond), during which a
//! concurrent request may be refused although it would have fitted: refusals, not
//! admissions, are what a race adds (measured by tests/e2e/test_pools.py, printed in
//! docs/benchmark.md). If the companion stops between a part's charge and its rollback, what that
//! part took stays charged until the counter refills. A settlement is split the same way,
//! each part applied at most once by its own record.
//!
//! A lease (a grant of budget a proxy admits from locally) is split the same way on a
//! cluster: the parts are granted in that order, each all or nothing in its slot; when a
//! part is refused, the grants already made are given back at once (a stand-alone credit,
//! which the script bounds by what was granted and not yet returned), and the lease is
//! refused. Budget a later-refused lease held for that round trip is, again, a refusal a
//! concurrent request may see, never an admission past a capacity.
//!
//! Elastic limits (a completion allowance clamped to what is left) give up one reduction
//! across all of a request's limits. A part that must clamp further than the parts before
//! it had clamped rolls every part back, and the charge starts over at the larger
//! reduction: at most once per part, as the reduction only grows.

use crate::batcher::Batcher;
use crate::limits::{self, Call, Op};
use llm_ratelimit_protocol::{
    Adjustment, ChargeRequest, LeaseAsk, LeaseRequest, LimitCharge, LimitOutcome, LimitSpec, LimitStatus, LimitsReply,
    Reservation, Settlement, TenantLimits,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How long the record of a part lives when the filter asked for none (a charge it will
/// not settle): long enough to roll the part back.
const ROLLBACK_RECORD_TTL_MS: u64 = 60_000;

/// The owners of `limits` (their own, else `tenant`), each with the indices of its
/// limits: the tenant's first, then the pools in the order they first appear.
pub fn by_owner<'a>(tenant: &'a str, owners: impl Iterator<Item = Option<&'a str>>) -> Vec<(&'a str, Vec<usize>)> {
    let mut groups: Vec<(&str, Vec<usize>)> = vec![(tenant, Vec::new())];
    for (i, owner) in owners.enumerate() {
        let owner = owner.unwrap_or(tenant);
        match groups.iter_mut().find(|(known, _)| *known == owner) {
            Some((_, indices)) => indices.push(i),
            None => groups.push((owner, vec![i])),
        }
    }
    groups.retain(|(_, indices)| !indices.is_empty());
    groups
}

/// Whether every limit is the tenant's own, so one call's keys (with the record and the
/// marker, under the tenant's tag) share the tenant's slot. A request whose limits are
/// all a pool's is split too: its record goes under the pool's tag.
fn tenant_only(tenant: &str, groups: &[(&str, Vec<usize>)]) -> bool {
    match groups {
        [] => true,
        [(owner, _)] => *owner == tenant,
        _ => false,
    }
}

/// Charges `request`: in one script call on one server or when its limits have one
/// owner; split by owner on a cluster (each part checks its owner's cancel marker).
pub async fn charge(batcher: &Arc<Batcher>, prefix: &str, request: &ChargeRequest) -> Result<LimitsReply, String> {
    let groups = by_owner(&request.tenant, request.limits.iter().map(|l| l.owner.as_deref()));
    if !batcher.store().is_cluster() || tenant_only(&request.tenant, &groups) {
        return charge_one(batcher, prefix, request).await;
    }
    let groups: Vec<(String, Vec<usize>)> = groups.into_iter().map(|(o, i)| (o.to_string(), i)).collect();
    let reservation = request
        .reservation
        .clone()
        .map(|r| Reservation { ttl_ms: if r.ttl_ms == 0 { ROLLBACK_RECORD_TTL_MS } else { r.ttl_ms }, ..r });
    let reservation = reservation.unwrap_or_else(|| Reservation { id: rollback_id(), ttl_ms: ROLLBACK_RECORD_TTL_MS });
    let mut reduction = 0;
    // Each pass either ends or raises the reduction, which a part raises at most once.
    for _ in 0..=groups.len() {
        let mut outcomes: Vec<Option<LimitOutcome>> = vec![None; request.limits.len()];
        let mut charged: Vec<(&str, ChargeRequest, LimitsReply)> = Vec::new();
        let mut again = false;
        for (g, (owner, indices)) in groups.iter().enumerate() {
            let part = ChargeRequest {
                domain: request.domain.clone(),
                tenant: owner.clone(),
                limits: indices.iter().map(|&i| reduced(&request.limits[i], reduction)).collect(),
                reservation: Some(reservation.clone()),
                wait: None,
            };
            let reply = charge_one(batcher, prefix, &part).await;
            let reply = match reply {
                Ok(reply) => reply,
                Err(err) => {
                    roll_back(batcher, prefix, &charged).await;
                    return Err(err);
                }
            };
            for (&i, outcome) in indices.iter().zip(&reply.limits) {
                outcomes[i] = Some(outcome.clone());
            }
            if reply.suspended.is_some() {
                roll_back(batcher, prefix, &charged).await;
                return Ok(reply);
            }
            if !reply.allowed {
                roll_back(batcher, prefix, &charged).await;
                let rest = &groups[g + 1..];
                peek_rest(batcher, prefix, request, rest, &mut outcomes).await;
                return Ok(merged(charged_names(request), false, outcomes));
            }
            let further = part
                .limits
                .iter()
                .zip(&reply.limits)
                .filter(|(l, _)| l.min_cost.is_some_and(|min| min < l.cost) && !l.shadow)
                .map(|(l, o)| l.cost.saturating_sub(o.charged))
                .max()
                .unwrap_or(0);
            charged.push((owner.as_str(), part, reply));
            reduction += further;
            if further > 0 && g > 0 {
                roll_back(batcher, prefix, &charged).await;
                again = true;
                break;
            }
        }
        if !again {
            return Ok(merged(charged_names(request), true, outcomes));
        }
    }
    Err("elastic limits of several owners did not agree on a grant".into())
}

/// One script call (`request`'s keys share one slot, or there is one server).
async fn charge_one(batcher: &Arc<Batcher>, prefix: &str, request: &ChargeRequest) -> Result<LimitsReply, String> {
    let call = limits::charge(prefix, request);
    let value = batcher.decide(call).await.map_err(|e| format!("redis: {e}"))?;
    limits::reply(request.limits.iter().map(|l| l.name.as_str()), &value)
}

/// A limit as a later part charges it: an elastic one already clamped by `reduction`.
fn reduced(limit: &LimitCharge, reduction: u64) -> LimitCharge {
    let mut limit = LimitCharge { owner: None, ..limit.clone() };
    if let Some(min) = limit.min_cost.filter(|&min| min < limit.cost && !limit.shadow) {
        limit.cost = limit.cost.saturating_sub(reduction).max(min);
    }
    limit
}

/// Gives back what the charged parts took, each through its own record.
async fn roll_back(batcher: &Arc<Batcher>, prefix: &str, charged: &[(&str, ChargeRequest, LimitsReply)]) {
    let calls = charged.iter().map(|(owner, part, reply)| {
        let limits =
            part.limits.iter().map(|l| (l.name.as_str(), l.capacity, l.window_ms, l.kind, &l.period_bounds_ms[..]));
        let reservation = part.reservation.as_ref().map(|r| r.id.clone());
        limits::adjust(prefix, Op::Settle, &giving_back(&part.domain, owner, reservation, limits, reply))
    });
    adjust_all(batcher, calls.collect(), "a part of a refused charge (it stays charged until it refills)").await;
}

/// The settlement that credits each of a part's `limits` (name, capacity, window, kind,
/// period bounds) with what `reply` charged or granted it.
fn giving_back<'a>(
    domain: &str,
    owner: &str,
    reservation: Option<String>,
    limits: impl Iterator<Item = (&'a str, u64, u64, llm_ratelimit_protocol::LimitKind, &'a [u64])>,
    reply: &LimitsReply,
) -> Settlement {
    Settlement {
        domain: domain.to_string(),
        tenant: owner.to_string(),
        reservation,
        once: None,
        cancel: false,
        stand_in: None,
        limits: limits
            .zip(&reply.limits)
            .map(|((name, capacity, window_ms, kind, bounds), o)| Adjustment {
                name: name.to_string(),
                capacity,
                window_ms,
                credit: i64::try_from(o.charged).unwrap_or(i64::MAX),
                kind,
                owner: None,
                period_bounds_ms: bounds.to_vec(),
            })
            .collect(),
    }
}

/// Runs give-back `calls`, saying which `what` could not be given back.
async fn adjust_all(batcher: &Arc<Batcher>, calls: Vec<Call>, what: &str) {
    if calls.is_empty() {
        return;
    }
    for outcome in batcher.adjust(calls).await {
        if let Err(err) = outcome {
            eprintln!("companion: cannot give back {what}: {err}");
        }
    }
}

/// Where the parts never asked stand (a peek, charging nothing), for the refusal's
/// headers; each reported as not refusing, as it did not.
async fn peek_rest(
    batcher: &Arc<Batcher>,
    prefix: &str,
    request: &ChargeRequest,
    rest: &[(String, Vec<usize>)],
    outcomes: &mut [Option<LimitOutcome>],
) {
    for (owner, indices) in rest {
        let peek = TenantLimits {
            domain: request.domain.clone(),
            tenant: owner.clone(),
            limits: indices
                .iter()
                .map(|&i| {
                    let l = &request.limits[i];
                    LimitSpec {
                        name: l.name.clone(),
                        capacity: l.capacity,
                        window_ms: l.window_ms,
                        kind: l.kind,
                        period_bounds_ms: l.period_bounds_ms.clone(),
                    }
                })
                .collect(),
        };
        let Ok(value) = batcher.decide(limits::tenant(prefix, Op::Peek, &peek)).await else { continue };
        let Ok(reply) = limits::reply(peek.limits.iter().map(|l| l.name.as_str()), &value) else { continue };
        for (&i, outcome) in indices.iter().zip(reply.limits) {
            outcomes[i] = Some(LimitOutcome { status: LimitStatus::Allowed, retry_after_ms: 0, ..outcome });
        }
    }
}

/// The parts' outcomes as one reply, in the request's order (`limits`: each limit's name
/// and capacity; a limit no part reported, which a failed peek leaves, as full).
fn merged<'a>(
    limits: impl Iterator<Item = (&'a str, u64)>,
    allowed: bool,
    outcomes: Vec<Option<LimitOutcome>>,
) -> LimitsReply {
    let limits =
        limits.zip(outcomes).map(|((name, capacity), outcome)| outcome.unwrap_or_else(|| unreported(name, capacity)));
    LimitsReply { allowed, waited_ms: 0, limits: limits.collect(), suspended: None }
}

fn charged_names(request: &ChargeRequest) -> impl Iterator<Item = (&str, u64)> {
    request.limits.iter().map(|l| (l.name.as_str(), l.capacity))
}

/// Grants `request` (a lease): in one script call on one server or when its limits have
/// one owner; on a cluster split by owner, the tenant's part first, each part granted all
/// or nothing, and the parts granted before a refused one given back at once.
pub async fn lease(batcher: &Arc<Batcher>, prefix: &str, request: &LeaseRequest) -> Result<LimitsReply, String> {
    let groups = by_owner(&request.tenant, request.limits.iter().map(|l| l.owner.as_deref()));
    if !batcher.store().is_cluster() || tenant_only(&request.tenant, &groups) {
        return lease_one(batcher, prefix, request).await;
    }
    let names = || request.limits.iter().map(|l| (l.name.as_str(), l.capacity));
    let mut outcomes: Vec<Option<LimitOutcome>> = vec![None; request.limits.len()];
    let mut granted: Vec<(LeaseRequest, LimitsReply, &[usize])> = Vec::new();
    for (owner, indices) in &groups {
        if indices.iter().all(|&i| request.limits[i].wanted == 0 && request.limits[i].look_only) {
            continue; // nothing asked of this owner (the proxy's lease covers its part)
        }
        let part = LeaseRequest {
            domain: request.domain.clone(),
            tenant: owner.to_string(),
            limits: indices.iter().map(|&i| LeaseAsk { owner: None, ..request.limits[i].clone() }).collect(),
            share: request.share,
        };
        let reply = match lease_one(batcher, prefix, &part).await {
            Ok(reply) => reply,
            Err(err) => {
                give_back(batcher, prefix, &granted).await;
                return Err(err);
            }
        };
        for (&i, outcome) in indices.iter().zip(&reply.limits) {
            outcomes[i] = Some(outcome.clone());
        }
        if reply.suspended.is_some() {
            give_back(batcher, prefix, &granted).await;
            return Ok(reply);
        }
        if !reply.allowed {
            give_back(batcher, prefix, &granted).await;
            // What was given back was not granted.
            for (_, _, indices) in &granted {
                for &i in indices.iter() {
                    if let Some(outcome) = outcomes[i].as_mut() {
                        outcome.charged = 0;
                    }
                }
            }
            return Ok(merged(names(), false, outcomes));
        }
        granted.push((part, reply, indices));
    }
    Ok(merged(names(), true, outcomes))
}

async fn lease_one(batcher: &Arc<Batcher>, prefix: &str, request: &LeaseRequest) -> Result<LimitsReply, String> {
    let value = batcher.decide(limits::lease(prefix, request)).await.map_err(|err| format!("redis: {err}"))?;
    limits::reply(request.limits.iter().map(|l| l.name.as_str()), &value)
        .map_err(|err| format!("unexpected script reply: {err}"))
}

/// Returns the grants of a lease's parts (a stand-alone credit of what each granted, as a
/// proxy returns an expired lease).
async fn give_back(batcher: &Arc<Batcher>, prefix: &str, granted: &[(LeaseRequest, LimitsReply, &[usize])]) {
    let calls = granted.iter().map(|(part, reply, _)| {
        let limits = part.limits.iter().map(|l| (l.name.as_str(), l.capacity, l.window_ms, l.kind, &[][..]));
        limits::adjust(prefix, Op::Settle, &giving_back(&part.domain, &part.tenant, None, limits, reply))
    });
    adjust_all(batcher, calls.collect(), "a part of a refused lease (it returns when the lease would)").await;
}

/// The outcome of a limit no part reported (a failed peek): as a full limit that
/// refused nothing and was charged nothing.
fn unreported(name: &str, capacity: u64) -> LimitOutcome {
    LimitOutcome {
        name: name.to_string(),
        status: LimitStatus::Allowed,
        limit: capacity,
        remaining: capacity,
        reset_after_ms: 0,
        retry_after_ms: 0,
        charged: 0,
    }
}

/// A reservation id for the parts of a charge the filter asked no record for (only a
/// rollback reads it): unique per companion run and call.
fn rollback_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("rb{:x}{:x}", started as u64 ^ std::process::id() as u64, NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The script calls of one settlement (or touch, or release): one on one server or when
/// its limits have one owner; one per owner on a cluster, each with its own part's record
/// (and marker), and the indices of the settlement's limits it carries.
pub fn adjust(prefix: &str, op: Op, settlement: &Settlement, cluster: bool) -> Vec<(Call, Vec<usize>)> {
    let groups = by_owner(&settlement.tenant, settlement.limits.iter().map(|l| l.owner.as_deref()));
    if !cluster || tenant_only(&settlement.tenant, &groups) {
        return vec![(limits::adjust(prefix, op, settlement), (0..settlement.limits.len()).collect())];
    }
    groups
        .into_iter()
        .map(|(owner, indices)| {
            let part = Settlement {
                tenant: owner.to_string(),
                limits: indices.iter().map(|&i| Adjustment { owner: None, ..settlement.limits[i].clone() }).collect(),
                ..settlement.clone()
            };
            (limits::adjust(prefix, op, &part), indices)
        })
        .collect()
}

/// The replies of a settlement's parts as one, in its limits' order: failed if a part
/// failed (sent again, the parts applied already find their records gone), applied if
/// any part was.
pub fn merged_adjustment(
    settlement: &Settlement,
    parts: Vec<(Result<LimitsReply, String>, Vec<usize>)>,
) -> Result<LimitsReply, String> {
    let mut outcomes: Vec<Option<LimitOutcome>> = vec![None; settlement.limits.len()];
    let mut allowed = false;
    for (reply, indices) in parts {
        let reply = reply?;
        allowed |= reply.allowed;
        for (i, outcome) in indices.into_iter().zip(reply.limits) {
            outcomes[i] = Some(outcome);
        }
    }
    let limits = settlement
        .limits
        .iter()
        .zip(outcomes)
        .map(|(l, outcome)| outcome.unwrap_or_else(|| unreported(&l.name, l.capacity)))
        .collect();
    Ok(LimitsReply { allowed, waited_ms: 0, limits, suspended: None })
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_ratelimit_protocol::LimitKind;

    #[test]
    fn the_tenant_goes_first_then_the_pools_in_request_order() {
        let owners = [Some("all"), None, Some("p1"), Some("all"), None];
        let groups = by_owner("t", owners.into_iter());
        assert_eq!(groups, vec![("t", vec![1, 4]), ("all", vec![0, 3]), ("p1", vec![2])]);
        assert_eq!(by_owner("t", [Some("all")].into_iter()), vec![("all", vec![0])]);
    }

    fn charge_limit(cost: u64, min_cost: Option<u64>, shadow: bool) -> LimitCharge {
        LimitCharge {
            name: "tpm".into(),
            capacity: 1000,
            window_ms: 60_000,
            cost,
            min_cost,
            kind: LimitKind::TokenBucket,
            period_bounds_ms: Vec::new(),
            provisional: true,
            look_only: false,
            shadow,
            owner: Some("all".into()),
            fair: None,
        }
    }

    #[test]
    fn a_later_part_is_clamped_by_the_reduction_so_far_never_below_its_least() {
        assert_eq!(reduced(&charge_limit(500, Some(100), false), 150).cost, 350);
        assert_eq!(reduced(&charge_limit(500, Some(100), false), 450).cost, 100);
        assert_eq!(reduced(&charge_limit(500, None, false), 150).cost, 500, "not elastic");
        assert_eq!(reduced(&charge_limit(500, Some(100), true), 150).cost, 500, "a shadow limit never clamps");
        assert_eq!(reduced(&charge_limit(500, None, false), 0).owner, None, "a part's limits are its owner's");
    }

    #[test]
    fn a_settlement_is_split_by_owner_on_a_cluster_only() {
        let adjustment = |name: &str, owner: Option<&str>| Adjustment {
            name: name.into(),
            capacity: 10,
            window_ms: 1000,
            credit: 3,
            kind: LimitKind::TokenBucket,
            period_bounds_ms: Vec::new(),
            owner: owner.map(Into::into),
        };
        let settlement = Settlement {
            domain: "llm".into(),
            tenant: "t".into(),
            reservation: Some("r1".into()),
            once: None,
            cancel: false,
            stand_in: None,
            limits: vec![adjustment("key", None), adjustment("team", Some("p1")), adjustment("org", Some("all"))],
        };
        let one = adjust("x:", Op::Settle, &settlement, false);
        assert_eq!(one.len(), 1);
        assert_eq!(
            one[0].0.keys,
            vec![
                "x:{llm:t}:tb:key",
                "x:{llm:p1}:tb:team",
                "x:{llm:all}:tb:org",
                "x:{llm:t}:res:r1",
                "x:{llm:t}:plan:limits",
                "x:{llm:p1}:plan:limits",
                "x:{llm:all}:plan:limits"
            ]
        );
        let parts = adjust("x:", Op::Settle, &settlement, true);
        let keys: Vec<&Vec<String>> = parts.iter().map(|(call, _)| &call.keys).collect();
        assert_eq!(
            keys,
            [
                &vec!["x:{llm:t}:tb:key".to_string(), "x:{llm:t}:res:r1".into(), "x:{llm:t}:plan:limits".into()],
                &vec!["x:{llm:p1}:tb:team".to_string(), "x:{llm:p1}:res:r1".into(), "x:{llm:p1}:plan:limits".into()],
                &vec!["x:{llm:all}:tb:org".to_string(), "x:{llm:all}:res:r1".into(), "x:{llm:all}:plan:limits".into()],
            ]
        );
        assert_eq!(parts.iter().map(|(_, i)| i.clone()).collect::<Vec<_>>(), [vec![0], vec![1], vec![2]]);
    }
}
