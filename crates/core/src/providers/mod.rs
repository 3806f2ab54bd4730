//! The providers the filter knows, one module each, and their registration. A provider's
//! module owns what is its API's: its paths (into a `Route`), its body shapes (where the
//! prompt is, where the output cap is and how it is rewritten, how many completions a
//! request asks for), its usage (JSON and streamed) and how its streams end, and where
//! its upstream reads the caller's credential, and the names of its rate-limit headers
//! (which `replies` renders and `effects::provider_word` reads). This module ties them
//! together: the `Provider` list, the order paths are tried in, which module's shape
//! each `Api` is, and the order usage shapes are read in. The modules import only the layers below
//! (`parse`, `tokens`, `api`) and this registry's types.
//!
//! | provider | paths | model |
//! |---|---|---|
//! | OpenAI, OpenAI-compatible servers (`openai`) | `…/chat/completions`, `…/completions`, `…/responses`, `…/embeddings` | the body's `model` |
//! | Anthropic (`anthropic`) | `…/messages` | the body's `model` |
//! | Gemini, Vertex AI (`gemini`) | `…/models/{model}:generateContent`, `:streamGenerateContent`, `:countTokens` | the path |
//! | Azure OpenAI (`azure`) | `/openai/deployments/{deployment}/…` | `deployments` in the config, else the deployment's name |
//! | Azure OpenAI v1 (`azure`) | `/openai/v1/…`, `/openai/responses` | the body's `model`, a deployment name, mapped the same way |
//! | AWS Bedrock (`bedrock`) | `…/model/{modelId}/converse`, `/converse-stream`, `/invoke`, `/invoke-with-response-stream` | the path |

pub mod anthropic;
pub mod azure;
pub mod bedrock;
pub mod gemini;
pub mod openai;

use crate::api::dialect::Dialect;
use crate::api::identity::{CredentialPlace, BEARER, SIGV4};
use crate::api::refusal::Refusal;
use crate::api::{Api, ReportedUsage};
use crate::parse::json::Json;
use std::collections::BTreeMap;

/// A model name (from a path, a reply or the config) is at most this long; a longer one
/// is not a model's.
pub const MAX_MODEL_NAME: usize = 256;

/// Whose API a path belongs to: what the filter answers in (its `Dialect`) and whose
/// module reads the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// OpenAI, and every server that copies its paths (vLLM, Ollama...).
    OpenAi,
    Anthropic,
    /// Gemini and Vertex AI.
    Gemini,
    Azure,
    Bedrock,
}

/// Every place a family reads: on a path no family is recognised in, the upstream may be
/// any of them, so all must agree.
pub const EVERY_CREDENTIAL_PLACE: [CredentialPlace<'static>; 6] = [
    BEARER,
    CredentialPlace::Header { name: "x-api-key", prefix: None },
    CredentialPlace::Header { name: "x-goog-api-key", prefix: None },
    CredentialPlace::Header { name: "api-key", prefix: None },
    SIGV4,
    CredentialPlace::Query("key"),
];

impl Provider {
    /// Where this provider's upstream reads the caller's credential: the only places the
    /// tenant is read from, so a client cannot name itself by adding a header the
    /// upstream ignores.
    pub fn credentials(self) -> &'static [CredentialPlace<'static>] {
        match self {
            Provider::OpenAi => &openai::CREDENTIALS,
            Provider::Anthropic => &anthropic::CREDENTIALS,
            Provider::Gemini => &gemini::CREDENTIALS,
            Provider::Azure => &azure::CREDENTIALS,
            Provider::Bedrock => &bedrock::CREDENTIALS,
        }
    }

    /// The shape of the filter's own answers to this provider's callers.
    pub const fn dialect(self) -> Dialect {
        match self {
            Provider::OpenAi | Provider::Azure => Dialect::OpenAi,
            Provider::Anthropic => Dialect::Anthropic,
            Provider::Gemini => Dialect::Google,
            Provider::Bedrock => Dialect::Bedrock,
        }
    }
}

/// What the path says about a request: read once, when its headers arrive, and the only
/// reading of the path there is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub provider: Provider,
    /// The API whose body the filter parses; `None` for a provider's call the filter does
    /// not parse (Gemini's `:embedContent`), still answered in the provider's shape.
    pub api: Option<Api>,
    /// The model or deployment the path names, if it names one (and it is a valid name).
    pub path_model: Option<PathModel>,
    /// Whether the reply streams, when the path decides it (Bedrock's `-stream`
    /// operations, Gemini's `:streamGenerateContent`); `None` when the body does.
    pub streams: Option<bool>,
    /// The body is covered by the client's signature (AWS SigV4 on Bedrock): it must
    /// reach the upstream byte for byte, so it is never rewritten.
    pub body_is_signed: bool,
    /// The shape the filter's own answers take: the provider's, unless `error_format`
    /// fixes another.
    pub dialect: Dialect,
}

impl Route {
    /// A route on which the path says nothing but the API. Anthropic's messages body is
    /// sent by Anthropic's SDKs wherever it goes (an OpenAI-compatible server, Azure's
    /// Anthropic models), so it is answered in Anthropic's shape.
    pub(crate) fn of_api(provider: Provider, api: Api) -> Route {
        let dialect = if api == Api::Messages { Dialect::Anthropic } else { provider.dialect() };
        Route { provider, api: Some(api), path_model: None, streams: None, body_is_signed: false, dialect }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathModel {
    /// Gemini, Vertex AI and Bedrock: the model itself.
    Model(String),
    /// Azure OpenAI: a deployment, mapped to its model by `deployments`.
    Deployment(String),
    /// Azure OpenAI's v1 paths: the body's `model` names a deployment.
    DeploymentInBody,
}

/// Recognises the provider and API by the path (normalised by `crate::parse::path`); `None` for
/// a path no provider's API is recognised in.
pub fn route(path: &str) -> Option<Route> {
    route_normalised(&crate::parse::path::normalised(path))
}

/// `route` of a path already `parse::path::normalised` (the lifecycle reads the path once
/// and routes, bypasses and refuses on the same reading).
pub fn route_normalised(path: &str) -> Option<Route> {
    bedrock::route(path)
        .or_else(|| gemini::route(path))
        .or_else(|| azure::route(path))
        .or_else(|| anthropic::route(path))
        .or_else(|| openai::route(path))
}

/// What counts a text's tokens (or bytes) while a prompt is walked.
pub type TextCounter<'a> = dyn FnMut(&str) -> u64 + 'a;

/// How one API lays out a request body, as the provider module that owns the API says.
pub struct BodyShape {
    /// The output cap the client set, if it set one.
    pub max_output: fn(Json) -> Option<u64>,
    /// Where a lower cap is written (a field, or a path of fields); empty where a body is
    /// never rewritten.
    pub cap_field: fn(Json) -> &'static [&'static str],
    /// How many completions one request generates, each up to the cap, if the body says.
    pub choices: fn(Json) -> Option<u64>,
    /// The prompt's tokens, each text counted by the function given.
    pub prompt: fn(Json, &mut TextCounter) -> u64,
}

/// The body shape of `api`, from the module of the provider whose API it is.
pub fn body_shape(api: Api) -> &'static BodyShape {
    match api {
        Api::ChatCompletions => &openai::CHAT_COMPLETIONS,
        Api::Completions => &openai::COMPLETIONS,
        Api::Responses => &openai::RESPONSES,
        Api::Embeddings => &openai::EMBEDDINGS,
        Api::Messages => &anthropic::MESSAGES,
        Api::Converse => &bedrock::CONVERSE,
        Api::GenerateContent | Api::StreamGenerateContent => &gemini::GENERATE_CONTENT,
        Api::CountTokens => &gemini::COUNT_TOKENS,
    }
}

/// A provider's error, for a reply the filter makes itself: the body its SDKs parse into
/// their exception classes, and the header that carries its error code, where it has one.
pub struct ErrorEnvelope {
    pub body: serde_json::Value,
    pub header: Option<(&'static str, String)>,
}

impl ErrorEnvelope {
    fn body(body: serde_json::Value) -> ErrorEnvelope {
        ErrorEnvelope { body, header: None }
    }
}

/// `refusal`, saying `message`, in the error envelope of `dialect`'s provider;
/// `retry_after_seconds` is when to try again, if that is known.
pub fn error_envelope(
    dialect: Dialect,
    refusal: Refusal,
    message: &str,
    retry_after_seconds: Option<u64>,
) -> ErrorEnvelope {
    match dialect {
        Dialect::OpenAi => openai::error_envelope(refusal, message),
        Dialect::Anthropic => anthropic::error_envelope(refusal, message),
        Dialect::Google => gemini::error_envelope(refusal, message, retry_after_seconds),
        Dialect::Bedrock => bedrock::error_envelope(refusal, message),
    }
}

/// What one of a provider's rate-limit headers reports on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderQuota {
    Requests,
    /// Tokens whatever part of them a limit counts: the tightest token limit.
    AnyTokens,
    /// Limits that count input and output together.
    TotalTokens,
    InputTokens,
    OutputTokens,
    /// Requests in flight at once (the filter's own figure: no provider sends it).
    Concurrency,
}

/// How a provider writes when a quota is whole again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetForm {
    /// The time left, as Go prints a duration (`6m0s`, `7.2s`).
    After,
    /// The instant, RFC 3339 in UTC, rounded up to the second.
    At,
}

/// One quota's headers as a provider names them: its limit, what is left of it, and when
/// it is whole again (`None`: slots come back as requests end, not on a schedule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaHeaders {
    pub quota: HeaderQuota,
    pub limit: &'static str,
    pub remaining: &'static str,
    pub reset: Option<&'static str>,
}

/// A provider's rate-limit headers: the quotas it reports on, in the order they are sent,
/// and how it writes their resets. The filter sends them to the provider's callers
/// (`headers: [provider]`) and reads them on the provider's replies (`provider_limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimitHeaders {
    pub quotas: &'static [QuotaHeaders],
    pub reset: ResetForm,
}

impl RateLimitHeaders {
    /// The headers of `quota`, if the provider reports on it.
    pub fn of(&self, quota: HeaderQuota) -> Option<&'static QuotaHeaders> {
        self.quotas.iter().find(|q| q.quota == quota)
    }
}

/// The rate-limit headers of `dialect`'s provider, if it sends any (Google and Bedrock
/// send none of their own: their callers get the IETF fields).
pub fn rate_limit_headers(dialect: Dialect) -> Option<&'static RateLimitHeaders> {
    match dialect {
        Dialect::OpenAi => Some(&openai::RATE_LIMIT_HEADERS),
        Dialect::Anthropic => Some(&anthropic::RATE_LIMIT_HEADERS),
        Dialect::Google | Dialect::Bedrock => None,
    }
}

/// What a 401 tells a caller answered in `dialect` who sent no credential: where its
/// provider reads one.
pub fn missing_credential(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::OpenAi => openai::MISSING_CREDENTIAL,
        Dialect::Anthropic => anthropic::MISSING_CREDENTIAL,
        Dialect::Google => gemini::MISSING_CREDENTIAL,
        Dialect::Bedrock => bedrock::MISSING_CREDENTIAL,
    }
}

/// Usage from a usage object (at `usage`, `message.usage`, `response.usage` or Groq's
/// `x_groq.usage`), in whichever provider's shape it is: Bedrock's when it is one; else
/// each figure as OpenAI names it, or else as Anthropic does. Replies are read this way
/// on every route, since OpenAI-compatible servers answer in more than one shape.
pub fn usage_object(usage: Json) -> ReportedUsage {
    if let Some(bedrock) = bedrock::converse_usage(usage) {
        return bedrock;
    }
    let (openai, anthropic) = (openai::usage(usage), anthropic::usage(usage));
    let input = openai.input.or(anthropic.input);
    let output =
        openai.output.or(anthropic.output).or_else(|| (input.is_some() && openai::has_total(usage)).then_some(0));
    ReportedUsage {
        input,
        output,
        cached_input: openai.cached_input.or(anthropic.cached_input),
        reasoning: openai.reasoning,
    }
}

/// Usage from Gemini's `usageMetadata`.
pub fn usage_metadata(metadata: Json) -> ReportedUsage {
    gemini::usage_from_metadata(metadata)
}

/// Whether one streamed message ends its stream: `kind` is its `type`, else its SSE event
/// name. (OpenAI's chat streams end with `openai::DONE`, which is no JSON.)
pub fn ends_stream(message: Json, kind: &str) -> bool {
    anthropic::ends_stream(kind) || openai::ends_stream(kind) || gemini::is_final(message)
}

/// The generated text one streamed message carries, in every provider's shape, each piece
/// handed to `text` (for a stream that never reports its output tokens).
pub fn streamed_texts(message: Json, text: &mut impl FnMut(Option<&str>)) {
    openai::chat_texts(message, text);
    let kind = message.at("type").as_str();
    anthropic::streamed_texts(message, kind, text);
    openai::responses_texts(message, kind, text);
    for part in gemini::streamed_texts(message) {
        text(Some(part));
    }
}

/// The model a request is limited, counted and priced as.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelName {
    /// Empty when nothing names one.
    pub name: String,
    /// The name is an Azure deployment's, with no entry in `deployments`: it stands in for
    /// the model until the reply says which model answered.
    pub unmapped_deployment: bool,
}

/// The model of a request on `route` whose body named `body_model`.
pub fn model_name(
    route: Option<&Route>,
    body_model: Option<&str>,
    deployments: &BTreeMap<String, String>,
) -> ModelName {
    let deployment = |name: &str| match deployments.get(name) {
        Some(model) => ModelName { name: model.clone(), unmapped_deployment: false },
        None => ModelName { name: name.to_string(), unmapped_deployment: true },
    };
    match route.and_then(|r| r.path_model.as_ref()) {
        Some(PathModel::Model(model)) => ModelName { name: model.clone(), unmapped_deployment: false },
        Some(PathModel::Deployment(name)) => deployment(name),
        Some(PathModel::DeploymentInBody) => body_model.map(deployment).unwrap_or_default(),
        None => ModelName { name: body_model.unwrap_or_default().to_string(), unmapped_deployment: false },
    }
}

#[cfg(test)]
mod lifecycle_tests;

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;

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
            // Not quite any: the default.
            ("/v1beta/models/gemini:", Dialect::OpenAi),
            ("/v1beta/tunedModels/x:generateContent", Dialect::Google),
            ("/v1/models/gemini-2.0-flash%3AcountTokens", Dialect::Google),
            ("/v1/models/gemini-2.0-flash%3agenerateContent", Dialect::Google),
            ("/v1beta/models/gemini:embedContent", Dialect::Google),
            // Charged as Gemini's generateContent (with no model), so answered as Google.
            ("/models/:generateContent", Dialect::Google),
            ("/openai/v1/messages", Dialect::Anthropic),
            ("/openai/deployments/d/chat/completions", Dialect::OpenAi),
            ("/model//converse", Dialect::OpenAi),
            ("/v1/models", Dialect::OpenAi),
            ("", Dialect::OpenAi),
            ("/", Dialect::OpenAi),
        ];
        for (path, dialect) in cases {
            assert_eq!(route(path).map_or(Dialect::OpenAi, |r| r.dialect), dialect, "{path}");
        }
    }

    /// Each provider's documented path shapes, as its SDKs send them: a prefix (a proxy's
    /// route, Vertex AI's project path), the model or deployment, the colon literal or
    /// percent-encoded, a query, a trailing slash.
    #[cfg(not(target_arch = "wasm32"))]
    fn provider_path() -> impl Strategy<Value = (String, Provider, Api)> {
        let model = "[a-z][a-z0-9.-]{0,15}";
        let colon = prop_oneof![Just(":"), Just("%3A"), Just("%3a")];
        let tail = (prop_oneof![Just(""), Just("?alt=sse"), Just("?api-version=2024-10-21&x=1")], any::<bool>())
            .prop_map(|(query, slash)| format!("{}{query}", if slash { "/" } else { "" }));
        let prefix = prop_oneof![Just(""), Just("/proxy"), Just("/api/llm")];
        let gemini = (
            prefix.clone(),
            prop_oneof![Just("/v1beta"), Just("/v1"), Just("/v1/projects/p-1/locations/us-central1/publishers/google")],
            prop_oneof![Just("models"), Just("tunedModels")],
            model,
            colon.clone(),
            prop_oneof![
                Just(("generateContent", Api::GenerateContent)),
                Just(("streamGenerateContent", Api::StreamGenerateContent)),
                Just(("countTokens", Api::CountTokens)),
            ],
        )
            .prop_map(|(prefix, version, collection, model, colon, (method, api))| {
                (format!("{prefix}{version}/{collection}/{model}{colon}{method}"), Provider::Gemini, api)
            });
        let bedrock = (
            prefix.clone(),
            model,
            colon,
            prop_oneof![
                Just(("converse", Api::Converse)),
                Just(("converse-stream", Api::Converse)),
                Just(("invoke", Api::Messages)),
                Just(("invoke-with-response-stream", Api::Messages)),
            ],
        )
            .prop_map(|(prefix, model, colon, (operation, api))| {
                (format!("{prefix}/model/anthropic.{model}-v1{colon}0/{operation}"), Provider::Bedrock, api)
            });
        let openai_api = prop_oneof![
            Just(("chat/completions", Api::ChatCompletions)),
            Just(("completions", Api::Completions)),
            Just(("responses", Api::Responses)),
            Just(("embeddings", Api::Embeddings)),
        ];
        let openai = (prefix.clone(), openai_api.clone())
            .prop_map(|(prefix, (path, api))| (format!("{prefix}/v1/{path}"), Provider::OpenAi, api));
        let azure =
            (prefix.clone(), "[a-z][a-z0-9_.-]{0,20}", openai_api).prop_map(|(prefix, deployment, (path, api))| {
                (format!("{prefix}/openai/deployments/{deployment}/{path}"), Provider::Azure, api)
            });
        let anthropic = prefix.prop_map(|prefix| (format!("{prefix}/v1/messages"), Provider::Anthropic, Api::Messages));
        (prop_oneof![gemini, bedrock, openai, azure, anthropic], tail)
            .prop_map(|((path, provider, api), tail)| (format!("{path}{tail}"), provider, api))
    }

    /// The family a provider's callers parse, from each provider's documentation, not
    /// from `Provider::dialect`.
    #[cfg(not(target_arch = "wasm32"))]
    fn documented_dialect(provider: Provider) -> Dialect {
        match provider {
            Provider::OpenAi | Provider::Azure => Dialect::OpenAi,
            Provider::Anthropic => Dialect::Anthropic,
            Provider::Gemini => Dialect::Google,
            Provider::Bedrock => Dialect::Bedrock,
        }
    }

    #[test]
    fn each_provider_names_its_own_rate_limit_headers() {
        // OpenAI's (also Azure's) and Anthropic's, as their documentation spells them;
        // Google's and Bedrock's callers get the IETF fields only.
        for (dialect, prefix) in [(Dialect::OpenAi, "x-ratelimit-"), (Dialect::Anthropic, "anthropic-ratelimit-")] {
            let headers = rate_limit_headers(dialect).expect("headers");
            let mut names: Vec<&str> =
                headers.quotas.iter().flat_map(|q| [q.limit, q.remaining].into_iter().chain(q.reset)).collect();
            assert!(names.iter().all(|n| n.starts_with(prefix) && n.to_ascii_lowercase() == *n), "{names:?}");
            let count = names.len();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), count, "one name, one header");
        }
        assert_eq!(rate_limit_headers(Dialect::Google), None);
        assert_eq!(rate_limit_headers(Dialect::Bedrock), None);
        let tokens = openai::RATE_LIMIT_HEADERS.of(HeaderQuota::AnyTokens).expect("tokens");
        assert_eq!(
            (tokens.remaining, tokens.reset),
            ("x-ratelimit-remaining-tokens", Some("x-ratelimit-reset-tokens"))
        );
        assert_eq!(openai::RATE_LIMIT_HEADERS.of(HeaderQuota::Concurrency).map(|q| q.reset), Some(None));
        assert_eq!(anthropic::RATE_LIMIT_HEADERS.of(HeaderQuota::AnyTokens), None, "Anthropic's tokens are a total");
        assert_eq!(anthropic::RATE_LIMIT_HEADERS.reset, ResetForm::At);
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// Every path of a provider's shape routes to that provider and its API, and is
        /// answered in that provider's dialect: the router and the answers never disagree.
        #[test]
        fn every_routed_path_answers_in_its_providers_dialect((path, provider, api) in provider_path()) {
            let route = route(&path);
            prop_assert_eq!(route.as_ref().map(|r| (r.provider, r.api)), Some((provider, Some(api))), "{}", path);
            prop_assert_eq!(route.map(|r| r.dialect), Some(documented_dialect(provider)), "{}", path);
        }

        /// For any path at all the router accepts, the dialect is the provider's (or
        /// Anthropic's, for Anthropic's messages body wherever it is sent).
        #[test]
        fn any_accepted_path_answers_as_its_provider(path in "(/[a-zA-Z0-9:%.-]{0,12}){0,6}[/?]?") {
            if let Some(route) = route(&path) {
                let expected = match (route.provider, route.api) {
                    (Provider::OpenAi | Provider::Azure, Some(Api::Messages)) => Dialect::Anthropic,
                    (provider, _) => documented_dialect(provider),
                };
                prop_assert_eq!(route.dialect, expected, "{}", path);
            }
        }
    }
}
