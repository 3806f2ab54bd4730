//! OpenAI's API, and every server that copies its paths (vLLM, Ollama, Groq...): chat
//! completions, the legacy completions, Responses and embeddings, on paths ending in
//! `/chat/completions`, `/completions`, `/responses` and `/embeddings` (any prefix). The
//! model is the body's `model`; the caller's key is a Bearer token.
//!
//! | API | prompt | output cap | completions |
//! |---|---|---|---|
//! | chat completions | `messages` (the cookbook's formula), `tools` | `max_completion_tokens`, else `max_tokens` | `n` |
//! | completions | `prompt` (text or token ids) | `max_tokens` | `n`, `best_of` |
//! | Responses | `instructions`, `input`, `tools` | `max_output_tokens` | one |
//! | embeddings | `input` | none (no output) | none |
//!
//! Usage: `usage.prompt_tokens`, `completion_tokens` and `prompt_tokens_details.cached_tokens`
//! (chat, completions, embeddings); Responses' `input_tokens` and `output_tokens` are the
//! names Anthropic's usage has, read by that one reading (`anthropic::usage`: with none of
//! Anthropic's cache fields, the figures themselves), its cached tokens here. Streams (SSE)
//! end with `data: [DONE]` (chat) or a `response.completed`, `.incomplete` or `.failed`
//! event (Responses); vLLM's `continuous_usage_stats` and Groq's `x_groq.usage` are read as
//! OpenAI's usage.

use super::{BodyShape, ErrorEnvelope, HeaderQuota, Provider, QuotaHeaders, RateLimitHeaders, ResetForm, Route};
use crate::api::identity::{CredentialPlace, BEARER};
use crate::api::prompt::{as_count, chat_messages, content, inputs, tools};
use crate::api::refusal::Refusal;
use crate::api::{Api, ReportedUsage};
use crate::parse::json::Json;
use serde_json::json;

/// Where OpenAI reads the caller's credential: a Bearer API key.
pub const CREDENTIALS: [CredentialPlace<'static>; 1] = [BEARER];

/// What a 401 tells OpenAI's callers (Azure's too, whose answers are OpenAI's shape) who sent no credential.
pub const MISSING_CREDENTIAL: &str =
    "No API key provided. Send it as 'Authorization: Bearer <key>' (Azure OpenAI: the 'api-key' header) or in \
     the header the operator configured.";

/// OpenAI's rate-limit headers (Azure OpenAI sends the same): `-requests`, `-tokens`
/// (the tightest token limit, whatever part of the tokens it counts), and the filter's own
/// `-concurrency` in the same style; resets as durations.
pub const RATE_LIMIT_HEADERS: RateLimitHeaders = RateLimitHeaders {
    quotas: &[
        QuotaHeaders {
            quota: HeaderQuota::Requests,
            limit: "x-ratelimit-limit-requests",
            remaining: "x-ratelimit-remaining-requests",
            reset: Some("x-ratelimit-reset-requests"),
        },
        QuotaHeaders {
            quota: HeaderQuota::AnyTokens,
            limit: "x-ratelimit-limit-tokens",
            remaining: "x-ratelimit-remaining-tokens",
            reset: Some("x-ratelimit-reset-tokens"),
        },
        QuotaHeaders {
            quota: HeaderQuota::Concurrency,
            limit: "x-ratelimit-limit-concurrency",
            remaining: "x-ratelimit-remaining-concurrency",
            reset: None,
        },
    ],
    reset: ResetForm::After,
};

/// The SSE data that ends a chat stream.
pub const DONE: &str = "[DONE]";

/// OpenAI's APIs by the path's last segments (`Api::from_path`); messages are
/// Anthropic's.
pub(super) fn route(path: &str) -> Option<Route> {
    let api = Api::from_path(path).filter(|&api| api != Api::Messages)?;
    Some(Route::of_api(Provider::OpenAi, api))
}

pub const CHAT_COMPLETIONS: BodyShape = BodyShape {
    max_output: |body| as_count(body.at("max_completion_tokens")).or_else(|| as_count(body.at("max_tokens"))),
    cap_field: chat_cap_field,
    choices: |body| as_count(body.at("n")),
    prompt: |body, count| chat_messages(body.at("messages"), count) + tools(body.at("tools"), count),
};

/// The field the client used, else the one the API documents (`max_completion_tokens`,
/// which reasoning models require).
fn chat_cap_field(body: Json) -> &'static [&'static str] {
    if body.get("max_tokens").is_some() && body.get("max_completion_tokens").is_none() {
        &["max_tokens"]
    } else {
        &["max_completion_tokens"]
    }
}

pub const COMPLETIONS: BodyShape = BodyShape {
    max_output: |body| as_count(body.at("max_tokens")),
    cap_field: |_| &["max_tokens"],
    // `best_of`: the candidates generated server-side.
    choices: |body| as_count(body.at("n")).max(as_count(body.at("best_of"))),
    prompt: |body, count| inputs(body.at("prompt"), count),
};

pub const RESPONSES: BodyShape = BodyShape {
    max_output: |body| as_count(body.at("max_output_tokens")),
    cap_field: |_| &["max_output_tokens"],
    choices: |_| None,
    prompt: |body, count| {
        content(body.at("instructions"), count) + content(body.at("input"), count) + tools(body.at("tools"), count)
    },
};

pub const EMBEDDINGS: BodyShape = BodyShape {
    max_output: |_| Some(0),
    cap_field: |_| &["max_tokens"],
    choices: |_| None,
    prompt: |body, count| inputs(body.at("input"), count),
};

/// OpenAI's own figures in a usage object: chat's `prompt_tokens` and `completion_tokens`,
/// and the cached prompt tokens (chat's `prompt_tokens_details`, Responses'
/// `input_tokens_details`).
pub(crate) fn usage(usage: Json) -> ReportedUsage {
    let cached_input = usage
        .at("prompt_tokens_details")
        .at("cached_tokens")
        .as_u64()
        .or_else(|| usage.at("input_tokens_details").at("cached_tokens").as_u64());
    ReportedUsage {
        input: usage.at("prompt_tokens").as_u64(),
        output: usage.at("completion_tokens").as_u64(),
        cached_input,
        reasoning: usage
            .at("completion_tokens_details")
            .at("reasoning_tokens")
            .as_u64()
            .or_else(|| usage.at("output_tokens_details").at("reasoning_tokens").as_u64()),
    }
}

/// Whether a usage object has a total: embeddings report their prompt and a total only,
/// so their output is zero, not unknown.
pub(crate) fn has_total(usage: Json) -> bool {
    usage.get("total_tokens").is_some()
}

/// Whether a streamed event of type `kind` ends a Responses stream.
pub(crate) fn ends_stream(kind: &str) -> bool {
    matches!(kind, "response.completed" | "response.incomplete" | "response.failed")
}

/// The generated text of one streamed chat or completions chunk: deltas' content,
/// refusals, reasoning and tool calls, and legacy completions' `text`.
pub(crate) fn chat_texts(message: Json, text: &mut impl FnMut(Option<&str>)) {
    let Some(choices) = message.at("choices").as_array() else { return };
    for choice in choices {
        let delta = &choice.at("delta");
        for part in [
            &delta.at("content"),
            &delta.at("refusal"),
            &delta.at("reasoning_content"),
            // Ollama's and Groq's name for a reasoning model's thinking.
            &delta.at("reasoning"),
            &choice.at("text"),
        ] {
            text(part.as_str());
        }
        for call in delta.at("tool_calls").as_array().into_iter().flatten() {
            text(call.at("function").at("arguments").as_str());
            text(call.at("function").at("name").as_str());
        }
    }
}

/// The generated text of one streamed Responses event of type `kind`: its text and
/// argument deltas.
pub(crate) fn responses_texts(message: Json, kind: Option<&str>, text: &mut impl FnMut(Option<&str>)) {
    if kind.is_some_and(|kind| kind.starts_with("response.") && kind.ends_with(".delta")) {
        text(message.at("delta").as_str());
    }
}

/// OpenAI's error: `{"error": {"message", "type", "param": null, "code"}}`.
pub(super) fn error_envelope(refusal: Refusal, message: &str) -> ErrorEnvelope {
    let (kind, code) = error_codes(refusal);
    ErrorEnvelope::body(json!({"error": {"message": message, "type": kind, "param": null, "code": code}}))
}

/// OpenAI's `error.type` and `error.code`.
fn error_codes(refusal: Refusal) -> (&'static str, &'static str) {
    match refusal {
        // A request larger than a limit: OpenAI's own answer to one larger than its
        // tokens-per-minute limit ("Request too large for ... on tokens per min") is this
        // same 429; what fixes it is a smaller request, not the billing page.
        Refusal::RateLimited(kind) | Refusal::NeverFits(kind) => (kind, "rate_limit_exceeded"),
        // OpenAI's own for a spent quota (a 429 its SDK raises as `RateLimitError`, with
        // this `code`): "You exceeded your current quota, please check your plan and
        // billing details".
        Refusal::QuotaSpent { .. } => ("insufficient_quota", "insufficient_quota"),
        Refusal::TooLarge => ("invalid_request_error", "request_too_large"),
        Refusal::Unavailable => ("server_error", "rate_limiter_unavailable"),
        Refusal::Unidentified => ("invalid_request_error", "missing_api_key"),
        Refusal::NotPriced => ("invalid_request_error", "model_not_priced"),
        // OpenAI's own for a key or organisation it has deactivated is a 401/403
        // `permission_error`-like refusal; here the operator suspended the caller.
        Refusal::Suspended => ("permission_error", "account_suspended"),
        Refusal::Unreadable(code) => ("invalid_request_error", code),
    }
}
