//! The least a reply is charged when the filter could not read what it cost: a tenant who
//! hides a reply's usage (a compressed body, a reset before the usage object, a stream of
//! hidden reasoning with no usage chunk) pays at least what it reserved, never a guess.
//!
//! Pure: the lifecycle says what it saw of the reply ([`ReplySight`]), this module says
//! whether the reservation is the floor, and whether the reply may teach the running
//! averages (a reply the filter could not read teaches nothing).

use crate::accounting::reservation::{Ending, TokenCounts};
use crate::tokens::glob_match;
use serde::{Deserialize, Serialize};

/// What a client that leaves before the reply's headers arrive is charged (the upstream
/// may be generating all the while, and the provider bills it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientAbortCharge {
    /// The whole reservation stands.
    #[default]
    Reservation,
    /// The prompt only: what the upstream generates for a client who left goes unpaid.
    PromptOnlyUnpaidOutput,
}

/// The models that can spend output tokens the client never sees (reasoning), by
/// `tokens.hidden_output_models`' default: a stream of theirs that ends without reported
/// usage is charged at least its reservation, since the visible text says nothing of
/// what they spent.
pub const DEFAULT_HIDDEN_OUTPUT_MODELS: [&str; 13] = [
    "o1*",
    "o3*",
    "o4*",
    "gpt-5*",
    "gpt-oss*",
    "gemini-2.5*",
    "gemini-3*",
    "claude-3-7*",
    "claude-opus-4*",
    "claude-sonnet-4*",
    "*thinking*",
    "*reasoner*",
    "*deepseek-r1*",
];
/// Bounds on `tokens.hidden_output_models`, so matching stays cheap per request.
pub const MAX_HIDDEN_OUTPUT_MODELS: usize = 64;
pub const MAX_MODEL_PATTERN_LEN: usize = 128;

/// Content codings the filter reads a reply in: none.
pub fn readable_encoding(content_encoding: Option<&str>) -> bool {
    content_encoding.is_none_or(|coding| {
        let coding = coding.trim();
        coding.is_empty() || coding.eq_ignore_ascii_case("identity")
    })
}

/// What the filter saw of one reply, for its settlement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplySight {
    /// The response headers arrived: the upstream was generating.
    pub started: bool,
    /// The reply's content coding is one the filter cannot read.
    pub unreadable: bool,
    /// The reply was a stream and reported no usage.
    pub stream_without_usage: bool,
    /// The request's model can spend tokens the client does not see.
    pub hidden_output_model: bool,
}

/// Why a reply is charged at least its reservation; `None`: charged what it reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// Its content coding hides its usage.
    Unreadable,
    /// It was cut off (the client or the upstream went away) after its headers.
    Cut,
    /// The client left before the reply started, while the upstream worked.
    LeftEarly,
    /// A stream of a model with hidden output ended without usage.
    HiddenOutput,
}

/// Whether the reservation is the least this reply is charged, and why. Upstream errors
/// keep `tokens.on_upstream_error`; a request that never went upstream costs nothing
/// (the caller does not ask).
pub fn floor(ending: Ending, sight: ReplySight, on_client_abort: ClientAbortCharge) -> Option<Floor> {
    match ending {
        Ending::UpstreamError => None,
        _ if sight.unreadable => Some(Floor::Unreadable),
        Ending::Interrupted if sight.started => Some(Floor::Cut),
        Ending::Interrupted => (on_client_abort == ClientAbortCharge::Reservation).then_some(Floor::LeftEarly),
        // The provider cut it and said why: nothing was generated past what it sent.
        Ending::Throttled => None,
        Ending::Completed => (sight.stream_without_usage && sight.hidden_output_model).then_some(Floor::HiddenOutput),
    }
}

/// `used`, raised part by part to what was reserved: a limit that counts only the input
/// or only the output is held to its own reservation too.
pub fn at_least_reserved(estimate: TokenCounts, used: TokenCounts) -> TokenCounts {
    TokenCounts { prompt: used.prompt.max(estimate.prompt), output: used.output.max(estimate.output) }
}

/// The output tokens a non-streamed reply cut before its usage object is charged at
/// least: as many as the bytes of text that already passed to the client (a token is at
/// least a byte; the stream readers count their text instead), but no more than the
/// request asked for at most (`asked`: its output cap times its choices), which the
/// provider honours. The bound is the most that text can cost, not a guess at it.
pub fn passed_output(text_bytes: u64, asked: Option<u64>) -> u64 {
    asked.map_or(text_bytes, |most| text_bytes.min(most))
}

/// Whether `model` can spend tokens the client does not see, by the configured patterns.
pub fn hides_output(patterns: &[String], model: &str) -> bool {
    patterns.iter().any(|pattern| glob_match(pattern, model))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EST: TokenCounts = TokenCounts { prompt: 100, output: 500 };

    #[test]
    fn each_blind_ending_has_the_reservation_for_floor() {
        use ClientAbortCharge::*;
        use Ending::*;
        let started = ReplySight { started: true, ..ReplySight::default() };
        let encoded = ReplySight { unreadable: true, ..started };
        let hidden = ReplySight { stream_without_usage: true, hidden_output_model: true, ..started };
        let visible = ReplySight { stream_without_usage: true, ..started };
        let cases = [
            (Completed, started, Reservation, None),
            (Completed, encoded, Reservation, Some(Floor::Unreadable)),
            (Interrupted, encoded, Reservation, Some(Floor::Unreadable)),
            (UpstreamError, encoded, Reservation, None),
            (Interrupted, started, Reservation, Some(Floor::Cut)),
            (Interrupted, started, PromptOnlyUnpaidOutput, Some(Floor::Cut)),
            (Interrupted, ReplySight::default(), Reservation, Some(Floor::LeftEarly)),
            (Interrupted, ReplySight::default(), PromptOnlyUnpaidOutput, None),
            (Completed, hidden, Reservation, Some(Floor::HiddenOutput)),
            (Completed, visible, Reservation, None),
            (UpstreamError, started, Reservation, None),
        ];
        for (ending, sight, abort, expected) in cases {
            assert_eq!(floor(ending, sight, abort), expected, "{ending:?} {sight:?} {abort:?}");
        }
    }

    #[test]
    fn the_floor_holds_each_part_and_keeps_what_is_more() {
        let counted = TokenCounts { prompt: 90, output: 7 };
        assert_eq!(at_least_reserved(EST, counted), EST);
        let long = TokenCounts { prompt: 90, output: 6_000_000 };
        assert_eq!(at_least_reserved(EST, long), TokenCounts { prompt: 100, output: 6_000_000 });
    }

    #[test]
    fn a_cut_reply_is_charged_the_text_that_passed_up_to_what_was_asked() {
        assert_eq!(passed_output(262_144, None), 262_144);
        assert_eq!(passed_output(262_144, Some(4_000)), 4_000);
        assert_eq!(passed_output(120, Some(4_000)), 120);
    }

    #[test]
    fn only_identity_is_readable() {
        for readable in [None, Some(""), Some("identity"), Some(" Identity ")] {
            assert!(readable_encoding(readable), "{readable:?}");
        }
        for unreadable in [Some("gzip"), Some("br"), Some("deflate"), Some("zstd"), Some("gzip, identity")] {
            assert!(!readable_encoding(unreadable), "{unreadable:?}");
        }
    }

    #[test]
    fn the_default_patterns_name_the_reasoning_families() {
        let patterns: Vec<String> = DEFAULT_HIDDEN_OUTPUT_MODELS.iter().map(|p| p.to_string()).collect();
        for model in ["o1-mini", "o3", "o4-mini", "gpt-5", "gpt-5-mini", "gemini-2.5-pro", "claude-sonnet-4-5"] {
            assert!(hides_output(&patterns, model), "{model}");
        }
        for model in ["gpt-4o", "gpt-4.1-mini", "gemini-2.0-flash", "claude-3-5-haiku", "text-embedding-3-small"] {
            assert!(!hides_output(&patterns, model), "{model}");
        }
    }
}

#[cfg(test)]
#[path = "reply_floor_tests.rs"]
mod lifecycle_tests;
