//! The rate-limit headers a policy writes, decided once at load from `headers` and the
//! limits: which conventions go to which callers, what each limit reports in them, and
//! the IETF fields' text of each limit as far as the config fixes it. A request then only
//! picks each quota's tightest outcome and writes its digits
//! (`crate::replies::decision::rate_limit_headers`).

use super::policy::{Dimension, HeaderStyle, Limit, TokenCount};
use crate::api::dialect::Dialect;
use crate::providers::{self, HeaderQuota, RateLimitHeaders, ResetForm};

/// The rate-limit headers a policy writes (`headers`, over its `limits`), decided once at
/// load: which conventions apply to which callers, and what each limit reports in them.
/// A request then only picks each quota's tightest outcome and writes its digits
/// (`crate::replies::decision::rate_limit_headers`).
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderPlan {
    /// The conventions as written.
    pub styles: Vec<HeaderStyle>,
    /// OpenAI's and Anthropic's headers, in the order they are written.
    pub providers: [ProviderHeaders; 2],
    /// `RateLimit-Policy` and `RateLimit`.
    pub ietf: bool,
    /// `X-RateLimit-Limit`, `-Remaining` and `-Reset`.
    pub classic: bool,
    /// What each limit reports, in the limits' order.
    pub limits: Vec<LimitHeaders>,
    /// What an outcome of a limit the policy does not name reports: a request limit's.
    pub unknown: LimitHeaders,
}

/// A provider's rate-limit headers in a policy, and to whom they are written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProviderHeaders {
    /// The callers of this dialect's API are its provider's.
    pub dialect: Dialect,
    pub names: &'static RateLimitHeaders,
    /// To every caller (its own convention named), to its provider's callers only
    /// (`provider`), or to none (`None`).
    pub to: Option<Callers>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callers {
    Every,
    TheProvidersOwn,
}

/// What one limit reports in the rate-limit headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHeaders {
    /// Listed in the IETF and classic fields, which describe quotas per time window:
    /// every limit but concurrency.
    pub windowed: bool,
    /// For each of `HeaderPlan::providers`, the quotas of its headers this limit reports
    /// on: bit `i` for its `quotas[i]`. A money budget reports on none.
    pub quotas: [u8; 2],
    /// The window in whole seconds, rounded up, where it never varies (a calendar budget's
    /// is the length of the period a request falls in).
    window_seconds: Option<u64>,
    /// The name as the IETF fields list it, `"rpm"` (empty for a limit the policy does
    /// not name: its outcome's name is quoted as it is written).
    quoted: String,
    /// The limit's whole `RateLimit-Policy` item at its capacity and fixed window
    /// (`"rpm";q=500;w=60`), with that capacity: what most replies say of it.
    policy_item: Option<(u64, String)>,
}

impl HeaderPlan {
    pub fn new(styles: &[HeaderStyle], limits: &[Limit]) -> HeaderPlan {
        let provider = |style: HeaderStyle, dialect: Dialect| ProviderHeaders {
            dialect,
            // Both send headers of their own (see `providers::rate_limit_headers`).
            names: providers::rate_limit_headers(dialect).unwrap_or(&NO_HEADERS),
            to: if styles.contains(&style) {
                Some(Callers::Every)
            } else {
                styles.contains(&HeaderStyle::Provider).then_some(Callers::TheProvidersOwn)
            },
        };
        let providers =
            [provider(HeaderStyle::Openai, Dialect::OpenAi), provider(HeaderStyle::Anthropic, Dialect::Anthropic)];
        HeaderPlan {
            styles: styles.to_vec(),
            providers,
            ietf: styles.contains(&HeaderStyle::Ietf),
            classic: styles.contains(&HeaderStyle::Classic),
            limits: limits.iter().map(|limit| LimitHeaders::of(Some(limit), &providers)).collect(),
            unknown: LimitHeaders::of(None, &providers),
        }
    }

    /// What the limit at `index` reports (one the policy does not have: `unknown`'s).
    pub fn limit(&self, index: Option<usize>) -> &LimitHeaders {
        index.and_then(|i| self.limits.get(i)).unwrap_or(&self.unknown)
    }
}

/// No quotas (what neither provider in `HeaderPlan::providers` has).
static NO_HEADERS: RateLimitHeaders = RateLimitHeaders { quotas: &[], reset: ResetForm::After };

impl LimitHeaders {
    /// What `limit` reports in each of `providers`' headers; `None`, a limit no policy
    /// names, reports as a request limit.
    fn of(limit: Option<&Limit>, providers: &[ProviderHeaders; 2]) -> LimitHeaders {
        let dimension = limit.map_or(Dimension::Requests, Limit::dimension);
        let count = limit.and_then(Limit::token_count);
        let reports = |quota: HeaderQuota| match (quota, dimension) {
            (HeaderQuota::Requests, Dimension::Requests) | (HeaderQuota::AnyTokens, Dimension::Tokens) => true,
            (HeaderQuota::Concurrency, Dimension::Concurrency) => true,
            (HeaderQuota::TotalTokens, Dimension::Tokens) => count == Some(TokenCount::Total),
            (HeaderQuota::InputTokens, Dimension::Tokens) => count == Some(TokenCount::Input),
            (HeaderQuota::OutputTokens, Dimension::Tokens) => count == Some(TokenCount::Output),
            _ => false,
        };
        let quotas = providers.map(|provider| {
            let bits = provider.names.quotas.iter().enumerate().filter(|(_, q)| reports(q.quota));
            bits.fold(0u8, |bits, (i, _)| bits | 1u8.checked_shl(i as u32).unwrap_or(0))
        });
        let window_seconds = match limit {
            Some(limit) if limit.calendar.is_some() => None,
            Some(limit) => Some(limit.window_ms().div_ceil(1000)),
            None => Some(0),
        };
        let quoted = limit.map_or_else(String::new, |limit| format!("\"{}\"", limit.name));
        let policy_item = match (limit, window_seconds) {
            (Some(limit), Some(window)) => {
                let mut item = String::new();
                write_policy_item(&mut item, &quoted, limit.capacity(), window);
                Some((limit.capacity(), item))
            }
            _ => None,
        };
        LimitHeaders { windowed: dimension != Dimension::Concurrency, quotas, window_seconds, quoted, policy_item }
    }

    /// Appends this limit's item of `RateLimit-Policy` (`"rpm";q=500;w=60`) for an outcome
    /// of `name` that says the limit allows `capacity`, at `now_ms`; `limit` is the
    /// policy's, if it names it.
    pub fn write_policy_item(&self, out: &mut String, name: &str, capacity: u64, limit: Option<&Limit>, now_ms: u64) {
        match &self.policy_item {
            Some((configured, item)) if *configured == capacity => out.push_str(item),
            _ => {
                // A calendar budget's window is its period's at `now_ms`.
                let window = self
                    .window_seconds
                    .unwrap_or_else(|| limit.map_or(0, |limit| limit.window_ms_at(now_ms).div_ceil(1000)));
                self.with_quoted(name, |quoted| write_policy_item(out, quoted, capacity, window));
            }
        }
    }

    /// Appends this limit's item of `RateLimit` (`"rpm";r=499;t=60`) for an outcome of
    /// `name`: what is left, and in how many seconds to ask again.
    pub fn write_state_item(&self, out: &mut String, name: &str, remaining: u64, wait_seconds: u64) {
        let mut digits = itoa::Buffer::new();
        self.with_quoted(name, |quoted| {
            for piece in [quoted, ";r=", digits.format(remaining)] {
                out.push_str(piece);
            }
        });
        out.push_str(";t=");
        out.push_str(digits.format(wait_seconds));
    }

    /// `f` of the limit's name in quotes: made at load, or for a limit the policy does
    /// not name, of `name` as the outcome has it.
    fn with_quoted(&self, name: &str, f: impl FnOnce(&str)) {
        if self.quoted.is_empty() {
            f(&format!("\"{name}\""));
        } else {
            f(&self.quoted);
        }
    }
}

/// A `RateLimit-Policy` item: the quoted name, the capacity, the window in seconds.
fn write_policy_item(out: &mut String, quoted: &str, capacity: u64, window_seconds: u64) {
    let mut digits = itoa::Buffer::new();
    for piece in [quoted, ";q=", digits.format(capacity), ";w="] {
        out.push_str(piece);
    }
    out.push_str(digits.format(window_seconds));
}
