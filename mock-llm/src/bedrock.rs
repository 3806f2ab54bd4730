//! AWS Bedrock Runtime, as the mock speaks it:
//!
//! - `POST /model/{modelId}/converse`: a `ConverseResponse` JSON (`output.message`,
//!   `stopReason`, `usage` with `inputTokens`, `outputTokens`, `totalTokens` and the cache
//!   fields, `metrics.latencyMs`);
//! - `POST /model/{modelId}/converse-stream`: an `application/vnd.amazon.eventstream`
//!   body of `messageStart`, one `contentBlockDelta` per token, `contentBlockStop`,
//!   `messageStop`, then `metadata` with `usage` and `metrics`;
//! - `POST /model/{modelId}/invoke` (Anthropic's models: an Anthropic messages body with
//!   `anthropic_version` and no `model`): Anthropic's `message` JSON, with Bedrock's
//!   `x-amzn-bedrock-*-token-count` headers;
//! - `POST /model/{modelId}/invoke-with-response-stream`: `chunk` events whose `bytes` is
//!   an Anthropic streaming event, base64-encoded; the last adds
//!   `amazon-bedrock-invocationMetrics`;
//! - invoke and invoke-with-response-stream for other models, by the family the model id
//!   names (`Family`): Amazon Titan's `inputText` (cap `textGenerationConfig.maxTokenCount`),
//!   Meta Llama's `prompt` (cap `max_gen_len`), Mistral's `prompt` (cap `max_tokens`),
//!   answered in that model's own JSON (Titan's `inputTextTokenCount` and `results`, Llama's
//!   `generation` and token counts, Mistral's `outputs`) and stream chunks, the last with
//!   `amazon-bedrock-invocationMetrics`.
//!
//! Every event-stream message carries `:event-type`, `:content-type` and `:message-type`
//! headers, CRCs as AWS computes them, and the random-length `p` padding field Bedrock
//! adds. Errors are Bedrock's: the type in `x-amzn-ErrorType`, `{"message": ...}`.
//!
//! Requests signed with SigV4 (`Authorization: AWS4-HMAC-SHA256 ...`) are verified with
//! the mock's secret (`--aws-secret-access-key`, the same for every access key id, so a
//! test makes tenants by varying the key id): a body or signed header changed on the way
//! (by the filter) fails as AWS fails it, `403 InvalidSignatureException`. Requests with a
//! Bedrock API key (`Authorization: Bearer`) are not signed and not checked.
//!
//! Per request, as for the other providers: `x-mock-completion-tokens`, the delays,
//! `x-mock-status`; and `x-mock-stream-exception: <type>` ends a stream after its first
//! token with an exception message of that type (e.g. `throttlingException`).

use crate::{completion_text, forced_error, pause, with_usage, Mock, Plan};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;

pub const EVENT_STREAM: &str = "application/vnd.amazon.eventstream";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Operation {
    Converse,
    ConverseStream,
    Invoke,
    InvokeStream,
}

impl Operation {
    fn from_path(name: &str) -> Option<Operation> {
        Some(match name {
            "converse" => Operation::Converse,
            "converse-stream" => Operation::ConverseStream,
            "invoke" => Operation::Invoke,
            "invoke-with-response-stream" => Operation::InvokeStream,
            _ => return None,
        })
    }
}

/// Whose body an invoke carries, by the model id: Anthropic's messages, or another
/// provider's own body, which Bedrock passes to the model as it is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    Anthropic,
    Titan,
    Llama,
    Mistral,
}

impl Family {
    fn of(model: &str) -> Family {
        if model.contains("amazon.titan-text") {
            Family::Titan
        } else if model.contains("meta.llama") {
            Family::Llama
        } else if model.contains("mistral.") {
            Family::Mistral
        } else {
            Family::Anthropic
        }
    }

    /// The field holding the prompt's text (Anthropic's: its messages).
    fn prompt_field(self) -> &'static str {
        match self {
            Family::Titan => "inputText",
            Family::Anthropic => "messages",
            Family::Llama | Family::Mistral => "prompt",
        }
    }

    fn max_tokens(self, request: &Value) -> Option<u64> {
        match self {
            Family::Anthropic | Family::Mistral => request["max_tokens"].as_u64(),
            Family::Titan => request["textGenerationConfig"]["maxTokenCount"].as_u64(),
            Family::Llama => request["max_gen_len"].as_u64(),
        }
    }
}

/// Bedrock's error: the type in `x-amzn-ErrorType` (where boto3 reads the code), the
/// text in `message`.
fn error(status: StatusCode, error_type: &str, message: &str) -> Response {
    (
        status,
        [("content-type", "application/json"), ("x-amzn-errortype", error_type), ("x-amzn-requestid", "mock-request")],
        json!({ "message": message }).to_string(),
    )
        .into_response()
}

fn error_type_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        429 => "ThrottlingException",
        403 => "AccessDeniedException",
        404 => "ResourceNotFoundException",
        408 => "ModelTimeoutException",
        424 => "ModelErrorException",
        503 => "ServiceUnavailableException",
        500..=599 => "InternalServerException",
        _ => "ValidationException",
    }
}

/// `POST /model/{modelId}/{operation}`.
pub async fn handle(
    State(mock): State<Arc<Mock>>,
    Path((model, operation)): Path<(String, String)>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(operation) = Operation::from_path(&operation) else {
        return error(StatusCode::NOT_FOUND, "UnknownOperationException", "The operation is not known.");
    };
    mock.received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Err((error_type, message)) =
        verify_signature(&mock.args.aws_secret_access_key, &method, &uri, &headers, &body)
    {
        return error(StatusCode::FORBIDDEN, error_type, message);
    }
    let request: Value = match serde_json::from_slice(&body) {
        Ok(value @ Value::Object(_)) => value,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "ValidationException",
                "Malformed input request, please reformat your input and try again.",
            )
        }
    };
    let invoke = matches!(operation, Operation::Invoke | Operation::InvokeStream);
    let family = if invoke { Family::of(&model) } else { Family::Anthropic };
    if invoke
        && family == Family::Anthropic
        && (request.get("model").is_some() || !request["anthropic_version"].is_string())
    {
        return error(StatusCode::BAD_REQUEST, "ValidationException", "Malformed input request: #: required key [anthropic_version] not found, or extraneous key [model] is not permitted, please reformat your input and try again.");
    }
    let field = family.prompt_field();
    let has_prompt = if family == Family::Anthropic { request[field].is_array() } else { request[field].is_string() };
    if !has_prompt {
        return error(
            StatusCode::BAD_REQUEST,
            "ValidationException",
            &format!("Malformed input request: #: required key [{field}] not found, please reformat your input and try again."),
        );
    }
    if let Some(status) = forced_error(&headers) {
        return error(status, error_type_of(status), "The mock was asked to fail this request.");
    }
    let max_tokens =
        if invoke { family.max_tokens(&request) } else { request["inferenceConfig"]["maxTokens"].as_u64() };
    // Another family's prompt is one text: counted as one message's would be.
    let counted = if family == Family::Anthropic { request.clone() } else { json!({"messages": [request[field]]}) };
    let mut plan = mock.plan(&headers, &counted, body.len(), max_tokens);
    plan.model = model;
    let exception = headers.get("x-mock-stream-exception").and_then(|v| v.to_str().ok()).map(str::to_string);
    let response = match operation {
        Operation::Converse => {
            pause(plan.first_delay).await;
            converse_reply(&plan)
        }
        Operation::ConverseStream => paced(converse_events(&plan, exception.as_deref()), &plan),
        Operation::Invoke => {
            pause(plan.first_delay).await;
            invoke_reply(&plan, family)
        }
        Operation::InvokeStream if family == Family::Anthropic => {
            paced(invoke_events(&plan, exception.as_deref()), &plan)
        }
        Operation::InvokeStream => paced(other_invoke_events(family, &plan, exception.as_deref()), &plan),
    };
    with_usage(response, &plan)
}

/// Converse and Anthropic's messages name their stop reasons alike.
fn stop_reason(plan: &Plan) -> &'static str {
    if plan.truncated {
        "max_tokens"
    } else {
        "end_turn"
    }
}

fn converse_usage(plan: &Plan) -> Value {
    json!({"inputTokens": plan.prompt_tokens, "outputTokens": plan.completion_tokens,
           "totalTokens": plan.prompt_tokens + plan.completion_tokens,
           "cacheReadInputTokens": 0, "cacheWriteInputTokens": 0})
}

fn converse_reply(plan: &Plan) -> Response {
    let body = json!({
        "output": {"message": {"role": "assistant", "content": [{"text": completion_text(plan.completion_tokens).concat()}]}},
        "stopReason": stop_reason(plan),
        "usage": converse_usage(plan),
        "metrics": {"latencyMs": 1}
    });
    (StatusCode::OK, [("content-type", "application/json"), ("x-amzn-requestid", "mock-request")], body.to_string())
        .into_response()
}

fn anthropic_usage(plan: &Plan, output: u64) -> Value {
    json!({"input_tokens": plan.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": output})
}

/// The stop reason as each other family spells it: Titan's `completionReason`, Llama's
/// and Mistral's `stop_reason`.
fn other_stop_reason(family: Family, plan: &Plan) -> &'static str {
    match (family, plan.truncated) {
        (Family::Titan, true) => "LENGTH",
        (Family::Titan, false) => "FINISHED",
        (_, true) => "length",
        (_, false) => "stop",
    }
}

fn invoke_reply(plan: &Plan, family: Family) -> Response {
    let text = completion_text(plan.completion_tokens).concat();
    let (prompt, completion) = (plan.prompt_tokens, plan.completion_tokens);
    let body = match family {
        Family::Anthropic => json!({
            "id": format!("msg_bdrk_mock{:012}", plan.id), "type": "message", "role": "assistant", "model": plan.model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": stop_reason(plan), "stop_sequence": null,
            "usage": anthropic_usage(plan, plan.completion_tokens)
        }),
        Family::Titan => json!({"inputTextTokenCount": prompt, "results": [
            {"tokenCount": completion, "outputText": text, "completionReason": other_stop_reason(family, plan)}]}),
        Family::Llama => json!({"generation": text, "prompt_token_count": prompt,
            "generation_token_count": completion, "stop_reason": other_stop_reason(family, plan)}),
        Family::Mistral => json!({"outputs": [{"text": text, "stop_reason": other_stop_reason(family, plan)}]}),
    };
    let mut response = (
        StatusCode::OK,
        [("content-type", "application/json"), ("x-amzn-requestid", "mock-request")],
        body.to_string(),
    )
        .into_response();
    let headers = response.headers_mut();
    for (name, value) in [
        ("x-amzn-bedrock-input-token-count", plan.prompt_tokens),
        ("x-amzn-bedrock-output-token-count", plan.completion_tokens),
        ("x-amzn-bedrock-invocation-latency", 1),
    ] {
        if let Ok(value) = value.to_string().parse() {
            headers.insert(name, value);
        }
    }
    response
}

/// One event-stream message: prelude (total and headers length), its CRC, string headers,
/// the payload, the message CRC; CRC32 with the IEEE polynomial, big-endian.
fn frame(headers: &[(&str, &str)], payload: &[u8]) -> Bytes {
    let mut section = Vec::new();
    for (name, value) in headers {
        section.push(name.len() as u8);
        section.extend_from_slice(name.as_bytes());
        section.push(7); // string
        section.extend_from_slice(&(value.len() as u16).to_be_bytes());
        section.extend_from_slice(value.as_bytes());
    }
    let total = 16 + section.len() + payload.len();
    let mut message = Vec::with_capacity(total);
    message.extend_from_slice(&(total as u32).to_be_bytes());
    message.extend_from_slice(&(section.len() as u32).to_be_bytes());
    let prelude_crc = crc32fast::hash(&message);
    message.extend_from_slice(&prelude_crc.to_be_bytes());
    message.extend_from_slice(&section);
    message.extend_from_slice(payload);
    let crc = crc32fast::hash(&message);
    message.extend_from_slice(&crc.to_be_bytes());
    Bytes::from(message)
}

/// Bedrock pads each event's JSON with `p`, of varying length, against length analysis.
fn padded(mut payload: Value, n: usize) -> Vec<u8> {
    const PADDING: &str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    payload["p"] = Value::from(&PADDING[..(n * 7) % PADDING.len() + 1]);
    payload.to_string().into_bytes()
}

fn event(kind: &str, payload: Value, n: usize) -> Bytes {
    frame(
        &[(":event-type", kind), (":content-type", "application/json"), (":message-type", "event")],
        &padded(payload, n),
    )
}

fn exception(kind: &str) -> Bytes {
    let message = json!({"message": "The mock was asked to fail this stream."}).to_string();
    frame(
        &[(":exception-type", kind), (":content-type", "application/json"), (":message-type", "exception")],
        message.as_bytes(),
    )
}

fn converse_events(plan: &Plan, exception_type: Option<&str>) -> Vec<Bytes> {
    let mut events = vec![event("messageStart", json!({"role": "assistant"}), 0)];
    for (i, word) in completion_text(plan.completion_tokens).into_iter().enumerate() {
        events.push(event("contentBlockDelta", json!({"contentBlockIndex": 0, "delta": {"text": word}}), i + 1));
        if let Some(kind) = exception_type {
            events.push(exception(kind));
            return events;
        }
    }
    events.push(event("contentBlockStop", json!({"contentBlockIndex": 0}), 2));
    events.push(event("messageStop", json!({"stopReason": stop_reason(plan)}), 3));
    events.push(event("metadata", json!({"usage": converse_usage(plan), "metrics": {"latencyMs": 1}}), 4));
    events
}

fn chunk(anthropic_event: Value, n: usize) -> Bytes {
    let bytes = base64::engine::general_purpose::STANDARD.encode(anthropic_event.to_string());
    event("chunk", json!({ "bytes": bytes }), n)
}

fn invoke_events(plan: &Plan, exception_type: Option<&str>) -> Vec<Bytes> {
    let mut events = vec![
        chunk(
            json!({"type": "message_start", "message": {
            "id": format!("msg_bdrk_mock{:012}", plan.id), "type": "message", "role": "assistant", "model": plan.model,
            "content": [], "stop_reason": null, "stop_sequence": null, "usage": anthropic_usage(plan, 1)}}),
            0,
        ),
        chunk(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}), 1),
    ];
    for (i, word) in completion_text(plan.completion_tokens).into_iter().enumerate() {
        events.push(chunk(
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}}),
            i + 2,
        ));
        if let Some(kind) = exception_type {
            events.push(exception(kind));
            return events;
        }
    }
    events.push(chunk(json!({"type": "content_block_stop", "index": 0}), 3));
    events.push(chunk(json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(plan), "stop_sequence": null}, "usage": {"output_tokens": plan.completion_tokens}}), 4));
    events.push(chunk(
        json!({"type": "message_stop", "amazon-bedrock-invocationMetrics": {
        "inputTokenCount": plan.prompt_tokens, "outputTokenCount": plan.completion_tokens,
        "invocationLatency": 1, "firstByteLatency": 1}}),
        5,
    ));
    events
}

/// invoke-with-response-stream for another family: a chunk per token in the model's own
/// shape (`first` carries the prompt's count where the model reports it), then a last
/// chunk with the stop reason and `amazon-bedrock-invocationMetrics`.
fn other_invoke_events(family: Family, plan: &Plan, exception_type: Option<&str>) -> Vec<Bytes> {
    let piece = |text: &str, generated: u64, stop: Option<&str>| match family {
        Family::Titan => json!({"outputText": text, "index": 0,
            "totalOutputTextTokenCount": stop.map(|_| plan.completion_tokens), "completionReason": stop,
            "inputTextTokenCount": (generated <= 1).then_some(plan.prompt_tokens)}),
        Family::Llama => json!({"generation": text,
            "prompt_token_count": (generated <= 1).then_some(plan.prompt_tokens),
            "generation_token_count": generated, "stop_reason": stop}),
        _ => json!({"outputs": [{"text": text, "stop_reason": stop}]}),
    };
    let mut events = Vec::new();
    for (i, word) in completion_text(plan.completion_tokens).into_iter().enumerate() {
        events.push(chunk(piece(word, i as u64 + 1, None), i));
        if let Some(kind) = exception_type {
            events.push(exception(kind));
            return events;
        }
    }
    let mut last = piece("", plan.completion_tokens, Some(other_stop_reason(family, plan)));
    last["amazon-bedrock-invocationMetrics"] = json!({"inputTokenCount": plan.prompt_tokens,
        "outputTokenCount": plan.completion_tokens, "invocationLatency": 1, "firstByteLatency": 1});
    events.push(chunk(last, events.len()));
    events
}

fn paced(events: Vec<Bytes>, plan: &Plan) -> Response {
    let mut response = crate::streamed(events, None, EVENT_STREAM, plan.first_delay, plan.chunk_delay);
    let headers = response.headers_mut();
    headers.insert("x-amzn-requestid", axum::http::HeaderValue::from_static("mock-request"));
    headers.insert("x-amzn-bedrock-content-type", axum::http::HeaderValue::from_static("application/json"));
    response
}

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks a SigV4 signature as AWS does for a service other than S3: the canonical
/// request (method, the path URI-encoded once more, the sorted query, the signed headers
/// with their values' whitespace folded, the signed header names, the body's SHA-256),
/// the string to sign over its hash with the date and scope, the key derived from the
/// secret through date, region, service and `aws4_request`.
fn verify_signature(
    secret: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(), (&'static str, &'static str)> {
    const MISMATCH: &str = "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.";
    let Some(authorization) = headers.get("authorization").and_then(|v| v.to_str().ok()) else {
        return Err(("UnrecognizedClientException", "The security token included in the request is invalid."));
    };
    let Some(parameters) = authorization.strip_prefix("AWS4-HMAC-SHA256 ") else {
        return Ok(()); // a Bedrock API key (bearer token): nothing signed
    };
    let field = |name: &str| parameters.split(',').find_map(|p| p.trim().strip_prefix(name)).map(str::trim);
    let (Some(credential), Some(signed_headers), Some(signature)) =
        (field("Credential="), field("SignedHeaders="), field("Signature="))
    else {
        return Err((
            "IncompleteSignatureException",
            "Authorization header requires Credential, SignedHeaders and Signature.",
        ));
    };
    let Some((_, scope)) = credential.split_once('/') else {
        return Err(("IncompleteSignatureException", "Credential should be scoped to a valid region."));
    };
    let scope_parts: Vec<&str> = scope.split('/').collect();
    let [date, region, service, "aws4_request"] = scope_parts[..] else {
        return Err(("IncompleteSignatureException", "Credential should be scoped correctly."));
    };
    let Some(timestamp) = headers.get("x-amz-date").and_then(|v| v.to_str().ok()) else {
        return Err((
            "IncompleteSignatureException",
            "Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header.",
        ));
    };
    let canonical_uri: String = uri
        .path()
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let mut query: Vec<&str> = uri.query().unwrap_or("").split('&').filter(|p| !p.is_empty()).collect();
    query.sort_unstable();
    let canonical_headers: String = signed_headers
        .split(';')
        .map(|name| {
            let values: Vec<String> = headers
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).split_whitespace().collect::<Vec<_>>().join(" "))
                .collect();
            format!("{name}:{}\n", values.join(","))
        })
        .collect();
    // The payload's hash, unless the client declared the body unsigned (botocore does
    // when payload signing is off) or sent the hash itself, which must then be the body's.
    let body_hash = hex(&Sha256::digest(body));
    let payload_hash = match headers.get("x-amz-content-sha256").and_then(|v| v.to_str().ok()) {
        Some("UNSIGNED-PAYLOAD") => "UNSIGNED-PAYLOAD".to_string(),
        Some(declared) if declared != body_hash => {
            return Err((
                "XAmzContentSHA256Mismatch",
                "The provided 'x-amz-content-sha256' header does not match what was computed.",
            ));
        }
        _ => body_hash,
    };
    let canonical_request = format!(
        "{method}\n{canonical_uri}\n{}\n{canonical_headers}\n{signed_headers}\n{payload_hash}",
        query.join("&"),
    );
    let string_to_sign =
        format!("AWS4-HMAC-SHA256\n{timestamp}\n{scope}\n{}", hex(&Sha256::digest(canonical_request.as_bytes())));
    let mut key = hmac(format!("AWS4{secret}").as_bytes(), date.as_bytes());
    for part in [region, service, "aws4_request"] {
        key = hmac(&key, part.as_bytes());
    }
    if hex(&hmac(&key, string_to_sign.as_bytes())) == signature {
        Ok(())
    } else {
        Err(("InvalidSignatureException", MISMATCH))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AWS's published SigV4 example (the `get-vanilla` case of the SigV4 test suite):
    /// GET / to example.amazonaws.com, service `service`, region `us-east-1`, with the
    /// documented example secret.
    #[test]
    fn verifies_awss_published_example_signature() {
        let secret = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
        let mut headers = HeaderMap::new();
        headers.insert("host", "example.amazonaws.com".parse().unwrap());
        headers.insert("x-amz-date", "20150830T123600Z".parse().unwrap());
        headers.insert(
            "authorization",
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"
                .parse()
                .unwrap(),
        );
        let uri: Uri = "/".parse().unwrap();
        assert!(verify_signature(secret, &Method::GET, &uri, &headers, b"").is_ok());
        assert!(verify_signature(secret, &Method::GET, &uri, &headers, b"x").is_err(), "a changed body fails");
        assert!(verify_signature("other", &Method::GET, &uri, &headers, b"").is_err());
    }
}
