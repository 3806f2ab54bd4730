//! llm-ratelimit's core: everything the filter judges, as plain Rust with no proxy-wasm
//! types, unit tested natively (and as wasm under Node). The cdylib in `crates/filter`
//! only maps proxy-wasm callbacks onto it.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod answers;
pub mod breaker;
pub mod bucket;
pub mod calibration;
pub mod charge;
pub mod config;
pub mod decision;
pub mod dialect;
pub mod eventstream;
pub mod host;
pub mod identity;
mod json;
pub mod json_array_stream;
pub mod lease;
pub mod lifecycle;
pub mod path;
pub mod prompt_cache;
pub mod providers;
pub mod request;
pub mod reservation;
pub mod series;
pub mod settle_queue;
pub mod sse;
pub mod tables;
pub mod tokens;
pub mod usage;
pub mod worker;

/// A fake host for lifecycle tests: records host calls, plays each host's semantics.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use llm_ratelimit_protocol as protocol;
pub use llm_ratelimit_protocol::duration;
