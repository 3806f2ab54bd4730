//! The shapes of what the filter answers itself, per API family (`crate::api::dialect`): the
//! error envelope each family's SDKs parse into their own exception classes, and
//! Anthropic's rate-limit headers. What is said (the messages, which limit binds) is
//! `crate::replies::decision`'s; how it is wrapped for the caller is here.
//!
//! - OpenAI: `{"error": {"message", "type", "param": null, "code"}}`.
//! - Anthropic: `{"type": "error", "error": {"type", "message"}}`, with Anthropic's
//!   documented error types (`rate_limit_error`, `request_too_large`...).
//! - Google: `{"error": {"code", "message", "status", "details"}}` with the canonical
//!   status names (`RESOURCE_EXHAUSTED`...) and, on a 429, a `google.rpc.RetryInfo`.
//! - Bedrock: the error code in `x-amzn-ErrorType` (as AWS's REST-JSON protocol carries
//!   it) and `{"message"}`.

use crate::api::dialect::Dialect;
use crate::config::{Dimension, Policy, TokenCount};
use crate::protocol::LimitsReply;
use crate::replies::reply::{tightest, Header, LocalReply};
use serde_json::json;

/// Bedrock's error code, where AWS's REST-JSON protocol carries it.
pub const BEDROCK_ERROR_HEADER: &str = "x-amzn-errortype";

/// Whether a local reply's header is part of its error (the body's type, Bedrock's error
/// code), so it has no place on a response forwarded instead (shadow mode).
pub fn belongs_to_the_error(name: &str) -> bool {
    name == "content-type" || name == BEDROCK_ERROR_HEADER
}

/// Who is answered, and when: the shape, and the time reset headers count from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Caller {
    pub dialect: Dialect,
    /// Milliseconds since the epoch, by the proxy's clock.
    pub now_ms: u64,
}

/// Why the filter answers a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A limit is exhausted (429). OpenAI's `error.type` for it: `requests`, `tokens`,
    /// `input_tokens`, `cost`, `concurrency`...
    RateLimited(&'static str),
    /// The body is larger than the filter reads (413).
    TooLarge,
    /// The limiter cannot decide and the config says deny (503).
    Unavailable,
    /// No API key (401).
    Unidentified,
    /// A budget applies but the model has no price (403).
    NotPriced,
    /// A request the filter will not read one way while the upstream may read it another
    /// (400): conflicting credentials, a body it cannot parse, a field given twice, a path
    /// it refuses. OpenAI's `error.code` for it.
    Unreadable(&'static str),
}

impl Refusal {
    pub fn status(self) -> u32 {
        match self {
            Refusal::RateLimited(_) => 429,
            Refusal::TooLarge => 413,
            Refusal::Unavailable => 503,
            Refusal::Unidentified => 401,
            Refusal::NotPriced => 403,
            Refusal::Unreadable(_) => 400,
        }
    }

    /// OpenAI's `error.type` and `error.code`.
    fn openai(self) -> (&'static str, &'static str) {
        match self {
            Refusal::RateLimited(kind) => (kind, "rate_limit_exceeded"),
            Refusal::TooLarge => ("invalid_request_error", "request_too_large"),
            Refusal::Unavailable => ("server_error", "rate_limiter_unavailable"),
            Refusal::Unidentified => ("invalid_request_error", "missing_api_key"),
            Refusal::NotPriced => ("invalid_request_error", "model_not_priced"),
            Refusal::Unreadable(code) => ("invalid_request_error", code),
        }
    }

    /// Anthropic's `error.type` (docs.claude.com, "Errors"). Anthropic answers overload
    /// with 529 `overloaded_error`; the filter's 503 says the same: retry shortly.
    fn anthropic(self) -> &'static str {
        match self {
            Refusal::RateLimited(_) => "rate_limit_error",
            Refusal::TooLarge => "request_too_large",
            Refusal::Unavailable => "overloaded_error",
            Refusal::Unidentified => "authentication_error",
            Refusal::NotPriced => "permission_error",
            Refusal::Unreadable(_) => "invalid_request_error",
        }
    }

    /// Google's canonical status name (google.rpc.Code) for the HTTP status.
    fn google(self) -> &'static str {
        match self {
            Refusal::RateLimited(_) => "RESOURCE_EXHAUSTED",
            Refusal::TooLarge => "INVALID_ARGUMENT",
            Refusal::Unavailable => "UNAVAILABLE",
            Refusal::Unidentified => "UNAUTHENTICATED",
            Refusal::NotPriced => "PERMISSION_DENIED",
            Refusal::Unreadable(_) => "INVALID_ARGUMENT",
        }
    }

    /// Bedrock runtime's error code (its API reference's "Errors").
    fn bedrock(self) -> &'static str {
        match self {
            Refusal::RateLimited(_) => "ThrottlingException",
            Refusal::TooLarge => "ValidationException",
            Refusal::Unavailable => "ServiceUnavailableException",
            Refusal::Unidentified | Refusal::NotPriced => "AccessDeniedException",
            Refusal::Unreadable(_) => "ValidationException",
        }
    }
}

/// The local reply for `refusal` in `dialect`'s shape, saying `message`;
/// `retry_after_seconds` is when to try again, if that is known. The rate-limit headers
/// and `retry-after` are the caller's to add.
pub fn error_reply(dialect: Dialect, refusal: Refusal, message: &str, retry_after_seconds: Option<u64>) -> LocalReply {
    let status = refusal.status();
    let mut headers: Vec<Header> = vec![("content-type", "application/json".to_string())];
    let body = match dialect {
        Dialect::OpenAi => {
            let (kind, code) = refusal.openai();
            json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        }
        Dialect::Anthropic => json!({"type": "error", "error": {"type": refusal.anthropic(), "message": message}}),
        Dialect::Google => {
            let details: Vec<_> = retry_after_seconds
                .map(|s| json!({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": format!("{s}s")}))
                .into_iter()
                .collect();
            json!({"error": {"code": status, "message": message, "status": refusal.google(), "details": details}})
        }
        Dialect::Bedrock => {
            headers.push((BEDROCK_ERROR_HEADER, refusal.bedrock().to_string()));
            json!({"message": message})
        }
    };
    LocalReply { status, headers, body: body.to_string() }
}

/// Anthropic's `anthropic-ratelimit-*` headers, each for the most restrictive limit of
/// its kind: `requests`; `tokens` (limits counting input and output together);
/// `input-tokens` and `output-tokens` (limits counting one side). Resets are the time the
/// limit is full again, RFC 3339 in UTC, rounded up to the second.
pub fn anthropic_headers(reply: &LimitsReply, config: &Policy, now_ms: u64, headers: &mut Vec<Header>) {
    let kinds: [(Dimension, Option<TokenCount>, [&'static str; 3]); 4] = [
        (
            Dimension::Requests,
            None,
            [
                "anthropic-ratelimit-requests-limit",
                "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-requests-reset",
            ],
        ),
        (
            Dimension::Tokens,
            Some(TokenCount::Total),
            [
                "anthropic-ratelimit-tokens-limit",
                "anthropic-ratelimit-tokens-remaining",
                "anthropic-ratelimit-tokens-reset",
            ],
        ),
        (
            Dimension::Tokens,
            Some(TokenCount::Input),
            [
                "anthropic-ratelimit-input-tokens-limit",
                "anthropic-ratelimit-input-tokens-remaining",
                "anthropic-ratelimit-input-tokens-reset",
            ],
        ),
        (
            Dimension::Tokens,
            Some(TokenCount::Output),
            [
                "anthropic-ratelimit-output-tokens-limit",
                "anthropic-ratelimit-output-tokens-remaining",
                "anthropic-ratelimit-output-tokens-reset",
            ],
        ),
    ];
    for (dimension, count, [limit, remaining, reset]) in kinds {
        let of_kind =
            |name: &str| config.limit(name).is_some_and(|l| l.dimension() == dimension && l.token_count() == count);
        if let Some(outcome) = tightest(reply, of_kind) {
            headers.push((limit, outcome.limit.to_string()));
            headers.push((remaining, outcome.remaining.to_string()));
            headers.push((reset, rfc3339(now_ms.saturating_add(outcome.reset_after_ms).div_ceil(1000))));
        }
    }
}

/// `seconds` since the epoch as an RFC 3339 time in UTC (`2026-12-01T15:37:00Z`). Only
/// this is needed of calendars, so it is done here rather than by a date crate in the
/// module: days to a civil date by the proleptic Gregorian rules (H. Hinnant's
/// `civil_from_days`).
pub fn rfc3339(seconds: u64) -> String {
    let days = seconds / 86_400;
    let of_day = seconds % 86_400;
    // Days since 0000-03-01, in 400-year eras of 146,097 days.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", of_day / 3_600, (of_day % 3_600) / 60, of_day % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(reply: &LocalReply) -> serde_json::Value {
        serde_json::from_str(&reply.body).expect("json body")
    }

    fn header<'a>(reply: &'a LocalReply, name: &str) -> Option<&'a str> {
        reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn rfc3339_counts_the_calendar() {
        let cases = [
            (0, "1970-01-01T00:00:00Z"),
            (951_782_400, "2000-02-29T00:00:00Z"),
            (1_709_251_199, "2024-02-29T23:59:59Z"),
            (1_796_139_420, "2026-12-01T15:37:00Z"),
            (4_102_444_800, "2100-01-01T00:00:00Z"),
            (253_402_300_799, "9999-12-31T23:59:59Z"),
        ];
        for (seconds, text) in cases {
            assert_eq!(rfc3339(seconds), text, "{seconds}");
        }
        // Nothing an input can make of the clock panics.
        let _ = rfc3339(u64::MAX);
    }

    #[test]
    fn each_family_gets_its_own_error_shape() {
        let message = "Rate limit reached.";
        let openai = error_reply(Dialect::OpenAi, Refusal::RateLimited("tokens"), message, Some(3));
        assert_eq!(
            body(&openai),
            json!({"error": {"message": message, "type": "tokens", "param": null, "code": "rate_limit_exceeded"}})
        );
        let anthropic = error_reply(Dialect::Anthropic, Refusal::RateLimited("tokens"), message, Some(3));
        assert_eq!(
            body(&anthropic),
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": message}})
        );
        let google = error_reply(Dialect::Google, Refusal::RateLimited("requests"), message, Some(3));
        assert_eq!(
            body(&google),
            json!({"error": {"code": 429, "message": message, "status": "RESOURCE_EXHAUSTED",
                   "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "3s"}]}})
        );
        let bedrock = error_reply(Dialect::Bedrock, Refusal::RateLimited("requests"), message, Some(3));
        assert_eq!(body(&bedrock), json!({"message": message}));
        assert_eq!(header(&bedrock, "x-amzn-errortype"), Some("ThrottlingException"));
        for reply in [&openai, &anthropic, &google, &bedrock] {
            assert_eq!((reply.status, header(reply, "content-type")), (429, Some("application/json")));
        }
    }

    #[test]
    fn every_refusal_has_a_name_in_every_family() {
        let cases = [
            (Refusal::TooLarge, 413, "request_too_large", "INVALID_ARGUMENT", "ValidationException"),
            (Refusal::Unavailable, 503, "overloaded_error", "UNAVAILABLE", "ServiceUnavailableException"),
            (Refusal::Unidentified, 401, "authentication_error", "UNAUTHENTICATED", "AccessDeniedException"),
            (Refusal::NotPriced, 403, "permission_error", "PERMISSION_DENIED", "AccessDeniedException"),
        ];
        for (refusal, status, anthropic, google, bedrock) in cases {
            let reply = error_reply(Dialect::Anthropic, refusal, "m", None);
            assert_eq!((reply.status, body(&reply)["error"]["type"].clone()), (status, json!(anthropic)));
            let reply = error_reply(Dialect::Google, refusal, "m", None);
            assert_eq!(body(&reply)["error"], json!({"code": status, "message": "m", "status": google, "details": []}));
            let reply = error_reply(Dialect::Bedrock, refusal, "m", None);
            assert_eq!((reply.status, header(&reply, "x-amzn-errortype")), (status, Some(bedrock)));
        }
    }
}
