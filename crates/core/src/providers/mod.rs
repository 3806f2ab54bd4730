//! The APIs the filter recognises by path, and where each names its model:
//!
//! | API | paths | model |
//! |---|---|---|
//! | OpenAI, Anthropic, OpenAI-compatible servers | `…/chat/completions`, `…/completions`, `…/responses`, `…/embeddings`, `…/messages` | the body's `model` |
//! | Gemini, Vertex AI | `…/models/{model}:generateContent`, `:streamGenerateContent`, `:countTokens` | the path |
//! | Azure OpenAI | `/openai/deployments/{deployment}/…` | `deployments` in the config, else the deployment's name |
//! | Azure OpenAI v1 | `/openai/v1/…`, `/openai/responses` | the body's `model`, a deployment name, mapped the same way |
//! | AWS Bedrock | `…/model/{modelId}/converse`, `/converse-stream`, `/invoke`, `/invoke-with-response-stream` | the path (see `bedrock`) |

pub mod azure;
pub mod bedrock;
pub mod gemini;

use crate::api::dialect::Dialect;
use crate::api::identity::{CredentialPlace, BEARER, SIGV4};
use crate::api::Api;
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

/// Anthropic reads its API key, or an OAuth token as Bearer.
const ANTHROPIC_CREDENTIALS: [CredentialPlace<'static>; 2] =
    [CredentialPlace::Header { name: "x-api-key", prefix: None }, BEARER];

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
            Provider::OpenAi => &[BEARER],
            Provider::Anthropic => &ANTHROPIC_CREDENTIALS,
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
    let normalised = crate::parse::path::normalised(path);
    let path = normalised.as_str();
    bedrock::route(path).or_else(|| gemini::route(path)).or_else(|| azure::route(path)).or_else(|| {
        Api::from_path(path).map(|api| {
            let provider = if api == Api::Messages { Provider::Anthropic } else { Provider::OpenAi };
            Route::of_api(provider, api)
        })
    })
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
