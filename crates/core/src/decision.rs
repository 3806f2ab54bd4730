//! What the client sees: rate-limit headers on every response, and the local replies (429,
//! 401, 413, 503) in OpenAI's error shape, so existing SDKs parse them and back off.

use crate::config::{Dimension, HeaderStyle, Policy};
use crate::duration::format_reset;
use crate::protocol::{LimitOutcome, LimitStatus, LimitsReply};
use serde_json::json;

pub type Header = (&'static str, String);

/// Set on responses that passed without a limiter decision (companion unavailable and
/// `failure_mode: allow`), so operators and clients can tell.
pub const DEGRADED_HEADER: &str = "x-llm-ratelimit-degraded";
/// The tokens a request reserved (prompt counted in the proxy plus completion estimate).
pub const RESERVED_TOKENS_HEADER: &str = "x-llm-ratelimit-reserved-tokens";
/// In shadow mode, on a request that enforcement would have refused: the status it would
/// have had (`429`, `413`, `503`).
pub const SHADOW_HEADER: &str = "x-llm-ratelimit-shadow";
/// How long the request waited in the queue for capacity (ms).
pub const QUEUED_HEADER: &str = "x-llm-ratelimit-queued-ms";

/// A response the filter sends itself instead of forwarding the request.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<Header>,
    pub body: String,
}

impl LocalReply {
    /// The same reply with no body (for a host that cannot send one just then): the
    /// status, `retry-after` and the rate-limit headers still say what happened.
    pub fn without_body(mut self) -> LocalReply {
        self.headers.retain(|(name, _)| *name != "content-type");
        self.body.clear();
        self
    }
}

fn dimension_of(config: &Policy, outcome: &LimitOutcome) -> Dimension {
    config.limit(&outcome.name).map_or(Dimension::Requests, |l| l.dimension())
}

/// OpenAI's `x-ratelimit-*-requests` and `x-ratelimit-*-tokens` headers, each for the
/// most restrictive limit of its dimension (fewest left; on a tie, longest to reset), and
/// the IETF `RateLimit-Policy` / `RateLimit` fields listing every limit.
pub fn rate_limit_headers(reply: &LimitsReply, config: &Policy) -> Vec<Header> {
    let mut headers = Vec::new();
    if config.headers.contains(&HeaderStyle::Openai) {
        openai_headers(reply, config, &mut headers);
    }
    // The IETF and classic fields describe quotas per time window: concurrency is not one.
    let windowed: Vec<_> = reply.limits.iter().filter(|o| dimension_of(config, o) != Dimension::Concurrency).collect();
    if config.headers.contains(&HeaderStyle::Ietf) {
        ietf_headers(&windowed, config, &mut headers);
    }
    if config.headers.contains(&HeaderStyle::Classic) {
        // The most restrictive: the smallest share of its limit left.
        let tightest = windowed.iter().min_by(|a, b| {
            let share = |o: &LimitOutcome| o.remaining as f64 / o.limit.max(1) as f64;
            share(a).total_cmp(&share(b))
        });
        if let Some(o) = tightest {
            headers.push(("x-ratelimit-limit", o.limit.to_string()));
            headers.push(("x-ratelimit-remaining", o.remaining.to_string()));
            headers.push(("x-ratelimit-reset", o.reset_after_ms.div_ceil(1000).to_string()));
        }
    }
    headers
}

fn openai_headers(reply: &LimitsReply, config: &Policy, headers: &mut Vec<Header>) {
    // OpenAI has no header for a money budget: the IETF and classic fields cover it.
    for dimension in [Dimension::Requests, Dimension::Tokens, Dimension::Concurrency] {
        let tightest = reply
            .limits
            .iter()
            .filter(|o| dimension_of(config, o) == dimension)
            .min_by_key(|o| (o.remaining, std::cmp::Reverse(o.reset_after_ms)));
        if let Some(o) = tightest {
            let (limit, remaining, reset) = match dimension {
                Dimension::Requests => {
                    ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
                }
                Dimension::Tokens => {
                    ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
                }
                // Slots come back when requests end, not on a schedule: no reset.
                Dimension::Concurrency => ("x-ratelimit-limit-concurrency", "x-ratelimit-remaining-concurrency", ""),
                Dimension::Cost => continue,
            };
            headers.push((limit, o.limit.to_string()));
            headers.push((remaining, o.remaining.to_string()));
            if !reset.is_empty() {
                headers.push((reset, format_reset(o.reset_after_ms)));
            }
        }
    }
}

fn ietf_headers(windowed: &[&LimitOutcome], config: &Policy, headers: &mut Vec<Header>) {
    if !windowed.is_empty() {
        let seconds = |ms: u64| ms.div_ceil(1000);
        let policy = windowed
            .iter()
            .map(|o| {
                let window = config.limit(&o.name).map_or(0, |l| l.window_ms());
                format!("\"{}\";q={};w={}", o.name, o.limit, seconds(window))
            })
            .collect::<Vec<_>>();
        let state = windowed
            .iter()
            .map(|o| format!("\"{}\";r={};t={}", o.name, o.remaining, seconds(o.reset_after_ms)))
            .collect::<Vec<_>>();
        headers.push(("ratelimit-policy", policy.join(", ")));
        headers.push(("ratelimit", state.join(", ")));
    }
}

/// The 429 for a reply that was not allowed. It names the limit that binds longest; when
/// a limit can never fit the request it says so and gives no `Retry-After`.
/// `requested_tokens` is what the request asked of token limits.
pub fn rejection(reply: &LimitsReply, config: &Policy, requested_tokens: u64) -> LocalReply {
    let never = reply.limits.iter().find(|o| o.status == LimitStatus::Never);
    let binding = never
        .or_else(|| reply.limits.iter().filter(|o| o.status == LimitStatus::Limited).max_by_key(|o| o.retry_after_ms));
    let mut headers = rate_limit_headers(reply, config);
    let Some(outcome) = binding else {
        // Not allowed yet nothing limited: only an inconsistent reply gets here.
        headers.push(("retry-after", "1".to_string()));
        headers.push(("content-type", "application/json".to_string()));
        let body = error_body("Rate limit reached. Please try again in 1s.", "requests", "rate_limit_exceeded");
        return LocalReply { status: 429, headers, body };
    };
    let dimension = dimension_of(config, outcome);
    let window = config.limit(&outcome.name).map_or(String::new(), |l| format!(" per {}", format_reset(l.window_ms())));
    let (name, limit) = (&outcome.name, outcome.limit);
    let message = match (outcome.status, dimension) {
        (LimitStatus::Never, Dimension::Tokens) => format!(
            "Request too large for limit \"{name}\": it needs {requested_tokens} tokens (prompt and completion allowance), \
             but the limit allows {limit}{window}, so it can never be admitted. Shorten the prompt or lower max_tokens."
        ),
        (LimitStatus::Never, Dimension::Cost) => format!(
            "Request too expensive for budget \"{name}\": it may cost more than the whole budget of {}{window}, so it \
             can never be admitted. Shorten the prompt or lower max_tokens.",
            usd(limit)
        ),
        (_, Dimension::Cost) => {
            headers.push(("retry-after", retry_after_seconds(outcome.retry_after_ms).to_string()));
            format!(
                "Budget reached: limit \"{name}\" allows {}{window}, {} left. Please try again in {}.",
                usd(limit),
                usd(outcome.remaining),
                format_reset(outcome.retry_after_ms)
            )
        }
        (LimitStatus::Never, Dimension::Requests | Dimension::Concurrency) => format!(
            "Request too large for limit \"{name}\": it allows {limit} requests{window}, so this request can never be admitted."
        ),
        (_, Dimension::Concurrency) => {
            headers.push(("retry-after", retry_after_seconds(outcome.retry_after_ms).to_string()));
            format!(
                "Concurrency limit reached: limit \"{name}\" allows {limit} requests in flight at once. Please try again \
                 in {}.",
                format_reset(outcome.retry_after_ms)
            )
        }
        (_, Dimension::Tokens) => {
            headers.push(("retry-after", retry_after_seconds(outcome.retry_after_ms).to_string()));
            format!(
                "Rate limit reached for tokens: limit \"{name}\" allows {limit}{window}, {} left, and this request needs \
                 {requested_tokens} (prompt and completion allowance). Please try again in {}.",
                outcome.remaining,
                format_reset(outcome.retry_after_ms)
            )
        }
        (_, Dimension::Requests) => {
            headers.push(("retry-after", retry_after_seconds(outcome.retry_after_ms).to_string()));
            format!(
                "Rate limit reached for requests: limit \"{name}\" allows {limit}{window}. Please try again in {}.",
                format_reset(outcome.retry_after_ms)
            )
        }
    };
    headers.push(("content-type", "application/json".to_string()));
    LocalReply { status: 429, headers, body: error_body(&message, dimension.name(), "rate_limit_exceeded") }
}

/// Micro-dollars as dollars: `$0.0035`, `$50.00`.
pub fn usd(micro: u64) -> String {
    let dollars = micro as f64 / 1e6;
    if dollars >= 1.0 {
        format!("${dollars:.2}")
    } else {
        format!("${}", format!("{dollars:.6}").trim_end_matches('0').trim_end_matches('.'))
    }
}

/// 403 for a request whose model has no price while a budget applies to it.
pub fn model_not_priced(model: &str) -> LocalReply {
    let shown: String = model.chars().take(100).collect();
    local_error(
        403,
        &format!("The model \"{shown}\" has no price in this gateway's price table, so its budget cannot charge it."),
        "invalid_request_error",
        "model_not_priced",
    )
}

/// 401 for a request without the identifying header, when the config says `reject`.
pub fn missing_identity() -> LocalReply {
    local_error(
        401,
        "No API key provided. Send it as 'Authorization: Bearer <key>' or in the header the operator configured.",
        "invalid_request_error",
        "missing_api_key",
    )
}

/// 413 for a body too large to count.
pub fn body_too_large(limit: u64) -> LocalReply {
    local_error(
        413,
        &format!("The request body is larger than the {limit} bytes this gateway reads to count tokens."),
        "invalid_request_error",
        "request_too_large",
    )
}

/// 503 when the limiter cannot decide and the config says `deny`.
pub fn limiter_unavailable() -> LocalReply {
    let mut reply = local_error(
        503,
        "The rate limiter is unavailable, so the request was not forwarded. Please try again shortly.",
        "server_error",
        "rate_limiter_unavailable",
    );
    reply.headers.insert(0, ("retry-after", "1".to_string()));
    reply
}

fn local_error(status: u32, message: &str, kind: &str, code: &str) -> LocalReply {
    LocalReply {
        status,
        headers: vec![("content-type", "application/json".to_string())],
        body: error_body(message, kind, code),
    }
}

/// Whole seconds, rounded up and at least 1: a client that waits this long finds room.
pub fn retry_after_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

fn error_body(message: &str, kind: &str, code: &str) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Policy {
        let json = r#"{"companion": {"upstream": "c", "token": "t"}, "limits": [
            {"name": "rpm", "requests": 20, "window": "1m"},
            {"name": "rph", "requests": 100, "window": "1h"},
            {"name": "rpd", "requests": 1000, "window": "1d"},
            {"name": "tpm", "tokens": 10000, "window": "1m"},
            {"name": "inflight", "concurrency": 3}]}"#;
        Policy::from_json(json.as_bytes()).expect("config")
    }

    fn outcome(name: &str, status: LimitStatus, limit: u64, remaining: u64, reset: u64, retry: u64) -> LimitOutcome {
        LimitOutcome {
            name: name.into(),
            status,
            limit,
            remaining,
            reset_after_ms: reset,
            retry_after_ms: retry,
            charged: 0,
        }
    }

    fn header<'a>(headers: &'a [Header], name: &str) -> Option<&'a str> {
        headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn headers_describe_the_tightest_limit_of_each_dimension() {
        let reply = LimitsReply {
            allowed: true,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 7, 39_000, 0),
                outcome("rpd", LimitStatus::Allowed, 1000, 7, 600_000, 0),
                outcome("tpm", LimitStatus::Allowed, 10_000, 8_800, 7_200, 0),
            ],
        };
        let headers = rate_limit_headers(&reply, &config());
        assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("1000"));
        assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), Some("7"));
        assert_eq!(header(&headers, "x-ratelimit-reset-requests"), Some("10m0s"));
        assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("10000"));
        assert_eq!(header(&headers, "x-ratelimit-remaining-tokens"), Some("8800"));
        assert_eq!(header(&headers, "x-ratelimit-reset-tokens"), Some("7.2s"));
        assert_eq!(
            header(&headers, "ratelimit-policy"),
            Some(r#""rpm";q=20;w=60, "rpd";q=1000;w=86400, "tpm";q=10000;w=60"#)
        );
        assert_eq!(header(&headers, "ratelimit"), Some(r#""rpm";r=7;t=39, "rpd";r=7;t=600, "tpm";r=8800;t=8"#));
    }

    #[test]
    fn concurrency_gets_its_own_headers_and_429() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 12, 24_000, 0),
                outcome("inflight", LimitStatus::Limited, 3, 0, 0, 800),
            ],
        };
        let reply = rejection(&reply, &config(), 0);
        assert_eq!(header(&reply.headers, "x-ratelimit-limit-concurrency"), Some("3"));
        assert_eq!(header(&reply.headers, "x-ratelimit-remaining-concurrency"), Some("0"));
        assert_eq!(header(&reply.headers, "retry-after"), Some("1"));
        assert!(!header(&reply.headers, "ratelimit-policy").unwrap_or("").contains("inflight"));
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["type"], "concurrency");
        assert!(body["error"]["message"].as_str().unwrap_or("").contains("3 requests in flight at once"));
    }

    #[test]
    fn header_styles_are_chosen_by_config() {
        let reply = LimitsReply {
            allowed: true,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 15, 15_000, 0),
                outcome("tpm", LimitStatus::Allowed, 10_000, 1_000, 54_000, 0),
            ],
        };
        let mut config = config();
        config.headers = vec![HeaderStyle::Classic];
        let headers = rate_limit_headers(&reply, &config);
        let names: Vec<&str> = headers.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"]);
        // tpm has 10% left, rpm 75%: tpm is the most restrictive.
        assert_eq!(header(&headers, "x-ratelimit-limit"), Some("10000"));
        assert_eq!(header(&headers, "x-ratelimit-reset"), Some("54"));
        config.headers = vec![HeaderStyle::Ietf];
        let headers = rate_limit_headers(&reply, &config);
        assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), None);
        assert!(header(&headers, "ratelimit").is_some());
        config.headers.clear();
        assert!(rate_limit_headers(&reply, &config).is_empty());
    }

    #[test]
    fn request_only_replies_carry_no_token_headers() {
        let reply = LimitsReply {
            allowed: true,
            waited_ms: 0,
            limits: vec![outcome("rpm", LimitStatus::Allowed, 20, 19, 3_000, 0)],
        };
        let headers = rate_limit_headers(&reply, &config());
        assert_eq!(header(&headers, "x-ratelimit-remaining-tokens"), None);
        assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), Some("19"));
    }

    #[test]
    fn a_429_names_the_limit_that_binds_longest() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Limited, 20, 0, 60_000, 2_500),
                outcome("rph", LimitStatus::Limited, 100, 0, 3_600_000, 36_001),
                outcome("rpd", LimitStatus::Allowed, 1000, 500, 100, 0),
            ],
        };
        let reply = rejection(&reply, &config(), 0);
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply.headers, "retry-after"), Some("37"));
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert_eq!(body["error"]["type"], "requests");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.contains("\"rph\" allows 100 per 1h0m0s"), "{message}");
        assert!(message.contains("try again in 36.001s"), "{message}");
    }

    #[test]
    fn a_token_429_says_what_the_request_needs() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 12, 24_000, 0),
                outcome("tpm", LimitStatus::Limited, 10_000, 300, 58_200, 5_400),
            ],
        };
        let reply = rejection(&reply, &config(), 1_200);
        assert_eq!(header(&reply.headers, "retry-after"), Some("6"));
        assert_eq!(header(&reply.headers, "x-ratelimit-remaining-tokens"), Some("300"));
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["type"], "tokens");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.contains("300 left, and this request needs 1200"), "{message}");
    }

    #[test]
    fn a_request_that_can_never_fit_gets_no_retry_after() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Limited, 20, 0, 60_000, 2_500),
                outcome("tpm", LimitStatus::Never, 10_000, 10_000, 0, 0),
            ],
        };
        let reply = rejection(&reply, &config(), 12_000);
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply.headers, "retry-after"), None);
        assert!(
            reply.body.contains("needs 12000 tokens") && reply.body.contains("can never be admitted"),
            "{}",
            reply.body
        );
    }

    #[test]
    fn a_budget_429_speaks_in_dollars() {
        let json = r#"{"companion": {"upstream": "c", "token": "t"}, "limits": [{"name": "day", "usd": 5, "window": "1d"}],
                       "prices": [{"match": "*", "input": 1, "output": 1}]}"#;
        let config = Policy::from_json(json.as_bytes()).expect("config");
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![outcome("day", LimitStatus::Limited, 5_000_000, 1_250, 86_000_000, 3_000)],
        };
        let reply = rejection(&reply, &config, 0);
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["type"], "cost");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.contains("allows $5.00 per 24h0m0s, $0.00125 left"), "{message}");
        assert_eq!(header(&reply.headers, "x-ratelimit-remaining-requests"), None);
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        for (ms, seconds) in [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (59_999, 60)] {
            assert_eq!(retry_after_seconds(ms), seconds, "{ms}");
        }
    }

    #[test]
    fn other_local_replies_parse_as_openai_errors() {
        let cases = [
            (missing_identity(), 401, "missing_api_key"),
            (limiter_unavailable(), 503, "rate_limiter_unavailable"),
            (body_too_large(1024), 413, "request_too_large"),
        ];
        for (reply, status, code) in cases {
            assert_eq!(reply.status, status);
            let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
            assert_eq!(body["error"]["code"], code);
        }
    }
}
