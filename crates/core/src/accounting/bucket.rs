//! The token bucket and the calendar budget of `lua/limits.lua`, as pure functions. The
//! script is what runs (Redis owns the state and the clock); this model states the same
//! math in Rust so it can be tested exhaustively and reused where the proxy must decide
//! alone. Both are tested against the case tables `tests/cases/token_bucket.json` and
//! `tests/cases/calendar.json`.
//!
//! A calendar budget is a bucket that never refills: its level at its last write holds
//! until the period (of `period_bounds_ms`) that write was in ends, and then it is full.

use crate::accounting::calendar::Calendar;
use crate::protocol::{LimitCharge, LimitKind, LimitOutcome, LimitStatus, LimitsReply};

/// A bucket as stored: its level at `updated_ms`. No state means a full bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketState {
    pub tokens: f64,
    pub updated_ms: f64,
}

/// Refills every bucket to `now_ms`, then charges each its cost if all have room. Elastic
/// buckets (`min_cost` below `cost`) all give up the same reduction, the smallest that
/// makes each fit, as long as none falls below its minimum. `states[i]` belongs to
/// `specs[i]`; charged buckets are updated in place.
pub fn check_and_charge(states: &mut [Option<BucketState>], specs: &[LimitCharge], now_ms: f64) -> LimitsReply {
    let levels = levels_at(states, specs, now_ms);
    // A shadow bucket never clamps the others (nor is it clamped beyond their reduction).
    let elastic = |spec: &LimitCharge| spec.min() < spec.cost && !spec.shadow;
    let wanted = specs
        .iter()
        .zip(&levels)
        .filter(|(spec, _)| elastic(spec))
        .map(|(spec, &level)| spec.cost as f64 - level.max(0.0))
        .fold(0.0f64, f64::max);
    let most = specs.iter().filter(|spec| elastic(spec)).map(|spec| spec.cost - spec.min()).min().unwrap_or(0);
    let reduction = wanted.min(most as f64).ceil() as u64;
    let costs: Vec<u64> =
        specs.iter().map(|spec| if elastic(spec) { spec.cost - reduction } else { spec.cost }).collect();
    take_all(states, specs, &levels, &costs, &costs, now_ms)
}

/// Grants each bucket's lease, all or none: if every bucket has what is needed
/// (`min_cost`), each grants `min(wanted (cost), max(needed, share x level))` and is
/// charged that, reported as `charged`.
pub fn lease(states: &mut [Option<BucketState>], specs: &[LimitCharge], share: f64, now_ms: f64) -> LimitsReply {
    let levels = levels_at(states, specs, now_ms);
    let needed: Vec<u64> = specs.iter().map(LimitCharge::min).collect();
    let grants: Vec<u64> = specs
        .iter()
        .zip(&levels)
        .map(|(spec, &level)| spec.cost.min(spec.min().max((level.max(0.0) * share).floor() as u64)))
        .collect();
    take_all(states, specs, &levels, &needed, &grants, now_ms)
}

fn levels_at(states: &[Option<BucketState>], specs: &[LimitCharge], now_ms: f64) -> Vec<f64> {
    specs.iter().zip(states.iter()).map(|(spec, state)| level_at(spec, *state, now_ms)).collect()
}

/// If every bucket holds what it `required`, takes `taken[i]` from each; reports each
/// bucket as the script does. A bucket whose minimum exceeds its capacity never fits; a
/// look-only bucket never refuses; a shadow bucket never refuses but says whether it had
/// room.
fn take_all(
    states: &mut [Option<BucketState>],
    specs: &[LimitCharge],
    levels: &[f64],
    required: &[u64],
    taken: &[u64],
    now_ms: f64,
) -> LimitsReply {
    let allowed = specs.len() == states.len()
        && specs.iter().zip(levels).zip(required).all(|((spec, &level), &req)| {
            spec.look_only || spec.shadow || (spec.min() <= spec.capacity && level >= req as f64)
        });
    let limits = specs
        .iter()
        .zip(levels)
        .zip(states.iter_mut())
        .zip(required.iter().zip(taken))
        .map(|(((spec, &level), state), (&req, &take))| {
            let (status, retry_after_ms) = if spec.look_only {
                (LimitStatus::Allowed, 0)
            } else if spec.min() > spec.capacity {
                (LimitStatus::Never, 0)
            } else if level < req as f64 {
                let refilled = ((req as f64 - level) * spec.window_ms as f64 / spec.capacity as f64).ceil() as u64;
                (LimitStatus::Limited, period_end(spec, now_ms).map_or(refilled, |end| until(end, now_ms)))
            } else {
                (LimitStatus::Allowed, 0)
            };
            let mut tokens = level;
            if allowed && take > 0 {
                tokens -= take as f64;
                *state = Some(BucketState { tokens, updated_ms: now_ms });
            }
            outcome(spec, tokens, status, retry_after_ms, if allowed { take } else { 0 }, now_ms)
        })
        .collect();
    LimitsReply { allowed, waited_ms: 0, limits, suspended: None }
}

fn outcome(
    spec: &LimitCharge,
    tokens: f64,
    status: LimitStatus,
    retry_after_ms: u64,
    charged: u64,
    now_ms: f64,
) -> LimitOutcome {
    let capacity = spec.capacity as f64;
    let refilled = ((capacity - tokens) * spec.window_ms as f64 / capacity).ceil() as u64;
    LimitOutcome {
        name: spec.name.clone(),
        status,
        limit: spec.capacity,
        remaining: tokens.floor().max(0.0) as u64,
        // A calendar budget says when its period ends, full or not: when it resets.
        reset_after_ms: period_end(spec, now_ms).map_or(refilled, |end| until(end, now_ms)),
        retry_after_ms,
        charged,
    }
}

/// Gives each bucket `credits[i]` tokens back (never above capacity), or takes `-credits[i]`
/// more (possibly below zero): the settlement of a reservation once the real cost is known.
pub fn settle(states: &mut [Option<BucketState>], specs: &[LimitCharge], credits: &[i64], now_ms: f64) -> LimitsReply {
    settle_charge_made_at(states, specs, credits, now_ms, now_ms)
}

/// `settle` for a charge made at `charged_at_ms`: a calendar budget takes no correction
/// of a charge made in a period that has ended (that period's budget is gone; the new
/// one owes nothing for it), as a sliding window takes none of a charge that left it.
pub fn settle_charge_made_at(
    states: &mut [Option<BucketState>],
    specs: &[LimitCharge],
    credits: &[i64],
    charged_at_ms: f64,
    now_ms: f64,
) -> LimitsReply {
    let limits = specs
        .iter()
        .zip(states.iter_mut())
        .zip(credits)
        .map(|((spec, state), &credit)| {
            let mut tokens = level_at(spec, *state, now_ms);
            let earlier_period = spec.kind == LimitKind::Calendar
                && Calendar::period_at(&spec.period_bounds_ms, now_ms)
                    .is_none_or(|(start, _)| charged_at_ms < start as f64);
            if credit != 0 && !earlier_period {
                tokens = (tokens + credit as f64).min(spec.capacity as f64);
                *state = Some(BucketState { tokens, updated_ms: now_ms });
            }
            outcome(spec, tokens, LimitStatus::Allowed, 0, 0, now_ms)
        })
        .collect();
    LimitsReply { allowed: true, waited_ms: 0, limits, suspended: None }
}

/// Where the period `now_ms` is in ends, for a calendar budget.
fn period_end(spec: &LimitCharge, now_ms: f64) -> Option<u64> {
    if spec.kind != LimitKind::Calendar {
        return None;
    }
    Calendar::period_at(&spec.period_bounds_ms, now_ms).map(|(_, end)| end)
}

/// Whole ms from `now_ms` to `end` (after it).
fn until(end: u64, now_ms: f64) -> u64 {
    (end as f64 - now_ms).ceil().max(0.0) as u64
}

/// What the bucket holds at `now_ms` (full again once refilled, or once its period ended).
pub(crate) fn level_at(spec: &LimitCharge, state: Option<BucketState>, now_ms: f64) -> f64 {
    let capacity = spec.capacity as f64;
    match state {
        None => capacity,
        // Spent in the period `now_ms` is in, or full again since.
        Some(BucketState { tokens, updated_ms }) if spec.kind == LimitKind::Calendar => {
            match Calendar::period_at(&spec.period_bounds_ms, now_ms) {
                Some((start, _)) if updated_ms >= start as f64 => tokens.min(capacity),
                _ => capacity,
            }
        }
        Some(BucketState { tokens, updated_ms }) => {
            let elapsed = (now_ms - updated_ms).max(0.0);
            (tokens + elapsed * capacity / spec.window_ms as f64).min(capacity)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize, Default)]
    #[serde(rename_all = "snake_case")]
    enum Op {
        #[default]
        Charge,
        Settle,
        Lease,
    }

    #[derive(Deserialize)]
    struct Table {
        cases: Vec<Case>,
    }

    #[derive(Deserialize)]
    struct Case {
        name: String,
        limits: Vec<CaseLimit>,
        steps: Vec<Step>,
    }

    #[derive(Deserialize)]
    struct CaseLimit {
        name: String,
        capacity: u64,
        window_ms: u64,
        /// Whose counter (a shared pool's id; default the tenant's): against Redis, the
        /// key's hash tag, so one call charges counters of several owners.
        #[serde(default)]
        owner: Option<String>,
    }

    #[derive(Deserialize)]
    struct Step {
        #[serde(default)]
        op: Op,
        advance_ms: u64,
        amounts: Vec<i64>,
        /// Least each bucket may be charged (elastic buckets); default: the amount.
        #[serde(default)]
        mins: Option<Vec<u64>>,
        /// Which buckets only look (the limit does not apply to the call); default none.
        #[serde(default)]
        looks: Option<Vec<bool>>,
        /// Which buckets are shadow limits (charged, never refusing); default none.
        #[serde(default)]
        shadows: Option<Vec<bool>>,
        /// What each bucket was charged, when the case checks it.
        #[serde(default)]
        charged: Option<Vec<u64>>,
        /// A lease's share of what is left.
        #[serde(default)]
        share: Option<f64>,
        done: bool,
        /// status, remaining, reset_after_ms, retry_after_ms
        outcomes: Vec<(LimitStatus, u64, u64, u64)>,
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn model_matches_the_shared_case_table() {
        let table: Table =
            serde_json::from_str(include_str!("../../../../tests/cases/token_bucket.json")).expect("case table");
        for case in table.cases {
            let mut states = vec![None; case.limits.len()];
            let mut now_ms = 1_700_000_000_000.0;
            for (i, step) in case.steps.iter().enumerate() {
                now_ms += step.advance_ms as f64;
                let specs: Vec<LimitCharge> = case
                    .limits
                    .iter()
                    .zip(&step.amounts)
                    .enumerate()
                    .map(|(j, (l, &amount))| LimitCharge {
                        owner: l.owner.clone(),
                        shadow: step.shadows.as_ref().and_then(|l| l.get(j).copied()).unwrap_or(false),
                        name: l.name.clone(),
                        capacity: l.capacity,
                        window_ms: l.window_ms,
                        cost: amount.max(0) as u64,
                        min_cost: step.mins.as_ref().and_then(|m| m.get(j).copied()),
                        kind: crate::protocol::LimitKind::TokenBucket,
                        period_bounds_ms: Vec::new(),
                        provisional: false,
                        look_only: step.looks.as_ref().and_then(|l| l.get(j).copied()).unwrap_or(false),
                        fair: None,
                    })
                    .collect();
                let reply = match step.op {
                    Op::Charge => check_and_charge(&mut states, &specs, now_ms),
                    Op::Settle => settle(&mut states, &specs, &step.amounts, now_ms),
                    Op::Lease => lease(&mut states, &specs, step.share.unwrap_or(0.5), now_ms),
                };
                let what = format!("{} / step {i}", case.name);
                assert_eq!(reply.allowed, step.done, "{what}");
                let got: Vec<_> =
                    reply.limits.iter().map(|o| (o.status, o.remaining, o.reset_after_ms, o.retry_after_ms)).collect();
                assert_eq!(got, step.outcomes, "{what}");
                if let Some(charged) = &step.charged {
                    assert_eq!(&reply.limits.iter().map(|o| o.charged).collect::<Vec<_>>(), charged, "{what}");
                }
                for (outcome, spec) in reply.limits.iter().zip(&specs) {
                    assert_eq!(outcome.limit, spec.capacity, "{what}");
                    assert_eq!(outcome.name, spec.name, "{what}");
                }
            }
        }
    }

    /// The calendar budgets' case table (`tests/cases/calendar.json`), shared with the
    /// script's test: boundaries and times are ms from the case's start, settlements
    /// name the reservation of an earlier charge.
    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn calendar_model_matches_the_shared_case_table() {
        #[derive(Deserialize)]
        struct CalendarTable {
            cases: Vec<CalendarCase>,
        }
        #[derive(Deserialize)]
        struct CalendarCase {
            name: String,
            capacity: u64,
            bounds_ms: Vec<i64>,
            steps: Vec<CalendarStep>,
        }
        #[derive(Deserialize)]
        struct CalendarStep {
            #[serde(default)]
            op: Op,
            advance_ms: u64,
            amount: i64,
            #[serde(default)]
            reservation: Option<String>,
            done: bool,
            /// status, remaining, reset_after_ms, retry_after_ms
            outcome: (LimitStatus, u64, u64, u64),
            #[serde(default)]
            charged: Option<u64>,
        }
        let table: CalendarTable =
            serde_json::from_str(include_str!("../../../../tests/cases/calendar.json")).expect("case table");
        let origin = 1_700_000_000_000i64;
        for case in table.cases {
            let mut states = [None];
            let mut reservations = std::collections::BTreeMap::new();
            let mut now = origin as f64;
            let bounds: Vec<u64> = case.bounds_ms.iter().map(|b| (origin + b) as u64).collect();
            for (i, step) in case.steps.iter().enumerate() {
                now += step.advance_ms as f64;
                let spec = LimitCharge {
                    name: "budget".into(),
                    capacity: case.capacity,
                    window_ms: bounds[bounds.len() - 1] - bounds[0],
                    cost: step.amount.max(0) as u64,
                    min_cost: None,
                    kind: LimitKind::Calendar,
                    period_bounds_ms: bounds.clone(),
                    provisional: false,
                    look_only: false,
                    shadow: false,
                    owner: None,
                    fair: None,
                };
                let specs = std::slice::from_ref(&spec);
                let reply = match step.op {
                    Op::Charge => {
                        let reply = check_and_charge(&mut states, specs, now);
                        if let (true, Some(id)) = (reply.allowed, &step.reservation) {
                            reservations.insert(id.clone(), now);
                        }
                        reply
                    }
                    Op::Settle => {
                        let record = step.reservation.as_ref().and_then(|id| reservations.remove(id));
                        match record {
                            Some(charged_at) => {
                                settle_charge_made_at(&mut states, specs, &[step.amount], charged_at, now)
                            }
                            None => LimitsReply { allowed: false, ..settle(&mut states, specs, &[0], now) },
                        }
                    }
                    Op::Lease => panic!("a calendar budget is not leased"),
                };
                let what = format!("{} / step {i}", case.name);
                assert_eq!(reply.allowed, step.done, "{what}");
                let o = &reply.limits[0];
                assert_eq!((o.status, o.remaining, o.reset_after_ms, o.retry_after_ms), step.outcome, "{what}");
                if let (Some(charged), Op::Charge) = (step.charged, &step.op) {
                    assert_eq!(o.charged, charged, "{what}");
                }
            }
        }
    }

    /// To the millisecond: spent up to the boundary, full at it.
    #[test]
    fn a_calendar_budget_is_full_again_exactly_at_its_boundary() {
        let spec = LimitCharge {
            name: "month".into(),
            capacity: 10,
            window_ms: 1_000,
            cost: 10,
            min_cost: None,
            kind: LimitKind::Calendar,
            period_bounds_ms: vec![0, 1_000, 2_000, 3_000],
            provisional: false,
            look_only: false,
            shadow: false,
            owner: None,
            fair: None,
        };
        let specs = std::slice::from_ref(&spec);
        let mut states = [None];
        assert!(check_and_charge(&mut states, specs, 1_000.0).allowed, "the period's first instant");
        let before = check_and_charge(&mut states, specs, 1_999.0);
        assert_eq!((before.allowed, before.limits[0].retry_after_ms, before.limits[0].reset_after_ms), (false, 1, 1));
        let at = check_and_charge(&mut states, specs, 2_000.0);
        assert!(at.allowed, "full again at the boundary: {at:?}");
        assert_eq!(at.limits[0].reset_after_ms, 1_000);
    }

    /// However calls are spaced, a bucket never admits more than capacity plus what the
    /// elapsed time refilled.
    #[test]
    fn never_admits_more_than_capacity_plus_refill() {
        let spec = LimitCharge {
            owner: None,
            shadow: false,
            name: "rpm".into(),
            capacity: 7,
            window_ms: 1_000,
            cost: 1,
            min_cost: None,
            kind: LimitKind::TokenBucket,
            period_bounds_ms: Vec::new(),
            provisional: false,
            look_only: false,
            fair: None,
        };
        for gap_ms in [0.0, 1.0, 13.0, 97.0, 142.857, 400.0] {
            let mut states = [None];
            let mut admitted = 0u64;
            let calls = 500;
            for call in 0..calls {
                let now = f64::from(call) * gap_ms;
                if check_and_charge(&mut states, std::slice::from_ref(&spec), now).allowed {
                    admitted += 1;
                }
            }
            let elapsed = f64::from(calls - 1) * gap_ms;
            let bound = 7.0 + elapsed * 7.0 / 1_000.0;
            assert!(admitted as f64 <= bound + 1e-9, "gap {gap_ms}: {admitted} > {bound}");
            assert!(admitted as f64 >= bound.floor().min(f64::from(calls)) - 1.0, "gap {gap_ms}: only {admitted}");
        }
    }
}
