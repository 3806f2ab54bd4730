//! What a request body asks for: which API, which model, whether it streams, the output
//! cap, and how many prompt tokens it carries. Bodies are parsed once into a tree that
//! borrows from the body (`json::Json`) and walked; nothing here panics on any input.
//!
//! Where each API keeps these (its prompt, its output cap, how many completions it asks
//! for) is its provider's body shape (`providers::body_shape`); this reads any of them.

use crate::api::Api;
use crate::parse::json::{Json, JsonDoc};
use crate::providers::{body_shape, PathModel, Route};
use crate::tokens::Encoding;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct LlmRequest {
    pub api: Api,
    pub model: Option<String>,
    pub stream: bool,
    /// `stream_options.include_usage` as the client sent it.
    pub include_usage: bool,
    /// Whether the body has a `stream_options` field at all (whatever its value).
    stream_options_given: bool,
    /// `max_completion_tokens`, `max_tokens` or `max_output_tokens`, whichever applies.
    pub max_output: Option<u64>,
    /// How many completions one request generates, each up to `max_output`: OpenAI's `n`
    /// (and the legacy completions' `best_of`, the candidates generated server-side),
    /// Gemini's `generationConfig.candidateCount`; 1 elsewhere (Anthropic, Responses and
    /// Bedrock have none). At least 1.
    pub choices: u64,
    /// Where an output cap is written (see `rewritten`): a field, or a path of fields.
    cap_field: &'static [&'static str],
    /// The body is covered by the client's signature (see `providers::Route`).
    pub body_is_signed: bool,
}

/// A request body parsed: what it asks for, and the document its prompt is counted from.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedBody<'a> {
    pub request: LlmRequest,
    doc: JsonDoc<'a>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    NotJson(String),
    NotAnObject,
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::NotJson(err) => write!(f, "the body is not JSON: {err}"),
            BodyError::NotAnObject => f.write_str("the body is not a JSON object"),
        }
    }
}

/// The body parsed as `route`'s API, with what the path itself says (the model on
/// Bedrock, streaming, a signed body). `None` when the route names no API the filter
/// parses.
pub fn parse_on<'a>(route: &Route, body: &'a [u8]) -> Option<Result<ParsedBody<'a>, BodyError>> {
    let parsed = LlmRequest::parse(route.api?, body);
    Some(parsed.map(|mut parsed| {
        if let Some(streams) = route.streams {
            parsed.request.stream = streams;
        }
        if route.body_is_signed {
            parsed.request.body_is_signed = true;
            if let Some(PathModel::Model(model)) = &route.path_model {
                parsed.request.model = Some(model.clone());
            }
        }
        parsed
    }))
}

impl LlmRequest {
    pub fn parse(api: Api, body: &[u8]) -> Result<ParsedBody<'_>, BodyError> {
        let doc = Json::parse_request(body).map_err(BodyError::NotJson)?;
        let body = doc.root();
        if !body.is_object() {
            return Err(BodyError::NotAnObject);
        }
        let shape = body_shape(api);
        let max_output = (shape.max_output)(body);
        let cap_field = (shape.cap_field)(body);
        let choices = (shape.choices)(body);
        let request = LlmRequest {
            api,
            choices: choices.unwrap_or(1).max(1),
            model: body.at("model").as_str().map(str::to_string),
            stream: api == Api::StreamGenerateContent || body.at("stream").as_bool().unwrap_or(false),
            include_usage: body.at("stream_options").at("include_usage").as_bool().unwrap_or(false),
            stream_options_given: body.get("stream_options").is_some(),
            max_output,
            cap_field,
            body_is_signed: false,
        };
        Ok(ParsedBody { request, doc })
    }
}

impl ParsedBody<'_> {
    /// The end user the body names, as its API has one: OpenAI's `safety_identifier` (the
    /// field that replaced `user`), else `user`; Anthropic's `metadata.user_id`. Gemini and
    /// Bedrock name none: a limit per end user reads a trusted header there. A value that
    /// is not a string is no user (the provider refuses such a body). Read only where a
    /// limit is counted per end user, not on every request.
    pub fn end_user(&self) -> Option<String> {
        let body = self.doc.root();
        let named = match self.request.api {
            Api::ChatCompletions | Api::Completions | Api::Responses | Api::Embeddings => {
                body.at("safety_identifier").as_str().or_else(|| body.at("user").as_str())
            }
            Api::Messages => body.at("metadata").at("user_id").as_str(),
            Api::Converse | Api::GenerateContent | Api::StreamGenerateContent | Api::CountTokens => None,
        };
        named.map(str::to_string)
    }

    /// Prompt tokens under `encoding`, before any correction factor.
    pub fn prompt_tokens(&self, encoding: Encoding) -> u64 {
        self.prompt_tokens_with(&mut |text| encoding.count(text))
    }

    /// The prompt with each text measured in bytes instead of tokens, and the same fixed
    /// costs (per message, name, image, token id): at least what any tokenizer that makes
    /// at most one token of a byte of text counts, on the same structure.
    pub fn prompt_bytes(&self) -> u64 {
        self.prompt_tokens_with(&mut |text| text.len() as u64)
    }

    /// Prompt tokens, each text counted by `count`.
    pub fn prompt_tokens_with(&self, count: &mut impl FnMut(&str) -> u64) -> u64 {
        (body_shape(self.request.api).prompt)(self.doc.root(), count)
    }
}

impl LlmRequest {
    /// `body` (this request's) as it goes upstream instead of the client's: with
    /// `stream_options.include_usage` set (OpenAI chat streams only) and/or the output cap
    /// set to `max_output` (in the field this API uses). `None` if nothing changes.
    pub fn rewritten(&self, body: &[u8], request_usage: bool, max_output: Option<u64>) -> Option<Vec<u8>> {
        if self.body_is_signed {
            return None;
        }
        let add_usage = request_usage && self.wants_usage_added();
        let cap_field = max_output
            .filter(|&cap| self.max_output.is_none_or(|current| cap < current))
            .map(|cap| (self.cap_field, cap));
        if !add_usage && cap_field.is_none() {
            return None;
        }
        // The common case, a stream that says nothing of its options: the field is written
        // in front of the client's first, the rest of its bytes as they came.
        if add_usage && cap_field.is_none() && !self.stream_options_given {
            if let Some(body) = with_usage_asked(body) {
                return Some(body);
            }
        }
        // Clamping, or options to merge into: a whole Value is parsed and written again.
        let mut body: Value = serde_json::from_slice(body).ok()?;
        let object = body.as_object_mut()?;
        if add_usage {
            let options = object.entry("stream_options").or_insert_with(|| Value::Object(Default::default()));
            if !options.is_object() {
                *options = Value::Object(Default::default());
            }
            options.as_object_mut()?.insert("include_usage".into(), Value::Bool(true));
        }
        if let Some((path, cap)) = cap_field {
            let (field, parents) = path.split_last()?;
            let mut object = object;
            for parent in parents {
                let inner = object.entry(*parent).or_insert_with(|| Value::Object(Default::default()));
                if !inner.is_object() {
                    *inner = Value::Object(Default::default());
                }
                object = inner.as_object_mut()?;
            }
            object.insert((*field).into(), Value::from(cap));
        }
        serde_json::to_vec(&body).ok()
    }

    /// A streamed OpenAI chat request that does not ask for the final usage chunk.
    pub fn wants_usage_added(&self) -> bool {
        self.api == Api::ChatCompletions && self.stream && !self.include_usage
    }
}

/// `body`, an object whose first member is a key, with `"stream_options":
/// {"include_usage": true}` written before that key; `None` for any other shape.
fn with_usage_asked(body: &[u8]) -> Option<Vec<u8>> {
    const FIELD: &[u8] = br#""stream_options":{"include_usage":true},"#;
    let first_byte = |from: usize| {
        let rest = body.get(from..)?;
        rest.iter().position(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r')).map(|at| from + at)
    };
    let open = first_byte(0).filter(|&at| body.get(at) == Some(&b'{'))?;
    first_byte(open + 1).filter(|&at| body.get(at) == Some(&b'"'))?;
    let (head, tail) = body.split_at_checked(open + 1)?;
    Some([head, FIELD, tail].concat())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::prompt::IMAGE_TOKENS;

    const O200K: Encoding = Encoding::O200kBase;

    fn parse(api: Api, body: &str) -> ParsedBody<'_> {
        LlmRequest::parse(api, body.as_bytes()).expect(body)
    }

    fn request(api: Api, body: &str) -> LlmRequest {
        parse(api, body).request
    }

    #[test]
    fn recognises_apis_by_path() {
        let cases = [
            ("/v1/chat/completions", Some(Api::ChatCompletions)),
            ("/openai/deployments/gpt4o/chat/completions?api-version=2024-10-21", Some(Api::ChatCompletions)),
            ("/v1/completions", Some(Api::Completions)),
            ("/v1/responses", Some(Api::Responses)),
            ("/v1/embeddings/", Some(Api::Embeddings)),
            ("/v1/messages", Some(Api::Messages)),
            ("/v1/threads/messages", None),
            ("/v1/models", None),
            ("", None),
        ];
        for (path, api) in cases {
            assert_eq!(Api::from_path(&crate::parse::path::normalised(path)), api, "{path}");
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn chat_counts_follow_openais_formula() {
        // "hello world" is 2 tokens; "user" 1; 3 per message; 3 priming; "bob" 1 + 1 per name.
        let request =
            parse(Api::ChatCompletions, r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}]}"#);
        assert_eq!(request.prompt_tokens(O200K), 3 + 1 + 2 + 3);
        let named = parse(
            Api::ChatCompletions,
            r#"{"model":"gpt-4o","messages":[{"role":"user","name":"bob","content":"hello world"}]}"#,
        );
        assert_eq!(named.prompt_tokens(O200K), 3 + 1 + 2 + 3 + 1 + 1);
        let parts = parse(
            Api::ChatCompletions,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hello world"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#,
        );
        assert_eq!(parts.prompt_tokens(O200K), 3 + 1 + 2 + IMAGE_TOKENS + 3);
    }

    #[test]
    fn reads_model_stream_and_output_caps() {
        let chat = request(
            Api::ChatCompletions,
            r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":70,"messages":[]}"#,
        );
        assert_eq!(
            (chat.model.as_deref(), chat.stream, chat.include_usage, chat.max_output),
            (Some("gpt-4o"), true, true, Some(70))
        );
        let responses = request(Api::Responses, r#"{"model":"o3","input":"hi","max_output_tokens":900}"#);
        assert_eq!(responses.max_output, Some(900));
        let messages = request(Api::Messages, r#"{"model":"claude","max_tokens":1024,"messages":[]}"#);
        assert_eq!(messages.max_output, Some(1024));
        let embeddings = request(Api::Embeddings, r#"{"model":"text-embedding-3-small","input":["a","b"]}"#);
        assert_eq!(embeddings.max_output, Some(0));
        let unset = request(Api::ChatCompletions, r#"{"messages":[],"max_tokens":"lots"}"#);
        assert_eq!((unset.model, unset.stream, unset.max_output), (None, false, None));
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn counts_every_api_shape() {
        let hw = O200K.count("hello world");
        let cases = [
            (Api::Completions, r#"{"prompt":"hello world"}"#, hw),
            (Api::Completions, r#"{"prompt":["hello world","hello world"]}"#, 2 * hw),
            (Api::Completions, r#"{"prompt":[1,2,3]}"#, 3),
            (Api::Embeddings, r#"{"input":"hello world"}"#, hw),
            (Api::Embeddings, r#"{"input":[[1,2],[3]]}"#, 3),
            (Api::Responses, r#"{"input":"hello world"}"#, hw),
            (
                Api::Responses,
                r#"{"instructions":"hello world","input":[{"role":"user","content":[{"type":"input_text","text":"hello world"}]}]}"#,
                hw + 3 + 1 + hw,
            ),
            (
                Api::Messages,
                r#"{"system":"hello world","messages":[{"role":"user","content":"hello world"}]}"#,
                hw + 3 + 3 + 1 + hw,
            ),
            (
                Api::Messages,
                r#"{"system":[{"type":"text","text":"hello world","cache_control":{"type":"ephemeral"}}],"messages":[]}"#,
                hw + 3,
            ),
        ];
        for (api, body, expected) in cases {
            assert_eq!(parse(api, body).prompt_tokens(O200K), expected, "{body}");
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn tools_and_tool_calls_add_tokens() {
        let base = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let with_tools = r#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"get_weather","description":"Weather for a city","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]}"#;
        let with_call = r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"call_1","content":"sunny"}]}"#;
        let base = parse(Api::ChatCompletions, base).prompt_tokens(O200K);
        assert!(parse(Api::ChatCompletions, with_tools).prompt_tokens(O200K) > base + 10);
        assert!(parse(Api::ChatCompletions, with_call).prompt_tokens(O200K) > base + 10);
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn bad_bodies_are_errors_not_panics() {
        assert!(matches!(LlmRequest::parse(Api::ChatCompletions, b"{oops"), Err(BodyError::NotJson(_))));
        assert_eq!(LlmRequest::parse(Api::ChatCompletions, b"[1,2]"), Err(BodyError::NotAnObject));
        // Wrong types inside are ignored, not fatal.
        let odd = parse(Api::ChatCompletions, r#"{"messages":{"role":"user"},"tools":"none","stream":"yes"}"#);
        assert_eq!(odd.prompt_tokens(O200K), 0);
        assert!(!odd.request.stream);
    }

    #[test]
    fn requests_usage_in_streamed_chat_only_when_missing() {
        let rewritten = |api, body: &str, usage| request(api, body).rewritten(body.as_bytes(), usage, None);
        let streamed = r#"{"model":"m","stream":true,"messages":[]}"#;
        let body: Value =
            serde_json::from_slice(&rewritten(Api::ChatCompletions, streamed, true).expect("rewritten")).expect("json");
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["model"], "m");
        assert_eq!(rewritten(Api::ChatCompletions, streamed, false), None);
        let odd_options = r#"{"stream":true,"stream_options":5,"messages":[]}"#;
        assert!(rewritten(Api::ChatCompletions, odd_options, true).is_some());
        for already_fine in [
            r#"{"stream":true,"stream_options":{"include_usage":true},"messages":[]}"#,
            r#"{"stream":false,"messages":[]}"#,
        ] {
            assert_eq!(rewritten(Api::ChatCompletions, already_fine, true), None);
        }
        assert_eq!(rewritten(Api::Messages, r#"{"stream":true,"messages":[]}"#, true), None);
    }

    #[test]
    fn usage_is_asked_for_in_front_of_the_clients_bytes_or_merged_into_its_options() {
        let rewritten = |body: &str| {
            let bytes = request(Api::ChatCompletions, body).rewritten(body.as_bytes(), true, None).expect(body);
            String::from_utf8(bytes).expect("UTF-8")
        };
        // Nothing of the client's is re-encoded: its spacing, key order and escapes stay.
        let body = " {\n  \"stream\": true, \"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"caf\\u00e9\"}]}";
        assert_eq!(
            rewritten(body),
            " {\"stream_options\":{\"include_usage\":true},\n  \"stream\": true, \"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"caf\\u00e9\"}]}"
        );
        // Options the client gave, in any spelling or shape, are merged into as before.
        for body in [
            r#"{"stream":true,"stream_options":{"include_usage":false,"other":1},"messages":[]}"#,
            r#"{"stream":true,"stream_\u006fptions":null,"messages":[]}"#,
        ] {
            let rewritten: Value = serde_json::from_str(&rewritten(body)).expect("JSON");
            assert_eq!(rewritten["stream_options"]["include_usage"], true, "{body}");
            assert_eq!(rewritten.as_object().map(|o| o.keys().filter(|k| *k == "stream_options").count()), Some(1));
        }
    }

    #[test]
    fn caps_output_in_the_field_each_api_uses() {
        let cases = [
            (Api::ChatCompletions, r#"{"messages":[],"max_tokens":900}"#, "max_tokens"),
            (Api::ChatCompletions, r#"{"messages":[],"max_completion_tokens":900}"#, "max_completion_tokens"),
            (Api::ChatCompletions, r#"{"messages":[]}"#, "max_completion_tokens"),
            (Api::Responses, r#"{"input":"x"}"#, "max_output_tokens"),
            (Api::Messages, r#"{"max_tokens":900,"messages":[]}"#, "max_tokens"),
        ];
        for (api, body, field) in cases {
            let rewritten: Value =
                serde_json::from_slice(&request(api, body).rewritten(body.as_bytes(), false, Some(300)).expect(body))
                    .expect("json");
            assert_eq!(rewritten[field], 300, "{body}");
        }
        // A cap at or above what the client asked for changes nothing.
        let body = r#"{"max_tokens":200,"messages":[]}"#;
        assert_eq!(request(Api::Messages, body).rewritten(body.as_bytes(), false, Some(200)), None);
    }
}
