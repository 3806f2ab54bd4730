//! What the worker sends the companion for its requests: settlements, queued and sent in
//! batches (again when an answer is lost), the spend ledger's aggregate, and the
//! heartbeats that keep held concurrency slots alive. What a settlement says is made in
//! `plan::settlement`.

use super::companion::{callout_reply, BACKGROUND_TIMEOUT};
use super::{RootAnswer, Worker};
use crate::accounting::ledger::MAX_ROWS as LEDGER_ROWS;
use crate::config::{Policy, Store};
use crate::effects::host::{Host, LogLevel, Metric, Owner};
use crate::effects::settle_queue::Queued;
use crate::plan::charge::limit_charge;
use crate::plan::settlement::{adjustments, settlement};
use crate::protocol::ledger::{LedgerReply, LEDGER_PATH};
use crate::protocol::{LimitCharge, SettleOutcome, SettleReply, Settlement, SettlementBatch, SETTLE_PATH, TOUCH_PATH};

/// Most settlements in one callout: all a call may carry. The companion applies them in
/// script calls of a hundred, so a large batch costs few round trips; with one batch out
/// at a time, a smaller one capped what a worker could settle (200 per 50 ms tick fell
/// behind a worker's 5,500 token requests/s, and the full queue dropped settlements).
const SETTLE_BATCH: usize = crate::protocol::MAX_SETTLEMENTS_PER_CALL;
/// How often the ledger's aggregate goes to the companion, in ticks (a second), and how
/// often a batch the companion did not acknowledge is sent again.
const LEDGER_TICKS: u32 = 20;

impl Worker {
    /// Takes the spend ledger's acknowledgement if `token` is its batch's; whether it was.
    pub(super) fn ledger_answered(&mut self, host: &mut impl Host, answer: RootAnswer) -> bool {
        let RootAnswer { token, body_size } = answer;
        if !self.ledger.is_sending(token) {
            return false;
        }
        let answer = callout_reply::<LedgerReply>(host, body_size);
        if let Err(why) = &answer {
            host.log(LogLevel::Debug, &format!("llm-ratelimit: ledger batch not acknowledged, kept: {why}"));
        }
        self.ledger.answered(answer.is_ok());
        true
    }

    /// Takes the answer to the settlement batch out if `token` is its; whether it was.
    pub(super) fn settlements_answered(&mut self, host: &mut impl Host, config: &Policy, answer: RootAnswer) -> bool {
        let RootAnswer { token, body_size } = answer;
        match self.settling.take() {
            Some((expected, batch)) if expected == token => {
                // A full batch: a backlog, maybe, which goes on at once rather than a tick
                // later; smaller batches wait for the tick, so that they stay batches.
                let full = batch.len() >= SETTLE_BATCH;
                match callout_reply::<SettleReply>(host, body_size) {
                    Ok(reply) if reply.results.len() == batch.len() => self.requeue(host, batch, Some(&reply.results)),
                    _ => self.requeue(host, batch, None),
                }
                if full && self.host_kind().dispatches_from_callout_replies() {
                    self.send_settlements(host, config);
                }
                true
            }
            other => {
                self.settling = other;
                false
            }
        }
    }

    pub(crate) fn queue_settlement(&mut self, host: &mut impl Host, settlement: Settlement) {
        if self.settlements.push(settlement).is_some() {
            host.add_metric(Metric::SettlementsFailed, 1);
        }
    }

    /// Queues, for `tenant`, the adjustments of `credits` (by limit index), if any, each
    /// on its limit's counter (`owners`, by limit index: a pool's, see `crate::plan::pools`;
    /// none or `None`: the tenant's).
    // Each argument is a part of the settlement's address or content; a struct for them
    // would be built at every one of the few call sites and read once here.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn settle_credits(
        &mut self,
        host: &mut impl Host,
        config: &Policy,
        tenant: &str,
        reservation: Option<String>,
        cancel: bool,
        owners: &[Option<String>],
        credits: impl Iterator<Item = (usize, i64)>,
    ) {
        let limits = adjustments(config, owners, credits, host.now_ms());
        if !limits.is_empty() {
            // Without a reservation record to settle against, an id of its own keeps it
            // from being applied twice when a batch is sent again after a lost answer.
            let once = reservation.is_none().then(|| self.ids.next(host));
            let settlement = Settlement { once, ..settlement(config, tenant, reservation, cancel, limits) };
            self.queue_settlement(host, settlement);
        }
    }

    pub(super) fn send_settlements(&mut self, host: &mut impl Host, config: &Policy) {
        // The breaker is read last: an idle tick makes no call into the host for it.
        if self.settling.is_some() || self.settlements.is_empty() || !self.breaker(host, config).is_closed() {
            return; // one batch at a time; none while the companion is known to be away
        }
        let batch = self.settlements.take_batch(SETTLE_BATCH, host.now_ms());
        if batch.is_empty() {
            return;
        }
        let request = SettlementBatch { settlements: batch.iter().map(|q| q.settlement.clone()).collect() };
        let timeout = config.companion.timeout.max(BACKGROUND_TIMEOUT);
        match self.call_companion(host, config, SETTLE_PATH, &request, timeout, Owner::Root) {
            Ok(token) => self.settling = Some((token, batch)),
            Err(why) => {
                host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot send settlements: {why}"));
                self.requeue(host, batch, None);
            }
        }
    }

    fn requeue(&mut self, host: &mut impl Host, batch: Vec<Queued>, outcomes: Option<&[SettleOutcome]>) {
        let now = host.now_ms();
        let given_up = self.settlements.requeue(batch, outcomes, now);
        if given_up > 0 {
            host.add_metric(Metric::SettlementsFailed, given_up as u64);
            host.log(
                LogLevel::Warn,
                &format!("llm-ratelimit: gave up {given_up} settlement(s); their reservations will expire as charged"),
            );
        }
    }

    /// Seals the ledger's aggregate as the next batch every second (sooner when it fills
    /// up) and sends the batch out, the same one until the companion acknowledges it;
    /// none while the companion is known to be away, when the aggregate keeps growing
    /// (bounded, see `accounting::ledger`).
    pub(super) fn send_ledger(&mut self, host: &mut impl Host, config: &Policy) {
        if self.ledger.is_empty() {
            return;
        }
        if self.ticks % LEDGER_TICKS != 0 && self.ledger.rows() < LEDGER_ROWS / 2 {
            return;
        }
        self.ledger.seal();
        if self.ledger.out().is_none_or(|out| out.token.is_some()) || !self.breaker(host, config).is_closed() {
            return;
        }
        let vm = self.ids.ledger_id(host);
        let Some(batch) = self.ledger.to_send(&config.domain, &vm) else { return };
        let timeout = config.companion.timeout.max(BACKGROUND_TIMEOUT);
        match self.call_companion(host, config, LEDGER_PATH, &batch, timeout, Owner::Root) {
            Ok(token) => self.ledger.sent(token),
            Err(why) => host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot send the ledger batch: {why}")),
        }
    }

    pub(crate) fn hold_slots(&mut self, id: String, slots: HeldSlots) {
        self.slots.insert(id, slots);
    }

    pub(crate) fn take_slots(&mut self, id: &str) -> Option<HeldSlots> {
        self.slots.remove(id)
    }

    /// Renews the slots of this VM's requests in flight, so a long stream keeps its slot
    /// while a crashed proxy's slots expire: those in Redis through the companion, those
    /// the local limiter counts (the local store's, the degraded mode's) in shared data.
    pub(super) fn touch_slots(&mut self, host: &mut impl Host, config: &Policy) {
        let mut in_redis = Vec::new();
        let specs: Vec<LimitCharge> = config.limits.iter().map(|limit| limit_charge(limit, 0)).collect();
        for held in self.slots.values() {
            match held {
                HeldSlots::InRedis(settlement) => in_redis.push(settlement.clone()),
                HeldSlots::InSharedData { entries, holder } => {
                    for entry in entries {
                        crate::effects::local_limiter::touch(host, config, entry, &specs, holder);
                    }
                }
            }
        }
        if config.store == Store::Local {
            return; // no companion (and so no slot in Redis)
        }
        for chunk in in_redis.chunks(SETTLE_BATCH) {
            let request = SettlementBatch { settlements: chunk.to_vec() };
            if let Err(why) = self.call_companion(host, config, TOUCH_PATH, &request, BACKGROUND_TIMEOUT, Owner::Root) {
                host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot renew concurrency slots: {why}"));
            }
        }
    }
}

/// Where the concurrency slots of a request in flight are held, so the worker renews them
/// there until the request ends.
#[derive(Debug, Clone)]
pub(crate) enum HeldSlots {
    /// In Redis, renewed through the companion by this settlement (its reservation names
    /// them).
    InRedis(Settlement),
    /// Counted by the local limiter in this proxy's shared data: in these entries (a
    /// tenant's, a pool's), under this holder.
    InSharedData { entries: Vec<String>, holder: String },
}
