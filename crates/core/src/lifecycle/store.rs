//! A request under the local store (`"store": "local"`): charged by the local limiter
//! (`effects/local_limiter.rs`) in this proxy's shared data as soon as it is planned (no callout, so it never waits), and
//! settled there once its reply has said what it used. Its answers, headers and metrics
//! are those of a request the companion decided.

use super::{Admission, RequestFilter, Verdict};
use crate::config::Policy;
use crate::effects::host::{Host, Metric};
use crate::effects::local_limiter::{self, Room};
use crate::plan::series::Decision;
use crate::protocol::LimitKind;
use crate::replies::decision;
use crate::worker::settlements::HeldSlots;
use crate::worker::Worker;

impl RequestFilter {
    /// Charges the request's plan in the local store at `now` (ms) and says what to do.
    pub(super) fn decide_in_store(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        now: u64,
    ) -> Verdict {
        let specs = self.plan.as_ref().map(|plan| plan.buckets.clone()).unwrap_or_default();
        let id = worker.new_reservation_id(host);
        let holder = local_limiter::holder(&id);
        let reply = match local_limiter::charge(host, config, &self.tenant, &specs, &holder, now, Room::IdleOnly) {
            Some(Ok(reply)) => reply,
            Some(Err(crate::effects::tables::Busy)) => {
                // All of the tenant's slots hold other tenants' live counters: no room to
                // count this one, so it is not admitted uncounted.
                host.add_metric(Metric::SharedWritesRefused, 1);
                host.warn_once(
                    "local-table-full",
                    "llm-ratelimit: a tenant found all of its slots of the local store taken by other \
                     tenants' live counters and was refused (503); raise memory.tenant_slots",
                );
                return Verdict::Reply(decision::limiter_unavailable(self.dialect));
            }
            None => return Verdict::Reply(decision::limiter_unavailable(self.dialect)),
        };
        if !reply.allowed {
            self.count_refusal(host, config, &reply);
            return self.rejection(config, &reply, now);
        }
        self.count_admission(host, config, Decision::Allowed);
        self.admission = Some(Admission::Stored { id: id.clone(), charged_at_ms: now });
        self.rewrite_body(host, config, &reply);
        // The slots it took are renewed on the worker's tick while it is in flight.
        if specs.iter().any(|spec| spec.kind == LimitKind::Slots && spec.cost > 0) {
            worker.hold_slots(id, HeldSlots::InSharedData { entries: vec![self.tenant.clone()], holder });
        }
        Verdict::Forward(self.admitted_headers(host, config, reply, now))
    }

    /// Settles a request the local store charged at `charged_at_ms` (reservation `id`):
    /// `credits` by limit index, its slots released.
    pub(super) fn settle_in_store(
        &self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        id: &str,
        charged_at_ms: u64,
        credits: &[(usize, i64)],
    ) {
        worker.take_slots(id);
        let specs = self.plan.as_ref().map(|plan| plan.buckets.clone()).unwrap_or_default();
        local_limiter::settle(host, config, &self.tenant, &specs, credits, charged_at_ms, &local_limiter::holder(id));
    }
}
