//! What a provider says about its own limits on a reply, read from its own headers and
//! throttling errors (a reader: no host, no state; `crate::effects::provider_state` keeps it):
//!
//! - OpenAI and Azure OpenAI: `x-ratelimit-remaining-requests` / `-tokens` with
//!   `x-ratelimit-reset-requests` / `-tokens`, durations as Go prints them (`6m0s`, `1s`,
//!   `20ms`, `1h2m3.5s`; Azure also a bare number of seconds); on a 429 `retry-after`
//!   (seconds) and `retry-after-ms`.
//! - Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-remaining`
//!   with `-reset` as RFC 3339 times; `retry-after` (seconds) on a 429.
//! - Google (Gemini API, Vertex AI): a 429 `RESOURCE_EXHAUSTED` whose body's `details`
//!   hold a `google.rpc.RetryInfo` with `retryDelay` (`"13s"`, `"0.5s"`).
//! - Bedrock: a 429 with `x-amzn-ErrorType: ThrottlingException` (no retry time: the
//!   config's `provider_limits.default_retry` stands in).
//!
//! Whatever the upstream sends, nothing here panics or grows: a header value longer than
//! [`MAX_VALUE`] is ignored, counts and times saturate, and a body is read only up to
//! [`MAX_ERROR_BODY`] bytes (the caller's buffer).

use crate::providers::{anthropic, openai, HeaderQuota, QuotaHeaders};

/// The longest header value read; a longer one is ignored.
pub const MAX_VALUE: usize = 64;
/// The most of a throttling error's body kept for its retry time.
pub const MAX_ERROR_BODY: usize = 16 * 1024;
/// The longest wait any field is read as (a day): what the state keeps is bounded further
/// by `provider_limits.max_retry`.
pub const MAX_WAIT_MS: u64 = 86_400_000;

/// A quota the provider reports on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    Requests,
    /// Input and output tokens together.
    Tokens,
    InputTokens,
    OutputTokens,
}

impl Quota {
    pub const ALL: [Quota; crate::protocol::QUOTAS] =
        [Quota::Requests, Quota::Tokens, Quota::InputTokens, Quota::OutputTokens];

    pub fn index(self) -> usize {
        self as usize
    }

    /// Its name in the filter's messages.
    pub fn name(self) -> &'static str {
        match self {
            Quota::Requests => "requests",
            Quota::Tokens => "tokens",
            Quota::InputTokens => "input tokens",
            Quota::OutputTokens => "output tokens",
        }
    }

    /// OpenAI's `error.type` for a refusal of it.
    pub fn error_type(self) -> &'static str {
        match self {
            Quota::Requests => "requests",
            Quota::Tokens => "tokens",
            Quota::InputTokens => "input_tokens",
            Quota::OutputTokens => "output_tokens",
        }
    }

    /// OpenAI's (and Azure's) remaining and reset headers for it.
    fn openai(self) -> Option<(&'static str, &'static str)> {
        let quota = match self {
            Quota::Requests => HeaderQuota::Requests,
            Quota::Tokens => HeaderQuota::AnyTokens,
            Quota::InputTokens | Quota::OutputTokens => return None,
        };
        remaining_and_reset(openai::RATE_LIMIT_HEADERS.of(quota)?)
    }

    /// Anthropic's remaining and reset headers for it.
    fn anthropic(self) -> Option<(&'static str, &'static str)> {
        let quota = match self {
            Quota::Requests => HeaderQuota::Requests,
            Quota::Tokens => HeaderQuota::TotalTokens,
            Quota::InputTokens => HeaderQuota::InputTokens,
            Quota::OutputTokens => HeaderQuota::OutputTokens,
        };
        remaining_and_reset(anthropic::RATE_LIMIT_HEADERS.of(quota)?)
    }
}

fn remaining_and_reset(headers: &QuotaHeaders) -> Option<(&'static str, &'static str)> {
    Some((headers.remaining, headers.reset?))
}

/// What is left of one quota, and in how long it is whole again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Left {
    pub remaining: u64,
    pub reset_after_ms: u64,
}

/// Everything one reply said about the provider's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProviderWord {
    /// The provider refused the request for its rate limits (a 429, Bedrock's throttling).
    pub refused: bool,
    /// How long it asked to wait, if it said (`retry-after-ms`, `retry-after`, RetryInfo).
    pub retry_after_ms: Option<u64>,
    /// Per quota ([`Quota::index`]).
    pub left: [Option<Left>; crate::protocol::QUOTAS],
}

impl ProviderWord {
    /// Whether the reply said anything at all about the provider's limits.
    pub fn said_anything(&self) -> bool {
        self.refused || self.retry_after_ms.is_some() || self.left.iter().any(Option::is_some)
    }

    /// How long the provider refuses from when it said this: its retry time on a refusal
    /// (else the longest reset of a quota it says is spent, else `default_ms`); without a
    /// refusal, until the reset of a quota with nothing left. `None`: it does not refuse.
    pub fn out_for_ms(&self, default_ms: u64) -> Option<u64> {
        let spent = self.left.iter().flatten().filter(|l| l.remaining == 0).map(|l| l.reset_after_ms).max();
        if self.refused {
            return Some(self.retry_after_ms.or(spent).unwrap_or(default_ms));
        }
        spent
    }
}

/// Reads a reply's status and headers (`header` gives a header's value by its lower-case
/// name) at `now_ms` by the proxy's clock (Anthropic's resets are times, read against it).
pub fn read_headers(status: u32, header: &mut dyn FnMut(&str) -> Option<String>, now_ms: u64) -> ProviderWord {
    let mut value = |name: &str| header(name).filter(|v| v.len() <= MAX_VALUE);
    let mut word = ProviderWord::default();
    for quota in Quota::ALL {
        let openai = quota.openai().and_then(|(remaining, reset)| {
            let remaining = count(&value(remaining)?)?;
            let reset_after_ms = go_duration_ms(&value(reset)?)?;
            Some(Left { remaining, reset_after_ms })
        });
        let anthropic = || {
            let (remaining, reset) = quota.anthropic()?;
            let remaining = count(&value(remaining)?)?;
            let reset_after_ms = rfc3339_ms(&value(reset)?)?.saturating_sub(now_ms).min(MAX_WAIT_MS);
            Some(Left { remaining, reset_after_ms })
        };
        if let Some(slot) = word.left.get_mut(quota.index()) {
            *slot = openai.or_else(anthropic);
        }
    }
    let bedrock_throttled = value(crate::providers::bedrock::ERROR_HEADER)
        .is_some_and(|kind| kind.split(':').next().is_some_and(|k| k.trim() == "ThrottlingException"));
    word.refused = status == 429 || bedrock_throttled;
    if word.refused {
        word.retry_after_ms = value("retry-after-ms")
            .and_then(|v| decimal_ms(&v, 1))
            .or_else(|| value("retry-after").and_then(|v| retry_after_ms(&v, now_ms)));
    }
    word
}

/// What an exception inside a Bedrock event stream says of the limits: its
/// `throttlingException` (an error header names it `ThrottlingException`) is the
/// provider's refusal, mid-stream, with no retry time; any other says nothing.
pub fn read_stream_exception(kind: &str) -> Option<ProviderWord> {
    kind.eq_ignore_ascii_case("throttlingException").then(|| ProviderWord { refused: true, ..ProviderWord::default() })
}

/// A throttling error's body, for the retry time Google puts there: the first
/// `google.rpc.RetryInfo` in `error.details`, its `retryDelay` a protobuf duration
/// (`"13s"`, `"0.5s"`).
pub fn retry_info_ms(body: &[u8]) -> Option<u64> {
    let body = body.get(..MAX_ERROR_BODY).unwrap_or(body);
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let details = value.get("error")?.get("details")?.as_array()?;
    details.iter().find_map(|detail| {
        let kind = detail.get("@type")?.as_str()?;
        if !kind.ends_with("google.rpc.RetryInfo") {
            return None;
        }
        let delay = detail.get("retryDelay")?.as_str()?;
        decimal_ms(delay.get(..MAX_VALUE).unwrap_or(delay).strip_suffix('s')?, 1000)
    })
}

/// A count (remaining requests or tokens): digits only, saturating. A negative value
/// (Azure sends `-1` when it does not say) is not one.
fn count(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.bytes().fold(0u64, |n, d| n.saturating_mul(10).saturating_add(u64::from(d - b'0'))))
}

/// A non-negative decimal number of units of `unit_ms` milliseconds (`"1.5"` at 1000 is
/// 1500), rounded up, at most [`MAX_WAIT_MS`].
fn decimal_ms(text: &str, unit_ms: u64) -> Option<u64> {
    let text = text.trim();
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() && fraction.is_empty() || !digits(whole) || !digits(fraction) {
        return None;
    }
    let whole = count(if whole.is_empty() { "0" } else { whole })?;
    // The fraction's first nine digits (nanosecond precision is all a duration has).
    let mut nanos = 0u64;
    for (i, d) in fraction.bytes().chain(std::iter::repeat(b'0')).take(9).enumerate() {
        nanos += u64::from(d - b'0') * 10u64.pow(8 - i as u32);
    }
    let ms = whole.saturating_mul(unit_ms).saturating_add((nanos.saturating_mul(unit_ms)).div_ceil(1_000_000_000));
    Some(ms.min(MAX_WAIT_MS))
}

/// A duration as Go's `time.Duration` prints it, which OpenAI's reset headers use: one or
/// more decimal numbers each with a unit (`h`, `m`, `s`, `ms`, `us`/`µs`, `ns`): `6m0s`,
/// `1s`, `20ms`, `1h2m3.5s`. A bare number is seconds (Azure). Rounded up to the ms.
pub fn go_duration_ms(text: &str) -> Option<u64> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    if let Some(seconds) = decimal_ms(text, 1000) {
        return Some(seconds);
    }
    let mut rest = text;
    let mut total_ns: u64 = 0;
    while !rest.is_empty() {
        let number_len = rest.bytes().take_while(|b| b.is_ascii_digit() || *b == b'.').count();
        let (number, after) = rest.split_at_checked(number_len)?;
        let unit_len =
            after.char_indices().find(|(_, c)| c.is_ascii_digit() || *c == '.').map_or(after.len(), |(i, _)| i);
        let (unit, next) = after.split_at_checked(unit_len)?;
        let unit_ns: u64 = match unit {
            "h" => 3_600_000_000_000,
            "m" => 60_000_000_000,
            "s" => 1_000_000_000,
            "ms" => 1_000_000,
            "us" | "µs" | "μs" => 1_000,
            "ns" => 1,
            _ => return None,
        };
        // Parsed in ms units of the unit, then brought to ns: `decimal_ms` rounds up.
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() || !fraction.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let whole = count(if whole.is_empty() { "0" } else { whole })?;
        let mut part = whole.saturating_mul(unit_ns);
        let mut scale = unit_ns;
        for d in fraction.bytes().take(18) {
            scale /= 10;
            part = part.saturating_add(u64::from(d - b'0').saturating_mul(scale));
        }
        total_ns = total_ns.saturating_add(part);
        rest = next;
    }
    Some(total_ns.div_ceil(1_000_000).min(MAX_WAIT_MS))
}

/// `retry-after`: delay-seconds (decimal accepted), or an HTTP-date (IMF-fixdate,
/// `Wed, 21 Oct 2015 07:28:00 GMT`) read against `now_ms`.
fn retry_after_ms(text: &str, now_ms: u64) -> Option<u64> {
    decimal_ms(text, 1000).or_else(|| Some(http_date_ms(text)?.saturating_sub(now_ms).min(MAX_WAIT_MS)))
}

const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

fn http_date_ms(text: &str) -> Option<u64> {
    let mut parts = text.trim().split_ascii_whitespace();
    let _weekday = parts.next()?;
    let day = count(parts.next()?)?;
    let month = MONTHS.iter().position(|m| Some(*m) == parts.next())? as u64 + 1;
    let year = count(parts.next()?)?;
    let time = parts.next()?;
    if parts.next()? != "GMT" {
        return None;
    }
    let seconds = clock_seconds(time)?;
    civil_ms(year, month, day, seconds, 0)
}

/// `HH:MM:SS` as seconds of the day.
fn clock_seconds(text: &str) -> Option<u64> {
    let mut fields = text.split(':');
    let (h, m, s) = (count(fields.next()?)?, count(fields.next()?)?, count(fields.next()?)?);
    (fields.next().is_none() && h < 24 && m < 60 && s <= 60).then_some(h * 3600 + m * 60 + s)
}

/// An RFC 3339 time (`2026-12-01T15:37:00Z`, `…:00.5+02:00`) as ms since the epoch.
pub fn rfc3339_ms(text: &str) -> Option<u64> {
    let text = text.trim();
    let (date, rest) = text.split_once(['T', 't', ' '])?;
    let mut ymd = date.split('-');
    let (year, month, day) = (count(ymd.next()?)?, count(ymd.next()?)?, count(ymd.next()?)?);
    if ymd.next().is_some() {
        return None;
    }
    let zone_at = rest.find(['Z', 'z', '+', '-'])?;
    let (clock, zone) = rest.split_at_checked(zone_at)?;
    let (clock, fraction) = clock.split_once('.').unwrap_or((clock, ""));
    let seconds = clock_seconds(clock)?;
    if !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let millis =
        fraction.bytes().chain(std::iter::repeat(b'0')).take(3).fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    let offset_s: i64 = match zone {
        "Z" | "z" => 0,
        _ => {
            let sign = if zone.starts_with('-') { -1 } else { 1 };
            let (h, m) = zone.get(1..)?.split_once(':')?;
            let (h, m) = (count(h)?, count(m)?);
            if h > 23 || m > 59 {
                return None;
            }
            sign * (h * 3600 + m * 60) as i64
        }
    };
    let local = civil_ms(year, month, day, seconds, millis)?;
    let utc = i128::from(local) - i128::from(offset_s) * 1000;
    u64::try_from(utc).ok()
}

/// A civil date and time (UTC) as ms since the epoch (H. Hinnant's `days_from_civil`, the
/// inverse of `answers::rfc3339`). `None` before 1970 or past year 9999.
fn civil_ms(year: u64, month: u64, day: u64, seconds: u64, millis: u64) -> Option<u64> {
    if !(1970..=9999).contains(&year) || !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let year_of_era = y - era * 400;
    let month_from_march = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = (era * 146_097 + day_of_era).checked_sub(719_468)?;
    Some((days * 86_400 + seconds) * 1000 + millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn word(status: u32, headers: &[(&str, &str)], now_ms: u64) -> ProviderWord {
        let mut header = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string());
        read_headers(status, &mut header, now_ms)
    }

    #[test]
    fn openais_durations_read_as_go_prints_them() {
        // OpenAI's documentation's examples (platform.openai.com, "Rate limits": "6m0s",
        // "20ms", "1s") and forms Go's time.Duration.String() prints.
        let cases = [
            ("6m0s", 360_000),
            ("1s", 1_000),
            ("20ms", 20),
            ("12ms", 12),
            ("1h2m3.5s", 3_723_500),
            ("0.5s", 500),
            ("1.001s", 1_001),
            ("1.0001s", 1_001),
            ("17.059s", 17_059),
            ("999us", 1),
            ("0s", 0),
            ("30", 30_000),
        ];
        for (text, ms) in cases {
            assert_eq!(go_duration_ms(text), Some(ms), "{text}");
        }
        for bad in ["", "s", "1x", "m1", "1..2s", "-1s", "1h-2m", "abc"] {
            assert_eq!(go_duration_ms(bad), None, "{bad}");
        }
        assert_eq!(go_duration_ms("99999999999999999999h"), Some(MAX_WAIT_MS), "saturates, bounded");
    }

    #[test]
    fn rfc3339_reads_what_answers_writes_and_offsets() {
        for seconds in [0u64, 951_782_400, 1_709_251_199, 1_796_139_420, 4_102_444_800] {
            assert_eq!(rfc3339_ms(&crate::replies::answers::rfc3339(seconds)), Some(seconds * 1000), "{seconds}");
        }
        assert_eq!(rfc3339_ms("2026-12-01T15:37:00.250Z"), Some(1_796_139_420_250));
        assert_eq!(rfc3339_ms("2026-12-01T17:37:00+02:00"), Some(1_796_139_420_000));
        assert_eq!(rfc3339_ms("2026-12-01T15:07:00-00:30"), Some(1_796_139_420_000));
        for bad in ["", "2026-12-01", "2026-13-01T00:00:00Z", "2026-12-01T25:00:00Z", "1969-12-31T23:59:59Z", "x"] {
            assert_eq!(rfc3339_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn openai_and_azure_headers_give_whats_left_and_the_refusal() {
        let now = 1_000_000;
        let ok = word(
            200,
            &[
                ("x-ratelimit-limit-requests", "5000"),
                ("x-ratelimit-remaining-requests", "4999"),
                ("x-ratelimit-reset-requests", "12ms"),
                ("x-ratelimit-remaining-tokens", "159976"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ],
            now,
        );
        assert!(!ok.refused);
        assert_eq!(ok.left[0], Some(Left { remaining: 4999, reset_after_ms: 12 }));
        assert_eq!(ok.left[1], Some(Left { remaining: 159_976, reset_after_ms: 360_000 }));
        assert_eq!(ok.out_for_ms(1000), None, "room left: not out");
        let spent =
            word(429, &[("x-ratelimit-remaining-requests", "0"), ("x-ratelimit-reset-requests", "17.059s")], now);
        assert_eq!(spent.out_for_ms(1000), Some(17_059), "no retry-after: the spent quota's reset");
        let azure =
            word(429, &[("retry-after", "3"), ("retry-after-ms", "2500"), ("x-ratelimit-remaining-tokens", "-1")], now);
        assert_eq!((azure.retry_after_ms, azure.left[1]), (Some(2500), None), "ms first; -1 says nothing");
        assert_eq!(azure.out_for_ms(1000), Some(2500));
    }

    #[test]
    fn anthropic_headers_are_times_and_retry_after_seconds() {
        let now = 1_796_139_400_000; // 20 s before 2026-12-01T15:37:00Z
        let reply = word(
            429,
            &[
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("anthropic-ratelimit-requests-reset", "2026-12-01T15:37:00Z"),
                ("anthropic-ratelimit-input-tokens-remaining", "1200"),
                ("anthropic-ratelimit-input-tokens-reset", "2026-12-01T15:36:50Z"),
                ("retry-after", "20"),
            ],
            now,
        );
        assert_eq!(reply.left[0], Some(Left { remaining: 0, reset_after_ms: 20_000 }));
        assert_eq!(reply.left[2], Some(Left { remaining: 1200, reset_after_ms: 10_000 }));
        assert_eq!(reply.out_for_ms(1), Some(20_000));
        let past = word(
            200,
            &[
                ("anthropic-ratelimit-tokens-remaining", "5"),
                ("anthropic-ratelimit-tokens-reset", "2000-01-01T00:00:00Z"),
            ],
            now,
        );
        assert_eq!(past.left[1], Some(Left { remaining: 5, reset_after_ms: 0 }), "a reset already past");
    }

    /// docs/provider-limits.md: "a header value longer than 64 bytes is ignored … an error body is read
    /// up to 16 KiB": at the edges, one byte in and one byte over.
    #[test]
    fn header_values_and_error_bodies_are_read_up_to_their_bounds_exactly() {
        let padded = |len: usize| format!("{:0>len$}", "1500");
        let waits = |len: usize| word(429, &[("retry-after-ms", &padded(len))], 0).retry_after_ms;
        assert_eq!(waits(64), Some(1500), "64 bytes are read");
        assert_eq!(waits(65), None, "65 bytes are ignored");
        let json =
            r#"{"error": {"details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "2s"}]}}"#;
        let body = |len: usize| format!("{}{json}", " ".repeat(len - json.len())).into_bytes();
        assert_eq!(retry_info_ms(&body(16 * 1024)), Some(2000), "a body of 16 KiB is read whole");
        assert_eq!(retry_info_ms(&body(16 * 1024 + 1)), None, "one byte more: its end is not read");
    }

    #[test]
    fn google_retry_info_and_bedrock_throttling() {
        let body = br#"{"error": {"code": 429, "message": "Resource has been exhausted (e.g. check quota).",
            "status": "RESOURCE_EXHAUSTED", "details": [
              {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []},
              {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "13.5s"}]}}"#;
        assert_eq!(retry_info_ms(body), Some(13_500));
        assert_eq!(retry_info_ms(br#"{"error": {"details": [{"@type": "x", "retryDelay": "1s"}]}}"#), None);
        assert_eq!(retry_info_ms(b"not json"), None);
        let throttled = word(
            429,
            &[("x-amzn-errortype", "ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/")],
            0,
        );
        assert!(throttled.refused && throttled.retry_after_ms.is_none());
        assert_eq!(throttled.out_for_ms(1000), Some(1000), "no retry time: the default");
        let mid_stream = read_stream_exception("throttlingException").expect("a refusal");
        assert!(mid_stream.refused && mid_stream.out_for_ms(1000) == Some(1000), "no retry time: the default");
        assert_eq!(read_stream_exception("modelStreamErrorException"), None);
        let date = word(503, &[("retry-after", "Thu, 01 Jan 1970 00:00:30 GMT")], 10_000);
        assert!(!date.refused, "a 503 is not the provider's rate limit");
        let date = word(429, &[("retry-after", "Thu, 01 Jan 1970 00:00:30 GMT")], 10_000);
        assert_eq!(date.retry_after_ms, Some(20_000));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// Hostile header values never panic, and every figure read is bounded.
            #[test]
            fn any_header_values_read_bounded(values in proptest::collection::vec(any::<String>(), 16), status in 0u32..1000, now in any::<u64>()) {
                let names = [
                    "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens", "anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset",
                    "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset", "anthropic-ratelimit-input-tokens-remaining",
                    "anthropic-ratelimit-input-tokens-reset", "anthropic-ratelimit-output-tokens-remaining",
                    "anthropic-ratelimit-output-tokens-reset", "retry-after", "retry-after-ms", "x-amzn-errortype", "x",
                ];
                let mut header = |name: &str| names.iter().position(|n| *n == name).and_then(|i| values.get(i).cloned());
                let word = read_headers(status, &mut header, now);
                for left in word.left.iter().flatten() {
                    prop_assert!(left.reset_after_ms <= MAX_WAIT_MS);
                }
                prop_assert!(word.retry_after_ms.is_none_or(|ms| ms <= MAX_WAIT_MS));
                prop_assert!(word.out_for_ms(1000).is_none_or(|ms| ms <= MAX_WAIT_MS.max(1000)));
            }

            #[test]
            fn durations_and_times_never_panic(text in "[0-9hmsuµn.:TZ+-]{0,40}", any_text in any::<String>()) {
                for t in [&text, &any_text] {
                    prop_assert!(go_duration_ms(t).is_none_or(|ms| ms <= MAX_WAIT_MS));
                    let _ = rfc3339_ms(t);
                    let _ = http_date_ms(t);
                    let _ = retry_info_ms(t.as_bytes());
                }
            }

            /// Go's own printing of a whole number of milliseconds reads back exactly.
            #[test]
            fn go_printed_durations_round_trip(ms in 0u64..MAX_WAIT_MS) {
                let (h, m, s, milli) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
                let text = if ms < 1000 {
                    format!("{ms}ms")
                } else {
                    let seconds = if milli == 0 {
                        format!("{s}s")
                    } else {
                        format!("{}s", format!("{s}.{milli:03}").trim_end_matches('0'))
                    };
                    match (h, m) {
                        (0, 0) => seconds,
                        (0, m) => format!("{m}m{seconds}"),
                        (h, m) => format!("{h}h{m}m{seconds}"),
                    }
                };
                prop_assert_eq!(go_duration_ms(&text), Some(ms), "{}", text);
            }
        }
    }
}
