//! Who is asking: the API key (or other identifying header) found in the request, turned
//! into a tenant id by hashing, so the key itself never leaves the filter: not in Redis
//! keys, not in logs, not in callouts.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The tenant id used when identity is missing and the config says `anonymous`.
pub const ANONYMOUS_TENANT: &str = "anonymous";

/// A request header that may carry the credential.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct IdentitySource {
    /// Looked up in lower case (the policy lower-cases what the operator wrote).
    pub header: String,
    /// Stripped from the value (case-insensitively); a value without it does not match.
    #[serde(default)]
    pub prefix: Option<String>,
}

/// What happens to a request that carries no credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
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

/// Where an upstream reads its caller's credential: a header (with the scheme its value
/// opens with, stripped), or a query parameter (Gemini's `?key=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialPlace<'a> {
    Header { name: &'a str, prefix: Option<&'a str> },
    Query(&'a str),
}

/// `Authorization: Bearer …`: OpenAI's, and accepted by every other family (OAuth tokens,
/// Bedrock API keys, Google access tokens).
pub const BEARER: CredentialPlace<'static> = CredentialPlace::Header { name: "authorization", prefix: Some("Bearer ") };

/// `Authorization: AWS4-HMAC-SHA256 Credential=AKID/…`: AWS Signature Version 4.
pub const SIGV4: CredentialPlace<'static> =
    CredentialPlace::Header { name: "authorization", prefix: Some("AWS4-HMAC-SHA256 ") };

impl IdentitySource {
    pub fn place(&self) -> CredentialPlace<'_> {
        CredentialPlace::Header { name: &self.header, prefix: self.prefix.as_deref() }
    }
}

/// What a request's credential places hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    Missing,
    Found(String),
    /// Two places (or one header given twice) hold different credentials: an upstream may
    /// authenticate either, so the request is keyed on neither.
    Conflicting,
}

/// Reads every place of `places`: `header_values` gives every value of a request header
/// by its lower-case name, `query` is the raw query string. A header given more than
/// once, or two places with different values, conflict; so does a value that is itself
/// two values joined by the host (Envoy joins a repeated `Authorization` with `,`, which no
/// token or key contains).
pub fn read_credential<'a>(
    places: impl IntoIterator<Item = CredentialPlace<'a>>,
    mut header_values: impl FnMut(&str) -> Vec<String>,
    query: &str,
) -> Credential {
    let mut found: Option<String> = None;
    for place in places {
        let value = match place {
            CredentialPlace::Header { name, prefix } => {
                let values = header_values(name);
                if values.len() > 1 {
                    return Credential::Conflicting;
                }
                let Some(raw) = values.first() else { continue };
                match credential_in(raw.trim(), prefix) {
                    Ok(Some(value)) => value,
                    Ok(None) => continue,
                    Err(Joined) => return Credential::Conflicting,
                }
            }
            CredentialPlace::Query(parameter) => {
                let mut values = query_values(query, parameter);
                let Some(value) = values.next() else { continue };
                if values.next().is_some() {
                    return Credential::Conflicting;
                }
                let value = value.trim().to_string();
                if value.is_empty() {
                    continue;
                }
                value
            }
        };
        match &found {
            Some(earlier) if *earlier != value => return Credential::Conflicting,
            _ => found = Some(value),
        }
    }
    found.map_or(Credential::Missing, Credential::Found)
}

/// A header value holding two credentials joined into one.
struct Joined;

fn credential_in(value: &str, prefix: Option<&str>) -> Result<Option<String>, Joined> {
    let value = match prefix {
        Some(prefix) if prefix.trim().eq_ignore_ascii_case(SIGV4_SCHEME) => {
            let Some(parameters) = strip_prefix_ignore_case(value, prefix.trim()) else { return Ok(None) };
            let schemes = value.to_ascii_uppercase().matches(SIGV4_SCHEME).count();
            if schemes > 1 || parameters.matches("Credential=").count() > 1 {
                return Err(Joined);
            }
            let Some(key) = sigv4_access_key(parameters) else { return Ok(None) };
            key
        }
        Some(prefix) => match strip_prefix_ignore_case(value, prefix) {
            Some(rest) => rest.trim(),
            None => return Ok(None),
        },
        None => value,
    };
    if value.contains(',') {
        return Err(Joined);
    }
    Ok((!value.is_empty()).then(|| value.to_string()))
}

/// The percent-decoded values of `parameter` in a query string.
fn query_values<'q>(query: &'q str, parameter: &'q str) -> impl Iterator<Item = String> + 'q {
    let decode = |s: &str| percent_encoding::percent_decode_str(&s.replace('+', " ")).decode_utf8_lossy().into_owned();
    query.split('&').filter_map(move |pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(name) == parameter).then(|| decode(value))
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

/// Recent credentials of one VM with their tenant ids, so a returning client is not hashed
/// again (SHA-256 is the largest part of identifying a request). Direct-mapped and
/// fixed-size: a credential takes the slot its bytes index, replacing whoever had it, so
/// memory stays at most `slots` entries of at most `MAX_CACHED_CREDENTIAL` bytes, whatever
/// keys clients invent; a longer credential is hashed every time.
pub struct TenantIds {
    slots: Vec<Option<(Box<str>, Box<str>)>>,
}

/// The longest credential kept (API keys are 40 to 200 bytes; JWTs can be kilobytes).
pub const MAX_CACHED_CREDENTIAL: usize = 256;

impl TenantIds {
    pub fn new(slots: usize) -> TenantIds {
        TenantIds { slots: vec![None; slots] }
    }

    /// `tenant_id(credential)`, from the cache when this VM saw the credential last in its slot.
    pub fn of(&mut self, credential: &str) -> String {
        if self.slots.is_empty() || credential.len() > MAX_CACHED_CREDENTIAL {
            return tenant_id(credential);
        }
        // FNV-1a: the index only spreads credentials; a client forcing two into one slot
        // costs itself a hash per request, nothing more.
        let index =
            credential.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        let slot = (index % self.slots.len() as u64) as usize;
        match self.slots.get_mut(slot) {
            Some(Some((seen, id))) if **seen == *credential => id.to_string(),
            Some(entry) => {
                let id = tenant_id(credential);
                *entry = Some((credential.into(), id.as_str().into()));
                id
            }
            None => tenant_id(credential),
        }
    }
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

    #[test]
    fn the_cache_of_tenant_ids_gives_what_hashing_gives_and_stays_bounded() {
        let mut ids = TenantIds::new(4);
        let keys: Vec<String> = (0..50).map(|i| format!("sk-cache-{i}")).collect();
        for round in 0..3 {
            for key in &keys {
                assert_eq!(ids.of(key), tenant_id(key), "round {round}, {key}");
            }
        }
        assert_eq!(ids.slots.len(), 4);
        let long = "k".repeat(MAX_CACHED_CREDENTIAL + 1);
        assert_eq!(ids.of(&long), tenant_id(&long));
        assert!(ids.slots.iter().flatten().all(|(credential, _)| credential.len() <= MAX_CACHED_CREDENTIAL));
        assert_eq!(TenantIds::new(0).of("sk-x"), tenant_id("sk-x"));
    }

    /// Every place the built-in families read (the places of a path no family is
    /// recognised in).
    const PLACES: [CredentialPlace<'static>; 6] = crate::providers::EVERY_CREDENTIAL_PLACE;

    fn read(headers: &[(&str, &str)], query: &str) -> Credential {
        let values = |name: &str| headers.iter().filter(|(n, _)| *n == name).map(|(_, v)| v.to_string()).collect();
        read_credential(PLACES, values, query)
    }

    fn found(value: &str) -> Credential {
        Credential::Found(value.to_string())
    }

    #[test]
    fn reads_every_place_and_refuses_disagreement() {
        use Credential::{Conflicting, Missing};
        type Headers<'a> = &'a [(&'a str, &'a str)];
        let sigv4 = "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20261201/us-east-1/bedrock/aws4_request, SignedHeaders=content-type;host;x-amz-date, Signature=5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7";
        let cases: &[(Headers, &str, Credential)] = &[
            (&[("authorization", "Bearer sk-abc")], "", found("sk-abc")),
            (&[("authorization", "bearer   sk-abc  ")], "", found("sk-abc")),
            (&[("x-api-key", "ak-1")], "", found("ak-1")),
            (&[], "key=gk-1&alt=sse", found("gk-1")),
            (&[], "alt=sse&key=gk%2D1", found("gk-1")),
            // The same credential in two places is one credential.
            (&[("authorization", "Bearer k"), ("api-key", "k")], "key=k", found("k")),
            // Two credentials: refused, whichever the upstream reads.
            (&[("authorization", "Bearer sk-abc"), ("x-api-key", "ak-1")], "", Conflicting),
            (&[("api-key", "az-1"), ("x-api-key", "random")], "", Conflicting),
            (&[("x-goog-api-key", "g")], "key=other", Conflicting),
            (&[], "key=a&key=b", Conflicting),
            (&[], "key=a&key=a", Conflicting),
            // One header twice, as the host lists it or as Envoy joins it.
            (&[("x-api-key", "a"), ("x-api-key", "a")], "", Conflicting),
            (&[("authorization", "Bearer a"), ("authorization", "Bearer b")], "", Conflicting),
            (&[("authorization", "Bearer a,Bearer b")], "", Conflicting),
            (&[("authorization", "Basic dXNlcg=="), ("authorization", "Bearer a")], "", Conflicting),
            (&[("authorization", &format!("{sigv4},{sigv4}"))], "", Conflicting),
            // Basic auth is not an API key.
            (&[("authorization", "Basic dXNlcg=="), ("x-api-key", "ak-1")], "", found("ak-1")),
            (&[("authorization", "Basic dXNlcg==")], "", Missing),
            (&[("authorization", "Bearer ")], "", Missing),
            (&[("authorization", "Bear")], "", Missing),
            (&[("x-api-key", "  ")], "key=", Missing),
            (&[], "", Missing),
            (&[], "keys=x&akey=y", Missing),
            // SigV4: the access key id, whatever the date and signature.
            (&[("authorization", sigv4)], "", found("AKIDEXAMPLE")),
            (
                &[("authorization", "aws4-hmac-sha256 SignedHeaders=host, Credential=AKID2/x, Signature=00")],
                "",
                found("AKID2"),
            ),
            (&[("authorization", "AWS4-HMAC-SHA256 Signature=00")], "", Missing),
            (&[("authorization", "AWS4-HMAC-SHA256 Credential=/20261201/us-east-1/bedrock/aws4_request")], "", Missing),
            (&[("authorization", sigv4), ("x-api-key", "random")], "", Conflicting),
        ];
        for (headers, query, expected) in cases {
            assert_eq!(&read(headers, query), expected, "{headers:?} {query}");
        }
    }

    #[test]
    fn only_the_places_given_are_read() {
        // Azure reads `api-key` and Bearer: a random `x-api-key` beside it changes nothing.
        let azure = [CredentialPlace::Header { name: "api-key", prefix: None }, BEARER];
        let headers = [("api-key", "az-1"), ("x-api-key", "random")];
        let values = |name: &str| headers.iter().filter(|(n, _)| *n == name).map(|(_, v)| v.to_string()).collect();
        assert_eq!(read_credential(azure, values, "key=random"), found("az-1"));
    }

    #[test]
    fn prefix_match_survives_multibyte_values() {
        assert_eq!(read(&[("authorization", "Bé")], ""), Credential::Missing);
    }

    #[test]
    fn tenant_ids_match_the_shared_key_table() {
        // tests/cases/keys.json is read by tests/checks/test_keys.py too.
        let table: serde_json::Value =
            serde_json::from_str(include_str!("../../../../tests/cases/keys.json")).expect("keys.json");
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
