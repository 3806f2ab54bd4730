//! The filter's configuration: the JSON an operator puts in the proxy's plugin
//! configuration. Parsing rejects unknown fields; every error names the field (as a path
//! such as `limits[0].window`) and the bad value, so the proxy refuses a bad config with a
//! message that says what to fix.

use crate::duration::parse_duration;
use serde::{Deserialize, Deserializer};
use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the companion (the service that runs the Lua scripts in Redis) is reached.
    pub companion: Companion,
    /// Namespace of this config's counters in Redis: configs with the same domain and limit
    /// names share budgets (that is how several proxies hold one global limit).
    #[serde(default = "default_domain")]
    pub domain: String,
    #[serde(default)]
    pub identity: Identity,
    /// What to do with a request when the companion fails or does not answer in time.
    #[serde(default)]
    pub failure_mode: FailureMode,
    /// Every request is charged against each of these, all or nothing.
    pub limits: Vec<Limit>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Companion {
    /// The callout target, taken verbatim: an Envoy cluster name, or `host:port` on hosts
    /// such as ngx_wasm_module.
    pub upstream: String,
    /// `:authority` of the callout; defaults to `upstream`.
    #[serde(default)]
    pub authority: Option<String>,
    /// Shared secret the companion requires in `x-llmrl-token`.
    pub token: Secret,
    #[serde(default = "default_companion_timeout")]
    pub timeout: ConfigDuration,
}

impl Companion {
    pub fn authority(&self) -> &str {
        self.authority.as_deref().unwrap_or(&self.upstream)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// Headers tried in order; the first present one identifies the tenant.
    #[serde(default = "default_identity_sources")]
    pub sources: Vec<IdentitySource>,
    #[serde(default)]
    pub missing: MissingIdentity,
}

impl Default for Identity {
    fn default() -> Self {
        Identity {
            sources: default_identity_sources(),
            missing: MissingIdentity::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentitySource {
    pub header: String,
    /// Stripped from the value (case-insensitively); a value without it does not match.
    #[serde(default)]
    pub prefix: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingIdentity {
    /// Answer 401.
    #[default]
    Reject,
    /// Count the request against one shared `anonymous` tenant.
    Anonymous,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Let the request through, marked with a response header and a metric.
    #[default]
    Allow,
    /// Answer 503 with `Retry-After`.
    Deny,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Names the counter in Redis and in headers and 429 bodies.
    pub name: String,
    /// Requests admitted per `window`.
    pub requests: u64,
    /// The time in which a spent budget refills completely.
    pub window: ConfigDuration,
}

/// A duration written as a string (`"250ms"`, `"1m"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigDuration(pub Duration);

impl<'de> Deserialize<'de> for ConfigDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        parse_duration(&text)
            .map(ConfigDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// A secret from config: never printed, not even by `Debug`.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `limits[0].window`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid filter config: field `{}`: {}",
            self.field, self.message
        )
    }
}

impl std::error::Error for ConfigError {}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

fn default_domain() -> String {
    "llm".to_string()
}

fn default_companion_timeout() -> ConfigDuration {
    ConfigDuration(Duration::from_millis(100))
}

fn default_identity_sources() -> Vec<IdentitySource> {
    vec![
        IdentitySource {
            header: "authorization".into(),
            prefix: Some("Bearer ".into()),
        },
        IdentitySource {
            header: "x-api-key".into(),
            prefix: None,
        },
    ]
}

/// Names that end up in Redis keys and headers: short, and free of the characters that
/// carry meaning there (`{}` are Redis Cluster hash tags, `:` separates key parts).
fn check_name(field: &str, name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{name:?} is not a valid name: use 1 to 32 of a-z, 0-9, '_', '-'"),
        ))
    }
}

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        let mut config: Config =
            serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
                let path = e.path().to_string();
                let field = if path == "." {
                    "(top level)".to_string()
                } else {
                    path
                };
                invalid(field, e.into_inner().to_string())
            })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&mut self) -> Result<(), ConfigError> {
        if self.companion.upstream.trim().is_empty() {
            return Err(invalid(
                "companion.upstream",
                "must name the companion's cluster (Envoy) or host:port",
            ));
        }
        if self.companion.token.expose().is_empty() {
            return Err(invalid("companion.token", "must not be empty"));
        }
        let timeout = self.companion.timeout.0;
        if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(60) {
            return Err(invalid(
                "companion.timeout",
                format!("{timeout:?} is outside 1ms..60s"),
            ));
        }
        check_name("domain", &self.domain)?;
        if self.identity.sources.is_empty() {
            return Err(invalid("identity.sources", "must list at least one header"));
        }
        for (i, source) in self.identity.sources.iter_mut().enumerate() {
            let header = source.header.trim().to_ascii_lowercase();
            let valid = !header.is_empty()
                && header
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !valid {
                return Err(invalid(
                    format!("identity.sources[{i}].header"),
                    format!("{:?} is not a header name", source.header),
                ));
            }
            source.header = header;
        }
        if self.limits.is_empty() {
            return Err(invalid("limits", "must list at least one limit"));
        }
        let mut names = HashSet::new();
        for (i, limit) in self.limits.iter().enumerate() {
            check_name(&format!("limits[{i}].name"), &limit.name)?;
            if !names.insert(limit.name.as_str()) {
                return Err(invalid(
                    format!("limits[{i}].name"),
                    format!("{:?} is used by another limit", limit.name),
                ));
            }
            if limit.requests == 0 || limit.requests > 1_000_000_000 {
                return Err(invalid(
                    format!("limits[{i}].requests"),
                    format!("{} is outside 1..1000000000", limit.requests),
                ));
            }
            let window = limit.window.0;
            if window < Duration::from_millis(100) || window > Duration::from_secs(366 * 86_400) {
                return Err(invalid(
                    format!("limits[{i}].window"),
                    format!("{window:?} is outside 100ms..366d"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{
        "companion": {"upstream": "companion", "token": "s3cret", "timeout": "250ms"},
        "domain": "prod",
        "identity": {"sources": [{"header": "X-Tenant"}], "missing": "anonymous"},
        "failure_mode": "deny",
        "limits": [
            {"name": "rpm", "requests": 20, "window": "1m"},
            {"name": "rpd", "requests": 1000, "window": "1d"}
        ]
    }"#;

    #[test]
    fn parses_a_full_config() {
        let config = Config::from_json(GOOD.as_bytes()).expect("good config");
        assert_eq!(config.companion.upstream, "companion");
        assert_eq!(config.companion.authority(), "companion");
        assert_eq!(config.companion.timeout.0, Duration::from_millis(250));
        assert_eq!(config.domain, "prod");
        assert_eq!(
            config.identity.sources,
            vec![IdentitySource {
                header: "x-tenant".into(),
                prefix: None
            }]
        );
        assert_eq!(config.identity.missing, MissingIdentity::Anonymous);
        assert_eq!(config.failure_mode, FailureMode::Deny);
        assert_eq!(config.limits.len(), 2);
        assert_eq!(config.limits[1].window.0, Duration::from_secs(86_400));
    }

    #[test]
    fn fills_defaults() {
        let json = r#"{"companion": {"upstream": "c", "token": "t"},
                       "limits": [{"name": "rpm", "requests": 1, "window": "1s"}]}"#;
        let config = Config::from_json(json.as_bytes()).expect("minimal config");
        assert_eq!(config.domain, "llm");
        assert_eq!(config.companion.timeout.0, Duration::from_millis(100));
        assert_eq!(config.identity.sources, default_identity_sources());
        assert_eq!(config.identity.missing, MissingIdentity::Reject);
        assert_eq!(config.failure_mode, FailureMode::Allow);
    }

    #[test]
    fn token_never_shows_in_debug_output() {
        let config = Config::from_json(GOOD.as_bytes()).expect("good config");
        assert!(!format!("{config:?}").contains("s3cret"));
    }

    /// Each bad config, the field its error must name, and a fragment of the message.
    #[test]
    fn rejects_bad_configs_naming_the_field() {
        let limits = r#""limits": [{"name": "rpm", "requests": 5, "window": "1m"}]"#;
        let companion = r#""companion": {"upstream": "c", "token": "t"}"#;
        let cases: Vec<(String, &str, &str)> = vec![
            ("not json".into(), "(top level)", "expected ident"),
            (
                format!("{{{limits}}}"),
                "(top level)",
                "missing field `companion`",
            ),
            (
                format!("{{{companion}}}"),
                "(top level)",
                "missing field `limits`",
            ),
            (
                format!("{{{companion}, {limits}, \"colour\": 1}}"),
                "colour",
                "unknown field `colour`",
            ),
            (
                format!(
                    r#"{{"companion": {{"upstream": "c", "token": "t", "tmeout": "1s"}}, {limits}}}"#
                ),
                "companion.tmeout",
                "unknown field `tmeout`",
            ),
            (
                format!(r#"{{"companion": {{"upstream": "", "token": "t"}}, {limits}}}"#),
                "companion.upstream",
                "must name",
            ),
            (
                format!(r#"{{"companion": {{"upstream": "c", "token": ""}}, {limits}}}"#),
                "companion.token",
                "must not be empty",
            ),
            (
                format!(
                    r#"{{"companion": {{"upstream": "c", "token": "t", "timeout": "soon"}}, {limits}}}"#
                ),
                "companion.timeout",
                "invalid duration \"soon\"",
            ),
            (
                format!(
                    r#"{{"companion": {{"upstream": "c", "token": "t", "timeout": "2m"}}, {limits}}}"#
                ),
                "companion.timeout",
                "outside 1ms..60s",
            ),
            (
                format!(r#"{{{companion}, {limits}, "failure_mode": "maybe"}}"#),
                "failure_mode",
                "unknown variant `maybe`",
            ),
            (
                format!(r#"{{{companion}, {limits}, "domain": "Prod!"}}"#),
                "domain",
                "\"Prod!\" is not a valid name",
            ),
            (
                format!(r#"{{{companion}, {limits}, "identity": {{"missing": "ignore"}}}}"#),
                "identity.missing",
                "unknown variant `ignore`",
            ),
            (
                format!(r#"{{{companion}, {limits}, "identity": {{"sources": []}}}}"#),
                "identity.sources",
                "at least one header",
            ),
            (
                format!(
                    r#"{{{companion}, {limits}, "identity": {{"sources": [{{"header": "a b"}}]}}}}"#
                ),
                "identity.sources[0].header",
                "\"a b\" is not a header name",
            ),
            (
                format!(r#"{{{companion}, "limits": []}}"#),
                "limits",
                "at least one limit",
            ),
            (
                format!(
                    r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 0, "window": "1m"}}]}}"#
                ),
                "limits[0].requests",
                "0 is outside",
            ),
            (
                format!(
                    r#"{{{companion}, "limits": [{{"name": "rpm", "requests": -3, "window": "1m"}}]}}"#
                ),
                "limits[0].requests",
                "invalid value: integer `-3`",
            ),
            (
                format!(
                    r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 1, "window": "1x"}}]}}"#
                ),
                "limits[0].window",
                "unknown unit \"x\"",
            ),
            (
                format!(
                    r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 1, "window": "10ms"}}]}}"#
                ),
                "limits[0].window",
                "outside 100ms..366d",
            ),
            (
                format!(
                    r#"{{{companion}, "limits": [{{"name": "rpm", "requests": 1, "window": "1m"}}, {{"name": "rpm", "requests": 2, "window": "1h"}}]}}"#
                ),
                "limits[1].name",
                "used by another limit",
            ),
            (
                format!(
                    r#"{{{companion}, "limits": [{{"name": "r{{x}}", "requests": 1, "window": "1m"}}]}}"#
                ),
                "limits[0].name",
                "not a valid name",
            ),
            (
                format!(r#"{{{companion}, "limits": [{{"name": "rpm", "window": "1m"}}]}}"#),
                "limits[0]",
                "missing field `requests`",
            ),
        ];
        for (json, field, fragment) in cases {
            let err = Config::from_json(json.as_bytes()).expect_err(&json);
            assert_eq!(err.field, field, "{json}: {err}");
            assert!(err.message.contains(fragment), "{json}: {err}");
            assert!(err.to_string().contains(&format!("`{field}`")), "{err}");
        }
    }
}
