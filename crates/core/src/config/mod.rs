//! The filter's configuration: the JSON an operator puts in the proxy's plugin
//! configuration, compiled once, at load, into the `Policy` the filter runs on.
//!
//! - `shape`: the JSON as written, with its defaults; parsing rejects unknown fields.
//! - `read`: runs the shape's serde code over the parsed JSON, naming the field (and the
//!   line and column) of an error.
//! - `compile`: checks each section and builds the policy. Every error names the field
//!   (as a path such as `limits[0].window`) and the bad value, so the proxy refuses a bad
//!   config with a message that says what to fix.
//! - `policy`: the checked result, in types that cannot hold what compile refuses.

mod compile;
#[cfg(test)]
pub(crate) use compile::slot_key;
mod effective;
mod error;
mod headers;
mod per;
mod policy;
mod read;
pub mod shape;
#[cfg(test)]
mod tests;

pub use effective::effective;
pub use error::ConfigError;
pub use headers::{Callers, HeaderPlan, LimitHeaders, ProviderHeaders};
pub use per::{FairShare, HeaderPer, Per, PerShape};
pub use policy::{
    Bypass, Companion, Dimension, FailureMode, Fallback, HeaderStyle, Identity, LeaseConfig, Limit, Measure, Memory,
    Mode, ModelPolicy, Policy, Price, PriceEntry, ProviderLimits, QueueConfig, RecordMode, Secret, Slots, Store,
    TierConfig, TokenCount, TokenPolicy, UnknownPaths, UnreadableBody, REDACTED,
};
// Types of the policy's fields that belong to the modules that act on them.

impl Policy {
    /// Parses the plugin configuration and compiles it, outside a VM: a token named by
    /// `companion.token_env` is not read (see `from_json_in`), and the policy's token is
    /// empty.
    pub fn from_json(bytes: &[u8]) -> Result<Policy, ConfigError> {
        compile::compile(&shape::Document::parse(bytes)?, &|_| None, false)
    }

    /// Parses and compiles the configuration inside a VM, whose environment variables
    /// `environment` reads: `companion.token_env` must name one that holds a credential.
    pub fn from_json_in(bytes: &[u8], environment: &dyn Fn(&str) -> Option<String>) -> Result<Policy, ConfigError> {
        compile::compile(&shape::Document::parse(bytes)?, environment, true)
    }
}
