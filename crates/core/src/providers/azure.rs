//! Azure OpenAI: OpenAI's request and reply shapes, on paths that name a deployment
//! (`/openai/deployments/{deployment}/chat/completions?api-version=…`, also completions,
//! embeddings and responses) rather than a model, or, on the newer v1 paths
//! (`/openai/v1/chat/completions`, `/openai/responses`), with the deployment's name in
//! the body's `model`. The config's `deployments` maps a deployment to its model. Its
//! replies carry OpenAI's rate-limit headers (`openai::RATE_LIMIT_HEADERS`), and its callers
//! are answered with them.

use super::{PathModel, Provider, Route};
use crate::api::identity::{CredentialPlace, BEARER};
use crate::api::Api;

/// Where Azure OpenAI reads the caller's credential: the resource key or an Entra ID token.
pub const CREDENTIALS: [CredentialPlace<'static>; 2] =
    [CredentialPlace::Header { name: "api-key", prefix: None }, BEARER];

/// Azure limits a deployment's name to 64 characters.
pub const MAX_DEPLOYMENT_NAME: usize = 64;

pub(super) fn route(path: &str) -> Option<Route> {
    // One search for the segment every Azure path has (most paths are not Azure's).
    const OPENAI: &str = "/openai/";
    let at = memchr::memmem::find(path.as_bytes(), OPENAI.as_bytes())?;
    let after = path.get(at + OPENAI.len()..)?;
    if let Some(after) = after.strip_prefix("deployments/") {
        let (name, operation) = after.split_at(after.find('/')?);
        let api = Api::from_path(operation)?;
        let name = percent_encoding::percent_decode_str(name).decode_utf8().ok();
        let name = name.filter(|n| is_deployment_name(n)).map(|n| PathModel::Deployment(n.into_owned()));
        return Some(Route { path_model: name, ..Route::of_api(Provider::Azure, api) });
    }
    if after.starts_with("v1/") || after == "responses" {
        let api = Api::from_path(path)?;
        return Some(Route { path_model: Some(PathModel::DeploymentInBody), ..Route::of_api(Provider::Azure, api) });
    }
    None
}

/// What Azure accepts as a deployment name: letters, digits, `-`, `_` and `.`, at most 64.
pub fn is_deployment_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_DEPLOYMENT_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::super::{model_name, route, ModelName};
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn the_deployment_comes_from_the_path_and_the_api_from_what_follows() {
        let deployment = |d: &str| Some(PathModel::Deployment(d.to_string()));
        let cases = [
            (
                "/openai/deployments/gpt4o-prod/chat/completions?api-version=2024-10-21",
                Api::ChatCompletions,
                deployment("gpt4o-prod"),
            ),
            ("/openai/deployments/davinci/completions", Api::Completions, deployment("davinci")),
            (
                "/openai/deployments/embed.small/embeddings?api-version=2024-10-21",
                Api::Embeddings,
                deployment("embed.small"),
            ),
            ("/openai/deployments/o4_mini/responses", Api::Responses, deployment("o4_mini")),
            ("/apim/openai/deployments/my%2Dgpt/chat/completions", Api::ChatCompletions, deployment("my-gpt")),
            ("/openai/deployments/bad name!/chat/completions", Api::ChatCompletions, None),
            ("/openai/v1/chat/completions", Api::ChatCompletions, Some(PathModel::DeploymentInBody)),
            ("/openai/v1/responses?api-version=preview", Api::Responses, Some(PathModel::DeploymentInBody)),
            ("/openai/responses?api-version=2025-04-01-preview", Api::Responses, Some(PathModel::DeploymentInBody)),
        ];
        for (path, api, path_model) in cases {
            assert_eq!(
                route(path).map(|r| (r.provider, r.api, r.path_model)),
                Some((Provider::Azure, Some(api), path_model)),
                "{path}"
            );
        }
        for unknown in ["/openai/deployments/x/images/generations", "/openai/deployments/x", "/openai/v1/models"] {
            assert_eq!(route(unknown), None, "{unknown}");
        }
        let long = format!("/openai/deployments/{}/chat/completions", "d".repeat(MAX_DEPLOYMENT_NAME + 1));
        assert_eq!(route(&long).map(|r| r.path_model), Some(None));
        // A plain OpenAI path names no deployment.
        assert_eq!(
            super::super::route("/v1/chat/completions").map(|r| (r.provider, r.api, r.path_model)),
            Some((Provider::OpenAi, Some(Api::ChatCompletions), None))
        );
    }

    #[test]
    fn bad_deployment_entries_are_refused_at_load_naming_the_entry() {
        let load = |deployments: &str| {
            let json = format!(
                r#"{{"companion": {{"upstream": "c", "token": "test-token-0123456789"}}, "limits": [{{"name": "rpm", "requests": 1, "window": "1m"}}], "deployments": {deployments}}}"#
            );
            crate::config::Policy::from_json(json.as_bytes()).map(|p| p.deployments).map_err(|e| e.to_string())
        };
        assert_eq!(load(r#"{"prod-4o": "gpt-4o"}"#), Ok(BTreeMap::from([("prod-4o".into(), "gpt-4o".into())])));
        for (deployments, field) in [
            (r#"{"prod 4o": "gpt-4o"}"#, "deployments.prod 4o"),
            (r#"{"": "gpt-4o"}"#, "deployments."),
            (r#"{"prod": ""}"#, "deployments.prod"),
        ] {
            let error = load(deployments).expect_err(deployments);
            assert!(error.contains(&format!("`{field}`")), "{error}");
        }
        let error = load(r#"{"prod": 4}"#).expect_err("not a string");
        assert!(error.contains("deployments"), "{error}");
    }

    #[test]
    fn deployments_map_to_models_and_an_unmapped_one_stands_in_for_its_model() {
        let deployments = BTreeMap::from([("gpt4o-prod".to_string(), "gpt-4o".to_string())]);
        let model = |path: &str, body: Option<&str>| model_name(route(path).as_ref(), body, &deployments);
        let known = |m: &str| ModelName { name: m.to_string(), unmapped_deployment: false };
        let unmapped = |m: &str| ModelName { name: m.to_string(), unmapped_deployment: true };
        assert_eq!(model("/openai/deployments/gpt4o-prod/chat/completions", None), known("gpt-4o"));
        assert_eq!(model("/openai/deployments/gpt4o-prod/chat/completions", Some("other")), known("gpt-4o"));
        assert_eq!(model("/openai/deployments/team-x/chat/completions", None), unmapped("team-x"));
        assert_eq!(model("/openai/v1/chat/completions", Some("gpt4o-prod")), known("gpt-4o"));
        assert_eq!(model("/openai/v1/chat/completions", Some("team-x")), unmapped("team-x"));
        assert_eq!(model("/openai/v1/chat/completions", None), ModelName::default());
        assert_eq!(model("/v1/chat/completions", Some("gpt4o-prod")), known("gpt4o-prod"), "only Azure paths map");
        assert_eq!(model("/v1beta/models/gemini-2.5-flash:generateContent", None), known("gemini-2.5-flash"));
        assert_eq!(model("/nothing", Some("m")), known("m"));
    }
}
