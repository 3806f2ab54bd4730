//! Which API family a caller speaks, so that what the filter answers it itself (429, 413,
//! 503 and the other local replies, and the provider's own rate-limit headers) comes in
//! the shape that family's SDKs parse. Chosen per request from its route (the path's
//! provider: `providers::Route`'s `dialect`), which is known
//! when the request headers arrive, before any body: even a refusal that never reads the
//! body (a missing API key, a request limit) answers in the caller's shape. The config's
//! `error_format` may fix it instead. `crate::replies::answers` builds the shapes.

use serde::{Deserialize, Serialize};

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

/// The config's `error_format`: whose shape the filter answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorFormat {
    /// The caller's: the dialect of the request's route.
    #[default]
    Auto,
    Openai,
    Anthropic,
    Google,
    Bedrock,
}

impl ErrorFormat {
    /// The dialect a request whose route answers in `of_route` is answered in.
    pub fn dialect(self, of_route: Dialect) -> Dialect {
        match self {
            ErrorFormat::Auto => of_route,
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
    fn a_fixed_format_overrides_the_path() {
        assert_eq!(ErrorFormat::Auto.dialect(Dialect::Anthropic), Dialect::Anthropic);
        assert_eq!(ErrorFormat::Openai.dialect(Dialect::Anthropic), Dialect::OpenAi);
        assert_eq!(ErrorFormat::Google.dialect(Dialect::OpenAi), Dialect::Google);
        assert_eq!(ErrorFormat::Bedrock.dialect(Dialect::Google), Dialect::Bedrock);
        assert_eq!(ErrorFormat::Anthropic.dialect(Dialect::Bedrock), Dialect::Anthropic);
    }
}
