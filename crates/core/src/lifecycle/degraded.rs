//! The degraded mode: a request decided without the companion, as `failure_mode` says
//! (`local`: each limit divided by `fallback.instances`, as token buckets in this proxy's
//! shared data, what it admits queued as debits Redis learns of when it is back), and what
//! this VM learns of the owners' plans for it.

use super::{record, Admission, RequestFilter, Verdict};
use crate::accounting::bucket::{check_and_charge, decode_states, encode_states, level_at, BucketState};
use crate::config::{FailureMode, Policy};
use crate::effects::host::{Host, LogLevel, Metric};
use crate::effects::lease_table::Holder;
use crate::effects::tables::{update_own, update_own_or_oldest, TenantTable};
use crate::plan::charge::ChargePlan;
use crate::plan::series::Decision;
use crate::plan::settlement::{adjustments, settlement};
use crate::protocol::{LimitCharge, LimitKind, LimitStatus, LimitsReply, Settlement, StandIn, Suspension};
use crate::replies::decision::{self, DEGRADED_HEADER};
use crate::worker::Worker;

/// In the degraded mode a concurrency limit is a bucket that does not refill (a slot comes
/// back when its request ends); this window makes the refill negligible.
const LOCAL_SLOTS_NEVER_REFILL_MS: u64 = u64::MAX / 4;

/// What the degraded mode makes of a request.
pub(super) enum Degraded {
    Decided(Verdict),
    /// Refused: an owner's plan suspends it, as this VM last saw it (at this time, ms).
    Suspended(Suspension, u64),
}

impl RequestFilter {
    /// Decides without the companion, which gave no decision (`why`), as `failure_mode`
    /// says. `unanswered` is the reservation of a charge sent and never answered, which a
    /// local admission stands in for.
    pub(super) fn decide_degraded(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        why: &str,
        unanswered: Option<&str>,
    ) -> Degraded {
        host.log(
            LogLevel::Debug,
            &format!("llm-ratelimit: no decision from the companion ({why}); failure_mode {:?}", config.failure_mode),
        );
        host.add_metric(Metric::DegradedDecisions, 1);
        match config.failure_mode {
            FailureMode::Local => self.decide_locally(host, worker, config, unanswered),
            FailureMode::Allow => {
                self.recorded.how = record::How::DegradedAllowed;
                self.count_per_limit(host, config, Decision::Degraded);
                Degraded::Decided(Verdict::Forward(vec![(DEGRADED_HEADER, "companion-unavailable".to_string())]))
            }
            FailureMode::Deny => Degraded::Decided(Verdict::Reply(decision::limiter_unavailable(self.dialect))),
        }
    }

    /// The degraded mode: each limit divided by `fallback.instances`, as token buckets in
    /// shared data, decided with the same model the Lua script follows. What is admitted
    /// is queued as a debit, so Redis learns of it when it is back. A shared pool is
    /// counted in its own local entry (named by its owner id, as in the lease table), so
    /// it holds its share for this proxy whatever the number of tenants; the tenant's
    /// entry and each pool's are charged in turn, all or nothing, each given back when a
    /// later one refuses.
    pub(super) fn decide_locally(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        unanswered: Option<&str>,
    ) -> Degraded {
        let mut specs = self.plan.as_ref().map(|plan| local_specs(config, plan)).unwrap_or_default();
        let now_ms = host.now_ms();
        // The owners' plans as this VM last saw them: a suspension holds through the
        // outage, a plan's capacity sizes the local share as the config's would.
        let owners = self.owners();
        for (i, spec) in specs.iter_mut().enumerate() {
            let owner = owners.get(i).and_then(Option::as_deref).unwrap_or(&self.tenant);
            if let Some(reason) = worker.owner_plans.suspended(owner) {
                let suspension = Suspension { limit: spec.name.clone(), reason: reason.to_string() };
                return Degraded::Suspended(suspension, now_ms);
            }
            if let Some(capacity) = worker.owner_plans.capacity(owner, i) {
                spec.capacity = capacity.div_ceil(u64::from(config.fallback.instances));
            }
        }
        let holders = self.holders(config);
        let mut charged: Vec<&Holder> = Vec::new();
        let mut outcomes: Vec<Option<crate::protocol::LimitOutcome>> = vec![None; specs.len()];
        let mut allowed = true;
        for holder in &holders {
            let part = holder_specs(&specs, &holder.indices);
            let Some(reply) = charge_local(host, config, &holder.name, &part, now_ms) else {
                for done in &charged {
                    give_back_local(host, config, done, &specs, now_ms);
                }
                return Degraded::Decided(Verdict::Reply(decision::limiter_unavailable(self.dialect)));
            };
            for &i in &holder.indices {
                if let (Some(slot), Some(outcome)) = (outcomes.get_mut(i), reply.limits.get(i)) {
                    *slot = Some(outcome.clone());
                }
            }
            if !reply.allowed {
                allowed = false;
                for done in &charged {
                    give_back_local(host, config, done, &specs, now_ms);
                }
                break;
            }
            charged.push(holder);
        }
        let limits = specs
            .iter()
            .zip(outcomes)
            .map(|(spec, outcome)| {
                outcome.unwrap_or_else(|| crate::protocol::LimitOutcome {
                    name: spec.name.clone(),
                    status: LimitStatus::Allowed,
                    limit: spec.capacity,
                    remaining: spec.capacity,
                    reset_after_ms: 0,
                    retry_after_ms: 0,
                    charged: 0,
                })
            })
            .collect();
        let reply = LimitsReply { allowed, waited_ms: 0, limits, suspended: None };
        if !reply.allowed {
            self.count_refusal(host, config, &reply);
            let refused = self.rejection(config, &reply, now_ms);
            return Degraded::Decided(refused.with_header(DEGRADED_HEADER, "local".to_string()));
        }
        self.count_admission(host, config, Decision::Degraded);
        // Redis learns of the budget spent here; slots are this proxy's alone.
        let debits = specs.iter().enumerate().filter(|(_, b)| b.kind != LimitKind::Slots);
        let debits = debits.map(|(i, b)| (i, -(b.cost as i64)));
        // Standing in for the charge (unanswered, or never sent while the breaker is
        // open), which the stand-in stops; an unanswered one may hold Redis slots, which
        // it releases.
        let releases = if unanswered.is_some() { self.slot_releases(config) } else { Vec::new() };
        let id = unanswered.map_or_else(|| worker.new_reservation_id(host), str::to_string);
        let limits = adjustments(config, &self.owners(), debits.chain(releases), now_ms);
        if !limits.is_empty() {
            let stand_in = Some(StandIn { record_ttl_ms: self.record_ttl_ms(config, None) });
            let queued = settlement(config, &self.tenant, Some(id.clone()), false, limits);
            worker.queue_settlement(host, Settlement { stand_in, ..queued });
        }
        self.admission = Some(Admission::Local(id));
        let admitted = Verdict::Forward(self.admitted_headers(host, config, reply, now_ms));
        Degraded::Decided(admitted.with_header(DEGRADED_HEADER, "local".to_string()))
    }

    /// Notes, for the degraded mode, the limits whose capacity the companion answered
    /// other than the filter sent it: an owner's plan.
    pub(super) fn learn_plans(&self, worker: &mut Worker, reply: &LimitsReply, now: u64) {
        let Some(plan) = self.plan.as_ref() else { return };
        // The common case, on every reply: no plan answered, none known: nothing to do.
        let differs = plan.buckets.iter().zip(&reply.limits).any(|(sent, answered)| sent.capacity != answered.limit);
        if !differs && worker.owner_plans.is_empty() {
            return;
        }
        let owners = crate::plan::pools::owners(plan);
        for (i, (sent, answered)) in plan.buckets.iter().zip(&reply.limits).enumerate() {
            if !plan.applies(i) || answered.name != sent.name {
                continue;
            }
            let owner = owners.get(i).cloned().flatten().unwrap_or_else(|| self.tenant.clone());
            worker.owner_plans.answered(&owner, i, sent.capacity, answered.limit, now);
        }
    }

    /// Settles a request the degraded mode admitted (reservation `id`): this proxy's own
    /// slots (of `slot_limits`) go back at once; the credits go to Redis, against the
    /// stand-in's record (or the late charge's, if it came first).
    pub(super) fn settle_degraded(
        &self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        id: String,
        credits: Vec<(usize, i64)>,
        slot_limits: &[usize],
    ) {
        if !slot_limits.is_empty() {
            self.release_local_slots(host, config, slot_limits);
        }
        let credits = credits.into_iter();
        worker.settle_credits(host, config, &self.tenant, Some(id), false, &self.owners(), credits);
    }

    pub(super) fn release_local_slots(&self, host: &mut impl Host, config: &Policy, indices: &[usize]) {
        let Some(plan) = self.plan.as_ref() else { return };
        let specs = local_specs(config, plan);
        let credits: Vec<i64> = (0..specs.len()).map(|i| i64::from(indices.contains(&i))).collect();
        let now = host.now_ms() as f64;
        for holder in self.holders(config).iter().filter(|h| h.indices.iter().any(|i| indices.contains(i))) {
            let credits: Vec<i64> =
                credits.iter().enumerate().map(|(i, &c)| if holder.indices.contains(&i) { c } else { 0 }).collect();
            credit_local(host, config, &holder.name, &specs, &credits, now);
        }
    }
}

/// The degraded mode's buckets: each limit divided by `fallback.instances`; a slot comes
/// back when its request ends, not with time.
fn local_specs(config: &Policy, plan: &ChargePlan) -> Vec<LimitCharge> {
    let instances = u64::from(config.fallback.instances);
    plan.buckets
        .iter()
        .map(|b| LimitCharge {
            capacity: b.capacity.div_ceil(instances),
            min_cost: None,
            window_ms: if b.kind == LimitKind::Slots { LOCAL_SLOTS_NEVER_REFILL_MS } else { b.window_ms },
            ..b.clone()
        })
        .collect()
}

/// `specs` as `holder`'s local entry charges them: its limits at their cost, the others
/// at none.
fn holder_specs(specs: &[LimitCharge], indices: &[usize]) -> Vec<LimitCharge> {
    let part = specs.iter().enumerate();
    part.map(|(i, s)| if indices.contains(&i) { s.clone() } else { LimitCharge { cost: 0, ..s.clone() } }).collect()
}

/// Charges `specs` in the local entry `name` (a tenant's or a pool's), if it admits;
/// `None` when its slot is another's that may not be taken yet, or the write failed.
fn charge_local(
    host: &mut impl Host,
    config: &Policy,
    name: &str,
    specs: &[LimitCharge],
    now_ms: u64,
) -> Option<LimitsReply> {
    let now = now_ms as f64;
    // A colliding entry's local bucket may be replaced only once it has admitted nothing
    // for a whole window: taken sooner, its owner would find a fresh budget.
    let idle = |payload: &[u8]| {
        let states = decode_states(Some(payload), specs.len());
        states.iter().zip(specs).all(|(state, spec)| state.is_none_or(|s| now - s.updated_ms >= spec.window_ms as f64))
    };
    // Failing that, when all its slots are held, the entry written longest ago that holds
    // no concurrency slot: an outage must not refuse a newcomer service because the
    // table remembers older tenants (a day's limit keeps every entry for a day). What
    // that tenant spent here is in Redis's debits all the same; only its local share
    // starts afresh (see `tables`).
    let left_at = |payload: &[u8]| {
        let states = decode_states(Some(payload), specs.len());
        let holds_slot = states.iter().zip(specs).any(|(state, spec)| {
            spec.kind == LimitKind::Slots && state.is_some_and(|s| s.tokens < spec.capacity as f64)
        });
        (!holds_slot).then(|| states.iter().flatten().map(|s| s.updated_ms as u64).max().unwrap_or(0))
    };
    let reply = update_own_or_oldest(host, config, TenantTable::Local, name, idle, left_at, |payload| {
        let mut states = decode_states(payload, specs.len());
        let reply = check_and_charge(&mut states, specs, now);
        if !reply.allowed {
            // Its own entry is written as of now (the same levels): a tenant refused here
            // is still in use, so its spent entry is never the one a newcomer takes as
            // written longest ago. A newcomer refused takes no place.
            if payload.is_none() {
                return (None, reply);
            }
            for (state, spec) in states.iter_mut().zip(specs) {
                *state = state.map(|s| BucketState { tokens: level_at(spec, Some(s), now), updated_ms: now });
            }
        }
        (Some(encode_states(&states)), reply)
    });
    reply.and_then(Result::ok)
}

/// Gives back to `holder`'s local entry what a request took of it.
fn give_back_local(host: &mut impl Host, config: &Policy, holder: &Holder, specs: &[LimitCharge], now_ms: u64) {
    let credits: Vec<i64> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| if holder.indices.contains(&i) { i64::try_from(s.cost).unwrap_or(i64::MAX) } else { 0 })
        .collect();
    credit_local(host, config, &holder.name, specs, &credits, now_ms as f64);
}

fn credit_local(host: &mut impl Host, config: &Policy, name: &str, specs: &[LimitCharge], credits: &[i64], now: f64) {
    update_own(
        host,
        config,
        TenantTable::Local,
        name,
        |_| false,
        |payload| {
            let Some(payload) = payload else { return (None, ()) }; // replaced meanwhile
            let mut states = decode_states(Some(payload), specs.len());
            crate::accounting::bucket::settle(&mut states, specs, credits, now);
            (Some(encode_states(&states)), ())
        },
    );
}
