//! A request's settlement: what it gives back to each limit (what it reserved less what
//! its reply says it used, by the part of its tokens each limit counts, or in dollars at
//! its model's price), and the one way a settlement and its adjustments are made for the
//! wire. The lifecycle reads the reply and sends what this makes; the worker queues it.

use crate::accounting::reply_floor::{self, Floor};
use crate::accounting::reservation::{credit, TokenCounts};
use crate::config::{Measure, Policy, Price};
use crate::plan::charge::ChargePlan;
use crate::protocol::{Adjustment, LimitKind, Settlement};

/// What a request is settled from: what it held reserved, what it is charged as having
/// used (its cached input apart), and the price its dollars are counted at.
#[derive(Debug, Clone, Copy)]
pub struct Settled {
    pub reserved: TokenCounts,
    pub used: TokenCounts,
    pub cached: u64,
    pub price: Option<Price>,
}

/// The credits (negative: a further debit) of each token and cost limit `plan` applies to,
/// by limit index: of the part of its tokens the limit counts, or in micro-dollars against
/// what the budget was charged. Request and concurrency limits settle nothing here.
pub fn credits(config: &Policy, plan: &ChargePlan, settled: Settled) -> Vec<(usize, i64)> {
    let Settled { reserved, used, cached, price } = settled;
    let applying = config.limits.iter().zip(&plan.buckets).enumerate().filter(|(i, _)| plan.applies(*i));
    applying
        .filter_map(|(i, (limit, bucket))| match limit.measure {
            Measure::Tokens { count, .. } => Some((i, credit(count.reserved(reserved), count.used(used, cached)))),
            // Against what the budget was charged, at the price of each part used.
            Measure::Usd { .. } => {
                let cost = price.map_or(0, |price| credit(bucket.cost, price.micro_usd_cached(used, cached)));
                Some((i, cost))
            }
            Measure::Requests(_) | Measure::Concurrency(_) => None,
        })
        .collect()
}

/// What a forwarded request is charged as having used under `floor` (a reply the filter
/// could not read to its end: see `reply_floor`): at least its reservation, and a reply
/// cut after its text and before its usage at least the output that passed (of its text's
/// bytes, bounded by what it asked for), since a reservation set by a history the client
/// chose may be far below what it already received.
pub fn floored(
    plan: &ChargePlan,
    reserved: TokenCounts,
    used: TokenCounts,
    floor: Option<Floor>,
    output_reported: bool,
    passed_text_bytes: Option<u64>,
) -> TokenCounts {
    match floor {
        Some(Floor::Cut) if !output_reported => {
            let asked = plan.request.as_ref().and_then(|r| r.max_output.map(|most| most.saturating_mul(r.choices)));
            let passed = reply_floor::passed_output(passed_text_bytes.unwrap_or(0), asked);
            let floored = reply_floor::at_least_reserved(reserved, used);
            TokenCounts { output: floored.output.max(passed), ..floored }
        }
        Some(_) => reply_floor::at_least_reserved(reserved, used),
        None => used,
    }
}

/// What gives back all a request planned as `plan` took from each limit but slots
/// (released on their own): requests, tokens and dollars alike.
pub fn refund_everything(config: &Policy, plan: &ChargePlan) -> Vec<(usize, i64)> {
    let limits = config.limits.iter().zip(&plan.buckets).enumerate().filter(|(i, _)| plan.applies(*i));
    limits
        .filter(|(_, (limit, _))| limit.kind != LimitKind::Slots)
        .map(|(i, (_, bucket))| (i, i64::try_from(bucket.cost).unwrap_or(i64::MAX)))
        .collect()
}

/// A release (credit 0) of each slot limit a charge of `plan` would hold.
pub fn slot_releases(config: &Policy, plan: &ChargePlan) -> Vec<(usize, i64)> {
    let slots = config.limits.iter().zip(&plan.buckets).enumerate();
    slots
        .filter(|(_, (limit, bucket))| limit.kind == LimitKind::Slots && bucket.cost > 0)
        .map(|(i, _)| (i, 0))
        .collect()
}

/// The one way a settlement is made.
pub fn settlement(
    config: &Policy,
    tenant: &str,
    reservation: Option<String>,
    cancel: bool,
    limits: Vec<Adjustment>,
) -> Settlement {
    Settlement {
        domain: config.domain.clone(),
        tenant: tenant.to_string(),
        reservation,
        once: None,
        cancel,
        stand_in: None,
        limits,
    }
}

/// Adjustments of configured limits (by index): buckets and windows with a non-zero
/// credit, and slot limits (released or renewed, whatever the credit), each on the
/// counter of its owner in `owners` (by index; missing: the tenant's); calendar budgets
/// dated at `now_ms`.
pub fn adjustments(
    config: &Policy,
    owners: &[Option<String>],
    credits: impl Iterator<Item = (usize, i64)>,
    now_ms: u64,
) -> Vec<Adjustment> {
    credits
        .filter_map(|(i, credit)| {
            let limit = config.limits.get(i)?;
            let kind = limit.kind;
            (credit != 0 || kind == LimitKind::Slots).then(|| Adjustment {
                name: limit.name.clone(),
                capacity: limit.capacity(),
                window_ms: limit.window_ms(),
                credit,
                kind,
                period_bounds_ms: limit.period_bounds_ms(now_ms),
                owner: owners.get(i).cloned().flatten(),
            })
        })
        .collect()
}
