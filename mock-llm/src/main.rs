//! mock-llm: a TEST FIXTURE, not a product. It stands in for an LLM provider in
//! llm-ratelimit's tests, demo and benchmarks, and speaks the providers' wire formats as
//! they send them:
//!
//! - OpenAI `POST /v1/chat/completions`: a `chat.completion` JSON, or with `stream: true`
//!   `chat.completion.chunk` SSE events ending in `data: [DONE]`, with the final usage
//!   chunk (`choices: []`) when `stream_options.include_usage` is true;
//! - Anthropic `POST /v1/messages`: a `message` JSON, or with `stream: true` the named SSE
//!   events `message_start` .. `message_stop`, usage in `message_start` and `message_delta`.
//!
//! Completion length: `--completion-tokens`, or per request the `x-mock-completion-tokens`
//! header, capped by the request's `max_tokens` / `max_completion_tokens`. Each streamed
//! content chunk is one token. Delays: `--first-token-delay-ms` / `--chunk-delay-ms`, or per
//! request `x-mock-first-token-delay-ms` / `x-mock-chunk-delay-ms`. Prompt tokens are an
//! estimate (about 4 characters a token over the messages' text): the fixture does not
//! tokenize. `--prompt-tokens-per-byte F` counts them as F per byte of the whole request
//! body instead, like a provider whose count differs from the proxy's (tools, images,
//! another tokenizer): 0.25 is about 4 bytes a token. (The body's JSON around the prompt
//! counts too, so past about 0.3 this counts more than any tokenizer would of the text.)
//!
//! Also AWS Bedrock's `POST /model/{modelId}/converse`, `/converse-stream`, `/invoke` and
//! `/invoke-with-response-stream`, with SigV4 signatures verified (see bedrock.rs); Google's
//! Gemini API and Vertex AI (`…/models/{model}:generateContent`, tuned models'
//! `/v1beta/tunedModels/{model}:generateContent`, `:streamGenerateContent`
//! as SSE with `alt=sse` or a JSON array without, `:countTokens`; see gemini.rs); and Azure
//! OpenAI's deployment paths (see azure.rs).
//!
//! For tests: every reply carries `x-mock-prompt-tokens` and `x-mock-completion-tokens`,
//! the usage it reports (or would, for a stream without a usage chunk); a request with
//! `x-mock-status: <code>` gets that error status with the provider's error body; with
//! `x-mock-cached-tokens: N`, N of the prompt tokens (at most all) are reported as read
//! from the prompt cache (OpenAI `prompt_tokens_details.cached_tokens`; Anthropic
//! `cache_read_input_tokens`, which its `input_tokens` then leave out, as Anthropic does).
//! Compressed, cut-off replies and hidden reasoning tokens: see reply_controls.rs.
//! On every endpoint, `x-mock-set-<name>` adds a header to the reply and
//! `x-mock-abort-after-bytes` breaks the connection mid-body (see controls.rs).

mod azure;
mod controls;
mod credentials;
mod gemini;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use clap::Parser;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

mod bedrock;
mod reply_controls;

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Test fixture: a mock LLM upstream speaking OpenAI's, Anthropic's, Gemini's and Azure OpenAI's wire formats"
)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: String,
    /// Completion tokens per reply, unless the request caps it lower.
    #[arg(long, default_value_t = 16)]
    completion_tokens: u64,
    /// Delay before the first streamed token (or before a non-streamed reply).
    #[arg(long, default_value_t = 0)]
    first_token_delay_ms: u64,
    /// Delay between streamed chunks.
    #[arg(long, default_value_t = 0)]
    chunk_delay_ms: u64,
    /// Report prompt tokens as this many per byte of the request body (e.g. 0.25), rounded
    /// up, instead of about four characters a token over the messages' text.
    #[arg(long, value_parser = per_byte)]
    prompt_tokens_per_byte: Option<f64>,
    /// The secret Bedrock requests' SigV4 signatures are checked with, whatever their
    /// access key id (a test credential, never a real one).
    #[arg(long, default_value = "mock-bedrock-secret")]
    aws_secret_access_key: String,
    /// Answer requests that carry no credential, as a provider does behind a gateway
    /// route that adds the operator's own key (an anonymous pool: `identity.missing`).
    #[arg(long)]
    accept_anonymous: bool,
}

fn per_byte(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value > 0.0 && value <= 16.0 => Ok(value),
        _ => Err(format!("{text:?} is not a number of tokens per byte in (0, 16]")),
    }
}

struct Mock {
    args: Args,
    /// Every request that reached a provider endpoint, valid or not (`GET /mock/stats`):
    /// tests use it to prove that rejected requests never got here.
    received: AtomicU64,
    served: AtomicU64,
}

/// Words that are one token each in cl100k_base and o200k_base.
const WORDS: [&str; 10] = [" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."];

struct Plan {
    model: String,
    stream: bool,
    include_usage: bool,
    prompt_tokens: u64,
    /// Of the prompt tokens, those reported as read from the prompt cache.
    cached_tokens: u64,
    completion_tokens: u64,
    truncated: bool,
    first_delay: Duration,
    chunk_delay: Duration,
    id: u64,
}

fn header_u64(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// About four characters a token over every string in the messages.
fn estimate_prompt_tokens(request: &Value) -> u64 {
    fn chars(value: &Value) -> usize {
        match value {
            Value::String(s) => s.chars().count(),
            Value::Array(items) => items.iter().map(chars).sum(),
            Value::Object(map) => map.values().map(chars).sum(),
            _ => 0,
        }
    }
    let text = chars(&request["messages"]) + chars(&request["system"]);
    (text as u64).div_ceil(4).max(1)
}

impl Mock {
    /// The prompt tokens this mock reports for a request whose body is `body_len` bytes.
    fn prompt_tokens(&self, request: &Value, body_len: usize) -> u64 {
        match self.args.prompt_tokens_per_byte {
            Some(per_byte) => ((body_len as f64 * per_byte).ceil() as u64).max(1),
            None => estimate_prompt_tokens(request),
        }
    }

    fn plan(&self, headers: &HeaderMap, request: &Value, body_len: usize, max_tokens: Option<u64>) -> Plan {
        let wanted = header_u64(headers, "x-mock-completion-tokens").unwrap_or(self.args.completion_tokens);
        let completion_tokens = max_tokens.map_or(wanted, |cap| wanted.min(cap));
        let prompt_tokens = self.prompt_tokens(request, body_len);
        Plan {
            model: request["model"].as_str().unwrap_or("unknown").to_string(),
            stream: request["stream"].as_bool().unwrap_or(false),
            include_usage: request["stream_options"]["include_usage"].as_bool().unwrap_or(false),
            prompt_tokens,
            cached_tokens: header_u64(headers, "x-mock-cached-tokens").unwrap_or(0).min(prompt_tokens),
            completion_tokens,
            truncated: completion_tokens < wanted,
            first_delay: Duration::from_millis(
                header_u64(headers, "x-mock-first-token-delay-ms").unwrap_or(self.args.first_token_delay_ms),
            ),
            chunk_delay: Duration::from_millis(
                header_u64(headers, "x-mock-chunk-delay-ms").unwrap_or(self.args.chunk_delay_ms),
            ),
            id: self.served.fetch_add(1, Ordering::Relaxed),
        }
    }
}

fn completion_text(tokens: u64) -> Vec<&'static str> {
    WORDS.iter().cycle().take(tokens as usize).copied().collect()
}

/// Sleeps, but not for zero: tokio's timer ticks in whole milliseconds, so even a zero
/// sleep would add about 1 ms to every reply.
async fn pause(delay: Duration) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

/// Adds the usage the reply reports, for tests to compare with what was charged.
fn with_usage(mut response: Response, plan: &Plan) -> Response {
    let headers = response.headers_mut();
    for (name, value) in
        [("x-mock-prompt-tokens", plan.prompt_tokens), ("x-mock-completion-tokens", plan.completion_tokens)]
    {
        if let Ok(value) = value.to_string().parse() {
            headers.insert(name, value);
        }
    }
    response
}

/// The status a test asked for with `x-mock-status`, if it is an error status.
fn forced_error(headers: &HeaderMap) -> Option<StatusCode> {
    header_u64(headers, "x-mock-status")
        .and_then(|code| StatusCode::from_u16(u16::try_from(code).ok()?).ok())
        .filter(|status| status.is_client_error() || status.is_server_error())
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (status, [("content-type", "application/json")], body.to_string()).into_response()
}

/// Sends `events` after `first` delay, then one every `gap`.
fn sse_response(events: Vec<String>, first: Duration, gap: Duration) -> Response {
    streamed(events.into_iter().map(Bytes::from).collect(), None, "text/event-stream; charset=utf-8", first, gap)
}

/// A streamed body: `pieces` one after another (the first after `first`, then one every
/// `gap`), or, with `chunk_bytes` (the `x-mock-chunk-bytes` control), their bytes re-cut
/// into pieces of that size.
fn streamed(
    pieces: Vec<Bytes>,
    chunk_bytes: Option<u64>,
    content_type: &str,
    first: Duration,
    gap: Duration,
) -> Response {
    let pieces: Vec<Bytes> = match chunk_bytes {
        Some(size) => pieces.concat().chunks(size.max(1) as usize).map(Bytes::copy_from_slice).collect(),
        None => pieces,
    };
    let stream = futures_util::stream::unfold((pieces.into_iter(), true), move |(mut pieces, is_first)| async move {
        let piece = pieces.next()?;
        pause(if is_first { first } else { gap }).await;
        Some((Ok::<Bytes, std::convert::Infallible>(piece), (pieces, false)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", content_type)
        .header("cache-control", "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn openai_error(status: StatusCode, message: &str) -> Response {
    json_response(
        status,
        &json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}}),
    )
}

fn anthropic_error(status: StatusCode, message: &str) -> Response {
    json_response(status, &json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}}))
}

/// A request body read as OpenAI's Python server reads bytes (`json.loads`): a leading
/// UTF-8 byte order mark is skipped, which serde_json alone refuses.
fn read_json(body: &[u8]) -> serde_json::Result<Value> {
    serde_json::from_slice(body.strip_prefix(b"\xef\xbb\xbf".as_slice()).unwrap_or(body))
}

async fn chat_completions(
    mock: axum::extract::State<Arc<Mock>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    mock.received.fetch_add(1, Ordering::Relaxed);
    // Azure's `/openai/v1/...` takes its own key or a Bearer token; OpenAI only the latter.
    let api = if uri.path().starts_with("/openai/") { credentials::Api::Azure } else { credentials::Api::OpenAi };
    let credential = match credentials::authenticate(api, &headers, &uri, mock.args.accept_anonymous) {
        Ok(fingerprint) => fingerprint,
        Err(refusal) => return *refusal,
    };
    let request: Value = match read_json(&body) {
        Ok(value @ Value::Object(_)) => value,
        _ => return openai_error(StatusCode::BAD_REQUEST, "We could not parse the JSON body of your request."),
    };
    credentials::billed_to(chat_reply(&mock, &headers, &request, body.len()).await, &credential)
}

/// The chat completion for a parsed request (also Azure's, see azure.rs).
async fn chat_reply(mock: &Mock, headers: &HeaderMap, request: &Value, body_len: usize) -> Response {
    if !request["messages"].is_array() {
        return openai_error(StatusCode::BAD_REQUEST, "Missing required parameter: 'messages'.");
    }
    let max_tokens = request["max_completion_tokens"].as_u64().or(request["max_tokens"].as_u64());
    if let Some(status) = forced_error(headers) {
        return openai_error(status, "The mock was asked to fail this request.");
    }
    let plan = mock.plan(headers, request, body_len, max_tokens);
    let reasoning = reply_controls::reasoning_tokens(headers);
    let id = format!("chatcmpl-mock{:08}", plan.id);
    let created = now_secs();
    let words = completion_text(plan.completion_tokens);
    let finish_reason = if plan.truncated { "length" } else { "stop" };
    let usage = json!({
        "prompt_tokens": plan.prompt_tokens,
        "completion_tokens": plan.completion_tokens + reasoning,
        "total_tokens": plan.prompt_tokens + plan.completion_tokens + reasoning,
        "prompt_tokens_details": {"cached_tokens": plan.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    });
    if !plan.stream {
        pause(plan.first_delay).await;
        return with_usage(
            json_response(
                StatusCode::OK,
                &json!({
                    "id": id, "object": "chat.completion", "created": created, "model": plan.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": words.concat(), "refusal": null, "annotations": []}, "logprobs": null, "finish_reason": finish_reason}],
                    "usage": usage, "service_tier": "default", "system_fingerprint": "fp_mock"
                }),
            ),
            &plan,
        );
    }
    // With include_usage every chunk carries `"usage": null` and one extra chunk with empty
    // choices carries the totals, as OpenAI sends them.
    let chunk = |delta: Value, finish: Value| {
        let mut chunk = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": plan.model,
            "service_tier": "default", "system_fingerprint": "fp_mock",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]
        });
        if plan.include_usage {
            chunk["usage"] = Value::Null;
        }
        format!("data: {chunk}\n\n")
    };
    let mut events = vec![chunk(json!({"role": "assistant", "content": "", "refusal": null}), Value::Null)];
    events.extend(words.iter().map(|w| chunk(json!({"content": w}), Value::Null)));
    events.push(chunk(json!({}), json!(finish_reason)));
    if plan.include_usage {
        let last = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": plan.model,
            "service_tier": "default", "system_fingerprint": "fp_mock", "choices": [], "usage": usage
        });
        events.push(format!("data: {last}\n\n"));
    }
    events.push("data: [DONE]\n\n".to_string());
    with_usage(sse_response(events, plan.first_delay, plan.chunk_delay), &plan)
}

async fn messages(mock: axum::extract::State<Arc<Mock>>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    mock.received.fetch_add(1, Ordering::Relaxed);
    let credential =
        match credentials::authenticate(credentials::Api::Anthropic, &headers, &uri, mock.args.accept_anonymous) {
            Ok(fingerprint) => fingerprint,
            Err(refusal) => return *refusal,
        };
    credentials::billed_to(anthropic_message(&mock, &headers, &body).await, &credential)
}

async fn anthropic_message(mock: &Mock, headers: &HeaderMap, body: &[u8]) -> Response {
    let request: Value = match serde_json::from_slice(body) {
        Ok(value @ Value::Object(_)) => value,
        _ => return anthropic_error(StatusCode::BAD_REQUEST, "There was an error parsing the body of your request."),
    };
    let Some(max_tokens) = request["max_tokens"].as_u64() else {
        return anthropic_error(StatusCode::BAD_REQUEST, "max_tokens: Field required");
    };
    if !request["messages"].is_array() {
        return anthropic_error(StatusCode::BAD_REQUEST, "messages: Field required");
    }
    if let Some(status) = forced_error(headers) {
        return anthropic_error(status, "The mock was asked to fail this request.");
    }
    let plan = mock.plan(headers, &request, body.len(), Some(max_tokens));
    let reasoning = reply_controls::reasoning_tokens(headers);
    let id = format!("msg_mock{:016}", plan.id);
    let words = completion_text(plan.completion_tokens);
    let stop_reason = if plan.truncated { "max_tokens" } else { "end_turn" };
    if !plan.stream {
        pause(plan.first_delay).await;
        return with_usage(
            json_response(
                StatusCode::OK,
                &json!({
                    "id": id, "type": "message", "role": "assistant", "model": plan.model,
                    "content": [{"type": "text", "text": words.concat()}],
                    "stop_reason": stop_reason, "stop_sequence": null,
                    "usage": {"input_tokens": plan.prompt_tokens - plan.cached_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": plan.cached_tokens, "output_tokens": plan.completion_tokens + reasoning, "service_tier": "standard"}
                }),
            ),
            &plan,
        );
    }
    let event = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    let mut events = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": plan.model, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": plan.prompt_tokens - plan.cached_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": plan.cached_tokens, "output_tokens": 1, "service_tier": "standard"}
            }}),
        ),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    events.extend(words.iter().map(|w| {
        event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}),
        )
    }));
    events.push(event("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
    events.push(event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": plan.completion_tokens + reasoning}})));
    events.push(event("message_stop", json!({"type": "message_stop"})));
    with_usage(sse_response(events, plan.first_delay, plan.chunk_delay), &plan)
}

async fn stats(mock: axum::extract::State<Arc<Mock>>) -> Response {
    json_response(StatusCode::OK, &json!({"received": mock.received.load(Ordering::Relaxed)}))
}

async fn run(args: Args) -> Result<(), String> {
    let listen = args.listen.clone();
    let mock = Arc::new(Mock { args, received: AtomicU64::new(0), served: AtomicU64::new(0) });
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/model/{model_id}/{operation}", post(bedrock::handle))
        .route("/v1beta/models/{*rest}", post(gemini::models))
        .route("/v1/models/{*rest}", post(gemini::models))
        .route("/v1beta/tunedModels/{*rest}", post(gemini::models))
        .route("/v1/projects/{project}/locations/{location}/publishers/google/models/{*rest}", post(gemini::vertex))
        .route("/openai/deployments/{deployment}/chat/completions", post(azure::deployment_chat))
        .route("/openai/v1/chat/completions", post(chat_completions))
        .route("/healthz", get(|| async { "ok" }))
        .route("/mock/stats", get(stats))
        .layer(axum::middleware::from_fn(reply_controls::apply))
        .layer(axum::middleware::from_fn(controls::apply))
        .with_state(mock);
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?
        .tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
    eprintln!("mock-llm: listening on {listen}");
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| e.to_string())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let result = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .and_then(|runtime| runtime.block_on(run(args)));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("mock-llm: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
