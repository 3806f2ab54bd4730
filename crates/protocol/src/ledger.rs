//! The spend ledger: what each proxy worker's settled requests used, summed per owner (a
//! tenant, a pool's claimant), model and UTC day, handed to the companion in batches
//! (`LEDGER_PATH`) that the companion adds to Redis once each; and what an operator
//! reads back (`SPEND_PATH`, the `llm-ratelimit spend` command).
//!
//! Exactly once: a worker numbers its batches (`seq`, 1, 2, ...) under an id of its own
//! (`vm`) and sends the next only once the companion acknowledged the last, resending the
//! same batch until then. The companion keeps, per owner, the last `seq` it added for
//! each `vm`, and adds a batch's rows of that owner only when its `seq` is higher: a batch
//! resent after a lost answer is added once.

use crate::is_key_part;
use serde::{Deserialize, Serialize};

/// Endpoint where a proxy worker hands in a [`LedgerBatch`] (data-plane credential).
pub const LEDGER_PATH: &str = "/v1/ledger";
/// Endpoint where an operator reads the ledger (`GET`, admin credential; query
/// `domain`, `from`, `to` as `YYYY-MM-DD`, `by` a comma-separated list of dimensions).
pub const SPEND_PATH: &str = "/v1/admin/spend";
/// The model a row is counted under once an owner's day has as many models as the
/// companion keeps (and in the proxy, once its aggregate is full).
pub const OTHER_MODEL: &str = "other";
/// The owner label of a tenant's rows; a pool's is `<header>=<value>`.
pub const TENANT_LABEL: &str = "tenant";
/// Most rows in one batch (a worker's aggregate is smaller).
pub const MAX_LEDGER_ROWS: usize = 4096;
/// Longest model name kept (longer names are cut, at a character boundary, by the proxy).
pub const MAX_LEDGER_MODEL: usize = 128;
/// Longest owner label kept (`<header>=<value>`, cut likewise).
pub const MAX_LEDGER_LABEL: usize = 160;
/// Most days one spend query covers.
pub const MAX_SPEND_DAYS: u32 = 400;

/// What a worker's requests used since its last batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerBatch {
    pub domain: String,
    /// The worker's id (hex): its batches' numbers count apart from every other's.
    pub vm: String,
    /// This batch's number for `vm`: 1, 2, ...; a batch resent keeps its number.
    pub seq: u64,
    pub rows: Vec<LedgerRow>,
}

/// One owner's use of one model on one day.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerRow {
    /// The owner id: the tenant id, or the pool's owner id (as its counters' keys).
    pub owner: String,
    /// `tenant`, or `<header>=<value>` for a pool's claimant.
    pub label: String,
    pub model: String,
    /// The UTC day, as `YYYYMMDD`.
    pub day: u32,
    #[serde(flatten)]
    pub used: Spent,
}

/// Requests and what they used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spent {
    pub requests: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub reasoning_tokens: u64,
    pub cost_micro_usd: u64,
}

impl Spent {
    pub fn add(&mut self, other: &Spent) {
        self.requests = self.requests.saturating_add(other.requests);
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(other.cached_tokens);
        self.reasoning_tokens = self.reasoning_tokens.saturating_add(other.reasoning_tokens);
        self.cost_micro_usd = self.cost_micro_usd.saturating_add(other.cost_micro_usd);
    }

    /// The parts as the ledger's hash fields name them (`<model>|<part>`), with values.
    pub fn parts(&self) -> [(&'static str, u64); 6] {
        [
            ("r", self.requests),
            ("i", self.input_tokens),
            ("o", self.output_tokens),
            ("c", self.cached_tokens),
            ("t", self.reasoning_tokens),
            ("u", self.cost_micro_usd),
        ]
    }

    /// Sets the part a hash field names; false for an unknown part.
    pub fn set_part(&mut self, part: &str, value: u64) -> bool {
        let slot = match part {
            "r" => &mut self.requests,
            "i" => &mut self.input_tokens,
            "o" => &mut self.output_tokens,
            "c" => &mut self.cached_tokens,
            "t" => &mut self.reasoning_tokens,
            "u" => &mut self.cost_micro_usd,
            _ => return false,
        };
        *slot = value;
        true
    }
}

/// The companion's answer to a batch: the owners whose rows it added now, and those it
/// had added before (a resent batch).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerReply {
    pub added: usize,
    pub already: usize,
}

/// Largest number a ledger field holds exactly in Redis's Lua (a double).
pub const MAX_LEDGER_VALUE: u64 = (1 << 53) - 1;

impl LedgerBatch {
    pub fn validate(&self) -> Result<(), String> {
        if !is_key_part(&self.domain) {
            return Err("domain must be 1-64 of [A-Za-z0-9_.-]".into());
        }
        if !is_key_part(&self.vm) {
            return Err("vm must be 1-64 of [A-Za-z0-9_.-]".into());
        }
        if self.seq == 0 || self.seq > MAX_LEDGER_VALUE {
            return Err(format!("seq must be 1..={MAX_LEDGER_VALUE}"));
        }
        if self.rows.len() > MAX_LEDGER_ROWS {
            return Err(format!("at most {MAX_LEDGER_ROWS} rows per batch, got {}", self.rows.len()));
        }
        for (i, row) in self.rows.iter().enumerate() {
            if !is_key_part(&row.owner) {
                return Err(format!("rows[{i}].owner must be 1-64 of [A-Za-z0-9_.-]"));
            }
            if row.label.is_empty() || row.label.len() > MAX_LEDGER_LABEL {
                return Err(format!("rows[{i}].label must be 1-{MAX_LEDGER_LABEL} bytes"));
            }
            if row.model.is_empty() || row.model.len() > MAX_LEDGER_MODEL {
                return Err(format!("rows[{i}].model must be 1-{MAX_LEDGER_MODEL} bytes"));
            }
            if civil_from_day(row.day).is_none() {
                return Err(format!("rows[{i}].day {} is not a date as YYYYMMDD", row.day));
            }
            if row.used.parts().iter().any(|(_, value)| *value > MAX_LEDGER_VALUE) {
                return Err(format!("rows[{i}]: every count must be at most {MAX_LEDGER_VALUE}"));
            }
        }
        Ok(())
    }
}

/// One row of a spend report: the dimensions asked for, and the sums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpendRow {
    /// Each dimension of `by`, in its order, with this row's value.
    pub keys: Vec<(String, String)>,
    #[serde(flatten)]
    pub used: Spent,
}

/// The companion's answer to a spend query.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpendReply {
    pub from: String,
    pub to: String,
    pub by: Vec<String>,
    pub rows: Vec<SpendRow>,
}

/// The day (`YYYYMMDD`) of `ms` since the epoch, in UTC.
pub fn day_of_ms(ms: u64) -> u32 {
    let days = (ms / 86_400_000) as i64;
    // H. Hinnant's `civil_from_days`.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y * 10_000 + m * 100 + d) as u32
}

/// Days since the epoch of a civil date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since the epoch of `YYYYMMDD`, if it is a real date (1970 to 9999).
pub fn civil_from_day(day: u32) -> Option<i64> {
    let (y, m, d) = (i64::from(day / 10_000), i64::from(day / 100 % 100), i64::from(day % 100));
    if !(1970..=9999).contains(&y) || !(1..=12).contains(&m) || d < 1 {
        return None;
    }
    let days = days_from_civil(y, m, d);
    (day_of_ms(days as u64 * 86_400_000) == day).then_some(days)
}

/// `YYYY-MM-DD` as `YYYYMMDD`, if a real date.
pub fn parse_day(text: &str) -> Option<u32> {
    let bytes = text.as_bytes();
    if bytes.len() != 10 || bytes.get(4) != Some(&b'-') || bytes.get(7) != Some(&b'-') {
        return None;
    }
    let digits: String = text.chars().filter(|c| *c != '-').collect();
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let day: u32 = digits.parse().ok()?;
    civil_from_day(day).map(|_| day)
}

/// `YYYYMMDD` as `YYYY-MM-DD`.
pub fn format_day(day: u32) -> String {
    format!("{:04}-{:02}-{:02}", day / 10_000, day / 100 % 100, day % 100)
}

/// Every day from `from` to `to` (both `YYYYMMDD`, inclusive), at most `MAX_SPEND_DAYS`.
pub fn days_between(from: u32, to: u32) -> Result<Vec<u32>, String> {
    let (Some(start), Some(end)) = (civil_from_day(from), civil_from_day(to)) else {
        return Err("from and to must be dates".into());
    };
    if end < start {
        return Err("`to` is before `from`".into());
    }
    if end - start >= i64::from(MAX_SPEND_DAYS) {
        return Err(format!("at most {MAX_SPEND_DAYS} days per query"));
    }
    Ok((start..=end).map(|days| day_of_ms(days as u64 * 86_400_000)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_are_utc_civil_dates() {
        assert_eq!(day_of_ms(0), 19_700_101);
        // 2026-11-30T23:59:59.999Z and the next millisecond.
        assert_eq!(day_of_ms(1_796_083_199_999), 20_261_130);
        assert_eq!(day_of_ms(1_796_083_200_000), 20_261_201);
        assert_eq!(day_of_ms(951_782_400_000), 20_000_229, "2000-02-29");
        assert_eq!(parse_day("2026-11-01"), Some(20_261_101));
        assert_eq!(parse_day("2026-02-29"), None);
        assert_eq!(parse_day("2026-1-01"), None);
        assert_eq!(parse_day("２０26-11-01"), None);
        assert_eq!(format_day(20_261_101), "2026-11-01");
        let days = days_between(20_261_130, 20_261_202).unwrap();
        assert_eq!(days, [20_261_130, 20_261_201, 20_261_202]);
        assert!(days_between(20_261_202, 20_261_130).is_err());
        assert!(days_between(20_250_101, 20_270_101).is_err());
    }

    #[test]
    fn a_batch_with_a_bad_row_is_refused() {
        let row = LedgerRow {
            owner: "0123456789abcdef0123456789abcdef".into(),
            label: TENANT_LABEL.into(),
            model: "gpt-4o".into(),
            day: 20_261_101,
            used: Spent { requests: 1, ..Spent::default() },
        };
        let batch = LedgerBatch { domain: "llm".into(), vm: "ab12".into(), seq: 1, rows: vec![row.clone()] };
        assert_eq!(batch.validate(), Ok(()));
        let json = serde_json::to_value(&batch).unwrap();
        assert_eq!(json["rows"][0]["requests"], 1, "the counts are flat in a row: {json}");
        for bad in [
            LedgerRow { owner: "a{b}".into(), ..row.clone() },
            LedgerRow { model: String::new(), ..row.clone() },
            LedgerRow { day: 20_261_131, ..row.clone() },
            LedgerRow { used: Spent { input_tokens: 1 << 53, ..row.used }, ..row.clone() },
        ] {
            assert!(LedgerBatch { rows: vec![bad], ..batch.clone() }.validate().is_err());
        }
        assert!(LedgerBatch { seq: 0, ..batch.clone() }.validate().is_err());
    }
}
