//! Direct mode: the request charged in Redis through the companion, one callout each,
//! under a reservation record that its settlement (and any refund) is made against; its
//! slots held while it is in flight.

use super::{Admission, RequestFilter, Verdict};
use crate::config::Policy;
use crate::effects::host::{Host, LogLevel, Metric, Owner};
use crate::plan::series::Decision;
use crate::plan::settlement::{adjustments, settlement};
use crate::protocol::{
    ChargeRequest, LimitKind, LimitsReply, Reservation, SettlementBatch, Wait, CHARGE_PATH, RELEASE_PATH,
};
use crate::worker::settlements::HeldSlots;
use crate::worker::Worker;
use std::time::Duration;

/// Releasing slots at once waits at least this long for the companion.
const RELEASE_TIMEOUT: Duration = Duration::from_millis(500);

impl RequestFilter {
    /// Sends the charge, to wait in the queue for capacity as `wait` says.
    pub(super) fn send_charge(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        wait: Option<Wait>,
    ) -> Result<(), String> {
        let Some(plan) = self.plan.as_ref() else { return Err("no plan".into()) };
        let timeout = config.companion.timeout + if self.queued { config.queue.max_wait } else { Duration::ZERO };
        // Every charge keeps a reservation record: it holds tokens to settle, names the
        // request's slots and its place in the queue, and backs the refund an upstream
        // 401/403 gives (the companion credits nothing a record does not back).
        let id = worker.new_reservation_id(host);
        self.admission = Some(Admission::Reserved(id.clone()));
        let mut limits = plan.buckets.clone();
        if wait.is_none() {
            // Only the queue reads it: a charge that cannot wait goes out as before this
            // field existed, which a companion older than the filter still takes.
            limits.iter_mut().for_each(|limit| limit.provisional = false);
        }
        let request = ChargeRequest {
            domain: config.domain.clone(),
            tenant: self.tenant.clone(),
            limits,
            reservation: Some(Reservation { id, ttl_ms: self.record_ttl_ms(config, wait.as_ref()) }),
            wait,
        };
        let sent = worker.call_companion(host, config, CHARGE_PATH, &request, timeout, Owner::Request).map(drop);
        if sent.is_err() {
            self.admission = None; // never sent: nothing can happen in Redis
        }
        sent
    }

    /// The charge answered and allowed: the body rewritten to what was granted, the slots
    /// it took renewed while the request is in flight.
    pub(super) fn admit_charged(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        reply: LimitsReply,
        now: u64,
    ) -> Verdict {
        host.add_metric(Metric::Allowed, 1);
        self.count_per_limit_in(host, config, Decision::Allowed, Some(&reply));
        self.rewrite_body(host, config, &reply);
        if let (true, Some(Admission::Reserved(id))) = (config.has_concurrency(), &self.admission) {
            let costs = self.costs();
            let held = config
                .limits
                .iter()
                .enumerate()
                .filter(|(i, l)| l.kind == LimitKind::Slots && costs.get(*i).is_some_and(|&c| c > 0))
                .map(|(i, _)| (i, 0));
            let held = adjustments(config, &self.owners(), held, now);
            let slots = settlement(config, &self.tenant, Some(id.clone()), false, held);
            worker.hold_slots(id.clone(), HeldSlots::InRedis(slots));
        }
        Verdict::Forward(self.admitted_headers(host, config, reply, now))
    }

    /// The client gave up while the charge waited in the queue: stop the charge if it has
    /// not happened yet, and refund everything it took if it has (one script call does
    /// both, so one of the two is true).
    pub(super) fn cancel_queued(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        let Some(Admission::Reserved(id)) = self.admission.take() else { return };
        self.give_up_charge(host, worker, config, id);
    }

    /// Stops the charge of reservation `id` if it has not happened yet, and refunds
    /// everything it took (its slots too) if it has: one script call does both.
    pub(super) fn give_up_charge(&self, host: &mut impl Host, worker: &mut Worker, config: &Policy, id: String) {
        worker.take_slots(&id);
        let costs = self.costs();
        let refunds = config.limits.iter().zip(&costs).enumerate().map(|(i, (limit, &cost))| {
            (i, if limit.kind == LimitKind::Slots { 0 } else { i64::try_from(cost).unwrap_or(i64::MAX) })
        });
        let limits = adjustments(config, &self.owners(), refunds, host.now_ms());
        worker.queue_settlement(host, settlement(config, &self.tenant, Some(id), true, limits));
    }

    /// Settles a request charged in Redis: `credits` against its reservation record
    /// (`None`: a lease grant charged it, and there is no record), and with a record the
    /// slots of `slot_limits` released.
    pub(super) fn settle_charge(
        &self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        reservation: Option<String>,
        credits: Vec<(usize, i64)>,
        slot_limits: Vec<usize>,
    ) {
        if let Some(id) = &reservation {
            // Released at once where the host lets a finished request call out; the
            // settlement below releases them too, within a tick, everywhere.
            let slots = worker.take_slots(id);
            if let Some(HeldSlots::InRedis(slots)) =
                slots.filter(|_| worker.host_kind().dispatches_in_response_phases())
            {
                release_now(host, worker, config, slots);
            }
        }
        let with_slots = reservation.is_some();
        let releases = slot_limits.into_iter().filter(|_| with_slots).map(|i| (i, 0));
        let credits = credits.into_iter().chain(releases);
        worker.settle_credits(host, config, &self.tenant, reservation, false, &self.owners(), credits);
    }
}

/// Releases a request's slots at once, in a callout owned by the root context so it
/// outlives the request; its settlement (queued, sent within a tick) releases them too,
/// so nothing is lost if this one fails.
fn release_now(host: &mut impl Host, worker: &Worker, config: &Policy, slots: crate::protocol::Settlement) {
    let request = SettlementBatch { settlements: vec![slots] };
    let timeout = config.companion.timeout.max(RELEASE_TIMEOUT);
    if let Err(why) = worker.call_companion(host, config, RELEASE_PATH, &request, timeout, Owner::Root) {
        host.log(LogLevel::Debug, &format!("llm-ratelimit: cannot release slots at once ({why}); the settlement will"));
    }
}
