//! Settlements waiting to be sent to the companion. Requests add to the queue as their
//! replies end; the root context sends the queue in batches on its timer. A request's own
//! context is gone soon after its reply ends, and the host cancels its callouts with it,
//! so the settlement must outlive the request.
//!
//! Settling is idempotent (the Lua script applies a reservation at most once), so a batch
//! that fails is sent again, backing off from 100 ms to 5 s (about 11 s in all, so a
//! Redis paused or restarted for seconds loses nothing), then dropped: the reservation
//! then expires and its estimate stands, which errs on the side of the limit.

use crate::protocol::{SettleOutcome, Settlement};
use std::collections::VecDeque;

/// Attempts before a settlement is given up.
pub const MAX_ATTEMPTS: u8 = 8;
const FIRST_RETRY_MS: u64 = 100;
const LONGEST_RETRY_MS: u64 = 5_000;

#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    pub settlement: Settlement,
    pub attempts: u8,
    /// Not sent again before this time.
    pub retry_at_ms: u64,
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
        self.waiting.push_back(Queued { settlement, attempts: 0, retry_at_ms: 0 });
        dropped
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Takes up to `max` settlements due at `now_ms`, oldest first.
    pub fn take_batch(&mut self, max: usize, now_ms: u64) -> Vec<Queued> {
        let mut batch = Vec::new();
        let mut waiting = std::collections::VecDeque::with_capacity(self.waiting.len());
        for queued in self.waiting.drain(..) {
            if batch.len() < max && queued.retry_at_ms <= now_ms {
                batch.push(queued);
            } else {
                waiting.push_back(queued);
            }
        }
        self.waiting = waiting;
        batch
    }

    /// Puts back what a batch did not settle at `now_ms`: everything if the call failed
    /// (`outcomes` is `None`), else those whose outcome is `Failed`, each due again after
    /// its backoff. Returns how many were given up.
    pub fn requeue(&mut self, batch: Vec<Queued>, outcomes: Option<&[SettleOutcome]>, now_ms: u64) -> usize {
        let mut given_up = 0;
        for (i, mut queued) in batch.into_iter().enumerate() {
            let failed = outcomes.is_none_or(|o| o.get(i).is_none_or(|&outcome| outcome == SettleOutcome::Failed));
            if !failed {
                continue;
            }
            queued.attempts += 1;
            let backoff = FIRST_RETRY_MS.saturating_mul(1 << (queued.attempts - 1).min(16)).min(LONGEST_RETRY_MS);
            queued.retry_at_ms = now_ms + backoff;
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
            once: None,
            cancel: false,
            stand_in: None,
            limits: vec![Adjustment {
                owner: None,
                name: "tpm".into(),
                capacity: 100,
                window_ms: 60_000,
                credit: 5,
                kind: LimitKind::TokenBucket,
                period_bounds_ms: Vec::new(),
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
        assert_eq!(ids(&queue.take_batch(2, 0)), ["b", "c"]);
        assert_eq!(ids(&queue.take_batch(10, 0)), ["d"]);
        assert!(queue.is_empty());
    }

    #[test]
    fn requeues_failures_until_they_run_out_of_attempts() {
        let mut queue = SettleQueue::new(10);
        queue.push(settlement("a"));
        queue.push(settlement("b"));
        let batch = queue.take_batch(10, 0);
        let outcomes = [SettleOutcome::Applied, SettleOutcome::Failed];
        assert_eq!(queue.requeue(batch, Some(&outcomes), 0), 0);
        assert_eq!(queue.len(), 1);
        // Not sent again before its backoff: 100 ms, then 200, 400... up to 5 s.
        assert!(queue.take_batch(10, 99).is_empty());
        let (mut given_up, mut now, mut backoffs) = (0, 100, vec![100]);
        for _ in 1..MAX_ATTEMPTS {
            let batch = queue.take_batch(10, now);
            assert_eq!(batch.len(), 1, "due at {now}");
            given_up += queue.requeue(batch, None, now);
            if let Some(next) = queue.waiting.front() {
                backoffs.push(next.retry_at_ms - now);
                now = next.retry_at_ms;
            }
        }
        assert_eq!((given_up, queue.len()), (1, 0));
        assert_eq!(backoffs, [100, 200, 400, 800, 1600, 3200, 5000]);
        assert!(backoffs.iter().sum::<u64>() > 10_000, "a Redis paused for seconds loses nothing");
    }

    #[test]
    fn already_settled_is_not_retried() {
        let mut queue = SettleQueue::new(10);
        queue.push(settlement("a"));
        let batch = queue.take_batch(10, 0);
        assert_eq!(queue.requeue(batch, Some(&[SettleOutcome::AlreadySettled]), 0), 0);
        assert!(queue.is_empty());
    }
}
