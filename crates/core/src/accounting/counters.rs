//! The three limit kinds of `lua/limits.lua` as Rust values, and the one decision that
//! charges every limit of a call or none: a token bucket (the model of `bucket.rs`), a
//! sliding window as the log of what each call took, concurrency slots as the requests
//! holding one with the time each expires. Each kind is seen, for the decision, as a bucket
//! holding exactly what it has free now, so the bucket model's all-or-nothing and elastic
//! arithmetic decides for every kind alike; the times a kind reports are its own.
//!
//! Two users, one model: the fake companion (tests) answers with it, pinned against the
//! script in a real Redis by `tests/cases/windows_and_slots.json` (and the buckets by
//! `token_bucket.json`); the local limiter (`local_limiter.rs`) decides with it in the
//! proxy's shared data, for the local store (`store: "local"`) and the degraded mode.

use crate::accounting::bucket::{self, BucketState};
use crate::protocol::{LimitCharge, LimitKind, LimitOutcome, LimitStatus, LimitsReply};
use std::collections::BTreeMap;

/// One limit of one tenant, by kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Counter {
    /// The bucket's level at its last write; `None` is a full bucket.
    Bucket(Option<BucketState>),
    /// What each call took, at its time (ms), oldest first; a settlement corrects the
    /// entry of the charge it settles, so the correction leaves the window with it.
    Window(Vec<(f64, f64)>),
    /// The requests holding a slot, with the time each slot expires unless touched (ms).
    Slots(BTreeMap<String, f64>),
}

impl Counter {
    pub fn new(kind: LimitKind) -> Counter {
        match kind {
            // A calendar budget is a bucket that never refills (see `bucket`).
            LimitKind::TokenBucket | LimitKind::Calendar => Counter::Bucket(None),
            LimitKind::SlidingWindow => Counter::Window(Vec::new()),
            LimitKind::Slots => Counter::Slots(BTreeMap::new()),
        }
    }

    pub fn kind(&self) -> LimitKind {
        match self {
            Counter::Bucket(_) => LimitKind::TokenBucket,
            Counter::Window(_) => LimitKind::SlidingWindow,
            Counter::Slots(_) => LimitKind::Slots,
        }
    }

    /// What the limit has free at `now`, as the bucket model's state: a bucket as it is,
    /// the other kinds as a bucket holding exactly what they have free now.
    pub fn as_bucket(&self, spec: &LimitCharge, now: f64) -> Option<BucketState> {
        let in_use = match self {
            Counter::Bucket(state) => return *state,
            Counter::Window(entries) => entries.iter().filter(|(at, _)| in_window(*at, spec, now)).map(|e| e.1).sum(),
            Counter::Slots(held) => held.values().filter(|&&expiry| expiry > now).count() as f64,
        };
        Some(BucketState { tokens: spec.capacity as f64 - in_use, updated_ms: now })
    }

    /// What the limit has free at `now` (its capacity when untouched), in whole units.
    pub fn remaining(&self, spec: &LimitCharge, now: f64) -> u64 {
        let mut state = [self.as_bucket(spec, now)];
        let look = LimitCharge { cost: 0, min_cost: None, ..spec.clone() };
        let reply = bucket::settle(&mut state, std::slice::from_ref(&look), &[0], now);
        reply.limits.first().map_or(0, |o| o.remaining)
    }

    /// Drops what has left the window or expired (the housekeeping of a charge).
    pub fn refresh(&mut self, spec: &LimitCharge, now: f64) {
        match self {
            Counter::Bucket(_) => {}
            Counter::Window(entries) => entries.retain(|(at, _)| in_window(*at, spec, now)),
            Counter::Slots(held) => held.retain(|_, expiry| *expiry > now),
        }
    }

    /// Whether the counter holds nothing a newcomer could take for a fresh budget: a
    /// bucket refilled, a window with no entry left in it, no live slot.
    pub fn is_idle(&self, spec: &LimitCharge, now: f64) -> bool {
        match self {
            // Full again: dropping it loses nothing (a missing bucket is a full one).
            Counter::Bucket(state) => bucket::level_at(spec, *state, now) >= spec.capacity as f64,
            Counter::Window(entries) => entries.iter().all(|(at, _)| !in_window(*at, spec, now)),
            Counter::Slots(held) => held.values().all(|&expiry| expiry <= now),
        }
    }

    /// Charges `amount` now; `member` is the request's id (a slot's name).
    fn take(&mut self, charged: Option<BucketState>, amount: u64, member: Option<&str>, spec: &LimitCharge, now: f64) {
        match self {
            Counter::Bucket(state) => *state = charged,
            Counter::Window(entries) => entries.push((now, amount as f64)),
            Counter::Slots(held) => {
                if let Some(member) = member {
                    held.insert(member.to_string(), now + spec.window_ms as f64);
                }
            }
        }
    }

    /// The outcome's times as this kind reports them (the bucket model's are a bucket's).
    fn times(&self, outcome: &mut LimitOutcome, required: u64, spec: &LimitCharge, now: f64) {
        let window = spec.window_ms as f64;
        match self {
            Counter::Bucket(_) => {}
            Counter::Window(entries) => {
                let live = || entries.iter().filter(|(at, _)| in_window(*at, spec, now));
                outcome.reset_after_ms = live()
                    .map(|(at, _)| at)
                    .fold(None, |newest: Option<f64>, &at| Some(newest.map_or(at, |n| n.max(at))))
                    .map_or(0, |newest| (newest + window - now).max(0.0).ceil() as u64);
                if outcome.status == LimitStatus::Limited {
                    // The oldest entries leave first: wait until enough of them have.
                    let short = required as f64 - (spec.capacity as f64 - live().map(|e| e.1).sum::<f64>());
                    let mut oldest_first: Vec<&(f64, f64)> = live().collect();
                    oldest_first.sort_by(|a, b| a.0.total_cmp(&b.0));
                    let mut freed = 0.0;
                    outcome.retry_after_ms = window.ceil() as u64;
                    for (at, amount) in oldest_first {
                        freed += amount;
                        if freed >= short {
                            outcome.retry_after_ms = (at + window - now).ceil().max(1.0) as u64;
                            break;
                        }
                    }
                }
            }
            Counter::Slots(held) => {
                outcome.reset_after_ms = 0;
                if outcome.status == LimitStatus::Limited {
                    let oldest = held.values().copied().filter(|&expiry| expiry > now).fold(f64::INFINITY, f64::min);
                    outcome.retry_after_ms = (oldest - now).ceil().clamp(1.0, 1000.0) as u64;
                }
            }
        }
    }

    /// A settlement's credit (negative: a further debit) for a charge made at `charged_at`.
    pub fn give_back(&mut self, credit: i64, charged_at: f64, spec: &LimitCharge, now: f64) {
        match self {
            Counter::Bucket(state) => {
                let mut states = [*state];
                bucket::settle_charge_made_at(&mut states, std::slice::from_ref(spec), &[credit], charged_at, now);
                *state = states[0];
            }
            // The charge's entry is the first at or after its time (`bound` only ever
            // moves an amount into a later entry); one that left the window needs none.
            Counter::Window(entries) if in_window(charged_at, spec, now) => {
                if let Some(entry) = entries.iter_mut().find(|(at, _)| *at >= charged_at) {
                    entry.1 -= credit as f64;
                }
            }
            Counter::Window(_) | Counter::Slots(_) => {}
        }
    }

    /// Renews the request's slot if it is still live (an expired one is not revived).
    pub fn touch(&mut self, member: &str, spec: &LimitCharge, now: f64) {
        if let Counter::Slots(held) = self {
            if let Some(expiry) = held.get_mut(member).filter(|expiry| **expiry > now) {
                *expiry = now + spec.window_ms as f64;
            }
        }
    }

    pub fn release(&mut self, member: &str) {
        if let Counter::Slots(held) = self {
            held.remove(member);
        }
    }

    /// Keeps a window's log to at most `most` entries by folding the oldest into the next
    /// one: the folded amount then leaves the window later than it would, never sooner,
    /// so a bounded window admits at most what the exact one does (exactly as much while
    /// its calls in a window number at most `most`).
    pub fn bound(&mut self, most: usize) {
        if let Counter::Window(entries) = self {
            entries.sort_by(|a, b| a.0.total_cmp(&b.0));
            while entries.len() > most.max(1) {
                let (_, amount) = entries.remove(0);
                if let Some(next) = entries.first_mut() {
                    next.1 += amount;
                }
            }
        }
    }
}

/// Whether an entry made at `at` is still inside the window at `now` (the script drops
/// entries scored `now - window` and older).
fn in_window(at: f64, spec: &LimitCharge, now: f64) -> bool {
    at > now - spec.window_ms as f64
}

/// Charges every limit or none, as the script's charge does: `counters[i]` belongs to
/// `specs[i]` and is updated in place (what left the window or expired is dropped either
/// way). `member` names the request's slots.
pub fn charge(counters: &mut [Counter], specs: &[LimitCharge], member: Option<&str>, now: f64) -> LimitsReply {
    for (counter, spec) in counters.iter_mut().zip(specs) {
        counter.refresh(spec, now);
    }
    let mut states: Vec<Option<BucketState>> =
        counters.iter().zip(specs).map(|(counter, spec)| counter.as_bucket(spec, now)).collect();
    let mut reply = bucket::check_and_charge(&mut states, specs, now);
    for ((counter, spec), (state, outcome)) in
        counters.iter_mut().zip(specs).zip(states.into_iter().zip(reply.limits.iter_mut()))
    {
        if reply.allowed && outcome.charged > 0 {
            counter.take(state, outcome.charged, member, spec, now);
        }
        counter.times(outcome, spec.cost, spec, now);
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(capacity: u64, window_ms: u64, cost: u64) -> LimitCharge {
        LimitCharge {
            name: "w".into(),
            capacity,
            window_ms,
            cost,
            min_cost: None,
            kind: LimitKind::SlidingWindow,
            period_bounds_ms: Vec::new(),
            provisional: false,
            look_only: false,
            shadow: false,
            owner: None,
            fair: None,
        }
    }

    /// A bounded window admits at most its capacity in any window, as the exact one does,
    /// and still admits (it only ever holds amounts longer).
    #[test]
    fn a_bounded_window_never_admits_more_than_its_capacity_in_any_window() {
        let spec = window(50, 1_000, 1);
        let mut bounded = [Counter::new(spec.kind)];
        let mut admitted = Vec::new();
        for call in 0..2_000u32 {
            let now = f64::from(call) * 7.0;
            if charge(&mut bounded, std::slice::from_ref(&spec), None, now).allowed {
                admitted.push(now);
            }
            bounded[0].bound(8);
            let Counter::Window(entries) = &bounded[0] else { unreachable!() };
            assert!(entries.len() <= 8);
        }
        for &start in &admitted {
            let inside = admitted.iter().filter(|&&at| at >= start && at < start + 1_000.0).count();
            assert!(inside <= 50, "{inside} admitted in the window from {start}");
        }
        // 14 s of calls: at least one window's worth, however conservative the folding.
        assert!(admitted.len() >= 50, "{}", admitted.len());
    }

    /// A correction lands on its charge's entry even after that entry was folded forward.
    #[test]
    fn a_credit_follows_its_charge_into_a_folded_entry() {
        let spec = window(100, 10_000, 0);
        let mut counter = Counter::Window(vec![(1.0, 30.0), (2.0, 40.0), (3.0, 5.0)]);
        counter.bound(2);
        assert_eq!(counter, Counter::Window(vec![(2.0, 70.0), (3.0, 5.0)]));
        counter.give_back(25, 1.0, &spec, 4.0);
        assert_eq!(counter, Counter::Window(vec![(2.0, 45.0), (3.0, 5.0)]));
        assert_eq!(counter.remaining(&spec, 4.0), 50);
    }
}
