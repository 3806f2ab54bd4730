//! The shapes of what the filter answers itself, per API family (`crate::api::dialect`): a
//! local reply in the error envelope each family's SDKs parse into their own exception
//! classes (each provider's module has its envelope: `providers::error_envelope`), and
//! the RFC 3339 times Anthropic's reset headers are written in. What is said (the messages, which limit binds) is
//! `crate::replies::decision`'s; how it is wrapped for the caller is here.

use crate::api::dialect::Dialect;
use crate::api::refusal::Refusal;
use crate::providers::{self, bedrock};
use crate::replies::reply::{Header, LocalReply};

/// On a refusal that no wait a client's retries would take gets past (`Refusal::lasts`):
/// `false`. Not a standard header: the official OpenAI and Anthropic SDKs (and others
/// generated alike) read it before the status and then do not retry a 429.
pub const SHOULD_RETRY_HEADER: &str = "x-should-retry";

/// Whether a local reply's header is part of its error (the body's type, Bedrock's error
/// code, whether to retry it), so it has no place on a response forwarded instead (shadow
/// mode), where it would stop a client retrying the upstream's own 429.
pub fn belongs_to_the_error(name: &str) -> bool {
    name == "content-type" || name == bedrock::ERROR_HEADER || name == SHOULD_RETRY_HEADER
}

/// Who is answered, and when: the shape, and the time reset headers count from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Caller {
    pub dialect: Dialect,
    /// Milliseconds since the epoch, by the proxy's clock.
    pub now_ms: u64,
}

/// The local reply for `refusal` in `dialect`'s shape, saying `message`;
/// `retry_after_seconds` is when to try again, if that is known. The rate-limit headers
/// and `retry-after` are the caller's to add; `x-should-retry: false` is here, on every
/// refusal that lasts.
pub fn error_reply(dialect: Dialect, refusal: Refusal, message: &str, retry_after_seconds: Option<u64>) -> LocalReply {
    let envelope = providers::error_envelope(dialect, refusal, message, retry_after_seconds);
    let mut headers: Vec<Header> = vec![("content-type", "application/json".into())];
    headers.extend(envelope.header.map(|(name, value)| (name, value.into())));
    if refusal.lasts() {
        headers.push((SHOULD_RETRY_HEADER, "false".into()));
    }
    LocalReply { status: refusal.status(), headers, body: envelope.body.to_string() }
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
    use serde_json::json;

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
            (Refusal::Suspended, 403, "permission_error", "PERMISSION_DENIED", "AccessDeniedException"),
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
