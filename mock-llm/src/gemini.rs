//! Google's Gemini API and Vertex AI as they answer `…/models/{model}:{method}`:
//!
//! - `generateContent`: a `GenerateContentResponse` JSON (`candidates[].content.parts[]
//!   .text`, `finishReason`, `usageMetadata`, `modelVersion`, `responseId`);
//! - `streamGenerateContent?alt=sse`: one response per `data:` event (CRLF-terminated, as
//!   Google sends them), each with the usage so far (cumulative), the last with the
//!   `finishReason` and the whole usage;
//! - `streamGenerateContent` without `alt=sse`: the same responses as one pretty-printed
//!   JSON array (`[{…}\r\n,\r\n{…}]`), sent a response at a time;
//! - `countTokens`: `{"totalTokens": n}`.
//!
//! Controls besides the common ones (see main.rs): `x-mock-thoughts-tokens` reports that
//! many thinking tokens (`thoughtsTokenCount`, billed as output), `x-mock-cached-tokens`
//! that many `cachedContentTokenCount`, and `x-mock-chunk-bytes: n` cuts a streamed body
//! into pieces of n bytes instead of a response a piece. `x-mock-completion-tokens` on the
//! reply is the billed output: candidates plus thoughts.

use super::credentials;
use super::{completion_text, forced_error, header_u64, json_response, pause, streamed, with_usage, Mock, Plan};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::Response;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Google's error body (`google.rpc.Status`).
fn google_error(status: StatusCode, message: &str) -> Response {
    let name = match status.as_u16() {
        400 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        429 => "RESOURCE_EXHAUSTED",
        503 => "UNAVAILABLE",
        500 => "INTERNAL",
        _ => "UNKNOWN",
    };
    json_response(status, &json!({"error": {"code": status.as_u16(), "message": message, "status": name}}))
}

/// Vertex AI's `…/publishers/google/models/{model}:{method}`.
pub async fn vertex(
    mock: State<Arc<Mock>>,
    Path((_project, _location, rest)): Path<(String, String, String)>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(mock, credentials::Api::Vertex, rest, uri, headers, body).await
}

/// The Generative Language API's `/v1beta/models/{model}:{method}`.
pub async fn models(
    mock: State<Arc<Mock>>,
    Path(rest): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(mock, credentials::Api::Gemini, rest, uri, headers, body).await
}

/// `rest` is the path after `models/`: `{model}:{method}`.
async fn answer(
    State(mock): State<Arc<Mock>>,
    api: credentials::Api,
    rest: String,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    mock.received.fetch_add(1, Ordering::Relaxed);
    match credentials::authenticate(api, &headers, &uri, mock.args.accept_anonymous) {
        Ok(fingerprint) => credentials::billed_to(generate(&mock, rest, uri, headers, body).await, &fingerprint),
        Err(refusal) => *refusal,
    }
}

async fn generate(mock: &Mock, rest: String, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let Some((model, method)) = rest.rsplit_once(':') else {
        return google_error(StatusCode::NOT_FOUND, "Method not found.");
    };
    let request: Value = match serde_json::from_slice(&body) {
        Ok(value @ Value::Object(_)) => value,
        _ => return google_error(StatusCode::BAD_REQUEST, "Invalid JSON payload received."),
    };
    if !request["contents"].is_array() {
        return google_error(StatusCode::BAD_REQUEST, "* GenerateContentRequest.contents: contents is not specified");
    }
    if let Some(status) = forced_error(&headers) {
        return google_error(status, "The mock was asked to fail this request.");
    }
    // The common plan reads OpenAI's field names: give it the prompt's text where it looks.
    let as_chat = json!({"model": model, "messages": request["contents"], "system": request["systemInstruction"]});
    let max_tokens = request["generationConfig"]["maxOutputTokens"].as_u64();
    let plan = mock.plan(&headers, &as_chat, body.len(), max_tokens);
    let reply = Reply {
        plan,
        thoughts: header_u64(&headers, "x-mock-thoughts-tokens").unwrap_or(0),
        cached: header_u64(&headers, "x-mock-cached-tokens").unwrap_or(0),
    };
    let sse = uri.query().is_some_and(|q| q.split('&').any(|pair| pair == "alt=sse"));
    let chunk_bytes = header_u64(&headers, "x-mock-chunk-bytes").filter(|&n| n > 0);
    match method {
        "generateContent" => {
            pause(reply.plan.first_delay).await;
            let whole = reply.response(
                &completion_text(reply.plan.completion_tokens).concat(),
                reply.plan.completion_tokens,
                true,
            );
            reply.with_usage(json_response(StatusCode::OK, &whole))
        }
        "streamGenerateContent" => {
            let words = completion_text(reply.plan.completion_tokens);
            let last = words.len().saturating_sub(1);
            let responses: Vec<Value> = if words.is_empty() {
                vec![reply.response("", 0, true)]
            } else {
                words.iter().enumerate().map(|(i, word)| reply.response(word, i as u64 + 1, i == last)).collect()
            };
            let pieces: Vec<String> = if sse {
                responses.iter().map(|r| format!("data: {r}\r\n\r\n")).collect()
            } else {
                let count = responses.len();
                responses
                    .iter()
                    .enumerate()
                    .map(|(i, r)| {
                        let pretty = serde_json::to_string_pretty(r).unwrap_or_default().replace('\n', "\r\n");
                        let open = if i == 0 { "[" } else { "\r\n,\r\n" };
                        let close = if i + 1 == count { "]" } else { "" };
                        format!("{open}{pretty}{close}")
                    })
                    .collect()
            };
            let content_type = if sse { "text/event-stream" } else { "application/json; charset=UTF-8" };
            reply.with_usage(streamed(
                pieces.into_iter().map(Bytes::from).collect(),
                chunk_bytes,
                content_type,
                reply.plan.first_delay,
                reply.plan.chunk_delay,
            ))
        }
        "countTokens" => json_response(StatusCode::OK, &json!({"totalTokens": reply.plan.prompt_tokens})),
        _ => google_error(StatusCode::NOT_FOUND, "Method not found."),
    }
}

struct Reply {
    plan: Plan,
    thoughts: u64,
    cached: u64,
}

impl Reply {
    /// One `GenerateContentResponse`: `text`, the usage after `generated` candidate
    /// tokens, and for the last one the finish reason and the thinking tokens.
    fn response(&self, text: &str, generated: u64, last: bool) -> Value {
        let plan = &self.plan;
        let thoughts = if last { self.thoughts } else { 0 };
        let mut usage = json!({
            "promptTokenCount": plan.prompt_tokens,
            "candidatesTokenCount": generated,
            "totalTokenCount": plan.prompt_tokens + generated + thoughts,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": plan.prompt_tokens}],
        });
        if thoughts > 0 {
            usage["thoughtsTokenCount"] = json!(thoughts);
        }
        if self.cached > 0 {
            usage["cachedContentTokenCount"] = json!(self.cached);
            usage["cacheTokensDetails"] = json!([{"modality": "TEXT", "tokenCount": self.cached}]);
        }
        let mut candidate = json!({"content": {"parts": [{"text": text}], "role": "model"}, "index": 0});
        if last {
            candidate["finishReason"] = json!(if plan.truncated { "MAX_TOKENS" } else { "STOP" });
            usage["candidatesTokensDetails"] = json!([{"modality": "TEXT", "tokenCount": generated}]);
        }
        json!({
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": plan.model,
            "responseId": format!("mockresp{:012}", plan.id),
        })
    }

    /// The billed usage in the reply's headers: output is candidates plus thoughts.
    fn with_usage(&self, response: Response) -> Response {
        let mut response = with_usage(response, &self.plan);
        let billed = self.plan.completion_tokens + self.thoughts;
        if let Ok(value) = billed.to_string().parse() {
            response.headers_mut().insert("x-mock-completion-tokens", value);
        }
        response
    }
}
