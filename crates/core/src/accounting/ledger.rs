//! A worker's share of the spend ledger: what its requests used, summed per owner (the
//! tenant, each pool's claimant), model and UTC day since its last batch went to the
//! companion, and the batch out, kept (and resent, same number) until the companion
//! acknowledges it. New requests keep adding to the aggregate meanwhile.
//!
//! Bounded, whatever clients send: at most `MAX_ROWS` rows aggregate; once full, a new
//! model of an owner's day is added to that owner's `other` row, and when that cannot be
//! made either, to the `other` owner of the same kind (a tenant's, a pool header's), so
//! totals stay exact while attribution thins out. Only should even those overflow (more
//! than `SPARE_ROWS` kinds of owner-days) is a request's share dropped, counted in
//! `dropped`. At most `MAX_ROWS + 2 * SPARE_ROWS` rows, about 2,560 x 200 B = 0.5 MB.

use crate::protocol::ledger::{
    LedgerBatch, LedgerRow, Spent, MAX_LEDGER_LABEL, MAX_LEDGER_MODEL, OTHER_MODEL, TENANT_LABEL,
};
use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// Rows a worker sums before it must fold new ones into `other` (about 200 bytes each).
pub const MAX_ROWS: usize = 2048;
/// Rows beyond `MAX_ROWS` for owners' `other` rows, and as many again for the `other`
/// owners' (one per kind of owner and day: a handful).
pub const SPARE_ROWS: usize = 256;
/// The owner id rows of unknown owners are folded into once the aggregate is full.
pub const OTHER_OWNER: &str = "other";

/// One request's share for the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The tenant's id (labelled `tenant`).
    pub tenant: &'a str,
    /// Each pool's claimant with its label (`<header>=<value>`), borrowed from the
    /// request: every request adds one entry, which copies nothing it already has.
    pub pools: &'a [(String, String)],
    pub model: &'a str,
    pub day: u32,
    pub used: Spent,
}

/// The batch out: its number and rows, and the callout carrying it, if one is out.
#[derive(Debug, Clone)]
pub struct Out {
    pub seq: u64,
    pub rows: Vec<LedgerRow>,
    pub token: Option<u32>,
}

/// A row's key, (owner, model, day), as stored or as borrowed: a request adding to an
/// existing row (most do) finds it without copying its owner and model into strings.
trait RowKey {
    fn parts(&self) -> (&str, &str, u32);
}

impl RowKey for (String, String, u32) {
    fn parts(&self) -> (&str, &str, u32) {
        (&self.0, &self.1, self.2)
    }
}

impl RowKey for (&str, &str, u32) {
    fn parts(&self) -> (&str, &str, u32) {
        *self
    }
}

// The stored key orders as its parts do (a tuple's order is its fields' in turn), so a
// borrowed key finds what an owned one would.
impl<'a> Borrow<dyn RowKey + 'a> for (String, String, u32) {
    fn borrow(&self) -> &(dyn RowKey + 'a) {
        self
    }
}

impl PartialEq for dyn RowKey + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn RowKey + '_ {}

impl PartialOrd for dyn RowKey + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for dyn RowKey + '_ {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

#[derive(Debug, Default)]
pub struct Ledger {
    /// (owner, model, day) -> (label, used).
    rows: BTreeMap<(String, String, u32), (String, Spent)>,
    out: Option<Out>,
    last_seq: u64,
    /// Rows dropped since the worker started (the aggregate and its spare rows full).
    pub dropped: u64,
    /// The last day asked of `day_of_ms`: days since the epoch, and its date.
    today: Option<(u64, u32)>,
}

/// `text` cut to at most `max` bytes at a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or("")
}

impl Ledger {
    /// The UTC date of `ms` that rows are summed under (`20261201`), worked out once a
    /// day: every request asks it.
    pub fn day_of_ms(&mut self, ms: u64) -> u32 {
        let days = ms / 86_400_000;
        match self.today {
            Some((today, date)) if today == days => date,
            _ => {
                let date = crate::protocol::ledger::day_of_ms(ms);
                self.today = Some((days, date));
                date
            }
        }
    }

    /// Adds one request's use under each of its owners.
    pub fn add(&mut self, entry: &Entry) {
        let model = match cut(entry.model, MAX_LEDGER_MODEL) {
            "" => "unknown",
            model if model.starts_with('~') => "unknown",
            model => model,
        };
        let pools = entry.pools.iter().map(|(owner, label)| (owner.as_str(), label.as_str()));
        for (owner, label) in std::iter::once((entry.tenant, TENANT_LABEL)).chain(pools) {
            self.add_row(owner, cut(label, MAX_LEDGER_LABEL), model, entry.day, &entry.used);
        }
    }

    fn add_row(&mut self, owner: &str, label: &str, model: &str, day: u32, used: &Spent) {
        if let Some((_, sum)) = self.rows.get_mut(&(owner, model, day) as &dyn RowKey) {
            sum.add(used);
            return;
        }
        if self.rows.len() < MAX_ROWS {
            self.rows.insert((owner.to_string(), model.to_string(), day), (label.to_string(), *used));
            return;
        }
        // Full: the owner's `other` row, else the `other` owner of the label's kind.
        let kind = label.split_once('=').map_or(label.to_string(), |(header, _)| format!("{header}=other"));
        let folds = [(owner.to_string(), label.to_string()), (format!("{OTHER_OWNER}{}", kind_suffix(&kind)), kind)];
        for ((owner, label), room) in folds.into_iter().zip([MAX_ROWS + SPARE_ROWS, MAX_ROWS + 2 * SPARE_ROWS]) {
            let key = (owner, OTHER_MODEL.to_string(), day);
            if let Some((_, sum)) = self.rows.get_mut(&key) {
                sum.add(used);
                return;
            }
            if self.rows.len() < room {
                self.rows.insert(key, (label, *used));
                return;
            }
        }
        self.dropped = self.dropped.saturating_add(1);
    }

    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty() && self.out.is_none()
    }

    /// The batch out, if any.
    pub fn out(&self) -> Option<&Out> {
        self.out.as_ref()
    }

    /// Makes the aggregate the next batch, unless one is out or there is nothing to send.
    pub fn seal(&mut self) -> bool {
        if self.out.is_some() || self.rows.is_empty() {
            return false;
        }
        self.last_seq += 1;
        let rows = std::mem::take(&mut self.rows)
            .into_iter()
            .map(|((owner, model, day), (label, used))| LedgerRow { owner, label, model, day, used })
            .collect();
        self.out = Some(Out { seq: self.last_seq, rows, token: None });
        true
    }

    /// The batch to send (sealed, not in flight), as the companion takes it.
    pub fn to_send(&self, domain: &str, vm: &str) -> Option<LedgerBatch> {
        let out = self.out.as_ref().filter(|out| out.token.is_none())?;
        Some(LedgerBatch { domain: domain.to_string(), vm: vm.to_string(), seq: out.seq, rows: out.rows.clone() })
    }

    /// The batch out went with the callout `token`.
    pub fn sent(&mut self, token: u32) {
        if let Some(out) = self.out.as_mut() {
            out.token = Some(token);
        }
    }

    /// Whether `token` is the batch's callout.
    pub fn is_sending(&self, token: u32) -> bool {
        self.out.as_ref().is_some_and(|out| out.token == Some(token))
    }

    /// The companion answered the batch's callout: acknowledged, it is done; otherwise it
    /// waits to be sent again, with its number.
    pub fn answered(&mut self, acknowledged: bool) {
        if acknowledged {
            self.out = None;
        } else if let Some(out) = self.out.as_mut() {
            out.token = None;
        }
    }
}

/// The id suffix of the `other` owner of a label kind: `other` for tenants, `other-<hash>`
/// for a pool header (owner ids are key parts: [A-Za-z0-9_.-]).
fn kind_suffix(kind: &str) -> String {
    if kind == crate::protocol::ledger::TENANT_LABEL {
        return String::new();
    }
    let mut hash: u32 = 0x811c_9dc5;
    for byte in kind.bytes() {
        hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
    }
    format!("-{hash:08x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(input: u64, cost: u64) -> Spent {
        Spent { requests: 1, input_tokens: input, cost_micro_usd: cost, ..Spent::default() }
    }

    #[test]
    fn the_date_is_worked_out_again_when_the_day_changes() {
        let mut ledger = Ledger::default();
        // 2026-12-01T23:59:59.999Z, then a millisecond later, then back.
        let last_ms = 1_796_169_599_999;
        for (ms, date) in [(last_ms, 20_261_201), (last_ms + 1, 20_261_202), (last_ms, 20_261_201), (0, 19_700_101)] {
            assert_eq!(ledger.day_of_ms(ms), date, "{ms}");
            assert_eq!(ledger.day_of_ms(ms), crate::protocol::ledger::day_of_ms(ms), "{ms}");
        }
    }

    #[test]
    fn sums_per_owner_model_and_day() {
        let mut ledger = Ledger::default();
        let pools = [("pa".to_string(), "x-team=a".to_string())];
        ledger.add(&Entry { tenant: "t1", pools: &pools, model: "gpt-4o", day: 20_261_101, used: used(10, 3) });
        ledger.add(&Entry { tenant: "t1", pools: &pools, model: "gpt-4o", day: 20_261_101, used: used(5, 2) });
        ledger.add(&Entry { tenant: "t1", pools: &pools, model: "gpt-4o", day: 20_261_102, used: used(1, 1) });
        assert_eq!(ledger.rows(), 4);
        assert!(ledger.seal());
        let rows = &ledger.out().unwrap().rows;
        let first = rows.iter().find(|r| r.owner == "t1" && r.day == 20_261_101).unwrap();
        assert_eq!((first.used.requests, first.used.input_tokens, first.used.cost_micro_usd), (2, 15, 5));
        assert_eq!(rows.iter().find(|r| r.owner == "pa").unwrap().label, "x-team=a");
    }

    #[test]
    fn a_full_aggregate_folds_into_other_and_totals_stay_exact() {
        let mut ledger = Ledger::default();
        let ids: Vec<String> = (0..MAX_ROWS + 2 * SPARE_ROWS).map(|i| format!("t{i}")).collect();
        for id in &ids {
            for model in ["m1", "m2"] {
                ledger.add(&Entry { tenant: id, pools: &[], model, day: 1, used: used(1, 1) });
            }
        }
        assert!(ledger.rows() <= MAX_ROWS + 2 * SPARE_ROWS, "bounded: {}", ledger.rows());
        let total: u64 = ledger.rows.values().map(|(_, u)| u.input_tokens).sum();
        assert_eq!(total + ledger.dropped, 2 * ids.len() as u64);
        assert_eq!(ledger.dropped, 0, "the other owner takes what owners' other rows cannot");
        assert!(ledger.rows.contains_key(&(OTHER_OWNER.to_string(), OTHER_MODEL.to_string(), 1)));
    }

    #[test]
    fn a_batch_is_kept_and_resent_with_its_number_until_acknowledged() {
        let mut ledger = Ledger::default();
        let entry = Entry { tenant: "t1", pools: &[], model: "m", day: 1, used: used(1, 1) };
        ledger.add(&entry);
        assert!(ledger.seal());
        let first = ledger.to_send("llm", "vm1").unwrap();
        assert_eq!(first.seq, 1);
        ledger.sent(7);
        assert!(ledger.to_send("llm", "vm1").is_none(), "in flight");
        ledger.add(&entry); // meanwhile
        assert!(!ledger.seal(), "one batch out at a time");
        ledger.answered(false);
        assert_eq!(ledger.to_send("llm", "vm1").unwrap(), first, "the same batch, same number");
        ledger.sent(8);
        ledger.answered(true);
        assert!(ledger.seal());
        let second = ledger.to_send("llm", "vm1").unwrap();
        assert_eq!((second.seq, second.rows.len()), (2, 1));
    }

    #[test]
    fn long_names_are_cut_at_a_character_boundary() {
        assert_eq!(cut("ééé", 3), "é");
        let mut ledger = Ledger::default();
        let model = "x".repeat(500);
        ledger.add(&Entry { tenant: "t1", pools: &[], model: &model, day: 1, used: used(1, 1) });
        ledger.add(&Entry { tenant: "t1", pools: &[], model: "", day: 1, used: used(1, 1) });
        assert!(ledger.seal());
        let batch = ledger.to_send("llm", "v").unwrap();
        assert_eq!(batch.validate(), Err("rows[0].day 1 is not a date as YYYYMMDD".into()));
        assert!(batch.rows.iter().all(|r| r.model.len() <= MAX_LEDGER_MODEL && !r.model.is_empty()));
    }
}
