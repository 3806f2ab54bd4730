//! What the client sees: rate-limit headers on every response, and the local replies (429,
//! 401, 503) in OpenAI's error shape, so existing SDKs parse them and back off correctly.

use crate::duration::format_reset;
use crate::protocol::{BucketOutcome, BucketStatus, TokenBucketReply};
use serde_json::json;

pub type Header = (&'static str, String);

/// Set on responses that passed without a limiter decision (companion unavailable and
/// `failure_mode: allow`), so operators and clients can tell.
pub const DEGRADED_HEADER: &str = "x-llm-ratelimit-degraded";

/// A response the filter sends itself instead of forwarding the request.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<Header>,
    pub body: String,
}

/// OpenAI's `x-ratelimit-*-requests` headers for the most restrictive limit: the one with
/// the fewest requests left (on a tie, the one that takes longest to reset).
pub fn request_headers(reply: &TokenBucketReply) -> Vec<Header> {
    let tightest = reply
        .limits
        .iter()
        .min_by_key(|o| (o.remaining, std::cmp::Reverse(o.reset_after_ms)));
    match tightest {
        Some(o) => vec![
            ("x-ratelimit-limit-requests", o.limit.to_string()),
            ("x-ratelimit-remaining-requests", o.remaining.to_string()),
            ("x-ratelimit-reset-requests", format_reset(o.reset_after_ms)),
        ],
        None => Vec::new(),
    }
}

/// The 429 for a reply that was not allowed. It names the limit that binds longest; when
/// a limit can never fit the request it says so and gives no `Retry-After`.
pub fn rejection(
    reply: &TokenBucketReply,
    window_ms_of: impl Fn(&str) -> Option<u64>,
) -> LocalReply {
    let never = reply
        .limits
        .iter()
        .find(|o| o.status == BucketStatus::Never);
    let binding = never.or_else(|| {
        reply
            .limits
            .iter()
            .filter(|o| o.status == BucketStatus::Limited)
            .max_by_key(|o| o.retry_after_ms)
    });
    let mut headers = request_headers(reply);
    let message = match binding {
        Some(o @ BucketOutcome { status: BucketStatus::Never, .. }) => format!(
            "Request too large for limit \"{}\": it allows {} requests{}, so this request can never be admitted.",
            o.name,
            o.limit,
            per_window(window_ms_of(&o.name)),
        ),
        Some(o) => {
            headers.push(("retry-after", retry_after_seconds(o.retry_after_ms).to_string()));
            format!(
                "Rate limit reached for requests: limit \"{}\" allows {}{}. Please try again in {}.",
                o.name,
                o.limit,
                per_window(window_ms_of(&o.name)),
                format_reset(o.retry_after_ms),
            )
        }
        // Not allowed yet nothing limited: only an inconsistent reply gets here.
        None => {
            headers.push(("retry-after", "1".to_string()));
            "Rate limit reached for requests. Please try again in 1s.".to_string()
        }
    };
    headers.push(("content-type", "application/json".to_string()));
    LocalReply {
        status: 429,
        headers,
        body: error_body(&message, "requests", "rate_limit_exceeded"),
    }
}

/// 401 for a request without the identifying header, when the config says `reject`.
pub fn missing_identity() -> LocalReply {
    LocalReply {
        status: 401,
        headers: vec![("content-type", "application/json".to_string())],
        body: error_body(
            "No API key provided. Send it as 'Authorization: Bearer <key>' or in the header the operator configured.",
            "invalid_request_error",
            "missing_api_key",
        ),
    }
}

/// 503 when the limiter cannot decide and the config says `deny`.
pub fn limiter_unavailable() -> LocalReply {
    LocalReply {
        status: 503,
        headers: vec![("retry-after", "1".to_string()), ("content-type", "application/json".to_string())],
        body: error_body(
            "The rate limiter is unavailable, so the request was not forwarded. Please try again shortly.",
            "server_error",
            "rate_limiter_unavailable",
        ),
    }
}

/// Whole seconds, rounded up and at least 1: a client that waits this long finds room.
pub fn retry_after_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

fn per_window(window_ms: Option<u64>) -> String {
    window_ms
        .map(|ms| format!(" per {}", format_reset(ms)))
        .unwrap_or_default()
}

fn error_body(message: &str, kind: &str, code: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(
        name: &str,
        status: BucketStatus,
        limit: u64,
        remaining: u64,
        reset: u64,
        retry: u64,
    ) -> BucketOutcome {
        BucketOutcome {
            name: name.into(),
            status,
            limit,
            remaining,
            reset_after_ms: reset,
            retry_after_ms: retry,
        }
    }

    fn header<'a>(headers: &'a [Header], name: &str) -> Option<&'a str> {
        headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn headers_describe_the_tightest_limit() {
        let reply = TokenBucketReply {
            allowed: true,
            limits: vec![
                outcome("rpm", BucketStatus::Allowed, 20, 7, 39_000, 0),
                outcome("rpd", BucketStatus::Allowed, 1000, 7, 600_000, 0),
                outcome("rps", BucketStatus::Allowed, 10, 9, 100, 0),
            ],
        };
        let headers = request_headers(&reply);
        assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("1000"));
        assert_eq!(
            header(&headers, "x-ratelimit-remaining-requests"),
            Some("7")
        );
        assert_eq!(
            header(&headers, "x-ratelimit-reset-requests"),
            Some("10m0s")
        );
    }

    #[test]
    fn a_429_names_the_limit_that_binds_longest() {
        let reply = TokenBucketReply {
            allowed: false,
            limits: vec![
                outcome("rpm", BucketStatus::Limited, 20, 0, 60_000, 2_500),
                outcome("rph", BucketStatus::Limited, 100, 0, 3_600_000, 36_001),
                outcome("rpd", BucketStatus::Allowed, 1000, 500, 100, 0),
            ],
        };
        let windows = |name: &str| match name {
            "rph" => Some(3_600_000),
            _ => Some(60_000),
        };
        let reply = rejection(&reply, windows);
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply.headers, "retry-after"), Some("37"));
        assert_eq!(
            header(&reply.headers, "x-ratelimit-remaining-requests"),
            Some("0")
        );
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert_eq!(body["error"]["type"], "requests");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(
            message.contains("\"rph\" allows 100 per 1h0m0s"),
            "{message}"
        );
        assert!(message.contains("try again in 36.001s"), "{message}");
    }

    #[test]
    fn a_request_that_can_never_fit_gets_no_retry_after() {
        let reply = TokenBucketReply {
            allowed: false,
            limits: vec![
                outcome("rpm", BucketStatus::Limited, 20, 0, 60_000, 2_500),
                outcome("burst", BucketStatus::Never, 1, 1, 0, 0),
            ],
        };
        let reply = rejection(&reply, |_| Some(1_000));
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply.headers, "retry-after"), None);
        assert!(
            reply.body.contains("can never be admitted"),
            "{}",
            reply.body
        );
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        for (ms, seconds) in [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (59_999, 60)] {
            assert_eq!(retry_after_seconds(ms), seconds, "{ms}");
        }
    }

    #[test]
    fn other_local_replies_parse_as_openai_errors() {
        for (reply, status, code) in [
            (missing_identity(), 401, "missing_api_key"),
            (limiter_unavailable(), 503, "rate_limiter_unavailable"),
        ] {
            assert_eq!(reply.status, status);
            let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
            assert_eq!(body["error"]["code"], code);
        }
    }
}
