//! The leases this VM holds: entries renewed when they run low, what expired given back
//! to Redis, and the requests of this VM that wait for a grant another asked for (woken
//! by its answer, or by the tick once it landed elsewhere or they waited their longest).

use super::companion::callout_reply;
use super::{RootAnswer, Worker};
use crate::accounting::lease::{lease_asks, LeaseEntry, TenantLeases};
use crate::config::Policy;
use crate::effects::host::{Host, LogLevel, Metric, Owner};
use crate::effects::lease_table::{self, Holder};
use crate::effects::tables::{read_own, update_slot, TenantTable};
use crate::plan::charge::limit_charge;
use crate::protocol::{LeaseRequest, LimitCharge, LimitsReply, LEASE_PATH};

/// How often expired leases are looked for, in ticks.
const EXPIRY_TICKS: u32 = 10;

impl Worker {
    /// The full tick's work for leases: wakes the waiters whose grant landed, renews the
    /// entries that ran low and, every `EXPIRY_TICKS`, gives back what expired.
    pub(super) fn tend_leases(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        self.wake_stale_waiters(host, config, now);
        self.renew_leases(host, config, now);
        if self.ticks % EXPIRY_TICKS == 0 {
            self.return_expired_leases(host, config, now);
        }
    }

    /// Takes the answer to a lease renewal if `token` is one's; whether it was.
    pub(super) fn renewal_answered(&mut self, host: &mut impl Host, config: &Policy, answer: RootAnswer) -> bool {
        let RootAnswer { token, body_size } = answer;
        let Some((holder, asked)) = self.renewing.remove(&token) else { return false };
        // Answered (or failed): the next renewal of this entry may be asked, and
        // whoever waits for it takes again once this callback is over.
        lease_table::renewal_answered(host, config, &holder);
        self.lease_news(&holder.name);
        match callout_reply::<LimitsReply>(host, body_size) {
            Ok(reply) if reply.allowed && reply.limits.len() == asked.len() => {
                self.callout_succeeded(host, config);
                let now = host.now_ms();
                // The renewal asked for the holder's limits only, in its order.
                let outcome =
                    |i: usize| holder.indices.iter().position(|&at| at == i).and_then(|k| reply.limits.get(k));
                let holders = std::slice::from_ref(&holder);
                let merged = lease_table::merge(host, config, holders, outcome, None, now);
                self.note_leased(&merged.slots, &merged.leases, now);
            }
            Ok(LimitsReply { suspended: Some(suspension), .. }) => {
                // Suspended by its plan: this proxy's leases of the owner end now
                // rather than at their expiry (what is left goes back with the expired).
                self.callout_succeeded(host, config);
                let now = host.now_ms();
                lease_table::end(host, config, &holder, now);
                self.owner_plans.suspend(&holder.name, &suspension.reason, now);
            }
            Ok(_) => {}
            Err(why) => {
                self.record_callout_failure(host, config);
                host.log(LogLevel::Warn, &format!("llm-ratelimit: lease renewal failed: {why}"));
            }
        }
        true
    }

    /// How many slots of the lease table this VM watches for expiry (bounded by the table).
    pub fn leased_slots(&self) -> usize {
        self.leased.len()
    }

    /// Remembers that lease entries sit at `slots` and when the first of `leases` expires
    /// (should another tenant take such a slot later, the sweep returns that one's leases).
    pub(crate) fn note_leased(&mut self, slots: &[u32], leases: &TenantLeases, now: u64) {
        let Some(expiry) = leases.next_expiry_ms(now) else { return };
        for &slot in slots {
            let due = self.leased.entry(slot).or_insert(expiry);
            *due = (*due).min(expiry);
        }
    }

    pub(crate) fn want_renewal(&mut self, holder: Holder) {
        self.renewals.insert(holder.name, holder.indices);
    }

    /// Hands the renewal of `entry` this VM holds for its next tick to a request that
    /// found the entry dry: the request asks for it now, as its own callout (whose answer
    /// comes back to it: the SDK routes an answer to the context that dispatched it), and
    /// lifts the marker the renewal set when it answers.
    pub(crate) fn take_renewal(&mut self, entry: &str) -> Option<Holder> {
        let (name, indices) = self.renewals.remove_entry(entry)?;
        Some(Holder { name, indices })
    }

    /// Asks for fresh grants for the lease entries that ran low, one callout each, for
    /// the limits each holds (a pool's entry is renewed under the pool's owner id).
    fn renew_leases(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        if self.renewals.is_empty() || !self.breaker(host, config).is_closed() {
            return;
        }
        for (name, indices) in std::mem::take(&mut self.renewals) {
            self.renew(host, config, Holder { name, indices }, now);
        }
    }

    fn renew(&mut self, host: &mut impl Host, config: &Policy, holder: Holder, now: u64) {
        if self.renewing.values().any(|(h, _)| h.name == holder.name) {
            return;
        }
        let stored = read_own(host, config, TenantTable::Leases, &holder.name);
        let entry = LeaseEntry::decode(stored.as_deref(), config.limits.len());
        let held = TenantLeases(holder.indices.iter().filter_map(|&i| entry.leases.0.get(i).copied()).collect());
        // A renewal charges nothing itself; it sizes the grant by how the lease was used.
        let unused: Vec<LimitCharge> =
            holder.indices.iter().filter_map(|&i| config.limits.get(i)).map(|limit| limit_charge(limit, 0)).collect();
        let request = LeaseRequest {
            domain: config.domain.clone(),
            tenant: holder.name.clone(),
            limits: lease_asks(&held, &unused, &config.lease_policy(), now),
            share: config.lease.share,
        };
        match self.call_companion(host, config, LEASE_PATH, &request, config.companion.timeout, Owner::Root) {
            Ok(token) => {
                host.add_metric(Metric::LeaseCallouts, 1);
                self.renewing.insert(token, (holder, request.limits));
            }
            Err(why) => {
                host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot renew a lease: {why}"));
                // None is out: whoever waits for it asks.
                lease_table::renewal_answered(host, config, &holder);
                self.lease_news(&holder.name);
            }
        }
    }

    /// Gives back to Redis what is left of expired leases.
    fn return_expired_leases(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        let limits = config.limits.len();
        // Only slots whose first lease has expired are read: a sweep costs what expired,
        // not one shared-data read per tenant served.
        let due: Vec<u32> = self.leased.iter().filter(|(_, &due)| due <= now).map(|(&slot, _)| slot).collect();
        for slot in due {
            let returned = update_slot(host, config, TenantTable::Leases, slot, |tenant, payload| {
                let mut entry = LeaseEntry::decode(Some(payload), limits);
                let amounts = entry.leases.expire(now);
                let changed = amounts.iter().any(|&a| a != 0.0);
                let next_expiry = entry.leases.next_expiry_ms(now);
                (changed.then(|| entry.encode()), (tenant.to_string(), amounts, next_expiry))
            });
            let Some((tenant, amounts, next_expiry)) = returned else {
                self.leased.remove(&slot);
                continue;
            };
            let credits = amounts.iter().enumerate().map(|(i, a)| (i, a.round() as i64));
            self.settle_credits(host, config, &tenant, None, false, &[], credits);
            match next_expiry {
                Some(expiry) => {
                    self.leased.insert(slot, expiry);
                }
                None => {
                    self.leased.remove(&slot);
                }
            }
        }
    }

    /// `context` waits, until `until` at the latest, for the grant out for the lease entry
    /// `entry`.
    pub(crate) fn await_lease(&mut self, context: u32, entry: String, until: u64) {
        self.lease_waiters.retain(|(c, _, _)| *c != context);
        self.lease_waiters.push((context, entry, until));
    }

    /// `context` is over: it waits for nothing.
    pub(crate) fn stop_waiting(&mut self, context: u32) {
        self.lease_waiters.retain(|(c, _, _)| *c != context);
        self.waiters_due.retain(|&c| c != context);
    }

    /// A grant for `entry` answered: every request of this VM waiting for it is due.
    pub(crate) fn lease_news(&mut self, entry: &str) {
        self.wake_waiters(|waited, _| waited == entry);
    }

    fn wake_waiters(&mut self, mut due: impl FnMut(&str, u64) -> bool) {
        let waiters_due = &mut self.waiters_due;
        self.lease_waiters.retain(|(context, entry, until)| {
            let wake = due(entry, *until);
            if wake {
                waiters_due.push(*context);
            }
            !wake
        });
    }

    /// Whether requests of this VM wait for a lease grant: the glue then ticks the root
    /// every `WAIT_TICK`, which wakes them (`on_wait_tick`) soon after their grant lands.
    pub fn has_waiters(&self) -> bool {
        !self.lease_waiters.is_empty() || !self.waiters_due.is_empty()
    }

    /// The requests to resume now, each with `RequestFilter::on_lease_news` in its own
    /// context, from the root's callback: their grant answered (here, or in another
    /// worker), or they waited their longest.
    pub fn waiters_due(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.waiters_due)
    }

    /// Waiters the glue could not resume just now: due at its next chance.
    pub fn due_again(&mut self, contexts: Vec<u32>) {
        self.waiters_due.extend(contexts);
    }

    /// The short tick between two full ones while requests wait (`has_waiters`): wakes those
    /// whose grant is no longer out.
    pub fn on_wait_tick(&mut self, host: &mut impl Host) {
        let Some(config) = self.config.clone() else { return };
        let now = host.now_ms();
        self.wake_stale_waiters(host, &config, now);
    }

    /// Waiters whose entry has no grant out any more (another worker's grant landed: its
    /// answer wakes only that worker's waiters; or the one asked can no longer answer), and
    /// those that waited their longest.
    fn wake_stale_waiters(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        if self.lease_waiters.is_empty() {
            return;
        }
        let policy = config.lease_policy();
        // Each entry waited on is read once, however many wait on it: whether its grant landed.
        let mut waited_on: Vec<(String, bool)> = Vec::new();
        for (_, entry, _) in &self.lease_waiters {
            if !waited_on.iter().any(|(seen, _)| seen == entry) {
                waited_on.push((entry.clone(), !lease_table::grant_out(host, config, entry, &policy, now)));
            }
        }
        self.wake_waiters(|entry, until| now >= until || waited_on.iter().any(|(e, landed)| *landed && e == entry));
    }
}
