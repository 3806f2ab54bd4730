//! Azure OpenAI's deployment paths: `POST /openai/deployments/{deployment}/chat/completions
//! ?api-version=…`. The body is OpenAI's without a `model` (the deployment chooses it);
//! the reply is OpenAI's chat completion with the deployment's model (`x-mock-model`, else
//! the deployment's name) and Azure's content-filter annotations: `prompt_filter_results`
//! on the JSON reply, and on a stream a first chunk with empty `choices` and no usage
//! carrying them, as Azure sends it.

use super::{chat_reply, credentials, openai_error, Mock};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Azure's verdict on a prompt that passed every filter.
fn filter_results() -> Value {
    let safe = json!({"filtered": false, "severity": "safe"});
    json!({"hate": safe, "self_harm": safe, "sexual": safe, "violence": safe})
}

pub async fn deployment_chat(
    State(mock): State<Arc<Mock>>,
    Path(deployment): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    mock.received.fetch_add(1, Ordering::Relaxed);
    match credentials::authenticate(credentials::Api::Azure, &headers, &uri, mock.args.accept_anonymous) {
        Ok(fingerprint) => {
            credentials::billed_to(deployment_reply(&mock, deployment, uri, headers, body).await, &fingerprint)
        }
        Err(refusal) => *refusal,
    }
}

async fn deployment_reply(mock: &Mock, deployment: String, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    if !uri.query().is_some_and(|q| q.split('&').any(|pair| pair.starts_with("api-version="))) {
        return openai_error(StatusCode::NOT_FOUND, "Resource not found");
    }
    let mut request: Value = match serde_json::from_slice(&body) {
        Ok(value @ Value::Object(_)) => value,
        _ => return openai_error(StatusCode::BAD_REQUEST, "We could not parse the JSON body of your request."),
    };
    let model = headers.get("x-mock-model").and_then(|v| v.to_str().ok()).map_or(deployment, str::to_string);
    request["model"] = json!(model);
    let reply = chat_reply(mock, &headers, &request, body.len()).await;
    if !reply.status().is_success() {
        return reply;
    }
    let streaming = reply.headers().get("content-type").is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    let (parts, body) = reply.into_parts();
    let prompt_filter = json!([{"prompt_index": 0, "content_filter_results": filter_results()}]);
    if streaming {
        let first = json!({"choices": [], "created": 0, "id": "", "model": "", "object": "", "prompt_filter_results": prompt_filter});
        let first =
            futures_util::stream::once(
                async move { Ok::<Bytes, axum::Error>(Bytes::from(format!("data: {first}\n\n"))) },
            );
        return Response::from_parts(parts, Body::from_stream(first.chain(body.into_data_stream())));
    }
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 24).await else {
        return openai_error(StatusCode::INTERNAL_SERVER_ERROR, "The mock could not read its own reply.");
    };
    let mut completion: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    completion["prompt_filter_results"] = prompt_filter;
    if let Some(choices) = completion["choices"].as_array_mut() {
        for choice in choices {
            choice["content_filter_results"] = filter_results();
        }
    }
    let mut parts = parts;
    parts.headers.remove("content-length");
    Response::from_parts(parts, Body::from(completion.to_string()))
}
