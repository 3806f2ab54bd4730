//! Google's Gemini API (Generative Language, `/v1beta/models/{model}:generateContent`) and
//! Vertex AI (`/v1/projects/{p}/locations/{l}/publishers/google/models/{model}:...`): the
//! model from the path, the prompt from `contents`, `systemInstruction` and `tools`, the
//! output cap in `generationConfig.maxOutputTokens`, usage from `usageMetadata`, and
//! Google's error shape for the filter's own replies.
//!
//! Gemini's tokenizer is not public: the prompt is counted with the configured encoding
//! (an estimate, corrected by calibration against the `promptTokenCount` replies report).

use super::{BodyShape, ErrorEnvelope, Provider, Route, MAX_MODEL_NAME};
use crate::api::identity::{CredentialPlace, BEARER};
use crate::api::prompt::as_count;
use crate::api::refusal::Refusal;
use crate::api::{text_leaves, Api, ReportedUsage};
use crate::parse::json::Json;
use serde_json::json;

/// Where Gemini and Vertex AI read the caller's credential: the API key (header or `?key=`) or an OAuth access token.
pub const CREDENTIALS: [CredentialPlace<'static>; 3] =
    [CredentialPlace::Header { name: "x-goog-api-key", prefix: None }, CredentialPlace::Query("key"), BEARER];

/// What a 401 tells Gemini's and Vertex AI's callers who sent no credential.
pub const MISSING_CREDENTIAL: &str =
    "No API key provided. Send it in the 'x-goog-api-key' header (Vertex AI: 'Authorization: Bearer <token>') \
     or in the header the operator configured.";

/// What a Gemini image, video frame or file part costs: Google bills an image of up to
/// 384x384 pixels as 258 tokens (larger ones are tiled at 258 a tile).
pub const MEDIA_PART_TOKENS: u64 = 258;

/// The method in the path's last segment (`{model}:{method}`, on `models` or
/// `tunedModels`), the colon possibly percent-encoded. A method the filter does not parse
/// (`:embedContent`) is still Google's: it routes with no API.
pub(super) fn route(path: &str) -> Option<Route> {
    let (parent, last) = path.rsplit_once('/')?;
    let collection = parent.rsplit('/').next()?;
    if collection != "models" && collection != "tunedModels" {
        return None;
    }
    let last = percent_encoding::percent_decode_str(last).decode_utf8().ok()?;
    let (model, method) = last.rsplit_once(':')?;
    if method.is_empty() {
        return None;
    }
    let api = match method {
        "generateContent" => Some(Api::GenerateContent),
        "streamGenerateContent" => Some(Api::StreamGenerateContent),
        "countTokens" => Some(Api::CountTokens),
        _ => None,
    };
    let valid =
        api.is_some() && !model.is_empty() && model.len() <= MAX_MODEL_NAME && !model.chars().any(char::is_control);
    Some(Route {
        provider: Provider::Gemini,
        api,
        path_model: valid.then(|| super::PathModel::Model(model.to_string())),
        streams: (api == Some(Api::StreamGenerateContent)).then_some(true),
        body_is_signed: false,
        dialect: Provider::Gemini.dialect(),
    })
}

/// `generateContent` and `streamGenerateContent`: the output cap and the candidates in
/// `generationConfig`.
pub const GENERATE_CONTENT: BodyShape = BodyShape {
    max_output: |body| as_count(body.at("generationConfig").at("maxOutputTokens")),
    cap_field: |_| &["generationConfig", "maxOutputTokens"],
    choices: |body| as_count(body.at("generationConfig").at("candidateCount")),
    prompt: |body, count| prompt_tokens(body, count),
};

/// `countTokens` generates nothing and is charged nothing.
pub const COUNT_TOKENS: BodyShape = BodyShape {
    max_output: |_| Some(0),
    cap_field: |_| &["generationConfig", "maxOutputTokens"],
    choices: |_| None,
    prompt: |_, _| 0,
};

/// Prompt tokens of a `generateContent` body: the text of every part of `contents` and
/// `systemInstruction` (function calls and results as their JSON), each media part at
/// `MEDIA_PART_TOKENS`, and function declarations counted as text. Google adds no
/// published per-turn overhead, so none is added here.
pub(crate) fn prompt_tokens(body: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    let contents = body
        .at("contents")
        .as_array()
        .map_or(0, |contents| contents.map(|content| parts(content.at("parts"), count)).sum::<u64>());
    let system = parts(body.at("systemInstruction").at("parts"), count);
    let tools = body.at("tools").as_array().map_or(0, |tools| {
        let declarations = tools.flat_map(|tool| tool.at("functionDeclarations").as_array().into_iter().flatten());
        declarations.map(|declaration| text_leaves(declaration, count)).sum::<u64>()
    });
    contents + system + tools
}

fn parts(parts: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    let Some(parts) = parts.as_array() else { return 0 };
    parts
        .map(|part| {
            if let Some(text) = part.at("text").as_str() {
                count(text)
            } else if part.get("inlineData").is_some() || part.get("fileData").is_some() {
                MEDIA_PART_TOKENS
            } else if let Some(call) = part.get("functionCall") {
                count(call.at("name").as_str().unwrap_or("")) + count(&call.at("args").to_json_string())
            } else if let Some(result) = part.get("functionResponse") {
                count(result.at("name").as_str().unwrap_or("")) + count(&result.at("response").to_json_string())
            } else {
                count(part.at("executableCode").at("code").as_str().unwrap_or(""))
                    + count(part.at("codeExecutionResult").at("output").as_str().unwrap_or(""))
            }
        })
        .sum()
}

/// Usage from a `usageMetadata` object. Input: `promptTokenCount` (which includes the
/// cached content) plus `toolUsePromptTokenCount`; output: `candidatesTokenCount` plus
/// `thoughtsTokenCount` (thinking is billed as output); cached: `cachedContentTokenCount`.
pub(crate) fn usage_from_metadata(metadata: Json) -> ReportedUsage {
    let field = |name: &str| metadata.at(name).as_u64();
    let sum = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    };
    ReportedUsage {
        input: sum(field("promptTokenCount"), field("toolUsePromptTokenCount")),
        output: sum(field("candidatesTokenCount"), field("thoughtsTokenCount")),
        cached_input: field("cachedContentTokenCount"),
        reasoning: field("thoughtsTokenCount"),
    }
}

/// The generated text of one streamed response: every part's text (thoughts included,
/// since they are billed as output), for a stream that never reports its usage.
pub(crate) fn streamed_texts<'a>(message: Json<'a>) -> impl Iterator<Item = &'a str> + 'a {
    message
        .at("candidates")
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|candidate| candidate.at("content").at("parts").as_array().into_iter().flatten())
        .filter_map(|part| part.at("text").as_str())
}

/// Whether a streamed response ends its candidates (`finishReason` set).
pub(crate) fn is_final(message: Json) -> bool {
    message
        .at("candidates")
        .as_array()
        .is_some_and(|mut candidates| candidates.any(|c| c.at("finishReason").as_str().is_some()))
}

/// Google's error: `{"error": {"code", "message", "status", "details"}}` with the
/// canonical status names and, when the time to retry is known, a `google.rpc.RetryInfo`.
pub(super) fn error_envelope(refusal: Refusal, message: &str, retry_after_seconds: Option<u64>) -> ErrorEnvelope {
    let details: Vec<_> = retry_after_seconds
        .map(|s| json!({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": format!("{s}s")}))
        .into_iter()
        .collect();
    let status = refusal.status();
    ErrorEnvelope::body(
        json!({"error": {"code": status, "message": message, "status": error_status(refusal), "details": details}}),
    )
}

/// Google's canonical status name (google.rpc.Code) for the HTTP status.
fn error_status(refusal: Refusal) -> &'static str {
    match refusal {
        // Google answers a spent quota (a per-day one too) with RESOURCE_EXHAUSTED, as a
        // per-minute one; answered with 403 (`refusals.spent_status`), its status name is
        // the one HTTP 403 maps to.
        Refusal::RateLimited(_) | Refusal::NeverFits(_) | Refusal::QuotaSpent { status: 429 } => "RESOURCE_EXHAUSTED",
        Refusal::QuotaSpent { .. } => "PERMISSION_DENIED",
        Refusal::TooLarge => "INVALID_ARGUMENT",
        Refusal::Unavailable => "UNAVAILABLE",
        Refusal::Unidentified => "UNAUTHENTICATED",
        Refusal::NotPriced | Refusal::Suspended => "PERMISSION_DENIED",
        Refusal::Unreadable(_) => "INVALID_ARGUMENT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readers::request::LlmRequest;
    use crate::tokens::Encoding;
    use serde_json::json;

    const O200K: Encoding = Encoding::O200kBase;

    #[test]
    fn reads_the_model_and_method_from_both_path_shapes() {
        let model = |m: &str| Some(super::super::PathModel::Model(m.to_string()));
        let cases = [
            (
                "/v1beta/models/gemini-2.5-flash:generateContent",
                Some((Some(Api::GenerateContent), model("gemini-2.5-flash"))),
            ),
            (
                "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
                Some((Some(Api::StreamGenerateContent), model("gemini-2.5-pro"))),
            ),
            ("/v1/models/gemini-2.0-flash%3AcountTokens", Some((Some(Api::CountTokens), model("gemini-2.0-flash")))),
            (
                "/v1/projects/p-1/locations/us-central1/publishers/google/models/gemini-2.5-flash:generateContent",
                Some((Some(Api::GenerateContent), model("gemini-2.5-flash"))),
            ),
            (
                "/v1beta1/projects/p/locations/global/publishers/google/models/gemini%2D2.5:streamGenerateContent",
                Some((Some(Api::StreamGenerateContent), model("gemini-2.5"))),
            ),
            ("/v1beta/tunedModels/my-tune:generateContent", Some((Some(Api::GenerateContent), model("my-tune")))),
            ("/v1beta/models/:generateContent", Some((Some(Api::GenerateContent), None))),
            // Google's, though not a call the filter parses: answered in Google's shape.
            ("/v1beta/models/gemini:embedContent", Some((None, None))),
            ("/v1beta/models/gemini:", None),
            ("/v1beta/files/x:generateContent", None),
            ("/v1beta/models/gemini-2.5-flash", None),
            ("/v1beta/models/%FF%FE:generateContent", None),
        ];
        for (path, expected) in cases {
            let found = super::super::route(path).map(|r| (r.api, r.path_model));
            assert_eq!(found, expected, "{path}");
        }
        let long = format!("/v1beta/models/{}:generateContent", "m".repeat(MAX_MODEL_NAME + 1));
        assert_eq!(super::super::route(&long).map(|r| r.path_model), Some(None));
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn counts_contents_system_instruction_tools_and_media() {
        let hw = O200K.count("hello world");
        let count =
            |body: &str| LlmRequest::parse(Api::GenerateContent, body.as_bytes()).expect(body).prompt_tokens(O200K);
        assert_eq!(count(r#"{"contents":[{"role":"user","parts":[{"text":"hello world"}]}]}"#), hw);
        assert_eq!(
            count(
                r#"{"systemInstruction":{"parts":[{"text":"hello world"}]},"contents":[{"parts":[{"text":"hello world"},{"inlineData":{"mimeType":"image/png","data":"AAAA"}}]},{"role":"model","parts":[{"text":"hello world","thoughtSignature":"c2lnbmF0dXJlIGJ5dGVzIHRoYXQgYXJlIG5vdCB0ZXh0"}]}]}"#
            ),
            3 * hw + MEDIA_PART_TOKENS
        );
        let with_tools = count(
            r#"{"contents":[{"parts":[{"text":"hello world"}]}],"tools":[{"functionDeclarations":[{"name":"get_weather","description":"Weather for a city","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}]}]}"#,
        );
        assert!(with_tools > hw + 10, "{with_tools}");
        let calls = count(
            r#"{"contents":[{"role":"model","parts":[{"functionCall":{"name":"get_weather","args":{"city":"Paris"}}}]},{"role":"user","parts":[{"functionResponse":{"name":"get_weather","response":{"sky":"sunny"}}}]}]}"#,
        );
        assert_eq!(
            calls,
            2 * O200K.count("get_weather") + O200K.count(r#"{"city":"Paris"}"#) + O200K.count(r#"{"sky":"sunny"}"#)
        );
        // Wrong types are ignored, not fatal.
        assert_eq!(
            count(r#"{"contents":{"parts":"x"},"systemInstruction":7,"tools":[{"functionDeclarations":3}]}"#),
            0
        );
    }

    #[test]
    fn the_output_cap_and_streaming_come_from_the_config_and_path() {
        let body = r#"{"contents":[],"generationConfig":{"maxOutputTokens":900,"temperature":0.2}}"#;
        let request = LlmRequest::parse(Api::StreamGenerateContent, body.as_bytes()).expect("parsed").request;
        assert_eq!((request.max_output, request.stream, request.model), (Some(900), true, None));
        let plain = LlmRequest::parse(Api::GenerateContent, br#"{"contents":[]}"#).expect("parsed").request;
        assert_eq!((plain.max_output, plain.stream), (None, false));
        let count =
            LlmRequest::parse(Api::CountTokens, br#"{"contents":[{"parts":[{"text":"hi"}]}]}"#).expect("parsed");
        assert_eq!((count.request.max_output, count.prompt_tokens(O200K)), (Some(0), 0));
    }

    #[test]
    fn clamping_writes_the_cap_into_generation_config() {
        let rewritten = |body: &str| -> serde_json::Value {
            let request = LlmRequest::parse(Api::GenerateContent, body.as_bytes()).expect(body).request;
            serde_json::from_slice(&request.rewritten(body.as_bytes(), true, Some(300)).expect(body)).expect("json")
        };
        let kept = rewritten(r#"{"contents":[],"generationConfig":{"maxOutputTokens":900,"temperature":0.2}}"#);
        assert_eq!(kept["generationConfig"], json!({"maxOutputTokens": 300, "temperature": 0.2}));
        assert_eq!(rewritten(r#"{"contents":[]}"#)["generationConfig"]["maxOutputTokens"], 300);
        assert_eq!(
            rewritten(r#"{"contents":[],"generationConfig":"odd"}"#)["generationConfig"]["maxOutputTokens"],
            300
        );
        assert!(kept.get("stream_options").is_none(), "Gemini always reports usage: nothing to ask for");
        let body = r#"{"contents":[],"generationConfig":{"maxOutputTokens":200}}"#;
        let request = LlmRequest::parse(Api::GenerateContent, body.as_bytes()).expect("parsed").request;
        assert_eq!(request.rewritten(body.as_bytes(), true, Some(300)), None, "a larger grant changes nothing");
    }

    #[test]
    fn usage_metadata_maps_thoughts_to_output_and_tool_prompts_to_input() {
        let usage = |text: &str| usage_from_metadata(Json::parse(text.as_bytes()).expect(text).root());
        assert_eq!(
            usage(
                r#"{"promptTokenCount":12,"candidatesTokenCount":9,"thoughtsTokenCount":20,"cachedContentTokenCount":4,"toolUsePromptTokenCount":3,"totalTokenCount":44}"#
            ),
            ReportedUsage { input: Some(15), output: Some(29), cached_input: Some(4), reasoning: Some(20) }
        );
        assert_eq!(
            usage(r#"{"promptTokenCount":12,"totalTokenCount":12}"#),
            ReportedUsage { input: Some(12), output: None, cached_input: None, reasoning: None }
        );
        assert_eq!(
            usage(r#"{"thoughtsTokenCount":7}"#),
            ReportedUsage { input: None, output: Some(7), cached_input: None, reasoning: Some(7) }
        );
        assert_eq!(usage(r#"{"trafficType":"ON_DEMAND"}"#), ReportedUsage::default());
    }
}
