//! The vocabulary every layer above the base parsers shares: which API a request speaks,
//! the usage a reply reports, and what of a JSON value is text a model reads. The
//! providers' modules describe their shapes in these terms; the readers (`request`,
//! `usage`) and the accounting use them.

pub mod dialect;
pub mod identity;
pub mod prompt;
pub mod refusal;

use crate::parse::json::{Json, Kind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI `/v1/chat/completions` (and Azure's deployments path).
    ChatCompletions,
    /// OpenAI legacy `/v1/completions`.
    Completions,
    /// OpenAI `/v1/responses`.
    Responses,
    /// OpenAI `/v1/embeddings`.
    Embeddings,
    /// Anthropic `/v1/messages`.
    Messages,
    /// AWS Bedrock Converse (`/model/{modelId}/converse[-stream]`, see `providers::bedrock`).
    Converse,
    /// Gemini and Vertex AI `…/models/{model}:generateContent` (see `providers::gemini`).
    GenerateContent,
    /// Gemini and Vertex AI `:streamGenerateContent`: SSE with `alt=sse`, else a JSON array.
    StreamGenerateContent,
    /// Gemini and Vertex AI `:countTokens`: generates nothing, charged no tokens.
    CountTokens,
}

impl Api {
    /// Recognises the API by a normalised path's (`crate::parse::path`) last segments, so
    /// prefixes (`/openai/deployments/x/...`, `/proxy/v1/...`) work too.
    pub fn from_path(path: &str) -> Option<Api> {
        if path.ends_with("/chat/completions") {
            Some(Api::ChatCompletions)
        } else if path.ends_with("/completions") {
            Some(Api::Completions)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else if path.ends_with("/embeddings") {
            Some(Api::Embeddings)
        } else if path.ends_with("/messages") && !path.ends_with("/threads/messages") {
            Some(Api::Messages)
        } else {
            None
        }
    }

    pub fn produces_output(self) -> bool {
        !matches!(self, Api::Embeddings | Api::CountTokens)
    }
}

/// What one message reported; later reports override earlier ones field by field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReportedUsage {
    pub input: Option<u64>,
    pub output: Option<u64>,
    /// Of the input, tokens read from the provider's prompt cache (billed at a lower
    /// price by most providers).
    pub cached_input: Option<u64>,
    /// Of the output, tokens the model spent reasoning (OpenAI's `reasoning_tokens`,
    /// Gemini's `thoughtsTokenCount`): reported, not charged apart.
    pub reasoning: Option<u64>,
}

impl ReportedUsage {
    pub(crate) fn merge(&mut self, later: ReportedUsage) {
        self.input = later.input.or(self.input);
        self.output = later.output.or(self.output);
        self.cached_input = later.cached_input.or(self.cached_input);
        self.reasoning = later.reasoning.or(self.reasoning);
    }

    pub fn is_empty(self) -> bool {
        self.input.is_none() && self.output.is_none()
    }
}

/// Every string in a JSON value except identifiers and data blobs, plus the key names of
/// objects that carry free-form JSON (tool arguments, schemas).
pub fn text_leaves(value: Json, count: &mut (impl FnMut(&str) -> u64 + ?Sized)) -> u64 {
    const SKIPPED: [&str; 9] =
        ["type", "id", "call_id", "tool_use_id", "tool_call_id", "cache_control", "source", "detail", "status"];
    match value.kind() {
        Kind::String(text) => count(text),
        Kind::Array(items) => items.map(|v| text_leaves(v, count)).sum(),
        Kind::Object(fields) => fields
            .filter(|(key, _)| !SKIPPED.contains(key))
            .map(|(key, v)| match v.kind() {
                Kind::Object(_) | Kind::Array(_)
                    if key == "input" || key == "parameters" || key == "input_schema" || key == "properties" =>
                {
                    // Schemas and tool inputs reach the model as JSON text.
                    count(&v.to_json_string())
                }
                _ => text_leaves(v, count),
            })
            .sum(),
        Kind::Number(n) => count(&n.to_string()),
        _ => 0,
    }
}
