//! Each provider authenticates its own credential, in the place its API reads it, and bills
//! the account behind it. The mock does the same, so a test can tell which credential the
//! upstream would bill: a request without one in its API's place is refused as that
//! provider refuses it, a key beginning `invalid-` is refused as a wrong key is, and every
//! other answer carries `x-mock-credential`, the SHA-256 (hex) of the credential read.
//! Bedrock's SigV4 is checked in bedrock.rs.
//!
//! Where each API reads its credential (the providers' API references):
//! - OpenAI: `Authorization: Bearer`; 401 `invalid_api_key` when missing or wrong.
//! - Anthropic: `x-api-key` (or `Authorization: Bearer` for OAuth); 401
//!   `authentication_error`.
//! - Gemini API: `x-goog-api-key`, the `key` query parameter, or OAuth's Bearer; a wrong key
//!   is 400 `INVALID_ARGUMENT` (API_KEY_INVALID), none at all 403 `PERMISSION_DENIED`.
//! - Vertex AI: OAuth's `Authorization: Bearer` only; 401 `UNAUTHENTICATED`.
//! - Azure OpenAI: `api-key` or `Authorization: Bearer` (Entra ID); 401 with Azure's
//!   `{"error": {"code": "401", "message": ...}}`.

use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::json_response;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    OpenAi,
    Anthropic,
    Gemini,
    Vertex,
    Azure,
}

/// The prefix of a key the mock treats as wrong (revoked, mistyped).
const INVALID: &str = "invalid-";

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = header(headers, "authorization")?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

fn query_key(uri: &Uri) -> Option<&str> {
    uri.query()?.split('&').find_map(|pair| pair.strip_prefix("key=")).filter(|k| !k.is_empty())
}

/// The credential this API's upstream reads from the request, if any.
fn read<'a>(api: Api, headers: &'a HeaderMap, uri: &'a Uri) -> Option<&'a str> {
    match api {
        Api::OpenAi | Api::Vertex => bearer(headers),
        Api::Anthropic => header(headers, "x-api-key").or_else(|| bearer(headers)),
        Api::Gemini => header(headers, "x-goog-api-key").or_else(|| query_key(uri)).or_else(|| bearer(headers)),
        Api::Azure => header(headers, "api-key").or_else(|| bearer(headers)),
    }
}

/// Whether the request carries a credential in any API's place (then one in the wrong
/// place is still refused, anonymous or not).
fn has_any_credential(headers: &HeaderMap, uri: &Uri) -> bool {
    ["authorization", "x-api-key", "x-goog-api-key", "api-key"].iter().any(|name| header(headers, name).is_some())
        || query_key(uri).is_some()
}

/// The provider's refusal of a missing (`None`) or wrong credential.
fn refusal(api: Api, missing: bool) -> Response {
    match api {
        Api::OpenAi => {
            let message = if missing {
                "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            } else {
                "Incorrect API key provided. You can find your API key at https://platform.openai.com/account/api-keys."
            };
            let code = if missing { json!(null) } else { json!("invalid_api_key") };
            json_response(
                StatusCode::UNAUTHORIZED,
                &json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}}),
            )
        }
        Api::Anthropic => {
            let message = if missing { "x-api-key header is required" } else { "invalid x-api-key" };
            json_response(
                StatusCode::UNAUTHORIZED,
                &json!({"type": "error", "error": {"type": "authentication_error", "message": message}}),
            )
        }
        Api::Gemini if missing => json_response(
            StatusCode::FORBIDDEN,
            &json!({"error": {"code": 403, "message": "Method doesn't allow unregistered callers (callers without established identity). Please use API Key or other form of API consumer identity to call this API.", "status": "PERMISSION_DENIED"}}),
        ),
        Api::Gemini => json_response(
            StatusCode::BAD_REQUEST,
            &json!({"error": {"code": 400, "message": "API key not valid. Please pass a valid API key.", "status": "INVALID_ARGUMENT",
                "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID", "domain": "googleapis.com"}]}}),
        ),
        Api::Vertex => json_response(
            StatusCode::UNAUTHORIZED,
            &json!({"error": {"code": 401, "message": "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid authentication credential.", "status": "UNAUTHENTICATED"}}),
        ),
        Api::Azure => json_response(
            StatusCode::UNAUTHORIZED,
            &json!({"error": {"code": "401", "message": "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key for an active subscription and use a correct regional API endpoint for your resource."}}),
        ),
    }
}

/// What marks an answer to a request without a credential, with `--accept-anonymous`.
const ANONYMOUS: &str = "anonymous";

/// Authenticates the request as `api`'s upstream does: the credential's fingerprint to
/// mark the answer with, or the provider's refusal. With `anonymous_ok` a request without
/// any credential is answered (the gateway's route would have added the operator's key).
pub fn authenticate(api: Api, headers: &HeaderMap, uri: &Uri, anonymous_ok: bool) -> Result<String, Box<Response>> {
    match read(api, headers, uri) {
        None if anonymous_ok && !has_any_credential(headers, uri) => Ok(ANONYMOUS.to_string()),
        None => Err(Box::new(refusal(api, true))),
        Some(key) if key.starts_with(INVALID) => Err(Box::new(refusal(api, false))),
        Some(key) => Ok(fingerprint(key)),
    }
}

/// How the answer names the credential: its SHA-256 in hex (never the key itself).
fn fingerprint(key: &str) -> String {
    Sha256::digest(key.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Marks an answer with the credential the upstream authenticated.
pub fn billed_to(mut response: Response, fingerprint: &str) -> Response {
    if let Ok(value) = HeaderValue::from_str(fingerprint) {
        response.headers_mut().insert("x-mock-credential", value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn each_api_reads_its_own_place() {
        let uri: Uri = "/v1beta/models/m:generateContent?key=from-query".parse().expect("uri");
        let plain: Uri = "/v1/chat/completions".parse().expect("uri");
        let foreign = request(&[("x-api-key", "sk-other")]);
        // A credential in another API's place is not read: the request is unauthenticated.
        for api in [Api::OpenAi, Api::Vertex, Api::Azure] {
            assert!(authenticate(api, &foreign, &plain, true).is_err(), "{api:?}");
        }
        let azure = request(&[("api-key", "az-key"), ("x-api-key", "sk-other")]);
        assert_eq!(authenticate(Api::Azure, &azure, &plain, false).ok(), Some(fingerprint("az-key")));
        let gemini = request(&[("x-api-key", "sk-other")]);
        assert_eq!(authenticate(Api::Gemini, &gemini, &uri, false).ok(), Some(fingerprint("from-query")));
        assert_eq!(authenticate(Api::Anthropic, &foreign, &plain, false).ok(), Some(fingerprint("sk-other")));
    }

    #[test]
    fn a_wrong_key_is_refused_in_the_providers_shape() {
        let plain: Uri = "/v1/chat/completions".parse().expect("uri");
        let wrong = request(&[("authorization", "Bearer invalid-key"), ("x-goog-api-key", "invalid-key")]);
        let statuses: Vec<u16> = [Api::OpenAi, Api::Gemini, Api::Vertex]
            .into_iter()
            .map(|api| authenticate(api, &wrong, &plain, false).err().map_or(0, |r| r.status().as_u16()))
            .collect();
        assert_eq!(statuses, [401, 400, 401]);
        let none = request(&[]);
        assert_eq!(authenticate(Api::Gemini, &none, &plain, false).err().map(|r| r.status().as_u16()), Some(403));
        assert_eq!(authenticate(Api::Gemini, &none, &plain, true).ok().as_deref(), Some(ANONYMOUS));
    }
}
