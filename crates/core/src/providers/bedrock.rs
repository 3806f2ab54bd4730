//! AWS Bedrock Runtime: its paths, its Converse request bodies, its usage (JSON replies and
//! event streams) and its error shape.
//!
//! | path | body | usage |
//! |---|---|---|
//! | `/model/{modelId}/converse` | Converse | `usage.inputTokens`, `outputTokens`, `cacheReadInputTokens`, `cacheWriteInputTokens` |
//! | `/model/{modelId}/converse-stream` | Converse | event stream: the `metadata` event's `usage` |
//! | `/model/{modelId}/invoke` | Anthropic messages (`anthropic_version`, no `model`) | Anthropic's `usage` |
//! | `/model/{modelId}/invoke-with-response-stream` | same | event stream: `chunk` events carrying Anthropic's events base64-encoded in `bytes`; the last adds `amazon-bedrock-invocationMetrics` |
//!
//! The model is the path's (percent-decoded: ARNs and inference-profile ids are sent
//! encoded). Prompts are counted with the rule's encoding, an estimate for Bedrock's
//! models, settled against the reported usage.
//!
//! Bedrock requests are signed (SigV4 over the body's SHA-256): the filter never rewrites
//! their bodies (`LlmRequest::body_is_signed`), so `tokens.clamp_max_tokens` cannot shrink
//! their output cap. They are reserved at the bound clamping would have started from
//! instead (see `charge::plan`), all or nothing.

use super::{BodyShape, ErrorEnvelope, PathModel, Provider, Route};
use crate::api::identity::{CredentialPlace, BEARER, SIGV4};
use crate::api::prompt::{as_count, chat_messages, content};
use crate::api::refusal::Refusal;
use crate::api::{Api, ReportedUsage};
use crate::parse::eventstream::Message;
use crate::parse::json::Json;
use base64::Engine;
use serde_json::json;

/// Where Bedrock reads the caller's credential: a SigV4 signature (its access key id) or a Bedrock API key.
pub const CREDENTIALS: [CredentialPlace<'static>; 2] = [SIGV4, BEARER];

/// What a 401 tells Bedrock's callers who sent no credential.
pub const MISSING_CREDENTIAL: &str =
    "No credentials provided. Sign the request with AWS Signature Version 4 ('Authorization: AWS4-HMAC-SHA256 \
     Credential=...'), as the AWS SDKs do, or send the header the operator configured.";

/// Bedrock's own bound on a model id (an ARN included), in bytes.
pub const MAX_MODEL_ID_BYTES: usize = 2048;
/// Bedrock's error code, where AWS's REST-JSON protocol carries it.
pub const ERROR_HEADER: &str = "x-amzn-errortype";
/// The response content type of Bedrock's streams.
pub const EVENT_STREAM_CONTENT_TYPE: &str = "application/vnd.amazon.eventstream";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Converse,
    ConverseStream,
    Invoke,
    InvokeWithResponseStream,
}

impl Operation {
    const BY_PATH: [(&'static str, Operation); 4] = [
        ("converse", Operation::Converse),
        ("converse-stream", Operation::ConverseStream),
        ("invoke", Operation::Invoke),
        ("invoke-with-response-stream", Operation::InvokeWithResponseStream),
    ];

    /// The body's shape: Converse's own, or (invoke, for Anthropic's models on Bedrock)
    /// Anthropic's messages.
    pub fn api(self) -> Api {
        match self {
            Operation::Converse | Operation::ConverseStream => Api::Converse,
            Operation::Invoke | Operation::InvokeWithResponseStream => Api::Messages,
        }
    }

    pub fn streams(self) -> bool {
        matches!(self, Operation::ConverseStream | Operation::InvokeWithResponseStream)
    }
}

/// A Bedrock Runtime path: the operation and the model it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BedrockRoute {
    pub operation: Operation,
    pub model: String,
}

impl BedrockRoute {
    /// `…/model/{modelId}/{operation}`, ignoring the query string; a prefix before
    /// `/model/` is allowed (a proxy's route), the model id may be percent-encoded and
    /// may hold unencoded `/` (an ARN as some clients send it). `None` for other paths
    /// and for model ids past Bedrock's length bound.
    pub fn from_path(path: &str) -> Option<BedrockRoute> {
        Self::from_normalised(&crate::parse::path::normalised(path))
    }

    /// [`from_path`](Self::from_path) of a path already normalised, as the lifecycle routes it.
    fn from_normalised(path: &str) -> Option<BedrockRoute> {
        let (rest, operation) = path.rsplit_once('/')?;
        let operation = Operation::BY_PATH.iter().find(|(name, _)| *name == operation)?.1;
        let encoded = rest.get(rest.find("/model/")? + "/model/".len()..)?;
        // Three bytes of path (`%XX`) at most for each byte of the id.
        if encoded.is_empty() || encoded.len() > 3 * MAX_MODEL_ID_BYTES {
            return None;
        }
        // `%XX` decoded; anything else (a stray `%` included) kept; bytes that are not
        // UTF-8 replaced.
        let model = percent_encoding::percent_decode_str(encoded).decode_utf8_lossy().into_owned();
        (model.len() <= MAX_MODEL_ID_BYTES).then_some(BedrockRoute { operation, model })
    }
}

/// The route of a Bedrock Runtime path: the operation's body shape, the path's model,
/// the operation's streaming, and a signed body.
pub(super) fn route(path: &str) -> Option<Route> {
    let bedrock = BedrockRoute::from_normalised(path)?;
    Some(Route {
        provider: Provider::Bedrock,
        api: Some(bedrock.operation.api()),
        path_model: Some(PathModel::Model(bedrock.model)),
        streams: Some(bedrock.operation.streams()),
        body_is_signed: true,
        dialect: Provider::Bedrock.dialect(),
    })
}

/// Converse: `system`, `messages` (content blocks keyed by kind) and the tools; the cap in
/// `inferenceConfig.maxTokens`, never written (the body is signed).
pub const CONVERSE: BodyShape = BodyShape {
    max_output: |body| as_count(body.at("inferenceConfig").at("maxTokens")),
    cap_field: |_| &[],
    choices: |_| None,
    prompt: |body, count| {
        content(body.at("system"), count)
            + chat_messages(body.at("messages"), count)
            + converse_tools(body.at("toolConfig"), count)
    },
};

/// Converse's `toolConfig.tools[].toolSpec`, each counted as its JSON text (name,
/// description and input schema reach the model as text).
pub(crate) fn converse_tools(tool_config: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    let Some(tools) = tool_config.at("tools").as_array() else { return 0 };
    tools.map(|tool| tool.get("toolSpec").map_or(0, |spec| count(&spec.to_json_string()))).sum()
}

/// Bedrock's `TokenUsage` (camelCase), if `usage` is one. Bedrock's `inputTokens`
/// excludes the tokens read from and written to the prompt cache, which are billed too:
/// the input is their sum, as it is for Anthropic's usage.
pub(crate) fn converse_usage(usage: Json) -> Option<ReportedUsage> {
    let field = |name: &str| usage.at(name).as_u64();
    if field("inputTokens").is_none() && field("outputTokens").is_none() {
        return None;
    }
    let cache_read = field("cacheReadInputTokens");
    let input = field("inputTokens").map(|input| {
        input.saturating_add(cache_read.unwrap_or(0)).saturating_add(field("cacheWriteInputTokens").unwrap_or(0))
    });
    Some(ReportedUsage { input, output: field("outputTokens"), cached_input: cache_read, reasoning: None })
}

/// What Bedrock adds to the last event of an invoke stream:
/// `amazon-bedrock-invocationMetrics` with `inputTokenCount` and `outputTokenCount` (and,
/// with prompt caching, `cacheReadInputTokenCount` and `cacheWriteInputTokenCount`).
pub(crate) fn invocation_metrics(event: Json) -> ReportedUsage {
    let metrics = event.at("amazon-bedrock-invocationMetrics");
    let field = |name: &str| metrics.at(name).as_u64();
    let cache_read = field("cacheReadInputTokenCount");
    let input = field("inputTokenCount").map(|input| {
        input.saturating_add(cache_read.unwrap_or(0)).saturating_add(field("cacheWriteInputTokenCount").unwrap_or(0))
    });
    ReportedUsage { input, output: field("outputTokenCount"), cached_input: cache_read, reasoning: None }
}

/// What one message of a Bedrock event stream says.
pub(crate) enum StreamPart<'a> {
    /// An exception (a message whose `:message-type` is not `event`): its type, from
    /// `:exception-type` or an error's `:error-code`.
    Exception(&'a str),
    /// invoke-with-response-stream's `chunk`: one of Anthropic's events (base64 in
    /// `bytes`), and the usage Bedrock adds to the last (`invocation_metrics`).
    Event(Json<'a>, ReportedUsage),
    /// converse-stream's `contentBlockDelta`: generated text, tool input or reasoning.
    Text(&'a str),
    /// converse-stream's `metadata`, the end of the stream, with its usage if it has one.
    End(Option<ReportedUsage>),
}

/// Reads one message of a Bedrock event stream, handing `on` what it says (nothing, for
/// events that say nothing about usage or text, or that do not parse).
pub(crate) fn read_stream_message(message: &Message, on: &mut impl FnMut(StreamPart<'_>)) {
    if message.header(":message-type").is_some_and(|kind| kind != "event") {
        on(StreamPart::Exception(
            message.header(":exception-type").or(message.header(":error-code")).unwrap_or("error"),
        ));
        return;
    }
    let Ok(payload) = Json::parse(&message.payload) else { return };
    let payload = payload.root();
    match message.header(":event-type").unwrap_or("") {
        "chunk" => {
            let Some(encoded) = payload.at("bytes").as_str() else { return };
            let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(encoded) else { return };
            let Ok(event) = Json::parse(&bytes) else { return };
            let event = event.root();
            on(StreamPart::Event(event, invocation_metrics(event)));
        }
        "contentBlockDelta" => {
            let delta = payload.at("delta");
            for text in [delta.at("text"), delta.at("toolUse").at("input"), delta.at("reasoningContent").at("text")] {
                if let Some(text) = text.as_str() {
                    on(StreamPart::Text(text));
                }
            }
        }
        "metadata" => on(StreamPart::End(converse_usage(payload.at("usage")))),
        _ => {}
    }
}

/// Bedrock's error: the error code in `x-amzn-ErrorType` (as AWS's REST-JSON protocol
/// carries it) and `{"message"}`.
pub(super) fn error_envelope(refusal: Refusal, message: &str) -> ErrorEnvelope {
    ErrorEnvelope { body: json!({"message": message}), header: Some((ERROR_HEADER, error_code(refusal).to_string())) }
}

/// Bedrock runtime's error code (its API reference's "Errors").
fn error_code(refusal: Refusal) -> &'static str {
    match refusal {
        Refusal::RateLimited(_) | Refusal::NeverFits(_) => "ThrottlingException",
        // Bedrock runtime's error for a request over an account's quota ("Your request
        // exceeds the service quota for your account"), not one of the throttling codes
        // AWS SDKs retry.
        Refusal::QuotaSpent { .. } => "ServiceQuotaExceededException",
        Refusal::TooLarge => "ValidationException",
        Refusal::Unavailable => "ServiceUnavailableException",
        Refusal::Unidentified | Refusal::NotPriced | Refusal::Suspended => "AccessDeniedException",
        Refusal::Unreadable(_) => "ValidationException",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::effects::host::{HostKind, Metric};
    use crate::parse::eventstream::encode;
    use crate::parse::eventstream::StreamError;
    use crate::readers::usage::EventStreamUsage;
    use crate::testing::{FakeCompanion, InFlight, Proxy, Request, World};
    use crate::tokens::Encoding;
    use base64::Engine;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;

    const O200K: Encoding = Encoding::O200kBase;

    #[test]
    fn recognises_bedrock_paths() {
        let route = |operation, model: &str| Some(BedrockRoute { operation, model: model.to_string() });
        let cases = [
            ("/model/amazon.nova-lite-v1:0/converse", route(Operation::Converse, "amazon.nova-lite-v1:0")),
            (
                "/model/us.anthropic.claude-3-5-haiku-20241022-v1%3A0/converse-stream",
                route(Operation::ConverseStream, "us.anthropic.claude-3-5-haiku-20241022-v1:0"),
            ),
            (
                "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Ainference-profile%2Fus.anthropic.claude-sonnet-4-v1%3A0/invoke",
                route(
                    Operation::Invoke,
                    "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-sonnet-4-v1:0",
                ),
            ),
            (
                "/bedrock/model/arn:aws:bedrock:us-east-1::foundation-model/anthropic.claude-v2/invoke-with-response-stream?x=1",
                route(Operation::InvokeWithResponseStream, "arn:aws:bedrock:us-east-1::foundation-model/anthropic.claude-v2"),
            ),
            ("/model/odd%zz%4/converse", route(Operation::Converse, "odd%zz%4")),
            ("/model/%FF/converse", route(Operation::Converse, "\u{fffd}")),
            ("/model//converse", None),
            ("/model/x/count-tokens", None),
            ("/models/x/converse", None),
            ("/v1/messages", None),
            ("", None),
        ];
        for (path, expected) in cases {
            assert_eq!(BedrockRoute::from_path(path), expected, "{path}");
        }
        let longest = format!("/model/{}/converse", "%41".repeat(MAX_MODEL_ID_BYTES));
        assert_eq!(BedrockRoute::from_path(&longest).map(|r| r.model.len()), Some(MAX_MODEL_ID_BYTES));
        let too_long = format!("/model/{}/converse", "a".repeat(MAX_MODEL_ID_BYTES + 1));
        assert_eq!(BedrockRoute::from_path(&too_long), None);
    }

    fn parse<'a>(path: &str, body: &'a str) -> crate::readers::request::ParsedBody<'a> {
        crate::readers::request::parse_on(&super::super::route(path).expect(path), body.as_bytes())
            .expect(path)
            .expect(body)
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn counts_converse_bodies() {
        let hw = O200K.count("hello world");
        let spec = r#"{"name":"weather","description":"Weather for a city","inputSchema":{"json":{"type":"object"}}}"#;
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{{"text":"hello world"}},{{"image":{{"format":"png","source":{{"bytes":"AAAA"}}}}}},{{"cachePoint":{{"type":"default"}}}}]}}],
               "system":[{{"text":"hello world"}}],
               "toolConfig":{{"tools":[{{"toolSpec":{spec}}}]}},
               "inferenceConfig":{{"maxTokens":512,"temperature":0.5}}}}"#
        );
        let parsed = parse("/model/amazon.nova-pro-v1%3A0/converse-stream", &body);
        let request = &parsed.request;
        assert_eq!(request.api, Api::Converse);
        assert_eq!(request.model.as_deref(), Some("amazon.nova-pro-v1:0"));
        assert_eq!((request.stream, request.max_output, request.body_is_signed), (true, Some(512), true));
        // 3 priming + 3 for the message + "user" + the text; the image block as an image
        // (not its bytes); the system text; the tool spec as JSON text.
        let expected = 3 + 3 + O200K.count("user") + hw + crate::api::prompt::IMAGE_TOKENS + hw + O200K.count(spec);
        assert_eq!(parsed.prompt_tokens(O200K), expected);
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn invoke_reads_anthropics_body_with_the_paths_model() {
        let body = r#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":300,"system":"hello world","messages":[{"role":"user","content":"hello world"}]}"#;
        let parsed = parse("/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke", body);
        let direct = crate::readers::request::LlmRequest::parse(Api::Messages, body.as_bytes()).expect("messages");
        assert_eq!(parsed.prompt_tokens(O200K), direct.prompt_tokens(O200K));
        let request = &parsed.request;
        assert_eq!(request.model.as_deref(), Some("anthropic.claude-3-haiku-20240307-v1:0"));
        assert_eq!((request.api, request.stream, request.max_output), (Api::Messages, false, Some(300)));
        // Signed: nothing is ever rewritten, whatever is asked.
        assert_eq!(request.rewritten(body.as_bytes(), true, Some(10)), None);
        let streamed = parse("/model/anthropic.claude-v2/invoke-with-response-stream", body);
        assert!(streamed.request.stream);
    }

    fn event(kind: &str, payload: &str) -> Vec<u8> {
        encode(
            &[(":event-type", kind), (":content-type", "application/json"), (":message-type", "event")],
            payload.as_bytes(),
        )
    }

    fn chunk(anthropic_event: &str) -> Vec<u8> {
        let bytes = base64::engine::general_purpose::STANDARD.encode(anthropic_event);
        event("chunk", &format!(r#"{{"bytes":"{bytes}","p":"abcdefghij"}}"#))
    }

    /// A converse-stream reply as Bedrock frames it.
    fn converse_stream(with_metadata: bool) -> Vec<u8> {
        let mut messages = vec![
            event("messageStart", r#"{"p":"abcd","role":"assistant"}"#),
            event("contentBlockDelta", r#"{"contentBlockIndex":0,"delta":{"text":" The quick brown fox"},"p":"ab"}"#),
            event(
                "contentBlockDelta",
                r#"{"contentBlockIndex":0,"delta":{"text":" jumps over the lazy dog."},"p":"a"}"#,
            ),
            event("contentBlockStop", r#"{"contentBlockIndex":0,"p":"abc"}"#),
            event("messageStop", r#"{"p":"abcdef","stopReason":"end_turn"}"#),
        ];
        if with_metadata {
            messages.push(event(
                "metadata",
                r#"{"metrics":{"latencyMs":412},"p":"abcdefghijk","usage":{"cacheReadInputTokens":100,"cacheWriteInputTokens":20,"inputTokens":31,"outputTokens":10,"totalTokens":161}}"#,
            ));
        }
        messages.concat()
    }

    /// An invoke-with-response-stream reply for an Anthropic model.
    fn invoke_stream() -> Vec<u8> {
        [
            chunk(r#"{"type":"message_start","message":{"id":"msg_bdrk_01","type":"message","role":"assistant","model":"claude-3-haiku-20240307","content":[],"stop_reason":null,"usage":{"input_tokens":25,"output_tokens":1}}}"#),
            chunk(r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#),
            chunk(r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" The quick brown fox"}}"#),
            chunk(r#"{"type":"content_block_stop","index":0}"#),
            chunk(r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":4}}"#),
            chunk(r#"{"type":"message_stop","amazon-bedrock-invocationMetrics":{"inputTokenCount":26,"outputTokenCount":5,"invocationLatency":310,"firstByteLatency":120}}"#),
        ]
        .concat()
    }

    fn read(stream: &[u8], cuts: &[usize]) -> (ReportedUsage, u64, bool, Option<String>) {
        let mut reader = EventStreamUsage::new(O200K, 1 << 20);
        let mut rest = stream;
        for &cut in cuts {
            let (head, tail) = rest.split_at(cut.min(rest.len()));
            reader.feed(head);
            rest = tail;
        }
        reader.feed(rest);
        (reader.reported(), reader.output_tokens(), reader.finished(), reader.exception.clone())
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn reads_usage_from_each_stream() {
        let converse = ReportedUsage { input: Some(151), output: Some(10), cached_input: Some(100), reasoning: None };
        assert_eq!(read(&converse_stream(true), &[]), (converse, 10, true, None));
        // Without the metadata event: the text, counted (10 tokens in o200k_base).
        assert_eq!(read(&converse_stream(false), &[]), (ReportedUsage::default(), 10, false, None));
        // The invocation metrics, last, override what Anthropic's events said.
        let invoke = ReportedUsage { input: Some(26), output: Some(5), cached_input: None, reasoning: None };
        assert_eq!(read(&invoke_stream(), &[]), (invoke, 5, true, None));
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn every_two_way_split_gives_the_same_usage() {
        for stream in [converse_stream(true), converse_stream(false), invoke_stream()] {
            let whole = read(&stream, &[]);
            for at in 0..=stream.len() {
                assert_eq!(read(&stream, &[at]), whole, "split at {at}");
            }
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn an_exception_in_the_stream_is_noted_and_what_came_before_counts() {
        let exception = encode(
            &[
                (":exception-type", "throttlingException"),
                (":content-type", "application/json"),
                (":message-type", "exception"),
            ],
            br#"{"message":"Too many tokens, please wait before trying again."}"#,
        );
        let stream = [converse_stream(false), exception].concat();
        assert_eq!(read(&stream, &[]), (ReportedUsage::default(), 10, false, Some("throttlingException".to_string())));
        let error = encode(&[(":error-code", "InternalFailure"), (":message-type", "error")], b"");
        assert_eq!(read(&error, &[]).3.as_deref(), Some("InternalFailure"));
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn a_corrupted_stream_settles_on_what_came_before() {
        let mut stream = converse_stream(true);
        let metadata_start = converse_stream(false).len();
        stream[metadata_start + 20] ^= 0x01; // inside the metadata event
        let mut reader = EventStreamUsage::new(O200K, 1 << 20);
        reader.feed(&stream);
        assert_eq!(reader.broken(), Some(StreamError::BadMessageCrc));
        assert_eq!((reader.reported(), reader.output_tokens()), (ReportedUsage::default(), 10));
    }

    #[test]
    fn reads_converse_json_replies() {
        let body = r#"{"output":{"message":{"role":"assistant","content":[{"text":"Hi"}]}},"stopReason":"end_turn","usage":{"inputTokens":12,"outputTokens":3,"totalTokens":15,"cacheReadInputTokens":0,"cacheWriteInputTokens":4},"metrics":{"latencyMs":200}}"#;
        let mut reply = crate::readers::usage::ReplyUsage::new();
        reply.feed(body.as_bytes());
        assert_eq!(
            reply.finish(),
            ReportedUsage { input: Some(16), output: Some(3), cached_input: Some(0), reasoning: None }
        );
    }

    /// A Bedrock request as boto3 sends it: SigV4-signed, the model in the path.
    fn signed_request(access_key: &str, path: &str, body: &str) -> Request {
        let authorization = format!(
            "AWS4-HMAC-SHA256 Credential={access_key}/20261201/us-east-1/bedrock/aws4_request, SignedHeaders=content-type;host;x-amz-date, Signature={:064x}",
            body.len()
        );
        Request {
            headers: vec![
                (":method".into(), "POST".into()),
                (":path".into(), path.into()),
                ("authorization".into(), authorization),
                ("x-amz-date".into(), "20261201T160000Z".into()),
                ("content-type".into(), "application/json".into()),
                ("content-length".into(), body.len().to_string()),
            ],
            body: body.as_bytes().to_vec(),
        }
    }

    fn lifecycle_config(tokens: serde_json::Value, tpm: u64) -> String {
        serde_json::json!({"companion": {"upstream": "companion", "token": "test-token-0123456789"}, "failure_mode": "deny", "tokens": tokens,
            "limits": [{"name": "rpm", "requests": 2, "window": "1m"}, {"name": "tpm", "tokens": tpm, "window": "1m"}]})
        .to_string()
    }

    const CONVERSE: &str =
        r#"{"messages":[{"role":"user","content":[{"text":"hello world"}]}],"inferenceConfig":{"maxTokens":300}}"#;
    const INVOKE: &str = r#"{"anthropic_version":"bedrock-2023-05-31","max_tokens":300,"messages":[{"role":"user","content":"hello world"}]}"#;

    fn charge_costs(flight: &InFlight) -> Vec<(u64, Option<u64>)> {
        let charge: crate::protocol::ChargeRequest =
            serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge");
        charge.limits.iter().map(|l| (l.cost, l.min_cost)).collect()
    }

    /// Converse streamed and invoke streamed, each reply cut in two at every seventh byte
    /// (every byte: `every_two_way_split_gives_the_same_usage`): the tenant is
    /// the access key, the model the path's, and the settlement is what the stream reported.
    #[test]
    fn streams_settle_at_their_reported_usage_wherever_cut() {
        let streams = [
            ("/model/amazon.nova-lite-v1%3A0/converse-stream", CONVERSE, converse_stream(true), 151 + 10),
            (
                "/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke-with-response-stream",
                INVOKE,
                invoke_stream(),
                26 + 5,
            ),
        ];
        for (path, body, reply, used) in streams {
            let prompt = parse(path, body).prompt_tokens(O200K);
            for at in (0..=reply.len()).step_by(7) {
                let world = World::new(HostKind::Envoy);
                let mut proxy = Proxy::new(&world, &lifecycle_config(serde_json::json!({}), 10_000));
                let mut companion = FakeCompanion::default();
                let mut flight = proxy.send(signed_request("AKIDTENANT1", path, body), &mut companion);
                assert!(flight.forwarded(), "{path}");
                let charge: crate::protocol::ChargeRequest =
                    serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge");
                assert_eq!(charge.tenant, crate::api::identity::tenant_id("AKIDTENANT1"));
                assert_eq!(charge.limits[1].cost, prompt + 300, "{path}: the prompt counted and maxTokens");
                let (head, tail) = reply.split_at(at);
                proxy.reply_bytes(&mut flight, 200, EVENT_STREAM_CONTENT_TYPE, &[head, tail]);
                proxy.tick(Some(&mut companion));
                let settled = companion.settled.last().expect("settled");
                assert_eq!(settled.limits[0].credit, (prompt + 300) as i64 - used as i64, "{path} split at {at}");
            }
        }
    }

    /// A stream cut by an exception teaches nothing (a completed one teaches the tenant's
    /// average, which shrinks the next reservation). A `throttlingException` is the
    /// provider's rate limit stopping the model: charged the prompt and the output that
    /// came before it. Any other exception is an interrupted reply: charged at least its
    /// reservation (the provider may have generated more than it sent, `reply_floor`).
    #[test]
    fn an_exception_mid_stream_settles_as_the_provider_stopped_it() {
        let path = "/model/amazon.nova-lite-v1%3A0/converse-stream";
        let exception = |kind: &str| {
            encode(
                &[(":exception-type", kind), (":message-type", "exception")],
                br#"{"message":"Too many tokens, please wait before trying again."}"#,
            )
        };
        let throttled = [converse_stream(false), exception("throttlingException")].concat();
        let broken = [converse_stream(false), exception("modelStreamErrorException")].concat();
        let prompt = parse(path, CONVERSE).prompt_tokens(O200K);
        // (the stream, what it is charged, whether it teaches the average); the cut streams
        // sent 10 tokens before their exception.
        let cases =
            [(throttled, prompt + 10, false), (broken, prompt + 300, false), (converse_stream(true), 151 + 10, true)];
        for (reply, used, teaches) in cases {
            let world = World::new(HostKind::Envoy);
            let mut proxy = Proxy::new(&world, &lifecycle_config(serde_json::json!({}), 10_000));
            let mut companion = FakeCompanion::default();
            let mut flight = proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion);
            assert_eq!(charge_costs(&flight)[1].0, prompt + 300);
            proxy.reply_bytes(&mut flight, 200, EVENT_STREAM_CONTENT_TYPE, &[&reply]);
            proxy.tick(Some(&mut companion));
            // Nothing to give back is sent as no settlement at all.
            let credit = companion.settled.last().map_or(0, |settled| settled.limits[0].credit);
            assert_eq!(credit, (prompt + 300) as i64 - used as i64, "used {used}, teaches: {teaches}");
            let next = proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion);
            assert_eq!(charge_costs(&next)[1].0 < prompt + 300, teaches, "the next reservation, teaches: {teaches}");
        }
    }

    /// With `provider_limits`, a stream the provider throttled is its refusal: the
    /// credential's next request is answered here, in Bedrock's shape, for `default_retry`.
    #[test]
    fn throttling_mid_stream_is_heard_as_the_providers_refusal() {
        let path = "/model/amazon.nova-lite-v1%3A0/converse-stream";
        let throttled = encode(
            &[(":exception-type", "throttlingException"), (":message-type", "exception")],
            br#"{"message":"Too many tokens, please wait before trying again."}"#,
        );
        let reply = [converse_stream(false), throttled].concat();
        let mut config: serde_json::Value =
            serde_json::from_str(&lifecycle_config(serde_json::json!({}), 10_000)).expect("json");
        config["provider_limits"] = serde_json::json!({"enabled": true, "share": false, "default_retry": "4s"});
        for kind in [HostKind::Envoy, HostKind::Nginx] {
            let world = World::new(kind);
            let mut proxy = Proxy::new(&world, &config.to_string());
            let mut companion = FakeCompanion::default();
            let mut flight = proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion);
            proxy.reply_bytes(&mut flight, 200, EVENT_STREAM_CONTENT_TYPE, &[&reply]);
            assert_eq!(flight.host.metric(crate::effects::host::Metric::ProviderRefusalsSeen), 1, "{kind:?}");
            let next = proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion);
            let answered = next.replied().expect("answered here");
            assert_eq!(answered.status, 429, "{kind:?}");
            let header = |name: &str| answered.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str());
            assert_eq!(header("x-amzn-errortype").map(|v| v.starts_with("ThrottlingException")), Some(true));
            assert_eq!(header("retry-after"), Some("4"), "{kind:?}: default_retry");
            let other = proxy.send(signed_request("AKIDTENANT2", path, CONVERSE), &mut companion);
            assert!(other.forwarded(), "another credential is not held up");
        }
    }

    /// A corrupted stream reaches the client as it came, is settled on what came before
    /// the corruption, and is logged.
    #[test]
    fn a_corrupted_stream_is_settled_on_what_came_before_and_logged() {
        let path = "/model/amazon.nova-lite-v1%3A0/converse-stream";
        let world = World::new(HostKind::Envoy);
        let mut proxy = Proxy::new(&world, &lifecycle_config(serde_json::json!({}), 10_000));
        let mut companion = FakeCompanion::default();
        let mut flight = proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion);
        let mut reply = converse_stream(true);
        let metadata_start = converse_stream(false).len();
        reply[metadata_start + 20] ^= 0x01;
        proxy.reply_bytes(&mut flight, 200, EVENT_STREAM_CONTENT_TYPE, &[&reply]);
        proxy.tick(Some(&mut companion));
        // The metadata event is lost: charged the prompt as estimated and the 10 tokens
        // streamed, so the output allowance less 10 goes back.
        assert_eq!(companion.settled.last().expect("settled").limits[0].credit, 300 - 10);
        assert!(flight.host.logs.iter().any(|(_, line)| line.contains("BadMessageCrc")), "{:?}", flight.host.logs);
        assert_eq!(world.borrow().host_calls.get("replace_response_body"), None, "the stream passes unchanged");
    }

    /// With `clamp_max_tokens` a signed body is never rewritten: it is reserved at its
    /// prompt's bound plus its whole cap, all or nothing, and counted.
    #[test]
    fn clamping_never_rewrites_a_signed_body() {
        for (path, body) in [
            ("/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke", INVOKE),
            ("/model/amazon.nova-lite-v1%3A0/converse", CONVERSE),
        ] {
            let world = World::new(HostKind::Envoy);
            let tokens = serde_json::json!({"clamp_max_tokens": true, "min_output_tokens": 50});
            let mut proxy = Proxy::new(&world, &lifecycle_config(tokens, 10_000));
            let mut companion = FakeCompanion::default();
            let flight = proxy.send(signed_request("AKIDTENANT1", path, body), &mut companion);
            assert!(flight.forwarded());
            assert_eq!(flight.host.request_body, body.as_bytes(), "{path}: the body went unchanged");
            assert_eq!(world.borrow().host_calls.get("replace_request_body"), None);
            let parsed = parse(path, body);
            let bound = crate::plan::charge::prompt_bound(parsed.prompt_tokens(O200K), &parsed);
            assert_eq!(charge_costs(&flight)[1], (bound + 300, None), "{path}");
            assert_eq!(flight.host.metric(Metric::SignedNotClamped), 1);
            // Too little left for the whole cap: refused, not shrunk.
            let mut proxy = Proxy::new(&world, &lifecycle_config(serde_json::json!({"clamp_max_tokens": true}), 200));
            let refused = proxy.send(signed_request("AKIDTENANT2", path, body), &mut companion);
            assert_eq!(refused.replied().map(|r| r.status), Some(429), "{path}");
        }
    }

    #[test]
    fn a_refusal_is_in_bedrocks_shape() {
        let world = World::new(HostKind::Envoy);
        let mut proxy = Proxy::new(&world, &lifecycle_config(serde_json::json!({}), 10_000));
        let mut companion = FakeCompanion::default();
        let path = "/model/amazon.nova-lite-v1%3A0/converse";
        for _ in 0..2 {
            assert!(proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion).forwarded());
        }
        let refused = proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion);
        let reply = refused.replied().expect("a 429");
        assert_eq!(reply.status, 429);
        assert!(reply.headers.contains(&("x-amzn-errortype", "ThrottlingException".into())), "{:?}", reply.headers);
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON");
        assert!(body["message"].as_str().is_some_and(|m| m.contains("rpm")), "{body}");
        // An OpenAI request from the same proxy keeps OpenAI's shape.
        let chat = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
        for _ in 0..2 {
            assert!(proxy.send(Request::chat("sk-a", chat), &mut companion).forwarded());
        }
        let openai = proxy.send(Request::chat("sk-a", chat), &mut companion);
        let reply = openai.replied().expect("a 429");
        assert!(
            reply.body.contains("rate_limit_exceeded") && !reply.headers.iter().any(|(n, _)| *n == "x-amzn-errortype")
        );
    }

    /// The limiter unavailable (`failure_mode: deny`): Bedrock's 503, which its SDKs retry.
    #[test]
    fn an_unavailable_limiter_answers_in_bedrocks_shape() {
        let world = World::new(HostKind::Envoy);
        let mut proxy = Proxy::new(&world, &lifecycle_config(serde_json::json!({}), 10_000));
        let mut companion = FakeCompanion::failing(500);
        let path = "/model/amazon.nova-lite-v1%3A0/converse";
        let refused = proxy.send(signed_request("AKIDTENANT1", path, CONVERSE), &mut companion);
        let reply = refused.replied().expect("a 503");
        assert_eq!(reply.status, 503);
        assert!(reply.headers.contains(&("x-amzn-errortype", "ServiceUnavailableException".into())));
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("JSON");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any chunking of either stream gives the usage of the whole.
        #[test]
        fn any_chunking_gives_the_same_usage(cuts in proptest::collection::vec(0usize..300, 0..30), which in 0usize..3) {
            let stream = [converse_stream(true), converse_stream(false), invoke_stream()][which].clone();
            prop_assert_eq!(read(&stream, &cuts), read(&stream, &[]));
        }

        /// Mangled streams never panic.
        #[test]
        fn mutations_never_panic(flips in proptest::collection::vec((0usize..4000, any::<u8>()), 0..20), which in 0usize..3, cuts in proptest::collection::vec(0usize..300, 0..10)) {
            let mut stream = [converse_stream(true), converse_stream(false), invoke_stream()][which].clone();
            for (at, byte) in flips {
                let len = stream.len();
                stream[at % len] = byte;
            }
            let _ = read(&stream, &cuts);
        }
    }
}
