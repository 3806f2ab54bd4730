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

use crate::request::Api;
use std::collections::BTreeMap;

/// A model name (from a path, a reply or the config) is at most this long; a longer one
/// is not a model's.
pub const MAX_MODEL_NAME: usize = 256;

/// What the path says about a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub api: Api,
    /// The model or deployment the path names, if it names one (and it is a valid name).
    pub path_model: Option<PathModel>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathModel {
    /// Gemini and Vertex AI: the model itself.
    Model(String),
    /// Azure OpenAI: a deployment, mapped to its model by `deployments`.
    Deployment(String),
    /// Azure OpenAI's v1 paths: the body's `model` names a deployment.
    DeploymentInBody,
}

/// Recognises the API by the path (the query string ignored).
pub fn route(path: &str) -> Option<Route> {
    let path = path.split(['?', '#']).next().unwrap_or("").trim_end_matches('/');
    gemini::route(path)
        .or_else(|| azure::route(path))
        .or_else(|| Api::from_path(path).map(|api| Route { api, path_model: None }))
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
