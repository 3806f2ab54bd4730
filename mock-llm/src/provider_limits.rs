//! The mock as a provider with limits of its own (`--provider-requests`,
//! `--provider-tokens`, per `--provider-window-ms`), per credential, saying so the way
//! each provider does:
//!
//! - OpenAI (`/v1/chat/completions`): on every reply `x-ratelimit-limit-requests`,
//!   `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` (and `-tokens`), the
//!   resets as Go prints durations (`6m0s`, `1s`, `20ms`); over a limit a 429
//!   `rate_limit_exceeded` whose `type` names the quota, and no `retry-after` (the reset
//!   headers say when).
//! - Azure OpenAI (`/openai/...`): the same headers, and on a 429 `retry-after` (seconds)
//!   and `retry-after-ms`.
//! - Anthropic (`/v1/messages`): `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`,
//!   the resets RFC 3339 times; over a limit a 429 `rate_limit_error` with `retry-after`.
//! - Google (Gemini API, Vertex AI): no headers; over a limit a 429 `RESOURCE_EXHAUSTED`
//!   with a `google.rpc.QuotaFailure` and a `google.rpc.RetryInfo` (`retryDelay: "Ns"`).
//! - Bedrock (`/model/...`): no headers; over a limit a 429 with
//!   `x-amzn-ErrorType: ThrottlingException:...` and `{"message"}`, no retry time.
//!
//! Each window is fixed: it starts with a credential's first request and ends
//! `--provider-window-ms` later. Tokens are counted from the usage the reply reports (its
//! `x-mock-prompt-tokens` and `x-mock-completion-tokens`). `GET /mock/stats` counts the
//! requests refused here (`throttled`).

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The most credentials tracked: a test fixture bounded all the same.
const MAX_CREDENTIALS: usize = 10_000;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub requests: Option<u64>,
    pub tokens: Option<u64>,
    pub window: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    ends_ms: u64,
    requests: u64,
    tokens: u64,
}

pub struct ProviderLimits {
    limits: Limits,
    windows: Mutex<HashMap<String, Window>>,
    pub throttled: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    OpenAi,
    Azure,
    Anthropic,
    Google,
    Bedrock,
}

fn shape_of(path: &str) -> Shape {
    if path.starts_with("/v1/messages") {
        Shape::Anthropic
    } else if path.starts_with("/model/") {
        Shape::Bedrock
    } else if path.starts_with("/v1beta/") || path.starts_with("/v1/models/") || path.starts_with("/v1/projects/") {
        Shape::Google
    } else if path.starts_with("/openai/") {
        Shape::Azure
    } else {
        Shape::OpenAi
    }
}

/// The credential a request carries, as its provider reads it (SigV4: the access key id).
fn credential(headers: &HeaderMap, query: &str) -> String {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    if let Some(auth) = header("authorization") {
        if let Some(rest) = auth.strip_prefix("AWS4-HMAC-SHA256") {
            let key = rest.split("Credential=").nth(1).and_then(|c| c.split('/').next()).unwrap_or("");
            return format!("aws:{key}");
        }
        return auth;
    }
    for name in ["x-api-key", "x-goog-api-key", "api-key"] {
        if let Some(value) = header(name) {
            return value;
        }
    }
    query.split('&').find_map(|pair| pair.strip_prefix("key=")).unwrap_or("").to_string()
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A duration as Go's `time.Duration.String()` prints it, to the millisecond.
fn go_duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m, s, milli) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    let seconds =
        if milli == 0 { format!("{s}s") } else { format!("{}s", format!("{s}.{milli:03}").trim_end_matches('0')) };
    match (h, m) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

/// Seconds since the epoch as RFC 3339 in UTC (days to a civil date, Gregorian rules).
/// Written here again, not taken from the filter's core: the fixture is the outside
/// reference the filter is tested against, so it shares none of the filter's code.
fn rfc3339(seconds: u64) -> String {
    let days = (seconds / 86_400) as i64;
    let of_day = seconds % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", of_day / 3_600, of_day % 3_600 / 60, of_day % 60)
}

impl ProviderLimits {
    pub fn new(limits: Limits) -> ProviderLimits {
        ProviderLimits { limits, windows: Mutex::new(HashMap::new()), throttled: AtomicU64::new(0) }
    }

    fn active(&self) -> bool {
        self.limits.requests.is_some() || self.limits.tokens.is_some()
    }

    /// The credential's window at `now`, after `change`.
    fn window(&self, credential: &str, now: u64, change: impl FnOnce(&mut Window)) -> Window {
        let mut windows = self.windows.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if windows.len() >= MAX_CREDENTIALS && !windows.contains_key(credential) {
            windows.clear();
        }
        let fresh = Window { ends_ms: now + self.limits.window.as_millis() as u64, requests: 0, tokens: 0 };
        let window = windows.entry(credential.to_string()).or_insert(fresh);
        if now >= window.ends_ms {
            *window = fresh;
        }
        change(window);
        *window
    }

    /// The quota a window has spent, if one is: its `type` (OpenAI's words) and limit.
    fn spent(&self, window: &Window) -> Option<(&'static str, u64)> {
        let over = |limit: Option<u64>, used: u64| limit.filter(|&l| used >= l);
        over(self.limits.requests, window.requests)
            .map(|l| ("requests", l))
            .or_else(|| over(self.limits.tokens, window.tokens).map(|l| ("tokens", l)))
    }

    /// The rate-limit headers a reply carries in `shape`, for `window` at `now`.
    fn headers(&self, shape: Shape, window: &Window, now: u64, headers: &mut HeaderMap) {
        let reset_ms = window.ends_ms.saturating_sub(now);
        let quotas =
            [("requests", self.limits.requests, window.requests), ("tokens", self.limits.tokens, window.tokens)];
        for (quota, limit, used) in quotas {
            let Some(limit) = limit else { continue };
            let remaining = limit.saturating_sub(used);
            let fields: Vec<(String, String)> = match shape {
                Shape::OpenAi | Shape::Azure => vec![
                    (format!("x-ratelimit-limit-{quota}"), limit.to_string()),
                    (format!("x-ratelimit-remaining-{quota}"), remaining.to_string()),
                    (format!("x-ratelimit-reset-{quota}"), go_duration(reset_ms)),
                ],
                Shape::Anthropic => vec![
                    (format!("anthropic-ratelimit-{quota}-limit"), limit.to_string()),
                    (format!("anthropic-ratelimit-{quota}-remaining"), remaining.to_string()),
                    (format!("anthropic-ratelimit-{quota}-reset"), rfc3339(window.ends_ms.div_ceil(1000))),
                ],
                Shape::Google | Shape::Bedrock => Vec::new(),
            };
            for (name, value) in fields {
                if let (Ok(name), Ok(value)) = (name.parse::<axum::http::HeaderName>(), HeaderValue::from_str(&value)) {
                    headers.insert(name, value);
                }
            }
        }
    }

    /// The provider's 429 in `shape` for a window whose `quota` of `limit` is spent.
    fn refusal(&self, shape: Shape, window: &Window, now: u64, quota: &str, limit: u64) -> Response {
        let wait_ms = window.ends_ms.saturating_sub(now).max(1);
        let wait_s = wait_ms.div_ceil(1000);
        let message = format!(
            "Rate limit reached for {quota} (limit {limit} per {}). Please try again in {}.",
            go_duration(self.limits.window.as_millis() as u64),
            go_duration(wait_ms)
        );
        let body = match shape {
            Shape::OpenAi | Shape::Azure => {
                json!({"error": {"message": message, "type": quota, "param": null, "code": "rate_limit_exceeded"}})
            }
            Shape::Anthropic => json!({"type": "error", "error": {"type": "rate_limit_error", "message": message}}),
            Shape::Google => {
                json!({"error": {"code": 429, "message": message, "status": "RESOURCE_EXHAUSTED", "details": [
                {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [
                    {"quotaMetric": format!("generativelanguage.googleapis.com/generate_content_{quota}"), "quotaValue": limit.to_string()}]},
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": format!("{wait_s}s")}]}})
            }
            Shape::Bedrock => json!({"message": "Too many requests, please wait before trying again."}),
        };
        let mut response =
            (StatusCode::TOO_MANY_REQUESTS, [("content-type", "application/json")], body.to_string()).into_response();
        let headers = response.headers_mut();
        self.headers(shape, window, now, headers);
        let extra: Vec<(&str, String)> = match shape {
            Shape::Azure => vec![("retry-after", wait_s.to_string()), ("retry-after-ms", wait_ms.to_string())],
            Shape::Anthropic => vec![("retry-after", wait_s.to_string())],
            Shape::Bedrock => {
                vec![(
                    "x-amzn-errortype",
                    "ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/".into(),
                )]
            }
            Shape::OpenAi | Shape::Google => Vec::new(),
        };
        for (name, value) in extra {
            if let Ok(value) = HeaderValue::from_str(&value) {
                headers.insert(name, value);
            }
        }
        response
    }
}

fn reported_tokens(headers: &HeaderMap) -> u64 {
    ["x-mock-prompt-tokens", "x-mock-completion-tokens"]
        .iter()
        .filter_map(|name| headers.get(*name)?.to_str().ok()?.parse::<u64>().ok())
        .sum()
}

pub async fn apply(State(limits): State<Arc<ProviderLimits>>, request: Request, next: Next) -> Response {
    let path = request.uri().path().to_string();
    if !limits.active() || path.starts_with("/mock/") || path == "/healthz" {
        return next.run(request).await;
    }
    let shape = shape_of(&path);
    let credential = credential(request.headers(), request.uri().query().unwrap_or(""));
    let now = now_ms();
    let mut refused = None;
    let window = limits.window(&credential, now, |window| {
        refused = limits.spent(window);
        if refused.is_none() {
            window.requests += 1;
        }
    });
    if let Some((quota, limit)) = refused {
        limits.throttled.fetch_add(1, Ordering::Relaxed);
        return limits.refusal(shape, &window, now, quota, limit);
    }
    let response = next.run(request).await;
    let (mut parts, body): (_, Body) = response.into_parts();
    let used = reported_tokens(&parts.headers);
    let window = limits.window(&credential, now_ms(), |window| window.tokens += used);
    limits.headers(shape, &window, now_ms(), &mut parts.headers);
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_times_print_as_the_providers_do() {
        assert_eq!(go_duration(360_000), "6m0s");
        assert_eq!(go_duration(1_000), "1s");
        assert_eq!(go_duration(20), "20ms");
        assert_eq!(go_duration(17_059), "17.059s");
        assert_eq!(go_duration(3_723_500), "1h2m3.5s");
        assert_eq!(rfc3339(1_796_139_420), "2026-12-01T15:37:00Z");
    }
}
