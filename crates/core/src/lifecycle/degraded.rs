//! The degraded mode: a request decided without the companion, as `failure_mode` says
//! (`local`: each limit divided by `fallback.instances`, counted exactly by the local
//! limiter in this proxy's shared data, what it admits queued as debits Redis learns of
//! when it is back), and what this VM learns of the owners' plans for it.

use super::{record, Admission, RequestFilter, Verdict};
use crate::config::{FailureMode, Policy};
use crate::effects::host::{Host, LogLevel, Metric};
use crate::effects::lease_table::Holder;
use crate::effects::local_limiter::{self, Room};
use crate::plan::charge::ChargePlan;
use crate::plan::series::Decision;
use crate::plan::settlement::{adjustments, settlement};
use crate::protocol::{LimitCharge, LimitKind, LimitStatus, LimitsReply, Settlement, StandIn, Suspension};
use crate::replies::decision::{self, DEGRADED_HEADER};
use crate::worker::settlements::HeldSlots;
use crate::worker::Worker;

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
                Degraded::Decided(Verdict::Forward(vec![(DEGRADED_HEADER, "companion-unavailable".into())]))
            }
            FailureMode::Deny => Degraded::Decided(Verdict::Reply(decision::limiter_unavailable(self.dialect))),
        }
    }

    /// The degraded mode: each limit divided by `fallback.instances`, counted exactly by
    /// the local limiter in this proxy's shared data (the local store's counters: windows
    /// and slots as the Lua script keeps them). What is admitted is queued as a debit, so
    /// Redis learns of it when it is back. A shared pool is counted in its own local entry
    /// (named by its owner id, as in the lease table), so it holds its share for this
    /// proxy whatever the number of tenants; the tenant's entry and each pool's are
    /// charged in turn, all or nothing, each given back when a later one refuses.
    pub(super) fn decide_locally(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        unanswered: Option<&str>,
    ) -> Degraded {
        let mut specs = self.plan.as_ref().map(|plan| shares(config, plan)).unwrap_or_default();
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
        // Standing in for the charge (unanswered, or never sent while the breaker is
        // open), which the stand-in stops.
        let id = unanswered.map_or_else(|| worker.new_reservation_id(host), str::to_string);
        let holder = local_limiter::holder(&id);
        let entries = self.holders(config);
        let mut charged: Vec<&Holder> = Vec::new();
        let mut outcomes: Vec<Option<crate::protocol::LimitOutcome>> = vec![None; specs.len()];
        let mut allowed = true;
        for entry in &entries {
            let part = entry_specs(&specs, &entry.indices);
            let room = Room::OrLeastRecentlyUsed;
            let Some(Ok(reply)) = local_limiter::charge(host, config, &entry.name, &part, &holder, now_ms, room) else {
                for done in &charged {
                    give_back(host, config, done, &specs, now_ms, &holder);
                }
                return Degraded::Decided(Verdict::Reply(decision::limiter_unavailable(self.dialect)));
            };
            for &i in &entry.indices {
                if let (Some(slot), Some(outcome)) = (outcomes.get_mut(i), reply.limits.get(i)) {
                    *slot = Some(outcome.clone());
                }
            }
            if !reply.allowed {
                allowed = false;
                for done in &charged {
                    give_back(host, config, done, &specs, now_ms, &holder);
                }
                break;
            }
            charged.push(entry);
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
        // An unanswered charge may hold Redis slots, which the stand-in releases.
        let releases = if unanswered.is_some() { self.slot_releases(config) } else { Vec::new() };
        let limits = adjustments(config, &self.owners(), debits.chain(releases), now_ms);
        if !limits.is_empty() {
            let stand_in = Some(StandIn { record_ttl_ms: self.record_ttl_ms(config, None) });
            let queued = settlement(config, &self.tenant, Some(id.clone()), false, limits);
            worker.queue_settlement(host, Settlement { stand_in, ..queued });
        }
        // The slots it took are kept alive on the worker's tick while it is in flight, as
        // the local store's are, and released when it ends.
        let holding = entries.iter().filter(|entry| {
            entry.indices.iter().any(|&i| specs.get(i).is_some_and(|s| s.kind == LimitKind::Slots && s.cost > 0))
        });
        let holding: Vec<String> = holding.map(|entry| entry.name.clone()).collect();
        if !holding.is_empty() {
            worker.hold_slots(id.clone(), HeldSlots::InSharedData { entries: holding, holder });
        }
        self.admission = Some(Admission::Degraded { id, charged_at_ms: now_ms });
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

    /// Settles a request the degraded mode admitted at `charged_at_ms` (reservation `id`):
    /// the local limiter's entries take its `credits` back and release its slots at once,
    /// as the local store's do; the credits go to Redis too, against the stand-in's record
    /// (or the late charge's, if it came first).
    pub(super) fn settle_degraded(
        &self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        id: String,
        charged_at_ms: u64,
        credits: Vec<(usize, i64)>,
    ) {
        worker.take_slots(&id);
        if let Some(plan) = self.plan.as_ref() {
            let specs = shares(config, plan);
            let holder = local_limiter::holder(&id);
            for entry in self.holders(config) {
                let own: Vec<(usize, i64)> =
                    credits.iter().copied().filter(|(i, _)| entry.indices.contains(i)).collect();
                local_limiter::settle(host, config, &entry.name, &specs, &own, charged_at_ms, &holder);
            }
        }
        let credits = credits.into_iter();
        worker.settle_credits(host, config, &self.tenant, Some(id), false, &self.owners(), credits);
    }
}

/// The degraded mode's share of each limit for this proxy: its capacity divided by
/// `fallback.instances`.
fn shares(config: &Policy, plan: &ChargePlan) -> Vec<LimitCharge> {
    let instances = u64::from(config.fallback.instances);
    plan.buckets
        .iter()
        .map(|b| LimitCharge { capacity: b.capacity.div_ceil(instances), min_cost: None, ..b.clone() })
        .collect()
}

/// `specs` as `indices`' entry charges them: its limits at their cost, the others at none.
fn entry_specs(specs: &[LimitCharge], indices: &[usize]) -> Vec<LimitCharge> {
    let part = specs.iter().enumerate();
    part.map(|(i, s)| if indices.contains(&i) { s.clone() } else { LimitCharge { cost: 0, ..s.clone() } }).collect()
}

/// Gives back to `entry` what a request took of it (charged at `charged_at_ms`), its
/// slots released.
fn give_back(
    host: &mut impl Host,
    config: &Policy,
    entry: &Holder,
    specs: &[LimitCharge],
    charged_at_ms: u64,
    holder: &str,
) {
    let credits: Vec<(usize, i64)> = entry
        .indices
        .iter()
        .filter_map(|&i| Some((i, i64::try_from(specs.get(i)?.cost).unwrap_or(i64::MAX))))
        .collect();
    local_limiter::settle(host, config, &entry.name, specs, &credits, charged_at_ms, holder);
}
