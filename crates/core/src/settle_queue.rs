//! Settlements waiting to be sent to the companion. Requests add to the queue as their
//! replies end; the root context sends the queue in batches on its timer. A request's own
//! context is gone soon after its reply ends, and the host cancels its callouts with it,
//! so the settlement must outlive the request.
//!
//! Settling is idempotent (the Lua script applies a reservation at most once), so a batch
//! that fails is simply sent again, a few times, then dropped: the reservation then
//! expires and its estimate stands, which errs on the side of the limit.

use crate::protocol::{SettleOutcome, Settlement};
use std::collections::VecDeque;

/// Attempts before a settlement is given up.
pub const MAX_ATTEMPTS: u8 = 5;

#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    pub settlement: Settlement,
    pub attempts: u8,
}

#[derive(Debug)]
pub struct SettleQueue {
    waiting: VecDeque<Queued>,
    capacity: usize,
}

impl SettleQueue {
    pub fn new(capacity: usize) -> SettleQueue {
        SettleQueue { waiting: VecDeque::new(), capacity }
    }

    /// Adds a settlement; when full, the oldest is dropped and returned.
    pub fn push(&mut self, settlement: Settlement) -> Option<Queued> {
        let dropped = (self.waiting.len() >= self.capacity).then(|| self.waiting.pop_front()).flatten();
        self.waiting.push_back(Queued { settlement, attempts: 0 });
        dropped
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Takes up to `max` settlements to send.
    pub fn take_batch(&mut self, max: usize) -> Vec<Queued> {
        let n = max.min(self.waiting.len());
        self.waiting.drain(..n).collect()
    }

    /// Puts back what a batch did not settle: everything if the call failed (`outcomes` is
    /// `None`), else those whose outcome is `Failed`. Returns how many were given up.
    pub fn requeue(&mut self, batch: Vec<Queued>, outcomes: Option<&[SettleOutcome]>) -> usize {
        let mut given_up = 0;
        for (i, mut queued) in batch.into_iter().enumerate() {
            let failed = outcomes.is_none_or(|o| o.get(i).is_none_or(|&outcome| outcome == SettleOutcome::Failed));
            if !failed {
                continue;
            }
            queued.attempts += 1;
            if queued.attempts >= MAX_ATTEMPTS || self.waiting.len() >= self.capacity {
                given_up += 1;
            } else {
                self.waiting.push_back(queued);
            }
        }
        given_up
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Adjustment;
    use crate::protocol::LimitKind;

    fn settlement(id: &str) -> Settlement {
        Settlement {
            domain: "llm".into(),
            tenant: "t".into(),
            reservation: Some(id.into()),
            cancel: false,
            limits: vec![Adjustment {
                name: "tpm".into(),
                capacity: 100,
                window_ms: 60_000,
                credit: 5,
                kind: LimitKind::TokenBucket,
            }],
        }
    }

    fn ids(batch: &[Queued]) -> Vec<&str> {
        batch.iter().map(|q| q.settlement.reservation.as_deref().unwrap_or("")).collect()
    }

    #[test]
    fn batches_in_order_and_drops_the_oldest_when_full() {
        let mut queue = SettleQueue::new(3);
        for id in ["a", "b", "c"] {
            assert_eq!(queue.push(settlement(id)), None);
        }
        assert_eq!(queue.push(settlement("d")).and_then(|q| q.settlement.reservation), Some("a".into()));
        assert_eq!(ids(&queue.take_batch(2)), ["b", "c"]);
        assert_eq!(ids(&queue.take_batch(10)), ["d"]);
        assert!(queue.is_empty());
    }

    #[test]
    fn requeues_failures_until_they_run_out_of_attempts() {
        let mut queue = SettleQueue::new(10);
        queue.push(settlement("a"));
        queue.push(settlement("b"));
        let batch = queue.take_batch(10);
        let outcomes = [SettleOutcome::Applied, SettleOutcome::Failed];
        assert_eq!(queue.requeue(batch, Some(&outcomes)), 0);
        assert_eq!(queue.len(), 1);
        let mut given_up = 0;
        for _ in 0..MAX_ATTEMPTS {
            let batch = queue.take_batch(10);
            given_up += queue.requeue(batch, None);
        }
        assert_eq!((given_up, queue.len()), (1, 0));
    }

    #[test]
    fn already_settled_is_not_retried() {
        let mut queue = SettleQueue::new(10);
        queue.push(settlement("a"));
        let batch = queue.take_batch(10);
        assert_eq!(queue.requeue(batch, Some(&[SettleOutcome::AlreadySettled])), 0);
        assert!(queue.is_empty());
    }
}
