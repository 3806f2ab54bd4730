//! The fair shares of a pool (`lua/limits.lua`, "Fair shares") as pure functions: the
//! script is what runs (Redis owns the state and the clock, shared by every proxy); this
//! model states the same rules in Rust so they are tested against the same case table,
//! `tests/cases/fair_share.json`.
//!
//! Each active claimant of a pool has its use (admitted tokens, decayed exponentially with
//! a time constant of the pool's window: tokens per window), its weight and its last
//! call's cost. A claimant may take from the pool at most its allowance (its max-min water
//! level when the others keep what they use) less its use; one borrowing past its equal
//! share may not bring the pool below the reserve kept for the others' next calls.

use crate::protocol::FairClaim;
use std::collections::BTreeMap;

/// One claimant as the pool's fair hash stores it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Claimant {
    /// Its use at `at_ms`.
    pub used: f64,
    pub at_ms: f64,
    pub weight: f64,
    /// Its last call's cost.
    pub last: f64,
}

/// A pool's fair hash: claimant id → its entry.
pub type Claimants = BTreeMap<String, Claimant>;

/// What a claimant may take from the pool now, and why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Judgement {
    /// The most it may take (never above the pool's level).
    pub room: f64,
    /// Its use, now.
    pub used: f64,
    /// Its water level (see the module).
    pub allowance: f64,
    /// Its equal share: capacity × its weight / every active claimant's weight.
    pub share: f64,
    /// What a borrower leaves in the pool.
    pub reserve: f64,
    /// The pool's level.
    pub level: f64,
}

/// Drops the claimants idle for more than `idle_ms` and decays the others' use to
/// `now_ms` (the stored entries are rewritten only by `record` and `correct`, as the
/// script does).
pub fn active(claimants: &mut Claimants, now_ms: f64, window_ms: f64, idle_ms: f64) -> Claimants {
    claimants.retain(|_, c| c.weight > 0.0 && now_ms - c.at_ms <= idle_ms);
    claimants
        .iter()
        .map(|(id, c)| (id.clone(), Claimant { used: decayed(c, now_ms, window_ms), at_ms: now_ms, ..*c }))
        .collect()
}

fn decayed(c: &Claimant, now_ms: f64, window_ms: f64) -> f64 {
    c.used * (-(now_ms - c.at_ms).max(0.0) / window_ms).exp()
}

/// The water level of `id` (weight `weight`) when every other claimant of `now` (from
/// `active`) keeps what it uses: λ × weight, with Σ min(usedⱼ, λ × wⱼ) + λ × weight =
/// capacity.
pub fn allowance(now: &Claimants, id: &str, weight: f64, capacity: f64) -> f64 {
    let mut others: Vec<&Claimant> = now.iter().filter(|(other, _)| other.as_str() != id).map(|(_, c)| c).collect();
    let mut weights = weight + others.iter().map(|c| c.weight).sum::<f64>();
    others.sort_by(|a, b| (a.used / a.weight).total_cmp(&(b.used / b.weight)));
    let mut taken = 0.0;
    for c in others {
        if c.used / c.weight > (capacity - taken) / weights {
            break;
        }
        taken += c.used;
        weights -= c.weight;
    }
    (capacity - taken) / weights * weight
}

/// What `claim`'s claimant may take now from a pool of `capacity` at `level`, asking
/// `cost`; `now` from `active`.
pub fn judge(now: &Claimants, claim: &FairClaim, cost: f64, level: f64, capacity: f64) -> Judgement {
    let weight = f64::from(claim.weight);
    let used = now.get(&claim.claimant).map_or(0.0, |c| c.used);
    let total_weight = weight + now.iter().filter(|(id, _)| **id != claim.claimant).map(|(_, c)| c.weight).sum::<f64>();
    let allowance = allowance(now, &claim.claimant, weight, capacity);
    let share = capacity * weight / total_weight;
    let reserve = now
        .iter()
        .filter(|(id, _)| **id != claim.claimant)
        .map(|(_, c)| (capacity * c.weight / total_weight, c))
        .filter(|(their_share, c)| c.used < *their_share)
        .map(|(their_share, c)| (their_share - c.used).min(c.last))
        .sum::<f64>();
    let mut room = level.min(allowance - used);
    if used + cost > share {
        room = room.min(level - reserve);
    }
    Judgement { room, used, allowance, share, reserve, level }
}

impl Judgement {
    /// When `needed` would fit for this claimant (ms, at least 1): its use decayed to its
    /// allowance, and the pool refilled past the reserve (`refill_ms(amount)`: when the
    /// pool holds `amount`).
    pub fn retry_after_ms(&self, needed: f64, window_ms: f64, refill_ms: impl Fn(f64) -> u64) -> u64 {
        let mut wait = 0;
        if self.used + needed > self.allowance {
            wait = if self.allowance > needed {
                (window_ms * (self.used / (self.allowance - needed)).ln()).ceil() as u64
            } else {
                window_ms.ceil() as u64
            };
        }
        if self.used + needed > self.share && self.level - self.reserve < needed {
            wait = wait.max(refill_ms(self.reserve + needed));
        }
        wait.max(1)
    }
}

/// Records `claim`'s call at `now_ms` (`charged` more used; `cost` what it asked), `now`
/// from `active`: a newcomer finding `max_claimants` takes the place of the one using
/// least.
pub fn record(claimants: &mut Claimants, now: &Claimants, claim: &FairClaim, cost: f64, charged: f64, now_ms: f64) {
    let known = now.get(&claim.claimant);
    if known.is_none() && now.len() >= claim.max_claimants as usize {
        let least = now.iter().min_by(|a, b| a.1.used.total_cmp(&b.1.used)).map(|(id, _)| id.clone());
        if let Some(least) = least {
            claimants.remove(&least);
        }
    }
    let used = known.map_or(0.0, |c| c.used) + charged;
    let entry = Claimant { used, at_ms: now_ms, weight: f64::from(claim.weight), last: cost.max(charged) };
    claimants.insert(claim.claimant.clone(), entry);
}

/// A settlement's credit (a debit if < 0) corrects `id`'s use, if it is still recorded
/// (never below zero).
pub fn correct(claimants: &mut Claimants, id: &str, credit: f64, now_ms: f64, window_ms: f64) {
    if let Some(c) = claimants.get_mut(id) {
        c.used = (decayed(c, now_ms, window_ms) - credit).max(0.0);
        c.at_ms = now_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounting::bucket::{check_and_charge, settle_charge_made_at, BucketState};
    use crate::protocol::{LimitCharge, LimitKind};
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Table {
        cases: Vec<Case>,
    }

    #[derive(Deserialize)]
    struct Case {
        name: String,
        #[serde(default)]
        pool: Pool,
        #[serde(default)]
        fair: Fair,
        steps: Vec<Step>,
    }

    #[derive(Deserialize)]
    #[serde(default)]
    struct Pool {
        capacity: u64,
        window_ms: u64,
    }

    impl Default for Pool {
        fn default() -> Pool {
            Pool { capacity: 1000, window_ms: 60_000 }
        }
    }

    #[derive(Deserialize)]
    #[serde(default)]
    struct Fair {
        max: u32,
        idle_ms: u64,
    }

    impl Default for Fair {
        fn default() -> Fair {
            Fair { max: 64, idle_ms: 60_000 }
        }
    }

    #[derive(Deserialize)]
    struct Step {
        #[serde(default)]
        op: Option<String>,
        advance_ms: u64,
        #[serde(default)]
        id: String,
        #[serde(default = "one")]
        weight: u32,
        #[serde(default)]
        cost: u64,
        #[serde(default)]
        min_cost: Option<u64>,
        #[serde(default)]
        record: Option<String>,
        #[serde(default)]
        credit: i64,
        done: bool,
        remaining: u64,
        #[serde(default)]
        retry_after_ms: u64,
        #[serde(default)]
        charged: Option<u64>,
        used: BTreeMap<String, f64>,
    }

    fn one() -> u32 {
        1
    }

    fn bucket(pool: &Pool, cost: u64) -> LimitCharge {
        crate::testing::spec("pool", pool.capacity, pool.window_ms, cost, None, LimitKind::TokenBucket)
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn model_matches_the_shared_case_table() {
        let table: Table =
            serde_json::from_str(include_str!("../../../../tests/cases/fair_share.json")).expect("case table");
        for case in table.cases {
            let (capacity, window_ms) = (case.pool.capacity as f64, case.pool.window_ms as f64);
            let mut state: Vec<Option<BucketState>> = vec![None];
            let mut claimants = Claimants::new();
            // Each record: when it was charged, its claimant and what it took.
            let mut records: BTreeMap<String, (f64, String, u64)> = BTreeMap::new();
            let mut now_ms = 1_700_000_000_000.0;
            for (i, step) in case.steps.iter().enumerate() {
                let what = format!("{} / step {i}", case.name);
                now_ms += step.advance_ms as f64;
                let now = active(&mut claimants, now_ms, window_ms, case.fair.idle_ms as f64);
                let (done, remaining, retry, charged) = if step.op.as_deref() == Some("settle") {
                    let record = step.record.as_deref().and_then(|r| records.remove(r));
                    let spec = bucket(&case.pool, 0);
                    let Some((at, claimant, took)) = record else {
                        let level = crate::accounting::bucket::level_at(&spec, state[0], now_ms);
                        assert!(!step.done, "{what}");
                        assert_eq!(level.floor() as u64, step.remaining, "{what}");
                        check_used(&mut claimants, &step.used, now_ms, &case, &what);
                        continue;
                    };
                    let credit = if step.credit > 0 { step.credit.min(took as i64) } else { step.credit };
                    let reply = settle_charge_made_at(&mut state, &[spec], &[credit], at, now_ms);
                    correct(&mut claimants, &claimant, credit as f64, now_ms, window_ms);
                    (true, reply.limits[0].remaining, 0, None)
                } else {
                    let claim = FairClaim {
                        claimant: step.id.clone(),
                        weight: step.weight,
                        max_claimants: case.fair.max,
                        idle_ms: case.fair.idle_ms,
                    };
                    let level = crate::accounting::bucket::level_at(&bucket(&case.pool, step.cost), state[0], now_ms);
                    let judgement = judge(&now, &claim, step.cost as f64, level, capacity);
                    let min = step.min_cost.unwrap_or(step.cost);
                    let reduction = (step.cost as f64 - judgement.room.max(0.0)).max(0.0).min((step.cost - min) as f64);
                    let grant = step.cost - reduction.ceil() as u64;
                    let refill = |amount: f64| ((amount - level) * window_ms / capacity).ceil() as u64;
                    let outcome = if level < grant as f64 {
                        (false, level.floor() as u64, refill(grant as f64), None)
                    } else if judgement.room < grant as f64 {
                        let retry = judgement.retry_after_ms(grant as f64, window_ms, refill);
                        (false, level.floor() as u64, retry, None)
                    } else {
                        let reply = check_and_charge(&mut state, &[bucket(&case.pool, grant)], now_ms);
                        assert!(reply.allowed, "{what}: the bucket had room");
                        if let Some(r) = &step.record {
                            records.insert(r.clone(), (now_ms, step.id.clone(), grant));
                        }
                        (true, reply.limits[0].remaining, 0, Some(grant))
                    };
                    let charged = outcome.3.unwrap_or(0) as f64;
                    record(&mut claimants, &now, &claim, step.cost as f64, charged, now_ms);
                    outcome
                };
                assert_eq!(done, step.done, "{what}");
                assert_eq!(remaining, step.remaining, "{what}");
                assert!(retry.abs_diff(step.retry_after_ms) <= 1, "{what}: retry {retry} vs {}", step.retry_after_ms);
                if let (Some(want), Some(got)) = (step.charged, charged) {
                    assert_eq!(got, want, "{what}");
                }
                check_used(&mut claimants, &step.used, now_ms, &case, &what);
            }
        }
    }

    fn check_used(claimants: &mut Claimants, want: &BTreeMap<String, f64>, now_ms: f64, case: &Case, what: &str) {
        let now = active(claimants, now_ms, case.pool.window_ms as f64, case.fair.idle_ms as f64);
        let got: BTreeMap<String, f64> = now.into_iter().map(|(id, c)| (id, c.used)).collect();
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}: {got:?}");
        for (id, used) in want {
            assert!((got[id] - used).abs() <= 0.01, "{what}: {id} used {} vs {used}", got[id]);
        }
    }

    #[test]
    fn a_light_claimant_is_never_held_below_its_weighted_share() {
        // Nine claimants using their whole equal share: the tenth, new, may still take its own.
        let mut claimants = Claimants::new();
        for n in 0..9 {
            claimants.insert(format!("t{n}"), Claimant { used: 1000.0, at_ms: 0.0, weight: 1.0, last: 100.0 });
        }
        let now = active(&mut claimants, 0.0, 60_000.0, 60_000.0);
        let claim = FairClaim { claimant: "new".into(), weight: 1, max_claimants: 64, idle_ms: 60_000 };
        let judged = judge(&now, &claim, 100.0, 10_000.0, 10_000.0);
        assert!((judged.allowance - 1000.0).abs() < 1e-9 && (judged.share - 1000.0).abs() < 1e-9);
        assert!(judged.room >= 100.0);
        // Weighted 3: its share and allowance are three of twelve shares.
        let heavy = FairClaim { weight: 3, ..claim };
        let judged = judge(&now, &heavy, 100.0, 10_000.0, 10_000.0);
        assert!((judged.allowance - 2500.0).abs() < 1e-9, "{judged:?}");
    }
}
