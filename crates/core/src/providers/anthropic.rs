//! Anthropic's messages API: paths ending in `/messages` (any prefix; not OpenAI's
//! `/threads/messages`), the model in the body's `model`. The caller's credential is its
//! API key in `x-api-key`, or an OAuth token as Bearer.
//!
//! The prompt is `system`, `messages` (counted by OpenAI's message formula, there being
//! none published for Anthropic's) and `tools`; the output cap is `max_tokens`; one
//! completion a request. Usage: `usage.input_tokens` plus the prompt-cache writes and reads
//! (`cache_creation_input_tokens`, `cache_read_input_tokens`, billed as input too),
//! `usage.output_tokens`; streamed, `message_start` carries it in `message.usage` and each
//! `message_delta` its running total, and `message_stop` ends the stream. Bedrock's
//! invoke operations carry the same bodies and events.

use super::{BodyShape, ErrorEnvelope, HeaderQuota, Provider, QuotaHeaders, RateLimitHeaders, ResetForm, Route};
use crate::api::identity::{CredentialPlace, BEARER};
use crate::api::prompt::{as_count, chat_messages, content, tools};
use crate::api::refusal::Refusal;
use crate::api::{Api, ReportedUsage};
use crate::parse::json::Json;
use serde_json::json;

/// Where Anthropic reads the caller's credential: its API key, or an OAuth token as Bearer.
pub const CREDENTIALS: [CredentialPlace<'static>; 2] =
    [CredentialPlace::Header { name: "x-api-key", prefix: None }, BEARER];

/// What a 401 tells Anthropic's callers who sent no credential.
pub const MISSING_CREDENTIAL: &str =
    "No API key provided. Send it in the 'x-api-key' header or in the header the operator configured.";

/// A messages path.
pub(super) fn route(path: &str) -> Option<Route> {
    let api = Api::from_path(path).filter(|&api| api == Api::Messages)?;
    Some(Route::of_api(Provider::Anthropic, api))
}

/// Anthropic's `anthropic-ratelimit-*` headers: `requests`; `tokens` (limits counting
/// input and output together); `input-tokens` and `output-tokens` (limits counting one
/// side). Resets are the instant the quota is full again.
pub const RATE_LIMIT_HEADERS: RateLimitHeaders = RateLimitHeaders {
    quotas: &[
        QuotaHeaders {
            quota: HeaderQuota::Requests,
            limit: "anthropic-ratelimit-requests-limit",
            remaining: "anthropic-ratelimit-requests-remaining",
            reset: Some("anthropic-ratelimit-requests-reset"),
        },
        QuotaHeaders {
            quota: HeaderQuota::TotalTokens,
            limit: "anthropic-ratelimit-tokens-limit",
            remaining: "anthropic-ratelimit-tokens-remaining",
            reset: Some("anthropic-ratelimit-tokens-reset"),
        },
        QuotaHeaders {
            quota: HeaderQuota::InputTokens,
            limit: "anthropic-ratelimit-input-tokens-limit",
            remaining: "anthropic-ratelimit-input-tokens-remaining",
            reset: Some("anthropic-ratelimit-input-tokens-reset"),
        },
        QuotaHeaders {
            quota: HeaderQuota::OutputTokens,
            limit: "anthropic-ratelimit-output-tokens-limit",
            remaining: "anthropic-ratelimit-output-tokens-remaining",
            reset: Some("anthropic-ratelimit-output-tokens-reset"),
        },
    ],
    reset: ResetForm::At,
};

pub const MESSAGES: BodyShape = BodyShape {
    max_output: |body| as_count(body.at("max_tokens")),
    cap_field: |_| &["max_tokens"],
    choices: |_| None,
    prompt: |body, count| {
        content(body.at("system"), count) + chat_messages(body.at("messages"), count) + tools(body.at("tools"), count)
    },
};

/// Anthropic's figures in a usage object (Responses' `input_tokens` and `output_tokens`
/// are named alike, with no cache fields).
pub(crate) fn usage(usage: Json) -> ReportedUsage {
    let field = |name: &str| usage.at(name).as_u64();
    let input = field("input_tokens").map(|base| {
        let cache_parts = [field("cache_creation_input_tokens"), field("cache_read_input_tokens")];
        cache_parts.into_iter().flatten().fold(base, u64::saturating_add)
    });
    ReportedUsage {
        input,
        output: field("output_tokens"),
        cached_input: field("cache_read_input_tokens"),
        reasoning: None,
    }
}

/// Whether a streamed event of type `kind` ends the stream.
pub(crate) fn ends_stream(kind: &str) -> bool {
    kind == "message_stop"
}

/// The generated text of one streamed event of type `kind`: text, tool-input and thinking
/// deltas.
pub(crate) fn streamed_texts(message: Json, kind: Option<&str>, text: &mut impl FnMut(Option<&str>)) {
    if kind == Some("content_block_delta") {
        let delta = &message.at("delta");
        text(delta.at("text").as_str().or(delta.at("partial_json").as_str()).or(delta.at("thinking").as_str()));
    }
}

/// Anthropic's error: `{"type": "error", "error": {"type", "message"}}`, with its
/// documented error types.
pub(super) fn error_envelope(refusal: Refusal, message: &str) -> ErrorEnvelope {
    ErrorEnvelope::body(json!({"type": "error", "error": {"type": error_type(refusal), "message": message}}))
}

/// Anthropic's `error.type` (docs.claude.com, "Errors"). Anthropic answers overload
/// with 529 `overloaded_error`; the filter's 503 says the same: retry shortly.
fn error_type(refusal: Refusal) -> &'static str {
    match refusal {
        Refusal::RateLimited(_) | Refusal::NeverFits(_) => "rate_limit_error",
        // Anthropic's error for a spent balance or billing limit (its own status is 402,
        // "an issue with your billing"): the counterpart of OpenAI's `insufficient_quota`.
        // Its SDK picks the exception class by status (429: `RateLimitError`, 403:
        // `PermissionDeniedError`), and a program reads this type to tell it apart.
        Refusal::QuotaSpent { .. } => "billing_error",
        Refusal::TooLarge => "request_too_large",
        Refusal::Unavailable => "overloaded_error",
        Refusal::Unidentified => "authentication_error",
        Refusal::NotPriced | Refusal::Suspended => "permission_error",
        Refusal::Unreadable(_) => "invalid_request_error",
    }
}
