//! What the providers said about their own limits, shared by the fleet
//! ([`PROVIDER_PATH`]): each proxy worker hands in what replies told it since its last
//! exchange and gets back every upstream credential and model the fleet knows to be
//! limited, with who may send the one probe once the provider's retry time has passed.
//!
//! Keys are 16 hex digits: a keyed hash of (upstream credential id, model) under the
//! companion token's derived key, so neither a credential nor a model name reaches Redis,
//! and the fleet's hash is bounded ([`MAX_PROVIDER_ENTRIES`]) whatever clients send.

use serde::{Deserialize, Serialize};

/// Endpoint of the exchange (a [`ProviderExchange`], answered with a [`ProviderReply`]).
pub const PROVIDER_PATH: &str = "/v1/provider";
/// The provider's quotas the filter reads, in this order in every `left` list: requests,
/// tokens (input and output together), input tokens, output tokens.
pub const QUOTAS: usize = 4;
/// Most reports in one exchange (a worker that heard more sends the latest).
pub const MAX_PROVIDER_REPORTS: usize = 64;
/// Most entries the fleet keeps per domain; a report for a new key beyond it is dropped
/// until expired entries make room.
pub const MAX_PROVIDER_ENTRIES: usize = 256;
/// How long a proxy given the probe has to send it before the fleet offers it to another
/// (a proxy without traffic for the key does not hold the others up for long).
pub const PROBE_OFFER_MS: u64 = 2_000;
/// How long a probe that went out holds the right (its reply's headers normally come far
/// sooner; one that never answers does not stop the fleet for good).
pub const PROBE_HOLD_MS: u64 = 10_000;
/// The latest time any field may name: year 9999 in ms (nothing a provider says is later).
const MAX_TIME_MS: u64 = 253_402_300_799_000;

/// One proxy worker's news since its last exchange.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderExchange {
    pub domain: String,
    /// The proxy's id (shared by its workers): the probe is given to a proxy.
    pub proxy: String,
    pub reports: Vec<ProviderReport>,
}

/// What the provider last said for one key, as one proxy heard it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderReport {
    pub key: String,
    /// When the request whose reply said it was sent (ms since the epoch): later news wins.
    pub said_ms: u64,
    /// Until when the provider refuses (0: it does not).
    pub out_until_ms: u64,
    /// It refused a request (a 429): a probe goes first once `out_until_ms` has passed. Not
    /// set when a quota was only said to be spent (it is whole again at its reset).
    #[serde(default)]
    pub refused: bool,
    /// This proxy sent the probe it was given: the fleet holds it for [`PROBE_HOLD_MS`].
    #[serde(default)]
    pub probing: bool,
    /// Per quota ([`QUOTAS`]): `[remaining, until_ms]`, `until_ms` 0 when not said.
    pub left: Vec<[u64; 2]>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderReply {
    pub entries: Vec<ProviderEntry>,
}

/// Who sends the probe for a key whose retry time has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeBy {
    /// Nobody: the key is not past its retry time (or not out).
    Nobody,
    /// The proxy that asked, until `probe_until_ms`.
    You,
    /// Another proxy, until `probe_until_ms`.
    Another,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderEntry {
    pub key: String,
    pub said_ms: u64,
    pub out_until_ms: u64,
    pub refused: bool,
    pub probe: ProbeBy,
    pub probe_until_ms: u64,
    pub left: Vec<[u64; 2]>,
}

/// Whether `key` is a provider key: 16 hex digits.
pub fn is_provider_key(key: &str) -> bool {
    key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit())
}

impl ProviderExchange {
    pub fn validate(&self) -> Result<(), String> {
        if !crate::is_key_part(&self.domain) {
            return Err("domain must be 1-64 of [A-Za-z0-9_.-]".into());
        }
        if !is_provider_key(&self.proxy) {
            return Err("proxy must be 16 hex digits".into());
        }
        if self.reports.len() > MAX_PROVIDER_REPORTS {
            return Err(format!("at most {MAX_PROVIDER_REPORTS} reports per exchange, got {}", self.reports.len()));
        }
        for (i, report) in self.reports.iter().enumerate() {
            if !is_provider_key(&report.key) {
                return Err(format!("reports[{i}].key must be 16 hex digits"));
            }
            if report.left.len() != QUOTAS {
                return Err(format!("reports[{i}].left must have {QUOTAS} entries"));
            }
            let times = [report.said_ms, report.out_until_ms].into_iter().chain(report.left.iter().map(|l| l[1]));
            if times.into_iter().any(|t| t > MAX_TIME_MS) || report.left.iter().any(|l| l[0] > MAX_TIME_MS) {
                return Err(format!("reports[{i}]: a time or a count out of range"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(key: &str, left: Vec<[u64; 2]>) -> ProviderExchange {
        ProviderExchange {
            domain: "llm".into(),
            proxy: "0123456789abcdef".into(),
            reports: vec![ProviderReport {
                key: key.into(),
                said_ms: 1,
                out_until_ms: 2,
                refused: true,
                probing: false,
                left,
            }],
        }
    }

    #[test]
    fn an_exchange_is_checked_before_it_reaches_redis() {
        assert_eq!(exchange("00112233aabbccdd", vec![[0, 0]; QUOTAS]).validate(), Ok(()));
        assert!(exchange("not-a-key", vec![[0, 0]; QUOTAS]).validate().is_err());
        assert!(exchange("00112233aabbccdd", vec![[0, 0]; 3]).validate().is_err());
        assert!(exchange("00112233aabbccdd", vec![[u64::MAX, 0]; QUOTAS]).validate().is_err());
        let mut many = exchange("00112233aabbccdd", vec![[0, 0]; QUOTAS]);
        many.reports = vec![many.reports[0].clone(); MAX_PROVIDER_REPORTS + 1];
        assert!(many.validate().is_err());
    }
}
