//! Who is asking: the API key (or other identifying header) found in the request, turned
//! into a tenant id by hashing, so the key itself never leaves the filter: not in Redis
//! keys, not in logs, not in callouts.

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The tenant id used when identity is missing and the config says `anonymous`.
pub const ANONYMOUS_TENANT: &str = "anonymous";

/// A request header that may carry the credential.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentitySource {
    /// Looked up in lower case (the policy lower-cases what the operator wrote).
    pub header: String,
    /// Stripped from the value (case-insensitively); a value without it does not match.
    #[serde(default)]
    pub prefix: Option<String>,
}

/// What happens to a request that carries no credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingIdentity {
    /// Answer 401.
    #[default]
    Reject,
    /// Count the request against one shared `anonymous` tenant.
    Anonymous,
}

/// The authorization scheme of AWS Signature Version 4 (Bedrock's SDKs sign with it).
pub const SIGV4_SCHEME: &str = "AWS4-HMAC-SHA256";

/// Returns the credential of the first source that is present and non-empty.
/// `header` looks a request header up by its lower-case name. A source whose prefix is
/// the SigV4 scheme yields the access key id of `Credential=`: the rest of a signed
/// `Authorization` (date, signature) changes with every request.
pub fn find_credential(sources: &[IdentitySource], mut header: impl FnMut(&str) -> Option<String>) -> Option<String> {
    sources.iter().find_map(|source| {
        let raw = header(&source.header)?;
        let value = raw.trim();
        let value = match &source.prefix {
            Some(prefix) if prefix.trim().eq_ignore_ascii_case(SIGV4_SCHEME) => {
                sigv4_access_key(strip_prefix_ignore_case(value, prefix.trim())?)?
            }
            Some(prefix) => strip_prefix_ignore_case(value, prefix)?.trim(),
            None => value,
        };
        (!value.is_empty()).then(|| value.to_string())
    })
}

/// `AKID` from `Credential=AKID/20261201/us-east-1/bedrock/aws4_request, SignedHeaders=…`.
fn sigv4_access_key(parameters: &str) -> Option<&str> {
    parameters
        .split(',')
        .find_map(|part| part.trim().strip_prefix("Credential="))
        .and_then(|scope| scope.split('/').next())
        .map(str::trim)
}

fn strip_prefix_ignore_case<'a>(value: &'a str, prefix: &str) -> Option<&'a str> {
    let head = value.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix).then(|| value.get(prefix.len()..)).flatten()
}

/// A stable, non-reversible tenant id: the first 16 bytes of SHA-256 over a domain
/// separator and the credential, as 32 hex digits.
pub fn tenant_id(credential: &str) -> String {
    let digest =
        Sha256::new().chain_update(b"llm-ratelimit/tenant/v1\0").chain_update(credential.as_bytes()).finalize();
    let mut id = String::with_capacity(32);
    for nibble in digest.iter().take(16).flat_map(|b| [b >> 4, b & 0xf]) {
        id.push(char::from_digit(u32::from(nibble), 16).unwrap_or('0'));
    }
    id
}

/// Whether `value` is a tenant id as `tenant_id` makes them (32 lower-case hex digits) or
/// the anonymous tenant: what config may name, where a credential pasted by mistake must
/// be refused.
pub fn is_tenant_id(value: &str) -> bool {
    let hashed = value.len() == 32 && value.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    hashed || value == ANONYMOUS_TENANT
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The sources a config gets when it names none.
    fn default_sources() -> Vec<IdentitySource> {
        vec![
            IdentitySource { header: "authorization".into(), prefix: Some("Bearer ".into()) },
            IdentitySource { header: "x-api-key".into(), prefix: None },
            IdentitySource { header: "authorization".into(), prefix: Some("AWS4-HMAC-SHA256 ".into()) },
        ]
    }

    fn lookup<'a>(headers: &'a HashMap<&str, &str>) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| headers.get(name).map(|v| v.to_string())
    }

    #[test]
    fn finds_the_first_matching_source() {
        type Headers<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Headers, Option<&str>)] = &[
            (&[("authorization", "Bearer sk-abc")], Some("sk-abc")),
            (&[("authorization", "bearer   sk-abc  ")], Some("sk-abc")),
            (&[("x-api-key", "ak-1")], Some("ak-1")),
            (&[("authorization", "Bearer sk-abc"), ("x-api-key", "ak-1")], Some("sk-abc")),
            // Basic auth is not an API key: fall through to the next source.
            (&[("authorization", "Basic dXNlcg=="), ("x-api-key", "ak-1")], Some("ak-1")),
            (&[("authorization", "Basic dXNlcg==")], None),
            (&[("authorization", "Bearer ")], None),
            (&[("authorization", "Bear")], None),
            (&[("x-api-key", "  ")], None),
            (&[], None),
            // SigV4: the access key id, whatever the date and signature.
            (
                &[("authorization", "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261201/us-east-1/bedrock/aws4_request, SignedHeaders=content-type;host;x-amz-date, Signature=5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7")],
                Some("AKIDEXAMPLE"),
            ),
            (&[("authorization", "aws4-hmac-sha256 SignedHeaders=host, Credential=AKID2/x, Signature=00")], Some("AKID2")),
            (&[("authorization", "AWS4-HMAC-SHA256 Signature=00")], None),
            (&[("authorization", "AWS4-HMAC-SHA256 Credential=/20261201/us-east-1/bedrock/aws4_request")], None),
        ];
        for (headers, expected) in cases {
            let map: HashMap<&str, &str> = headers.iter().copied().collect();
            assert_eq!(find_credential(&default_sources(), lookup(&map)).as_deref(), *expected, "{headers:?}");
        }
    }

    #[test]
    fn prefix_match_survives_multibyte_values() {
        let map: HashMap<&str, &str> = [("authorization", "Bé")].into_iter().collect();
        assert_eq!(find_credential(&default_sources(), lookup(&map)), None);
    }

    #[test]
    fn tenant_ids_match_the_shared_key_table() {
        // tests/cases/keys.json is read by tests/test_keys.py too.
        let table: serde_json::Value =
            serde_json::from_str(include_str!("../../../tests/cases/keys.json")).expect("keys.json");
        for case in table["tenants"].as_array().expect("tenants") {
            assert_eq!(tenant_id(case["api_key"].as_str().expect("key")), case["tenant"].as_str().expect("id"));
        }
    }

    #[test]
    fn tenant_ids_are_stable_distinct_and_hide_the_key() {
        let a = tenant_id("sk-live-123");
        assert_eq!(a, tenant_id("sk-live-123"));
        assert_ne!(a, tenant_id("sk-live-124"));
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!a.contains("123"));
        assert!(is_tenant_id(&a) && is_tenant_id(ANONYMOUS_TENANT));
        assert!(!is_tenant_id("sk-live-123") && !is_tenant_id(&a.to_ascii_uppercase()));
    }
}
