//! Which API family a caller speaks, so that what the filter answers it itself (429, 413,
//! 503 and the other local replies, and the provider's own rate-limit headers) comes in
//! the shape that family's SDKs parse. Chosen per request from the path, which is known
//! when the request headers arrive, before any body: even a refusal that never reads the
//! body (a missing API key, a request limit) answers in the caller's shape. The config's
//! `error_format` may fix it instead. `crate::answers` builds the shapes.

use crate::providers::bedrock::BedrockRoute;
use crate::request::Api;
use serde::Deserialize;

/// An API family, as far as the shape of errors and rate-limit headers goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// OpenAI's `{"error": {"message", "type", "param", "code"}}` and `x-ratelimit-*`
    /// headers; also what every API that copies OpenAI's shapes (Azure OpenAI, vLLM,
    /// Ollama...) and every unknown path gets.
    #[default]
    OpenAi,
    /// Anthropic's `{"type": "error", "error": {"type", "message"}}` and
    /// `anthropic-ratelimit-*` headers.
    Anthropic,
    /// Google's (Gemini, Vertex AI) `{"error": {"code", "message", "status", "details"}}`;
    /// no rate-limit headers of its own.
    Google,
    /// AWS Bedrock's `x-amzn-ErrorType` header and `{"message"}`; no rate-limit headers
    /// of its own.
    Bedrock,
}

impl Dialect {
    /// The family of a request the filter parses.
    pub fn of_api(api: Api) -> Dialect {
        match api {
            Api::ChatCompletions | Api::Completions | Api::Responses | Api::Embeddings => Dialect::OpenAi,
            Api::Messages => Dialect::Anthropic,
            Api::Converse => Dialect::Bedrock,
            Api::GenerateContent | Api::StreamGenerateContent | Api::CountTokens => Dialect::Google,
        }
    }

    /// The family a path belongs to (the query ignored): Google's and Bedrock's path
    /// shapes first (Bedrock's `invoke` carries Anthropic's body, yet its callers are
    /// AWS's SDKs), then the API the filter parses from the path, else OpenAI's.
    pub fn of_path(path: &str) -> Dialect {
        let bare = path.split(['?', '#']).next().unwrap_or("").trim_end_matches('/');
        if is_google_path(bare) {
            Dialect::Google
        } else if BedrockRoute::from_path(bare).is_some() {
            Dialect::Bedrock
        } else {
            Api::from_path(path).map_or(Dialect::OpenAi, Dialect::of_api)
        }
    }
}

/// Google's method calls on a model: `/v1beta/models/{model}:generateContent` (Gemini),
/// `/v1/projects/{p}/locations/{l}/publishers/google/models/{model}:streamGenerateContent`
/// (Vertex AI), and the other `models/{model}:{method}` calls.
fn is_google_path(path: &str) -> bool {
    let mut segments = path.rsplit('/');
    let last = segments.next().unwrap_or("");
    let method_call = last.split_once(':').is_some_and(|(model, method)| !model.is_empty() && !method.is_empty());
    method_call && segments.next() == Some("models")
}

/// The config's `error_format`: whose shape the filter answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorFormat {
    /// The caller's, by the request's path.
    #[default]
    Auto,
    Openai,
    Anthropic,
    Google,
    Bedrock,
}

impl ErrorFormat {
    /// The dialect a request on `path` is answered in.
    pub fn dialect(self, path: &str) -> Dialect {
        match self {
            ErrorFormat::Auto => Dialect::of_path(path),
            ErrorFormat::Openai => Dialect::OpenAi,
            ErrorFormat::Anthropic => Dialect::Anthropic,
            ErrorFormat::Google => Dialect::Google,
            ErrorFormat::Bedrock => Dialect::Bedrock,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_says_which_family_answers() {
        let cases = [
            ("/v1/chat/completions", Dialect::OpenAi),
            ("/v1/responses?stream=true", Dialect::OpenAi),
            ("/openai/deployments/gpt4/chat/completions?api-version=2024-10-21", Dialect::OpenAi),
            ("/v1/embeddings", Dialect::OpenAi),
            ("/v1/messages", Dialect::Anthropic),
            ("/anthropic/v1/messages/", Dialect::Anthropic),
            ("/v1beta/models/gemini-2.0-flash:generateContent", Dialect::Google),
            ("/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", Dialect::Google),
            (
                "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-pro:generateContent",
                Dialect::Google,
            ),
            ("/model/anthropic.claude-3-5-sonnet-20240620-v1:0/converse", Dialect::Bedrock),
            ("/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2Fx/converse-stream", Dialect::Bedrock),
            ("/model/m/invoke-with-response-stream", Dialect::Bedrock),
            ("/model/m/invoke", Dialect::Bedrock),
            // Not quite either: the default.
            ("/models/:generateContent", Dialect::OpenAi),
            ("/model//converse", Dialect::OpenAi),
            ("/v1/models", Dialect::OpenAi),
            ("", Dialect::OpenAi),
            ("/", Dialect::OpenAi),
        ];
        for (path, dialect) in cases {
            assert_eq!(Dialect::of_path(path), dialect, "{path}");
        }
    }

    #[test]
    fn a_fixed_format_overrides_the_path() {
        assert_eq!(ErrorFormat::Auto.dialect("/v1/messages"), Dialect::Anthropic);
        assert_eq!(ErrorFormat::Openai.dialect("/v1/messages"), Dialect::OpenAi);
        assert_eq!(ErrorFormat::Google.dialect("/v1/chat/completions"), Dialect::Google);
        assert_eq!(ErrorFormat::Bedrock.dialect("/anything"), Dialect::Bedrock);
        assert_eq!(ErrorFormat::Anthropic.dialect(""), Dialect::Anthropic);
    }
}
