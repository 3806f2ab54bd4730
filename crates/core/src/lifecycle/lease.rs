//! Lease mode: a request admitted from this proxy's leases of its budgets (the tenant's,
//! each shared pool's), else a grant asked for it or waited for; settled back into the
//! lease it came from.

use super::{Admission, Ask, Phase, RequestFilter, Verdict};
use crate::accounting::lease::TenantLeases;
use crate::config::Policy;
use crate::effects::host::{Host, Metric, Owner};
use crate::effects::lease_table::{self, DryOut, Hold, Taken};
use crate::plan::series::Decision;
use crate::protocol::{LeaseRequest, LimitsReply, LEASE_PATH};
use crate::worker::Worker;

/// What the lease has to say about a request (lease mode).
pub(super) enum FromLease {
    Decided(Verdict),
    AskForLease,
    ChargeDirectly,
    /// Wait for the grant out for this entry.
    Await(String),
}

impl RequestFilter {
    /// Admits from this proxy's leases (the tenant's, and each shared pool's), if they
    /// cover the request, or refuses it if Redis recently refused as much; otherwise says
    /// how to ask Redis: for a lease once the tenant (and each pool) shows repeat traffic,
    /// else (and when another's lease holds the slot) a direct charge. Marks the entries
    /// that run low for renewal.
    pub(super) fn admit_from_lease(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        now: u64,
    ) -> FromLease {
        let holders = self.holders(config);
        let policy = config.lease_policy();
        let dry_out = if worker.host_kind().resumes_other_contexts() {
            DryOut::Coalesce { may_wait: self.lease_wait_until.is_none_or(|until| now < until) }
        } else {
            DryOut::AskEach
        };
        let specs = self.plan.as_ref().map_or(&[][..], |p| &p.buckets);
        match lease_table::take(host, config, &holders, specs, &policy, dry_out, now) {
            Taken::Admitted { renew, leases, slots } => {
                for holder in renew {
                    worker.want_renewal(holder);
                }
                host.add_metric(Metric::LeaseAdmissions, 1);
                FromLease::Decided(self.admitted_from_lease(host, worker, config, &leases, &slots, now))
            }
            Taken::Refused(refusal) => {
                self.count_refusal(host, config, &refusal);
                FromLease::Decided(self.rejection(config, &refusal, now))
            }
            Taken::Ask(hold) => {
                for holder in hold.renew.iter().cloned() {
                    worker.want_renewal(holder);
                }
                self.lease_hold = Some(hold);
                FromLease::AskForLease
            }
            Taken::Direct => FromLease::ChargeDirectly,
            Taken::Await(entry) => FromLease::Await(entry),
        }
    }

    /// The lease ran dry while the grant for `entry` is out: the request waits for it
    /// (true: it pauses until `on_lease_news`), unless that grant is this VM's renewal, not
    /// sent yet, which the request then asks for itself (false).
    pub(super) fn wait_for_grant(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        entry: String,
        now: u64,
    ) -> bool {
        match worker.take_renewal(&entry) {
            // The grant it would wait for is this VM's renewal, not sent yet: the
            // request asks for it now instead, and its answer is the renewal's.
            Some(renewal) => {
                self.ask = Ask::Lease;
                self.lease_hold = Some(Hold { short: self.holders(config), marked: vec![renewal], ..Hold::default() });
                false
            }
            None => {
                self.phase = Phase::AwaitingLease;
                // A request waiting again keeps the bound of its first wait.
                let until =
                    *self.lease_wait_until.get_or_insert(now.saturating_add(config.lease_policy().renewal_wait_ms));
                worker.await_lease(host.context_id(), entry, until);
                true
            }
        }
    }

    /// Lifts the markers this request set on the lease entries it asks a grant for, once
    /// that grant answers or never will: whoever waits for them takes again.
    pub(super) fn lift_marks(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        let Some(hold) = self.lease_hold.as_mut() else { return };
        for holder in std::mem::take(&mut hold.marked) {
            lease_table::renewal_answered(host, config, &holder);
            worker.lease_news(&holder.name);
        }
    }

    /// Asks the companion for a grant of the lease entries the request falls short on
    /// (a lease never waits in the queue).
    pub(super) fn ask_for_lease(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        now: u64,
    ) -> Result<(), String> {
        let Some(plan) = self.plan.as_ref() else { return Err("no plan".into()) };
        host.add_metric(Metric::LeaseCallouts, 1);
        let short = self.lease_hold.as_ref().map_or_else(|| self.holders(config), |hold| hold.short.clone());
        let request = LeaseRequest {
            domain: config.domain.clone(),
            tenant: self.tenant.clone(),
            limits: lease_table::asks(host, config, &short, &plan.buckets, &config.lease_policy(), now),
            share: config.lease.share,
        };
        let timeout = config.companion.timeout;
        worker.call_companion(host, config, LEASE_PATH, &request, timeout, Owner::Request).map(drop)
    }

    /// Gives back the parts of the request its lease entries hold, when no grant will
    /// make them an admission.
    pub(super) fn put_back_hold(&mut self, host: &mut impl Host, config: &Policy) {
        if let Some(hold) = self.lease_hold.take() {
            let now = host.now_ms();
            lease_table::put_back(host, config, &hold.held, &self.costs(), now);
        }
    }

    pub(super) fn admitted_from_lease(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        leases: &TenantLeases,
        slots: &[u32],
        now: u64,
    ) -> Verdict {
        self.count_admission(host, config, Decision::Allowed);
        worker.note_leased(slots, leases, now);
        self.admission = Some(Admission::Leased);
        let reply = leases.as_reply(self.plan.as_ref().map_or(&[][..], |p| &p.buckets));
        // As a callout's or the local store's admission: a stream is asked for its usage.
        self.rewrite_body(host, config, &reply);
        Verdict::Forward(self.admitted_headers(host, config, reply, now))
    }

    /// The grant answered and allowed: merged into the lease, and the request admitted from
    /// it; a part that cannot be kept as a lease leaves the request charged in Redis.
    pub(super) fn admit_from_grant(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        reply: LimitsReply,
        now: u64,
    ) -> Verdict {
        let costs = self.costs();
        let hold = self.lease_hold.take().unwrap_or_else(|| Hold { short: self.holders(config), ..Hold::default() });
        let lease_table::Merged { mut leases, refused, mut slots } =
            lease_table::merge(host, config, &hold.short, |i| reply.limits.get(i), Some(&costs), now);
        slots.extend(&hold.slots);
        for holder in &hold.held {
            for &i in &holder.indices {
                if let (Some(to), Some(from)) = (leases.0.get_mut(i), hold.leases.0.get(i)) {
                    *to = *from;
                }
            }
        }
        if refused.is_empty() {
            return self.admitted_from_lease(host, worker, config, &leases, &slots, now);
        }
        // Part of the grant cannot be kept as a lease (another's lease holds the
        // slot): what that part granted beyond this request goes back, and the
        // request stands charged there. Its settlement finds no lease for that
        // part and sends the part's credits to Redis.
        let surplus = refused
            .iter()
            .flat_map(|h| h.indices.iter().copied())
            .filter_map(|i| Some((i, reply.limits.get(i)?.charged as i64 - *costs.get(i)? as i64)));
        let surplus: Vec<(usize, i64)> = surplus.collect();
        worker.settle_credits(host, config, &self.tenant, None, false, &self.owners(), surplus.into_iter());
        if hold.held.is_empty() && refused.len() == hold.short.len() {
            self.count_admission(host, config, Decision::Allowed);
            self.admission = Some(Admission::Charged);
            return Verdict::Forward(self.admitted_headers(host, config, reply, now));
        }
        self.admitted_from_lease(host, worker, config, &leases, &slots, now)
    }

    /// The grant was refused: later requests that need as much are refused here until the
    /// retry time, and what the request's entries held goes back.
    pub(super) fn block_lease(&mut self, host: &mut impl Host, config: &Policy, reply: &LimitsReply, now: u64) {
        let short = self.lease_hold.as_ref().map_or_else(|| self.holders(config), |hold| hold.short.clone());
        lease_table::block(host, config, &short, reply, &self.costs(), now);
        self.put_back_hold(host, config);
    }

    /// An owner of the request (`owner`, when the limit is the request's) is suspended:
    /// this proxy's leases of it end now, and what the request's entries held goes back.
    pub(super) fn end_leases(&mut self, host: &mut impl Host, config: &Policy, owner: Option<&str>, now: u64) {
        for holder in self.holders(config).iter().filter(|h| Some(h.name.as_str()) == owner) {
            lease_table::end(host, config, holder, now);
        }
        self.put_back_hold(host, config);
    }

    /// Settles a request admitted from the lease: `credits` go back into its entries.
    pub(super) fn settle_leased(
        &self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        credits: &[(usize, i64)],
    ) {
        let now = host.now_ms();
        // What finds its lease expired (or evicted) meanwhile belongs to Redis.
        let left = lease_table::credit(host, config, &self.holders(config), credits, now);
        if !left.is_empty() {
            worker.settle_credits(host, config, &self.tenant, None, false, &self.owners(), left.into_iter());
        }
    }
}
