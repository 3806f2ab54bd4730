//! The filter's configuration: the JSON an operator puts in the proxy's plugin
//! configuration, compiled once, at load, into the `Policy` the filter runs on.
//!
//! - `shape`: the JSON as written, with its defaults; parsing rejects unknown fields.
//! - `compile`: checks each section and builds the policy. Every error names the field
//!   (as a path such as `limits[0].window`) and the bad value, so the proxy refuses a bad
//!   config with a message that says what to fix.
//! - `policy`: the checked result, in types that cannot hold what compile refuses.

mod compile;
mod error;
mod policy;
pub mod shape;
#[cfg(test)]
mod tests;

pub use error::ConfigError;
pub use policy::{
    Bypass, Companion, Dimension, FailureMode, Fallback, HeaderStyle, Identity, LeaseConfig, Limit, Measure, Memory,
    Mode, ModelPolicy, Policy, Price, PriceEntry, QueueConfig, Secret, Slots, TierConfig, TokenCount, TokenPolicy,
    UnknownPaths, UnreadableBody,
};
// Types of the policy's fields that belong to the modules that act on them.
pub use crate::dialect::ErrorFormat;
pub use crate::identity::{IdentitySource, MissingIdentity};
pub use crate::reservation::UpstreamErrorCharge;

impl Policy {
    /// Parses the plugin configuration and compiles it.
    pub fn from_json(bytes: &[u8]) -> Result<Policy, ConfigError> {
        compile::compile(&shape::Document::parse(bytes)?)
    }
}
